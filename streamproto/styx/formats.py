"""
The record body formats of C{/logs/{name}/records}, sans-IO.

- C{application/octet-stream} (or no type): the body is exactly one record;
- C{application/vnd.styx.line-delimited;line-ending=lf|cr|crlf}: records
  separated (and terminated) by the line ending;
- C{application/vnd.styx.binary-records}: repeated (int32 big-endian size,
  size bytes).

Decoders are incremental (feed bytes as they come, get records out) so that
a body is never held as one Python object per record longer than needed.
"""

from streamproto.core.framing import TOO_LARGE, frame_batch, scan_frames
from streamproto.log.batch import RecordBatch, lengths_array
import functools
import struct
from dataclasses import dataclass

OCTET_STREAM = "application/octet-stream"
LINES_MEDIA_TYPE = "application/vnd.styx.line-delimited"
BINARY_MEDIA_TYPE = "application/vnd.styx.binary-records"
LINE_ENDINGS = {"lf": b"\n", "cr": b"\r", "crlf": b"\r\n"}

_SIZE = struct.Struct(">i")


class FormatError(ValueError):
    """A body or media type that cannot be decoded."""


@dataclass(frozen=True)
class BodyFormat:
    """
    @ivar kind: C{"record"}, C{"lines"} or C{"binary"}.
    @ivar line_ending: C{"lf"}, C{"cr"} or C{"crlf"} for lines.
    """

    kind: str = "record"
    line_ending: str = "lf"

    @property
    def delimiter(self):
        return LINE_ENDINGS[self.line_ending]

    def media_type(self):
        if self.kind == "lines":
            return f"{LINES_MEDIA_TYPE}; line-ending={self.line_ending}"
        if self.kind == "binary":
            return BINARY_MEDIA_TYPE
        return OCTET_STREAM

    def encoder(self):
        if self.kind == "lines":
            return LinesEncoder(self.delimiter)
        if self.kind == "binary":
            return encode_binary
        raise FormatError("a single record needs no encoder")

    def decoder(self, max_record_size):
        if self.kind == "lines":
            return LinesDecoder(self.delimiter, max_record_size)
        if self.kind == "binary":
            return BinaryDecoder(max_record_size)
        raise FormatError("a single record needs no decoder")


RECORD = BodyFormat("record")
BINARY = BodyFormat("binary")


def lines(line_ending="lf"):
    if line_ending not in LINE_ENDINGS:
        raise FormatError(f"invalid line ending {line_ending!r}: use lf, cr or crlf")
    return BodyFormat("lines", line_ending)


def parse_media_type(value):
    """
    Split a Content-Type / Accept value into (media type, params), like Go's
    mime.ParseMediaType (lower-cased type and parameter names).
    """
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    parts = value.split(";")
    media = parts[0].strip().lower()
    params = {}
    for p in parts[1:]:
        if not p.strip():
            continue
        key, sep, val = p.partition("=")
        if not sep:
            raise FormatError(f"invalid media type parameter {p.strip()!r}")
        params[key.strip().lower()] = val.strip().strip('"')
    return media, params


@functools.lru_cache(maxsize=256)
def format_of(value):
    """
    The L{BodyFormat} a Content-Type or Accept header asks for (None or
    anything unknown means a single record, as in the reference).

    Remembered per header value (formats are immutable): every produce
    request asks, clients send the same few values.

    @raise FormatError: a line-delimited type with a bad line ending.
    """
    if not value:
        return RECORD
    try:
        media, params = parse_media_type(value)
    except FormatError:
        return RECORD
    if media == LINES_MEDIA_TYPE:
        return lines(params.get("line-ending") or "lf")
    if media == BINARY_MEDIA_TYPE:
        return BINARY
    return RECORD


# -- encoding ----------------------------------------------------------

def _payload(batch):
    data = batch.data
    return data if isinstance(data, bytes) else bytes(data)


def encode_binary(batch):
    """
    A L{streamproto.log.batch.RecordBatch} as binary-records bytes (int32 BE
    size + payload, repeated), framed in one call by the shared framing
    (C accelerated, pure-Python fallback).
    """
    if not len(batch.lengths):
        return b""
    return frame_batch(batch, b"")


class LinesEncoder:
    def __init__(self, delimiter):
        self.delimiter = delimiter

    def __call__(self, batch):
        if not len(batch.lengths):
            return b""
        data = _payload(batch)
        offs = batch.offsets()
        d = self.delimiter
        return d.join([data[a:z] for a, z in zip(offs, offs[1:])]) + d


def encode_records(fmt, records):
    """Encode a list of bytes records in C{fmt} (for clients)."""
    if fmt.kind == "lines":
        d = fmt.delimiter
        return b"".join(r + d for r in records)
    if fmt.kind == "binary":
        return b"".join(_SIZE.pack(len(r)) + r for r in records)
    if len(records) != 1:
        raise FormatError("an octet-stream body holds exactly one record")
    return bytes(records[0])


# -- decoding ----------------------------------------------------------

class BinaryDecoder:
    """
    Incremental decoder of binary-records bodies.  Bytes of an incomplete
    record wait in a list until enough has arrived (no quadratic
    re-concatenation of a large record fed in small pieces).
    """

    def __init__(self, max_record_size):
        self.max_record_size = max_record_size
        self._pieces = []
        self._held = 0
        self._need = 4  # bytes that must be held before decoding can progress

    def _check(self, size):
        from streamproto.log.errors import RecordTooLarge
        if size < 0:
            raise FormatError(f"negative record size {size}")
        if size > self.max_record_size:
            raise RecordTooLarge(
                f"record of {size} bytes exceeds max_record_size {self.max_record_size}")

    def feed(self, data):
        """
        @return: the list of records completed by C{data}.
        @raise FormatError: a negative size.
        @raise streamproto.log.errors.RecordTooLarge: a record above the limit.
        """
        if not data:
            return []
        self._pieces.append(bytes(data))
        self._held += len(data)
        if self._held < self._need:
            return []
        data = b"".join(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
        out = []
        append = out.append
        unpack = _SIZE.unpack_from
        limit = self.max_record_size
        pos = 0
        end = len(data)
        need = 4
        while end - pos >= 4:
            (size,) = unpack(data, pos)
            if size < 0 or size > limit:
                self._check(size)
            stop = pos + 4 + size
            if stop > end:
                need = stop - pos
                break
            append(data[pos + 4:stop])
            pos = stop
        rest = data[pos:] if pos < end else b""
        self._pieces = [rest] if rest else []
        self._held = len(rest)
        self._need = need
        return out

    def feed_batch(self, data):
        """
        Like L{feed}, the records completed by C{data} as one L{RecordBatch}
        (their sizes and one buffer of payloads, scanned by the shared
        framing code, C accelerated): no object per record.
        """
        if data:
            self._pieces.append(data)
            self._held += len(data)
        if self._held < self._need:
            return RecordBatch(0, lengths_array(), b"")
        data = b"".join(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
        lengths, payload, end, status = scan_frames(data, 0, b"", self.max_record_size)
        if status == TOO_LARGE:
            self._check(_SIZE.unpack_from(data, end)[0])
        rest = data[end:] if end < len(data) else b""
        self._pieces = [rest] if rest else []
        self._held = len(rest)
        self._need = 4 + _SIZE.unpack_from(rest, 0)[0] if len(rest) >= 4 else 4
        return RecordBatch(0, lengths, payload)

    def close(self):
        """@raise FormatError: the body ended inside a record."""
        if self._held:
            raise FormatError(f"body ends inside a record ({self._held} bytes left over)")
        return []


class LinesDecoder:
    """
    Incremental decoder of line-delimited bodies.  Unlike the reference
    (which drops it), a last line without a line ending is a record too.
    """

    def __init__(self, delimiter, max_record_size):
        self.delimiter = delimiter
        self.max_record_size = max_record_size
        self._buf = b""

    def feed(self, data):
        from streamproto.log.errors import RecordTooLarge
        buf = self._buf + bytes(data) if self._buf else bytes(data)
        parts = buf.split(self.delimiter)
        self._buf = parts.pop()
        limit = self.max_record_size
        # the unfinished line may end with the first bytes of a delimiter
        if len(self._buf) > limit + len(self.delimiter) - 1:
            raise RecordTooLarge(f"line longer than max_record_size {limit}")
        for p in parts:
            if len(p) > limit:
                raise RecordTooLarge(
                    f"record of {len(p)} bytes exceeds max_record_size {limit}")
        return parts

    def close(self):
        from streamproto.log.errors import RecordTooLarge
        rest, self._buf = self._buf, b""
        if len(rest) > self.max_record_size:
            raise RecordTooLarge(f"line longer than max_record_size {self.max_record_size}")
        return [rest] if rest else []
