"""
How a log lives in JetStream, as pure functions (no I/O): names, subjects,
and the layout of one message.

A log C{NAME} of a store with prefix C{P} is the stream C{P_NAME} with the
subjects C{P.NAME.d}, C{P.NAME.a} and C{P.NAME.m}.  The prefix is letters
and digits only, so the first C{_} ends it and two stores with different
prefixes never list each other's streams; log names are already valid
subject tokens (C{[A-Za-z0-9_-]+}).

One message holds one batch of consecutive records (an append, or part of
a large one)::

    header  Sp-Batch: <position> <offset> <count> <data_len> <crc32c>
    header  Sp-Attrs: {"key": int, ...}      on .a and .m messages only
    header  Sp-Start: <position> <offset>    on .m messages only
    header  Nats-Msg-Id, Nats-Expected-Last-Sequence, Nats-Expected-Last-Msg-Id
    body    count x u32 little-endian record lengths, then the payloads

- C{.d}: records without attributes;
- C{.a}: records (possibly none) with the log's I{whole} attribute map as
  of the end of this batch: the last C{.a} or C{.m} message is all a
  recovering store needs;
- C{.m}: a marker without records: where the readable log starts (after a
  truncation or retention) and the attribute map, written before older
  messages are purged, so a purge never loses either.

Every message carries its first position and payload offset, so a message
found by stream sequence is self-describing and positions stay contiguous
and 0-based however many records a message holds; the CRC-32C covers the
body end to end (client to client, whatever the servers do).  The header
alone (C{headers_only} consumers) says where a message is in the log,
which is what followers on other front-ends need.
"""

from __future__ import annotations

import json
import re
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from crc32c import crc32c

from streamproto.log.batch import BytesLike, lengths_array

#: the header every message of ours has
BATCH_HEADER = "Sp-Batch"
ATTRS_HEADER = "Sp-Attrs"
START_HEADER = "Sp-Start"
MSG_ID = "Nats-Msg-Id"
EXPECTED_LAST_SEQUENCE = "Nats-Expected-Last-Sequence"
EXPECTED_LAST_MSG_ID = "Nats-Expected-Last-Msg-Id"

DATA, ATTRS, MARKER = "d", "a", "m"

PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9]{1,32}$")
DEFAULT_PREFIX = "streamproto"
#: JetStream's stream names are file names on the servers
MAX_STREAM_NAME = 255

_LITTLE = array("I", [1]).tobytes() == b"\x01\x00\x00\x00"


class MessageFormatError(Exception):
    """A message in one of our streams that we did not write (or that was damaged)."""


def check_prefix(prefix: object) -> str:
    """@raise ValueError: unless C{prefix} is 1 to 32 letters and digits."""
    if not isinstance(prefix, str) or not PREFIX_PATTERN.match(prefix):
        raise ValueError(f"prefix {prefix!r}: 1 to 32 letters and digits")
    return prefix


def stream_name(prefix: str, name: str) -> str:
    return f"{prefix}_{name}"


def log_name(prefix: str, stream: str) -> str | None:
    """The log name of stream C{stream}, or None when it is not one of this prefix's."""
    head = prefix + "_"
    if stream.startswith(head) and len(stream) > len(head):
        return stream[len(head):]
    return None


def subject(prefix: str, name: str, kind: str) -> str:
    return f"{prefix}.{name}.{kind}"


def subjects_filter(prefix: str, name: str) -> str:
    return f"{prefix}.{name}.*"


def kind_of(subject_name: str) -> str:
    return subject_name.rsplit(".", 1)[-1]


@dataclass(slots=True, eq=False)
class BatchInfo:
    """
    What a message's headers say (C{headers_only} is enough).

    @ivar seq: its stream sequence.
    @ivar kind: L{DATA}, L{ATTRS} or L{MARKER}.
    @ivar attributes: the whole attribute map (C{.a}/C{.m}), else None.
    @ivar start: (position, offset) where the log starts (C{.m}), else None.
    @ivar msg_id: its C{Nats-Msg-Id}.
    """

    seq: int
    kind: str
    position: int
    offset: int
    count: int
    nbytes: int
    crc: int = 0
    attributes: dict[str, int] | None = None
    start: tuple[int, int] | None = None
    msg_id: str | None = None

    @property
    def end_position(self) -> int:
        return self.position + self.count

    @property
    def end_offset(self) -> int:
        return self.offset + self.nbytes

    def __repr__(self) -> str:
        return (f"<BatchInfo seq={self.seq} {self.kind} position={self.position} "
                f"count={self.count} offset={self.offset} nbytes={self.nbytes}>")


def encode_headers(position: int, offset: int, count: int, nbytes: int, crc: int,
                   attributes: Mapping[str, int] | None = None,
                   start: tuple[int, int] | None = None) -> dict[str, str]:
    """The C{Sp-*} headers of a message (a dict, as nats-py takes them)."""
    headers = {BATCH_HEADER: f"{position} {offset} {count} {nbytes} {crc}"}
    if attributes is not None:
        headers[ATTRS_HEADER] = json.dumps(attributes, sort_keys=True, separators=(",", ":"))
    if start is not None:
        headers[START_HEADER] = f"{start[0]} {start[1]}"
    return headers


def encode_body(lengths: array[int], data: BytesLike) -> tuple[bytes, int]:
    """
    @param lengths: the records' sizes, an C{array('I')}.
    @param data: their payloads, concatenated (bytes-like).
    @return: (body, crc): the message body and its CRC-32C.
    """
    lengths_bytes = lengths.tobytes() if _LITTLE else _swapped(lengths)
    if not len(lengths):
        return b"", 0
    body = b"".join((lengths_bytes, data))
    return body, crc32c(body)


def _swapped(lengths: array[int]) -> bytes:
    a = array("I", lengths)
    a.byteswap()
    return a.tobytes()


def decode_info(seq: int, subject_name: str,
                headers: Mapping[str, str] | None) -> BatchInfo:
    """
    @param headers: a mapping of the message's headers.
    @raise MessageFormatError: not one of our messages.
    """
    kind = kind_of(subject_name)
    raw = headers.get(BATCH_HEADER) if headers else None
    if headers is None or raw is None or kind not in (DATA, ATTRS, MARKER):
        raise MessageFormatError(f"message {seq} on {subject_name!r} is not a streamproto batch")
    try:
        position, offset, count, nbytes, crc = (int(v) for v in raw.split())
        attributes: dict[str, int] | None = None
        if kind != DATA:
            attributes = json.loads(headers[ATTRS_HEADER])
            if not isinstance(attributes, dict):
                raise ValueError("attributes")
        start: tuple[int, int] | None = None
        if kind == MARKER:
            a, b = headers[START_HEADER].split()
            start = (int(a), int(b))
    except (ValueError, KeyError, TypeError) as e:
        raise MessageFormatError(f"message {seq} on {subject_name!r}: bad headers ({e})")
    if min(position, offset, count, nbytes) < 0:
        raise MessageFormatError(f"message {seq}: negative coordinates")
    return BatchInfo(seq, kind, position, offset, count, nbytes, crc, attributes, start,
                     headers.get(MSG_ID))


def decode_body(info: BatchInfo, body: BytesLike) -> tuple[array[int], memoryview]:
    """
    @return: (lengths, data): an C{array('I')} and a memoryview of the payloads.
    @raise MessageFormatError: the body does not match its headers or its CRC.
    """
    n = info.count
    if n == 0:
        if body:
            raise MessageFormatError(f"message {info.seq}: body without records")
        return lengths_array(), memoryview(b"")
    if len(body) != 4 * n + info.nbytes:
        raise MessageFormatError(f"message {info.seq}: body of {len(body)} bytes, "
                                 f"headers say {n} records of {info.nbytes} bytes")
    if crc32c(body) != info.crc:
        raise MessageFormatError(f"message {info.seq}: checksum mismatch")
    lengths = lengths_array()
    lengths.frombytes(bytes(body[:4 * n]) if isinstance(body, memoryview) else body[:4 * n])
    if not _LITTLE:
        lengths.byteswap()
    return lengths, memoryview(body)[4 * n:]


def parse_headers(raw: bytes | bytearray | str) -> dict[str, str]:
    """
    The headers of a raw C{NATS/1.0} header block (what the stream message
    get API returns base64-encoded), as a dict.  Our values never repeat a
    key; a repeated key keeps its last value.
    """
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else raw
    lines = text.split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip()] = value.strip()
    return headers


HEADER_OVERHEAD = 512  # generous bound on our headers, for splitting appends


def split_points(lengths: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """
    Where to cut an append so that each message's body stays within
    C{limit} bytes (lengths included): a list of (start, stop) record
    indices.  One record larger than the limit gets a message of its own
    (the caller refuses it beforehand if it cannot fit).
    """
    n = len(lengths)
    if 4 * n + sum(lengths) <= limit:
        return [(0, n)]
    cuts: list[tuple[int, int]] = []
    start = 0
    size = 0
    for i, length in enumerate(lengths):
        need = 4 + length
        if i > start and size + need > limit:
            cuts.append((start, i))
            start, size = i, 0
        size += need
    cuts.append((start, n))
    return cuts


def unpack_u32(buf: BytesLike, index: int) -> int:
    value: int = struct.unpack_from("<I", buf, 4 * index)[0]
    return value
