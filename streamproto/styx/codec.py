"""
The styx/0 message codec, sans-IO: bytes in, messages out, and back.

Every integer is big-endian.  A message starts with its int16 type::

    Record     1  int32 size, size bytes of payload
    Ack        2  int64 position, int64 count
    Heartbeat  3  (nothing)
    Error      4  int16 code

Decoded records are plain C{bytes} (the payload); the other messages are
L{Ack}, L{HEARTBEAT} and L{ErrorMessage}.  Keeping records as bare bytes
lets the hot paths hand a decoded list straight to L{ILog.append} and lets
the encoders interleave pre-built headers with payloads in one C{join}.

Why the decoder scans C{bytes} rather than a bytearray: slicing bytes yields
the record's C{bytes} in one copy, slicing a bytearray yields a bytearray
that would need a second copy.  Bytes left over at the end of a chunk (a
partial message) are kept in a bytearray, with the number of bytes needed
before the next message can complete, so a large record arriving in many
chunks is copied once, never rescanned.
"""

import struct
from array import array
from enum import IntEnum
from functools import lru_cache
from itertools import accumulate, chain
from typing import NamedTuple

from streamproto.core.framing import NEED_MORE, OTHER, TOO_LARGE
from streamproto.core.framing import _speedups  # the optional C accelerator, or None

RECORD = 1
ACK = 2
HEARTBEAT_TYPE = 3
ERROR = 4

#: The largest record payload the wire format can carry (int32 size).
MAX_WIRE_RECORD_SIZE = 0x7FFFFFFF
#: Default bound on a decoded record's size (the reference's default
#: C{max_record_size}); servers use the log's own setting.
DEFAULT_MAX_RECORD_SIZE = 1048576

_RECORD_HEADER = struct.Struct(">hi")
_ACK = struct.Struct(">hqq")
_ERROR = struct.Struct(">hh")
_TYPE = struct.Struct(">h")
_INT16 = struct.Struct(">h")
_INT64_PAIR = struct.Struct(">qq")

#: Below this many records the uniform-size scan costs more than it saves.
_UNIFORM_MIN_RECORDS = 8
#: A Record message is a [int16 1][int32 size][payload] frame: the shared
#: framing's C{[prefix][u32 BE size][payload]} with this prefix (its type,
#: big-endian).
RECORD_PREFIX = b"\x00\x01"
_RECORD_PREFIX = RECORD_PREFIX
# the scan statuses are the shared framing's
_NEED_MORE, _OTHER, _TOO_LARGE = NEED_MORE, OTHER, TOO_LARGE


class ErrorCode(IntEnum):
    """
    The codes of Error messages.  The reference defines only 0; these are
    ours, documented in C{doc/styx-stream.rst}.  A peer that does not know a
    code treats it as 0.
    """

    #: Anything not covered below (the reference's only code).
    UNKNOWN = 0
    #: A message type other than 1-4.
    UNKNOWN_MESSAGE_TYPE = 1
    #: A record size below zero.
    INVALID_RECORD_SIZE = 2
    #: A record larger than the log's C{max_record_size}.
    RECORD_TOO_LARGE = 3
    #: A well-formed message the receiver does not accept in its role (a
    #: record sent to a consumer stream, an ack sent by a client, ...).
    UNEXPECTED_MESSAGE = 4
    #: Bytes sent by the client before the 101 response was complete.
    EARLY_DATA = 5
    #: No message received for the receiver's X-Styx-Timeout seconds.
    TIMEOUT = 6
    #: The store reports the log gone (LogNotFound).
    LOG_NOT_FOUND = 7
    #: The log cannot be written or read: it failed (fsync error,
    #: fail-stop), or was closed or deleted while the stream was open.
    LOG_NOT_AVAILABLE = 8
    #: The consumer's position was truncated away (retention) or is outside
    #: the log.
    POSITION_OUT_OF_RANGE = 9
    #: The server is shutting down: what was acked before it is durable;
    #: the client reconnects later (to this or another server).
    SHUTDOWN = 10
    #: The authorization policy denies the stream and the client showed no
    #: credentials (or an unknown bearer token): HTTP's 401.
    UNAUTHORIZED = 11
    #: The authorization policy denies the stream to the client's
    #: principals: HTTP's 403.
    FORBIDDEN = 12


class StyxProtocolError(Exception):
    """
    Malformed input.  The only exception L{StyxDecoder.feed} raises.

    @ivar code: the L{ErrorCode} to send to the peer.
    @ivar messages: the messages decoded, in this call, before the bad
        bytes: they were well-formed and the caller may still act on them.
    """

    def __init__(self, code, message, messages=()):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.messages = list(messages)

    def __repr__(self):
        return f"<StyxProtocolError {self.code.name}: {self}>"


class Ack(NamedTuple):
    """Server to producer: C{count} records of this stream are durable and
    the log's synced end is C{position}."""

    position: int
    count: int


class ErrorMessage(NamedTuple):
    """The sender hit an unrecoverable error; the stream ends."""

    code: int

    @property
    def name(self):
        try:
            return ErrorCode(self.code).name
        except ValueError:
            return f"code {self.code}"


class _Heartbeat:
    __slots__ = ()

    def __repr__(self):
        return "HEARTBEAT"


#: The heartbeat message (a singleton: it carries nothing).
HEARTBEAT = _Heartbeat()

#: Wire bytes of a heartbeat.
HEARTBEAT_BYTES = _TYPE.pack(HEARTBEAT_TYPE)


# -- encoding -------------------------------------------------------------

def encode_record(payload):
    """One Record message."""
    return _RECORD_HEADER.pack(RECORD, len(payload)) + bytes(payload)


def encode_records(records):
    """
    Record messages for a sequence of bytes-like payloads, as one bytes.

    Headers are built once per distinct size: when every record has the same
    size (the usual bulk case) a single header object is repeated and the
    whole batch is one C{join}.
    """
    n = len(records)
    if n == 0:
        return b""
    lengths = list(map(len, records))
    first = lengths[0]
    parts = [None] * (2 * n)
    if lengths.count(first) == n:
        parts[0::2] = [_RECORD_HEADER.pack(RECORD, first)] * n
    else:
        parts[0::2] = map(_RECORD_HEADER.pack, [RECORD] * n, lengths)
    parts[1::2] = records
    return b"".join(parts)


def encode_batch(batch):
    """
    Record messages for a L{streamproto.log.batch.RecordBatch} (a lengths
    array plus the concatenated payloads), as one bytes.
    """
    lengths = batch.lengths
    n = len(lengths)
    if n == 0:
        return b""
    data = batch.data
    if _speedups is not None:
        return _speedups.frame_records(lengths, data, _RECORD_PREFIX)
    if not isinstance(data, bytes):
        data = bytes(data)
    if n == 1:
        return _RECORD_HEADER.pack(RECORD, lengths[0]) + data
    first = lengths[0]
    uniform = lengths.count(first) == n
    if uniform and first <= _STRIDED_MAX_SIZE and first % 2 == 0 and n >= 64:
        return _encode_uniform_strided(data, first, n)
    parts = [None] * (2 * n)
    if uniform:
        parts[0::2] = [_RECORD_HEADER.pack(RECORD, first)] * n
        end = n * first
        parts[1::2] = [data[i:i + first] for i in range(0, end, first)] if first else [b""] * n
    else:
        offsets = batch.offsets()
        parts[0::2] = map(_RECORD_HEADER.pack, [RECORD] * n, lengths)
        parts[1::2] = [data[a:b] for a, b in zip(offsets, offsets[1:])]
    return b"".join(parts)


#: Up to this (even) size, same-size records are framed by strided copies
#: (one C-level copy per 2-byte column) rather than one slice per record:
#: about 5x faster at 10 bytes, slower from about 40.
_STRIDED_MAX_SIZE = 32


def _encode_uniform_strided(data, size, n):
    stride = size + 6
    out = bytearray(n * stride)
    columns = memoryview(out).cast("H")
    payload = memoryview(data).cast("H")
    header = memoryview(_RECORD_HEADER.pack(RECORD, size)).cast("H")
    half_stride = stride // 2
    half_size = size // 2
    for j in range(3):
        columns[j::half_stride] = memoryview(header[j:j + 1].tobytes() * n).cast("H")
    for k in range(half_size):
        columns[3 + k::half_stride] = payload[k::half_size]
    return bytes(out)


def encode_ack(position, count):
    return _ACK.pack(ACK, position, count)


def encode_error(code):
    return _ERROR.pack(ERROR, int(code))


def encode_message(message):
    """Encode any one message (C{bytes} payload = a record)."""
    if isinstance(message, (bytes, bytearray, memoryview)):
        return encode_record(message)
    if isinstance(message, Ack):
        return encode_ack(message.position, message.count)
    if isinstance(message, ErrorMessage):
        return encode_error(message.code)
    if message is HEARTBEAT:
        return HEARTBEAT_BYTES
    raise TypeError(f"not a styx/0 message: {message!r}")


# -- decoding -------------------------------------------------------------

class StyxDecoder:
    """
    Incremental decoder: L{feed} it bytes as they arrive, get back every
    message they complete.

    @ivar max_record_size: records larger than this are a protocol error
        (L{ErrorCode.RECORD_TOO_LARGE}), found as soon as the header arrives
        so nothing is buffered for them.
    @ivar accept: message types this side accepts; another well-formed type
        is L{ErrorCode.UNEXPECTED_MESSAGE}.  None accepts all four.
    """

    def __init__(self, max_record_size=DEFAULT_MAX_RECORD_SIZE, accept=None):
        if not 0 <= max_record_size <= MAX_WIRE_RECORD_SIZE:
            raise ValueError("max_record_size must be in 0..2147483647")
        self.max_record_size = max_record_size
        self.accept = frozenset(accept) if accept is not None else None
        self._pending = bytearray()  # the unconsumed tail
        self._need = 0               # bytes _pending must hold to make progress
        self._failed = None

    @property
    def buffered(self):
        """Bytes held back waiting for the rest of a message."""
        return len(self._pending)

    def feed(self, data):
        """
        @return: a list of messages: C{bytes} for records, L{Ack},
            L{HEARTBEAT}, L{ErrorMessage}.
        @raise StyxProtocolError: on malformed input; the decoder stays
            failed (every later call raises the same error).
        """
        out = []
        self._feed(data, out, out)
        return out

    def feed_split(self, data):
        """
        Like L{feed}, separating records from the rest (the hot path: no
        second pass over the records).  With the C accelerator the frames
        are scanned in C and only the cutting into bytes objects is Python.

        @return: C{(records, others)}: the record payloads in order, and the
            other messages in order (their interleaving is lost).
        @raise StyxProtocolError: as L{feed}; its C{messages} are the
            records then the others.
        """
        if _speedups is not None:
            lengths, payload, others = self.feed_batch(data)
            return split_payload(lengths, payload), others
        return self._feed_split_py(data)

    def _feed_split_py(self, data):
        records = []
        others = []
        try:
            self._feed(data, records, others)
        except StyxProtocolError as e:
            e.messages = records + others
            raise
        return records, others

    def feed_batch(self, data):
        """
        Like L{feed_split}, with the records as one batch: C{(lengths, data,
        others)}, an C{array('I')} of sizes and the concatenated payloads
        (a L{streamproto.log.batch.RecordBatch}'s layout).  With the C
        accelerator no Python code runs per record; without it the records
        are decoded as by L{feed_split}, then joined.

        @raise StyxProtocolError: as L{feed}; its C{messages} are the
            records decoded before the error, as bytes, then the others.
        """
        if _speedups is None:
            records, others = self._feed_split_py(data)
            return array("I", map(len, records)), b"".join(records), others
        chunks = []
        others = []
        try:
            self._feed(data, chunks, others, batch=True)
        except StyxProtocolError as e:
            e.messages = split_payload(*_join_chunks(chunks)) + others
            raise
        lengths, payload = _join_chunks(chunks)
        return lengths, payload, others

    def _feed(self, data, records, others, batch=False):
        if self._failed is not None:
            raise self._failed
        pending = self._pending
        head = None
        if pending and batch:
            # a record begun in the last read: complete it with the few
            # bytes it lacks and scan it alone; the records of this read
            # are then copied once, after its payload (not the whole read
            # appended to the tail first, then copied out again)
            data = memoryview(data)
            head_chunks = []
            try:
                while pending:
                    take = self._need - len(pending)
                    if take <= 0:
                        break       # no progress to make this way
                    pending += data[:take]
                    data = data[take:]
                    if len(pending) < self._need:
                        return
                    pos = self._scan(pending, head_chunks, others, batch)
                    if pos == 0 and len(pending) >= self._need:
                        break
                    del pending[:pos]
            except StyxProtocolError as e:
                records.extend(head_chunks)     # decoded before the error
                e.messages = records
                self._failed = StyxProtocolError(e.code, str(e))
                raise
            if head_chunks:
                head = _join_chunks(head_chunks)
        if pending:
            pending += data
            if len(pending) < self._need:
                self._put_back(head, records)
                return
            if batch:
                data = pending
                self._pending = pending = bytearray()
            else:
                data = bytes(pending)
                pending.clear()
        elif not data:
            self._put_back(head, records)
            return
        try:
            pos = self._scan(data, records, others, batch, head)
        except StyxProtocolError as e:
            e.messages = records
            self._failed = StyxProtocolError(e.code, str(e))
            raise
        if pos < len(data):
            pending += data[pos:] if isinstance(data, memoryview) else memoryview(data)[pos:]

    @staticmethod
    def _put_back(head, chunks):
        """Records decoded from a tail, with nothing after them to scan."""
        if head is not None:
            chunks.append((head[0].tobytes(), head[1]))

    def _check_type(self, message_type):
        if message_type not in (RECORD, ACK, HEARTBEAT_TYPE, ERROR):
            raise StyxProtocolError(ErrorCode.UNKNOWN_MESSAGE_TYPE,
                                    f"unknown message type {message_type}")
        if self.accept is not None and message_type not in self.accept:
            raise StyxProtocolError(ErrorCode.UNEXPECTED_MESSAGE,
                                    f"unexpected message type {message_type}")

    def _bad_size(self, size):
        if size < 0:
            return StyxProtocolError(ErrorCode.INVALID_RECORD_SIZE,
                                     f"negative record size {size}")
        return StyxProtocolError(ErrorCode.RECORD_TOO_LARGE,
                                 f"record of {size} bytes exceeds {self.max_record_size}")

    def _scan(self, data, out, others, batch=False, head=None):
        """
        Decode complete messages from C{data}: records to C{out}, the others
        to C{others} (which may be C{out}); return where it stopped.  With
        C{batch}, C{out} gets C{(lengths bytes, payloads)} chunks instead of
        records, the first starting with C{head}'s (C{(lengths, payloads)}
        decoded before C{data}), if given.
        """
        if batch:
            return self._scan_batch(data, out, others, head)
        pos = 0
        end = len(data)
        max_size = self.max_record_size
        unpack_header = _RECORD_HEADER.unpack_from
        append = out.append
        accept_records = self.accept is None or RECORD in self.accept
        while True:
            remaining = end - pos
            if remaining >= 6:
                message_type, size = unpack_header(data, pos)
                if message_type == RECORD and accept_records:
                    if size < 0 or size > max_size:
                        raise self._bad_size(size)
                    stride = size + 6
                    if remaining >= stride * _UNIFORM_MIN_RECORDS:
                        # Runs of same-size records: check every header of the
                        # run with six strided slices (C speed), then cut the
                        # payloads out in one comprehension.
                        count = remaining // stride
                        run_end = pos + count * stride
                        for j in range(6):
                            if data[pos + j:run_end:stride] != data[pos + j:pos + j + 1] * count:
                                break
                        else:
                            _cut_uniform(data, pos, size, count, out)
                            pos = run_end
                            continue
                    stop = pos + stride
                    if stop > end:
                        self._need = stride
                        return pos
                    append(data[pos + 6:stop])
                    pos = stop
                    # the general loop, without re-trying the strided scan for
                    # every record of a mixed run
                    while end - pos >= 6:
                        message_type, size = unpack_header(data, pos)
                        if message_type != RECORD:
                            break
                        if size < 0 or size > max_size:
                            raise self._bad_size(size)
                        stop = pos + 6 + size
                        if stop > end:
                            self._need = size + 6
                            return pos
                        append(data[pos + 6:stop])
                        pos = stop
                    continue
            elif remaining >= 2:
                (message_type,) = _TYPE.unpack_from(data, pos)
            else:
                self._need = 2
                return pos
            self._check_type(message_type)
            if message_type == HEARTBEAT_TYPE:
                others.append(HEARTBEAT)
                pos += 2
            elif message_type == RECORD:  # fewer than 6 bytes: header incomplete
                self._need = 6
                return pos
            elif message_type == ACK:
                if remaining < 18:
                    self._need = 18
                    return pos
                others.append(Ack(*_INT64_PAIR.unpack_from(data, pos + 2)))
                pos += 18
            else:  # ERROR
                if remaining < 4:
                    self._need = 4
                    return pos
                others.append(ErrorMessage(_INT16.unpack_from(data, pos + 2)[0]))
                pos += 4

    def _scan_batch(self, data, chunks, others, head=None):
        """L{StyxDecoder._scan} for batches (with the accelerator): runs of
        records are scanned in C, other messages one at a time."""
        if head is not None:
            # the first run's payloads are copied after head's, in C
            raw, payload, stop, status = _speedups.scan_frames(
                data, 0, _RECORD_PREFIX, self.max_record_size, -1, head[1])
            chunks.append((head[0].tobytes() + raw, payload))
            if status == _TOO_LARGE:
                raise self._bad_size(_RECORD_HEADER.unpack_from(data, stop)[1])
            if status == _NEED_MORE:
                self._need_more(data, stop)
                return stop
            data_pos = stop     # _OTHER: a message of another type follows
        else:
            data_pos = 0
        return self._scan_batch_from(data, data_pos, chunks, others)

    def _need_more(self, data, pos):
        """Note how many bytes the message at C{pos} needs."""
        remaining = len(data) - pos
        if remaining >= 6:
            self._need = 6 + _RECORD_HEADER.unpack_from(data, pos)[1]
        elif remaining:
            self._need = 6 if remaining >= 2 else 2

    def _scan_batch_from(self, data, pos, chunks, others):
        """The rest of L{_scan_batch}, from C{pos}."""
        end = len(data)
        max_size = self.max_record_size
        accept_records = self.accept is None or RECORD in self.accept
        while True:
            remaining = end - pos
            if remaining < 2:
                if remaining:
                    self._need = 2
                return pos
            (message_type,) = _TYPE.unpack_from(data, pos)
            if message_type == RECORD and accept_records:
                raw, payload, stop, status = _speedups.scan_frames(
                    data, pos, _RECORD_PREFIX, max_size, -1)
                if stop > pos:
                    chunks.append((raw, payload))
                    pos = stop
                if status == _TOO_LARGE:
                    raise self._bad_size(_RECORD_HEADER.unpack_from(data, pos)[1])
                if status == _NEED_MORE:
                    remaining = end - pos
                    if remaining >= 6:
                        self._need = 6 + _RECORD_HEADER.unpack_from(data, pos)[1]
                    elif remaining:
                        self._need = 6 if remaining >= 2 else 2
                    return pos
                continue    # _OTHER: a message of another type follows
            # one message of another type: the general scanner decodes it
            if message_type == RECORD:
                self._check_type(message_type)
            stop = self._scan_one(data, pos, others)
            if stop is None:
                return pos
            pos = stop

    def _scan_one(self, data, pos, others):
        """Decode the one non-record message at C{pos}; None if incomplete."""
        remaining = len(data) - pos
        (message_type,) = _TYPE.unpack_from(data, pos)
        self._check_type(message_type)
        if message_type == HEARTBEAT_TYPE:
            others.append(HEARTBEAT)
            return pos + 2
        if message_type == ACK:
            if remaining < 18:
                self._need = 18
                return None
            others.append(Ack(*_INT64_PAIR.unpack_from(data, pos + 2)))
            return pos + 18
        if remaining < 4:   # ERROR
            self._need = 4
            return None
        others.append(ErrorMessage(_INT16.unpack_from(data, pos + 2)[0]))
        return pos + 4


#: Same-size records are cut out this many at a time by one Struct.
_CUT_BLOCK = 64


@lru_cache(maxsize=128)
def _block_struct(size, header=6):
    """A Struct skipping C{header} bytes and copying the payload of
    L{_CUT_BLOCK} consecutive records of C{size} bytes."""
    skip = f"{header}x" if header else ""
    return struct.Struct(f"{skip}{size}s" * _CUT_BLOCK)


def split_payload(lengths, payload):
    """
    The records of a batch (C{array('I')} of sizes, concatenated payloads)
    as a list of bytes: same-size runs by blocks of C{Struct.iter_unpack},
    others by one slice each.
    """
    n = len(lengths)
    if n == 0:
        return []
    first = lengths[0]
    if lengths.count(first) == n:
        records = []
        blocks = n // _CUT_BLOCK if 0 < first <= 4096 else 0
        done = 0
        if blocks:
            done = blocks * _CUT_BLOCK * first
            records.extend(chain.from_iterable(
                _block_struct(first, 0).iter_unpack(memoryview(payload)[:done])))
        if first:
            records.extend([payload[i:i + first] for i in range(done, n * first, first)])
        else:
            records.extend([b""] * (n - len(records)))
        return records
    offsets = [0]
    offsets.extend(accumulate(lengths))
    return [payload[a:b] for a, b in zip(offsets, offsets[1:])]


def _cut_uniform(data, pos, size, count, out):
    """
    Append to C{out} the payloads of C{count} Record messages of C{size}
    bytes starting at C{pos} (headers already checked): whole blocks by
    C{Struct.iter_unpack} (C speed, ~6x a slice per record), the rest by
    slicing.
    """
    stride = size + 6
    blocks = count // _CUT_BLOCK if size <= 4096 else 0
    if blocks:
        block_end = pos + blocks * _CUT_BLOCK * stride
        out.extend(chain.from_iterable(
            _block_struct(size).iter_unpack(memoryview(data)[pos:block_end])))
        pos = block_end
        count -= blocks * _CUT_BLOCK
    first = pos + 6
    out.extend([data[i:i + size] for i in range(first, first + count * stride, stride)])


def _join_chunks(chunks):
    lengths = array("I")
    if not chunks:
        return lengths, b""
    for raw, _ in chunks:
        lengths.frombytes(raw)
    if len(chunks) == 1:
        return lengths, chunks[0][1]
    return lengths, b"".join(payload for _, payload in chunks)


def decode_all(data, **kwargs):
    """
    Decode a complete byte string.

    @raise StyxProtocolError: on malformed input or a truncated last message
        (L{ErrorCode.UNKNOWN}).
    """
    decoder = StyxDecoder(**kwargs)
    messages = decoder.feed(data)
    if decoder.buffered:
        raise StyxProtocolError(ErrorCode.UNKNOWN,
                                f"{decoder.buffered} bytes of a truncated message",
                                messages)
    return messages
