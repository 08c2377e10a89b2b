"""
The frames of the Pravega wire protocol under its commands: the frame
header and the protocol's constants, Java's modified UTF-8 strings, and the
Event frames a segment's bytes are made of (split, counted, skipped as they
arrive).  L{streamproto.pravega.codec} builds the commands on these and
names every one of them, so C{codec.EventCounter} and the rest keep working.
"""

import re
import struct

WIRE_VERSION = 17
OLDEST_COMPATIBLE_VERSION = 5
MAX_FRAME_SIZE = 0x00FFFFFF
HEADER_SIZE = 8
#: Java's Long.MIN_VALUE: "no event number" (a writer never seen before),
#: and the value of an attribute never set (NULL_ATTRIBUTE_VALUE).
NULL_EVENT_NUMBER = NULL_ATTRIBUTE_VALUE = -(1 << 63)

_HEADER = struct.Struct(">ii")
_Q = struct.Struct(">q")
_I = struct.Struct(">i")
_H = struct.Struct(">H")
_B = struct.Struct(">b")
_QQ = struct.Struct(">qq")
_II = struct.Struct(">ii")
pack_header = _HEADER.pack
unpack_header_from = _HEADER.unpack_from

EVENT = 0
PADDING = -1
PARTIAL_EVENT = -2


class ProtocolError(Exception):
    """Malformed input: the only exception the decoder ever raises."""


# -- modified UTF-8 --------------------------------------------------------

def encode_utf(text):
    """Java C{DataOutput.writeUTF}: u16 length + modified UTF-8."""
    try:
        raw = text.encode("ascii")
        if b"\x00" in raw:
            raise UnicodeEncodeError("ascii", text, 0, 1, "NUL")
    except UnicodeEncodeError:
        # Encode UTF-16 code units one by one: surrogates stay 3-byte
        # sequences (CESU-8) and NUL becomes C0 80, as Java does.
        units = text.encode("utf-16-be", "surrogatepass")
        out = bytearray()
        for (u,) in struct.iter_unpack(">H", units):
            if 0 < u < 0x80:
                out.append(u)
            elif u < 0x800:
                out += bytes((0xC0 | (u >> 6), 0x80 | (u & 0x3F)))
            else:
                out += bytes((0xE0 | (u >> 12), 0x80 | ((u >> 6) & 0x3F), 0x80 | (u & 0x3F)))
        raw = bytes(out)
    if len(raw) > 0xFFFF:
        raise ValueError(f"encoded string too long: {len(raw)} bytes")
    return _H.pack(len(raw)) + raw


_FOUR_BYTE_LEAD = re.compile(b"[\xf0-\xff]")


def decode_modified_utf8(raw):
    """
    Inverse of L{encode_utf} without the length prefix, in C: NUL (C0 80)
    is mapped back, surrogates (ED A0..BF xx) are decoded with
    C{surrogatepass} and paired through UTF-16.  4-byte sequences are not
    modified UTF-8 (Java rejects them too).
    """
    raw = bytes(raw)
    if raw.isascii():
        return raw.decode("ascii")
    if _FOUR_BYTE_LEAD.search(raw):
        raise ProtocolError("malformed modified UTF-8: 4-byte sequence")
    try:
        text = raw.replace(b"\xc0\x80", b"\x00").decode("utf-8", "surrogatepass")
        if b"\xed" in raw:
            # join surrogate pairs into code points, keep lone surrogates like Java
            text = text.encode("utf-16-be", "surrogatepass").decode("utf-16-be",
                                                                    "surrogatepass")
    except UnicodeError:
        raise ProtocolError("malformed modified UTF-8")
    return text


# -- events inside segments and blocks -----------------------------------

def split_events(data, max_events=-1):
    """
    Split a run of whole Event frames into payloads.

    @return: C{(payloads, consumed)}: the payloads of the whole frames at the
        start of C{data} and the number of bytes they took; a trailing
        partial frame is left for the next call.
    @raise ProtocolError: on a frame that is not an Event.
    """
    out = []
    pos = 0
    n = len(data)
    view = memoryview(data)
    unpack = _HEADER.unpack_from
    while n - pos >= HEADER_SIZE and max_events != len(out):
        t, length = unpack(view, pos)
        if t != EVENT or length < 0:
            raise ProtocolError(f"expected an Event frame at {pos}, found type {t}")
        end = pos + HEADER_SIZE + length
        if end > n:
            break
        out.append(bytes(view[pos + HEADER_SIZE:end]))
        pos = end
    view.release()
    return out, pos


class EventCounter:
    """
    Counts the Event frames in segment bytes that arrive in pieces cut
    anywhere (successive SegmentReads): C{feed} returns the number of frames
    whose header completes in the piece.  C{offset} is the segment offset
    the next piece must start at to continue the count.  Never raises: on
    bytes that are not Event frames it stops counting.
    """

    __slots__ = ("offset", "_skip", "_header", "_broken")

    def __init__(self, offset=0):
        self.offset = offset
        self._skip = 0           # bytes of the current event's body still to come
        self._header = b""       # the first bytes of a header cut by the last piece
        self._broken = False

    def feed(self, data):
        n = len(data)
        self.offset += n
        if self._broken:
            return 0
        count = 0
        pos = self._skip
        if self._header:
            pos = HEADER_SIZE - len(self._header)
            if n < pos:
                self._header += bytes(data[:n])
                return 0
            t, length = _HEADER.unpack(self._header + bytes(data[:pos]))
            self._header = b""
            if t != EVENT or length < 0:
                self._broken = True
                return 0
            count = 1
            pos += length
        unpack = _HEADER.unpack_from
        while pos + HEADER_SIZE <= n:
            t, length = unpack(data, pos)
            if t != EVENT or length < 0:
                self._broken = True
                return count
            count += 1
            pos += HEADER_SIZE + length
        if pos < n:
            self._header = bytes(data[pos:])
            self._skip = 0
        else:
            self._skip = pos - n
        return count


def skip_events(data, count):
    """
    @return: the offset in C{data} after its first C{count} whole Event frames.
    @raise ProtocolError: if C{data} does not start with that many.
    """
    pos = 0
    n = len(data)
    for _ in range(count):
        if n - pos < HEADER_SIZE:
            raise ProtocolError("fewer events in the append than it claims")
        t, length = _HEADER.unpack_from(data, pos)
        if t != EVENT or length < 0 or pos + HEADER_SIZE + length > n:
            raise ProtocolError("append data is not a run of Event frames")
        pos += HEADER_SIZE + length
    return pos
