"""
Lumberjack v1/v2 frames, sans-IO: bytes in, frames out; frames in, bytes out.

Every frame is a version byte (C{'1'} or C{'2'}), a type byte and a payload:

- C{W} window: u32 size
- C{J} JSON data: u32 seq, u32 length, JSON document
- C{D} key/value data (v1): u32 seq, u32 pairs, (u32 klen, key, u32 vlen, value)*
- C{C} compressed: u32 length, zlib stream (with header) of whole frames
- C{A} ack: u32 seq

L{FrameDecoder} is incremental: L{FrameDecoder.feed} bytes as they arrive,
L{FrameDecoder.decode} the frames that are complete.  Consecutive data frames
come out as one L{Events} run (an array of sequence numbers and one buffer of
payloads, L{streamproto.lumberjack.runs}: no object per event), compressed
frames are expanded in place.  Every malformed input raises a subclass of
L{ProtocolError}; nothing else escapes (the tests fuzz this).
"""

import json
import struct
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence

import msgspec as _msgspec  # validates without building objects: ~8x faster than the stdlib

from streamproto.log.batch import lengths_array
from streamproto.lumberjack import runs
from streamproto.lumberjack.runs import PayloadRun

VERSION_1 = 0x31
VERSION_2 = 0x32
WINDOW = 0x57      # 'W'
JSON = 0x4A        # 'J'
DATA = 0x44        # 'D'
COMPRESSED = 0x43  # 'C'
ACK = 0x41         # 'A'

DEFAULT_MAX_WINDOW = 10000
DEFAULT_MAX_FRAME = 1048576 - 4096  # leaves room for metadata in a 1 MiB log record
DEFAULT_MAX_DECOMPRESSED = 32 * 1048576
MAX_NESTING = 2  # a compressed frame inside a compressed frame, no deeper

_u32 = struct.Struct(">I")
_u32u32 = struct.Struct(">II")
_window = struct.Struct(">BBI")
_json_header = struct.Struct(">BBII")
_compressed_header = struct.Struct(">BBI")


# -- errors -----------------------------------------------------------------
class ProtocolError(Exception):
    """Malformed or disallowed input.  Lumberjack has no error frame: close."""

    code = "protocol_error"


class UnsupportedVersion(ProtocolError):
    code = "unsupported_version"


class UnknownFrameType(ProtocolError):
    code = "unknown_frame_type"


class UnexpectedFrame(ProtocolError):
    """A valid frame in the wrong place (an ack from a writer, data before a window)."""

    code = "unexpected_frame"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class WindowTooLarge(ProtocolError):
    code = "window_too_large"


class DecompressedTooLarge(ProtocolError):
    """A compressed frame inflating past the bound (zip bomb)."""

    code = "decompressed_too_large"


class BadCompressedFrame(ProtocolError):
    code = "bad_compressed_frame"


class MalformedJSON(ProtocolError):
    code = "malformed_json"


class MalformedData(ProtocolError):
    """A key/value (D) frame whose keys or values are not UTF-8."""

    code = "malformed_data"


# -- decoded frames ---------------------------------------------------------
class Window:
    __slots__ = ("version", "size")

    def __init__(self, version: int, size: int) -> None:
        self.version = version
        self.size = size

    def __eq__(self, other):
        return (type(other) is Window and self.version == other.version
                and self.size == other.size)

    def __repr__(self):
        return f"Window(version={self.version:#x}, size={self.size})"


class Ack:
    __slots__ = ("version", "seq")

    def __init__(self, version: int, seq: int) -> None:
        self.version = version
        self.seq = seq

    def __eq__(self, other):
        return type(other) is Ack and self.version == other.version and self.seq == other.seq

    def __repr__(self):
        return f"Ack(version={self.version:#x}, seq={self.seq})"


class Events:
    """
    A run of consecutive data frames of one version: C{seqs[i]} (an
    C{array('I')}) is the sequence number of C{payloads[i]}, a UTF-8 JSON
    document (key/value frames are converted to a JSON object); the
    payloads are a L{PayloadRun}, one buffer for the whole run.
    """

    __slots__ = ("version", "seqs", "payloads")

    def __init__(self, version: int, seqs: Sequence[int] | None = None,
                 payloads: Sequence[bytes] | None = None) -> None:
        self.version = version
        self.seqs: array[int] = seqs if type(seqs) is array else lengths_array(seqs or ())
        self.payloads: PayloadRun = PayloadRun.of(payloads or ())

    def __len__(self) -> int:
        return len(self.payloads)

    def split(self, n: int) -> tuple["Events", "Events"]:
        """(first n events, the rest) as two runs."""
        first, rest = self.payloads.split(n)
        return (Events(self.version, self.seqs[:n], first),
                Events(self.version, self.seqs[n:], rest))

    def __eq__(self, other):
        return (type(other) is Events and self.version == other.version
                and self.seqs == other.seqs and self.payloads == other.payloads)

    def __repr__(self):
        return f"Events(version={self.version:#x}, seqs={list(self.seqs)!r})"


# -- JSON validation ----------------------------------------------------------
# Events are stored as received, so validating is the only JSON work the
# server does per event.  The fastest checker installed answers first; only
# what it refuses goes to the stdlib, which has the last word: a document is
# valid if Python's json module reads it as UTF-8 (so the accelerators must
# never accept more than the stdlib does; the tests check it).
def stdlib_check(payload):
    json.loads(payload.decode("utf-8"))


def _make_msgspec_check():
    decode = _msgspec.json.Decoder(_msgspec.Raw).decode

    def msgspec_check(payload):
        decode(payload)  # syntax, without building objects
        if not payload.isascii():
            payload.decode("utf-8")  # msgspec does not check UTF-8 in Raw values
    return msgspec_check


CHECKERS = {"stdlib": stdlib_check, "msgspec": _make_msgspec_check()}
# (ujson is not used: it accepts e.g. [01] and raw control characters in strings)
fast_check = CHECKERS["msgspec"]


def validate_json(payload: bytes) -> None:
    """@raise MalformedJSON: unless C{payload} is one UTF-8 JSON document."""
    try:
        fast_check(payload)
        return
    except Exception:  # noqa: BLE001 - any failure means "not sure": ask the stdlib
        pass
    try:
        stdlib_check(payload)
    except Exception as e:  # noqa: BLE001 - ValueError, RecursionError, ...
        raise MalformedJSON(f"invalid JSON document: {e}") from None


_array_of_raw = _msgspec.json.Decoder(list[_msgspec.Raw]).decode
#: events validated in one parse, at most (a batch of Filebeat's is 2048)
VALIDATE_CHUNK = 8192


def validate_run(run: PayloadRun) -> None:
    """
    @raise MalformedJSON: unless every payload of C{run} is one UTF-8 JSON
        document (L{validate_json} each).

    With msgspec as the checker, the run is parsed in one call as the
    array C{[P1,P2,...,Pn,0]}: if that parses to n + 1 elements, the first
    n of the payloads' sizes, then each payload is exactly one element
    (the sizes add up to the whole text less the n commas and the
    brackets, so no whitespace is left between elements, and element i
    starts where payload i does).  Anything else, e.g. a payload with
    whitespace around it, is checked payload by payload.
    """
    if not run.lengths:
        return
    if len(run) > VALIDATE_CHUNK:
        # one compressed frame may hold millions of tiny events: an object
        # per element for a part of them at a time only
        for start in range(0, len(run), VALIDATE_CHUNK):
            validate_run(run[start:start + VALIDATE_CHUNK])
        return
    if fast_check is CHECKERS["msgspec"]:
        text, _ = runs.splice(run, b"[", b"", b",", b"0]")
        try:
            elements = _array_of_raw(text)
            if not run.data.isascii():
                run.data.decode("utf-8")  # msgspec does not check UTF-8 in Raw values
        except Exception:  # noqa: BLE001 - not sure: one by one below
            pass
        else:
            sizes = list(map(len, elements))
            if sizes.pop() == 1 and sizes == run.lengths.tolist():
                return
    for payload in run:
        validate_json(payload)


# -- decoder ------------------------------------------------------------------
class _PartialKeyValue:
    """Where a key/value frame split across reads stopped, so it resumes in O(new bytes)."""

    __slots__ = ("version", "seq", "pairs_left", "fields", "offset")

    def __init__(self, version, seq, pairs_left, offset):
        self.version = version
        self.seq = seq
        self.pairs_left = pairs_left
        self.fields = []
        self.offset = offset  # bytes of the frame parsed so far


class FrameDecoder:
    """
    Incremental decoder for one direction of one connection.

    @param max_frame: largest J or D frame payload, in bytes.
    @param max_decompressed: largest compressed frame, compressed and
        inflated, in bytes.
    @param max_window: largest window size accepted.
    @param validate: check that every J payload is one UTF-8 JSON document.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME,
                 max_decompressed: int = DEFAULT_MAX_DECOMPRESSED,
                 max_window: int = DEFAULT_MAX_WINDOW, validate: bool = True) -> None:
        self.max_frame = max_frame
        self.max_decompressed = max_decompressed
        self.max_window = max_window
        self.validate = validate
        self._buf = bytearray()
        self._pos = 0
        self._need = 0           # don't rescan before this many bytes are buffered
        self._partial: _PartialKeyValue | None = None  # a key/value frame cut by the end of the buffer

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        buf = self._buf
        if self._pos:
            # drop what was decoded once per read, not once per frame
            del buf[:self._pos]
            self._pos = 0
        buf += data

    def decode(self, max_events: int = -1) -> list[Window | Events | Ack]:
        """
        Decode complete frames from the buffer.

        @param max_events: stop once this many events came out (a compressed
            frame is expanded whole, so there may be more); 0 stops after the
            first frame of any kind; -1 decodes everything buffered.
        @return: a list of L{Window}, L{Events} and L{Ack}, in stream order.
        @raise ProtocolError: on malformed input; the decoder is then unusable.
        """
        out: list[Window | Events | Ack] = []
        buf = self._buf
        if len(buf) - self._pos < self._need:
            return out
        self._need = 0
        pos, need, _ = self._scan(buf, self._pos, len(buf), out, max_events, 0)
        self._pos = pos
        self._need = need - pos if need else 0
        if pos == len(buf) and pos > 65536:
            self._buf = bytearray()  # give a big buffer's memory back when idle
            self._pos = 0
        return out

    # The scanner serves the network buffer (incomplete frames wait for more
    # bytes) and inflated payloads (nested > 0: every frame must be whole).
    def _scan(self, data, pos, end, out, max_events, nested):
        events = 0
        unpack_u32 = _u32.unpack_from
        unpack_u32u32 = _u32u32.unpack_from
        validate = self.validate
        scan_json = runs.scan_json
        max_frame = self.max_frame
        if self._partial is not None and not nested:
            pos, done = self._resume_key_value(data, pos, end, out)
            if not done:
                return pos, 0, 0
            events = 1
            if 0 <= max_events <= events:
                return pos, 0, events
        while pos < end:
            if end - pos < 2:
                break
            version = data[pos]
            if version != VERSION_2 and version != VERSION_1:
                raise UnsupportedVersion(f"unsupported protocol version byte {version:#04x}")
            ftype = data[pos + 1]
            if ftype == JSON:
                # the hot path: a run of JSON frames in one call, no Python per event
                room = max_events - events if max_events >= 0 else -1
                seqs, payloads, pos, status, need = scan_json(data, pos, version, max_frame,
                                                              room)
                if seqs:
                    if validate:
                        validate_run(payloads)
                    out.append(Events(version, seqs, payloads))
                    events += len(seqs)
                if status == runs.TOO_LARGE:
                    raise FrameTooLarge(f"JSON frame of {need} bytes exceeds {max_frame}")
                if status == runs.INCOMPLETE:
                    if nested or need < 0:
                        break
                    return pos, need, events
            elif ftype == WINDOW:
                if end - pos < 6:
                    break
                (size,) = unpack_u32(data, pos + 2)
                if size > self.max_window:
                    raise WindowTooLarge(f"window {size} exceeds {self.max_window}")
                out.append(Window(version, size))
                pos += 6
            elif ftype == COMPRESSED:
                if end - pos < 6:
                    break
                (length,) = unpack_u32(data, pos + 2)
                if length > self.max_decompressed:
                    raise FrameTooLarge(
                        f"compressed frame of {length} bytes exceeds {self.max_decompressed}")
                stop = pos + 6 + length
                if stop > end:
                    if nested:
                        break
                    return pos, stop, events
                if nested >= MAX_NESTING:
                    raise BadCompressedFrame("compressed frames nested too deep")
                inflated = self._inflate(data, pos + 6, stop)
                # whole frames only; the events of one compressed frame all come out
                _, _, inner = self._scan(inflated, 0, len(inflated), out, -1, nested + 1)
                events += inner
                pos = stop
            elif ftype == DATA:
                start = pos
                if end - pos < 10:
                    break
                seq, pairs = unpack_u32u32(data, pos + 2)
                if pairs > max_frame // 8:
                    raise FrameTooLarge(f"key/value frame of {pairs} pairs exceeds {max_frame} bytes")
                partial = _PartialKeyValue(version, seq, pairs, 10)
                pos, done = self._key_values(data, pos, end, partial)
                if not done:
                    if nested:
                        raise BadCompressedFrame("compressed frame ends inside a frame")
                    self._partial = partial
                    return start, 0, events
                out.append(self._key_value_event(partial))
                events += 1
            elif ftype == ACK:
                if end - pos < 6:
                    break
                (seq,) = unpack_u32(data, pos + 2)
                out.append(Ack(version, seq))
                pos += 6
            else:
                raise UnknownFrameType(f"unknown frame type {ftype:#04x}")
            if max_events >= 0 and events >= max_events and out:
                break
        if nested and pos != end:
            raise BadCompressedFrame("compressed frame ends inside a frame")
        return pos, 0, events

    def _inflate(self, data, start, stop):
        inflater = zlib.decompressobj()
        limit = self.max_decompressed
        try:
            inflated = inflater.decompress(memoryview(data)[start:stop], limit + 1)
        except zlib.error as e:
            raise BadCompressedFrame(f"bad zlib stream: {e}") from None
        if len(inflated) > limit:
            raise DecompressedTooLarge(f"compressed frame inflates past {limit} bytes")
        if not inflater.eof:
            raise BadCompressedFrame("truncated zlib stream")
        if inflater.unused_data:
            raise BadCompressedFrame("bytes after the end of the zlib stream")
        return inflated

    def _key_values(self, data, frame_start, end, partial):
        """Parse pairs from C{partial.offset} on; (end of frame, True) or (None, False)."""
        pos = frame_start + partial.offset
        limit = frame_start + 10 + self.max_frame
        fields = partial.fields
        unpack_u32 = _u32.unpack_from
        while partial.pairs_left:
            if end - pos < 4:
                return None, False
            (klen,) = unpack_u32(data, pos)
            kstop = pos + 4 + klen
            if kstop + 4 > limit:
                raise FrameTooLarge(f"key/value frame exceeds {self.max_frame} bytes")
            if end - kstop < 4:
                return None, False
            (vlen,) = unpack_u32(data, kstop)
            vstop = kstop + 4 + vlen
            if vstop > limit:
                raise FrameTooLarge(f"key/value frame exceeds {self.max_frame} bytes")
            if vstop > end:
                return None, False
            fields.append((bytes(data[pos + 4:kstop]), bytes(data[kstop + 4:vstop])))
            partial.pairs_left -= 1
            pos = vstop
            partial.offset = pos - frame_start
        return pos, True

    def _resume_key_value(self, data, pos, end, out):
        partial = self._partial
        newpos, done = self._key_values(data, pos, end, partial)
        if not done:
            return pos, False
        self._partial = None
        out.append(self._key_value_event(partial))
        return newpos, True

    def _key_value_event(self, partial):
        try:
            document = {k.decode("utf-8"): v.decode("utf-8") for k, v in partial.fields}
        except UnicodeDecodeError as e:
            raise MalformedData(f"key/value frame is not UTF-8: {e}") from None
        payload = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        if len(payload) > self.max_frame:
            # escaping can grow it (a control character becomes 6 bytes): the
            # bound is on what gets stored
            raise FrameTooLarge(f"key/value frame as JSON is {len(payload)} bytes, "
                                f"over {self.max_frame}")
        return Events(partial.version, [partial.seq], [payload])


# -- encoders -----------------------------------------------------------------
def encode_window(size: int, version: int = VERSION_2) -> bytes:
    return _window.pack(version, WINDOW, size)


def encode_ack(seq: int, version: int = VERSION_2) -> bytes:
    return _window.pack(version, ACK, seq)


def encode_json(seq: int, payload: bytes, version: int = VERSION_2) -> bytes:
    return _json_header.pack(version, JSON, seq, len(payload)) + payload


def encode_key_values(seq: int, mapping: Mapping[str | bytes, str | bytes],
                      version: int = VERSION_1) -> bytes:
    """A v1 key/value (D) frame; keys and values are str or bytes."""
    parts = [_u32u32.pack(seq, len(mapping))]
    for k, v in mapping.items():
        k = k.encode("utf-8") if isinstance(k, str) else k
        v = v.encode("utf-8") if isinstance(v, str) else v
        parts += [_u32.pack(len(k)), k, _u32.pack(len(v)), v]
    return bytes((version, DATA)) + b"".join(parts)


def encode_json_frames(payloads: Iterable[bytes], first_seq: int = 1,
                       version: int = VERSION_2) -> bytes:
    """J frames for C{payloads} numbered from C{first_seq}, as one bytes."""
    pack = _json_header.pack
    parts: list[bytes] = []
    append = parts.append
    seq = first_seq
    for p in payloads:
        append(pack(version, JSON, seq, len(p)))
        append(p)
        seq = (seq + 1) & 0xFFFFFFFF  # roll over, as the spec allows
    return b"".join(parts)


def encode_compressed(frames: bytes, level: int = 3, version: int = VERSION_2) -> bytes:
    """A C frame holding C{frames} (bytes of whole frames)."""
    body = zlib.compress(frames, level)
    return _compressed_header.pack(version, COMPRESSED, len(body)) + body


def encode_batch(payloads: Sequence[bytes], compression_level: int = 3, first_seq: int = 1,
                 version: int = VERSION_2) -> bytes:
    """
    What a writer sends for one batch: a window frame, then the events as J
    frames, compressed into one C frame unless C{compression_level} is 0.
    """
    frames = encode_json_frames(payloads, first_seq, version)
    if compression_level:
        frames = encode_compressed(frames, compression_level, version)
    return encode_window(len(payloads), version) + frames
