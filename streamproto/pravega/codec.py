"""
Sans-IO codec of the Pravega segment-store wire protocol (WIRE_VERSION 17).

Every frame is C{int32 type, int32 length, fields}, big-endian, with
C{length <= 0x00FFFFFF}.  Strings are Java C{writeUTF}: a u16 byte length and
modified UTF-8 (NUL as C0 80, supplementary characters as two 3-byte
surrogates).  UUIDs are two int64 (most significant first), which is the
RFC 4122 byte order of L{uuid.UUID.bytes}.

Field order follows pravega's C{WireCommands.java}.  Trailing fields that
newer Pravega versions appended (request ids, stack traces, offsets) are
optional on decode, with the reference's defaults, so old peers still
parse; on encode every field is written.  Unlike the Java decoder, which
skips whatever follows the fields it knows, we treat a frame whose length
disagrees with its fields (too short *or* too long) as a L{ProtocolError}.
Only KeepAlive carries uninterpreted bytes (the draft spec allows it).

The frame header, modified UTF-8 and the Event frames inside segments are
in L{streamproto.pravega.frames} (named here too).  Nothing here does I/O: L{Decoder.feed} takes bytes and returns commands,
L{encode} takes a command and returns bytes.  L{AppendAssembler} is the
sans-IO equivalent of the reference's C{AppendDecoder}: it turns
SetupAppend / AppendBlock / AppendBlockEnd / ConditionalAppend into
L{Append}s.
"""

import uuid
from dataclasses import field, make_dataclass

from streamproto.pravega.frames import (  # named here too: the codec's public API
    WIRE_VERSION as WIRE_VERSION,
    OLDEST_COMPATIBLE_VERSION as OLDEST_COMPATIBLE_VERSION,
    MAX_FRAME_SIZE as MAX_FRAME_SIZE,
    HEADER_SIZE as HEADER_SIZE,
    NULL_EVENT_NUMBER as NULL_EVENT_NUMBER,
    NULL_ATTRIBUTE_VALUE as NULL_ATTRIBUTE_VALUE,
    _HEADER as _HEADER,
    _Q as _Q,
    _I as _I,
    _H as _H,
    _B as _B,
    _QQ as _QQ,
    _II as _II,
    pack_header as pack_header,
    unpack_header_from as unpack_header_from,
    EVENT as EVENT,
    PADDING as PADDING,
    PARTIAL_EVENT as PARTIAL_EVENT,
    ProtocolError as ProtocolError,
    encode_utf as encode_utf,
    decode_modified_utf8 as decode_modified_utf8,
    split_events as split_events,
    EventCounter as EventCounter,
    skip_events as skip_events,
)


# -- commands --------------------------------------------------------------

class TableKey:
    """A table segment key with its version (C{NO_VERSION}: unconditional)."""

    __slots__ = ("data", "version")
    #: Long.MIN_VALUE: unconditional update or removal
    NO_VERSION = -(1 << 63)
    #: the key must not exist (and, in replies, it does not)
    NOT_EXISTS = -1

    def __init__(self, data, version=NO_VERSION):
        self.data = bytes(data)
        self.version = version

    def __eq__(self, other):
        return (isinstance(other, TableKey)
                and (self.data, self.version) == (other.data, other.version))

    def __hash__(self):
        return hash((self.data, self.version))

    def __repr__(self):
        return f"TableKey({self.data!r}, {self.version})"

#
# Field kinds: q int64, i int32, b int8, ? boolean, u UUID, s UTF string,
# d int32-length-prefixed bytes, r the rest of the frame, e an embedded Event
# frame (ConditionalAppend), z zero padding (decoded as its length), L a list
# of int64, K a list of TableKey, T a list of (TableKey, value bytes).  Lists
# are an int32 count then the elements; a key is int32 payload size (12 +
# length), int32 length, bytes, int64 version; a value int32 payload size (4 +
# length), int32 length, bytes.
# A third element makes a field optional on decode, with that default.

_SPECS = [
    ("Hello", -127, [("high_version", "i"), ("low_version", "i")]),
    ("Padding", PADDING, [("length", "z")]),
    ("PartialEvent", PARTIAL_EVENT, [("data", "r")]),
    ("Event", EVENT, [("data", "r")]),
    ("SetupAppend", 1, [("request_id", "q"), ("writer_id", "u"), ("segment", "s"),
                        ("delegation_token", "s")]),
    ("AppendSetup", 2, [("request_id", "q"), ("segment", "s"), ("writer_id", "u"),
                        ("last_event_number", "q")]),
    ("AppendBlock", 3, [("writer_id", "u"), ("data", "r")]),
    ("AppendBlockEnd", 4, [("writer_id", "u"), ("size_of_whole_events", "i"), ("data", "d"),
                           ("num_events", "i"), ("last_event_number", "q"),
                           ("request_id", "q", -1)]),
    ("ConditionalAppend", 5, [("writer_id", "u"), ("event_number", "q"),
                              ("expected_offset", "q"), ("data", "e"),
                              ("request_id", "q", -1)]),
    ("DataAppended", 7, [("writer_id", "u"), ("event_number", "q"),
                         ("previous_event_number", "q", -1), ("request_id", "q", -1),
                         ("current_segment_write_offset", "q", -1)]),
    ("ConditionalCheckFailed", 8, [("writer_id", "u"), ("event_number", "q"),
                                   ("request_id", "q", -1)]),
    ("ReadSegment", 9, [("segment", "s"), ("offset", "q"), ("suggested_length", "i"),
                        ("delegation_token", "s"), ("request_id", "q", -1)]),
    ("SegmentRead", 10, [("segment", "s"), ("offset", "q"), ("at_tail", "?"),
                         ("end_of_segment", "?"), ("data", "d"), ("request_id", "q", -1)]),
    ("GetStreamSegmentInfo", 11, [("request_id", "q"), ("segment", "s"),
                                  ("delegation_token", "s")]),
    ("StreamSegmentInfo", 12, [("request_id", "q"), ("segment", "s"), ("exists", "?"),
                               ("is_sealed", "?"), ("is_deleted", "?"), ("last_modified", "q"),
                               ("write_offset", "q"), ("start_offset", "q", 0)]),
    ("CreateSegment", 20, [("request_id", "q"), ("segment", "s"), ("target_rate", "i"),
                           ("scale_type", "b"), ("delegation_token", "s"),
                           ("rollover_size_bytes", "q", 0)]),
    ("SegmentCreated", 21, [("request_id", "q"), ("segment", "s")]),
    ("SealSegment", 28, [("request_id", "q"), ("segment", "s"), ("delegation_token", "s")]),
    ("SegmentSealed", 29, [("request_id", "q"), ("segment", "s")]),
    ("DeleteSegment", 30, [("request_id", "q"), ("segment", "s"), ("delegation_token", "s")]),
    ("SegmentDeleted", 31, [("request_id", "q"), ("segment", "s")]),
    ("GetSegmentAttribute", 34, [("request_id", "q"), ("segment", "s"), ("attribute_id", "u"),
                                 ("delegation_token", "s")]),
    ("SegmentAttribute", 35, [("request_id", "q"), ("value", "q")]),
    ("UpdateSegmentAttribute", 36, [("request_id", "q"), ("segment", "s"), ("attribute_id", "u"),
                                    ("new_value", "q"), ("expected_value", "q"),
                                    ("delegation_token", "s")]),
    ("SegmentAttributeUpdated", 37, [("request_id", "q"), ("success", "?")]),
    ("CreateTransientSegment", 40, [("request_id", "q"), ("writer_id", "u"),
                                    ("parent_segment", "s"), ("delegation_token", "s")]),
    ("TruncateSegment", 38, [("request_id", "q"), ("segment", "s"),
                             ("truncation_offset", "q"), ("delegation_token", "s")]),
    ("SegmentTruncated", 39, [("request_id", "q"), ("segment", "s")]),
    ("WrongHost", 50, [("request_id", "q"), ("segment", "s"), ("correct_host", "s"),
                       ("server_stack_trace", "s", "")]),
    ("SegmentIsSealed", 51, [("request_id", "q"), ("segment", "s"),
                             ("server_stack_trace", "s", ""), ("offset", "q", -1)]),
    ("SegmentAlreadyExists", 52, [("request_id", "q"), ("segment", "s"),
                                  ("server_stack_trace", "s", "")]),
    ("NoSuchSegment", 53, [("request_id", "q"), ("segment", "s"),
                           ("server_stack_trace", "s", ""), ("offset", "q", -1)]),
    ("InvalidEventNumber", 55, [("writer_id", "u"), ("request_id", "q"),
                                ("server_stack_trace", "s", ""), ("event_number", "q", -1)]),
    ("SegmentIsTruncated", 56, [("request_id", "q"), ("segment", "s"), ("start_offset", "q"),
                                ("server_stack_trace", "s", ""), ("offset", "q", -1)]),
    ("OperationUnsupported", 57, [("request_id", "q"), ("operation_name", "s"),
                                  ("server_stack_trace", "s", "")]),
    ("AuthTokenCheckFailed", 60, [("request_id", "q"), ("server_stack_trace", "s", ""),
                                  ("error_code", "i", -1)]),
    ("ErrorMessage", 61, [("request_id", "q"), ("segment", "s"), ("message", "s"),
                          ("error_code", "i")]),
    ("MergeSegments", 58, [("request_id", "q"), ("target", "s"), ("source", "s"),
                           ("delegation_token", "s")]),
    ("SegmentsMerged", 59, [("request_id", "q"), ("target", "s"), ("source", "s"),
                            ("new_target_write_offset", "q", -1)]),
    # The Rust client sends (request id, segment, token); Java adds a sorted
    # flag and key length before the token and a rollover size after it.
    # Auth is off, so whatever follows the segment name is kept unparsed.
    ("CreateTableSegment", 70, [("request_id", "q"), ("segment", "s"), ("rest", "r")]),
    ("DeleteTableSegment", 71, [("request_id", "q"), ("segment", "s"), ("must_be_empty", "?"),
                                ("delegation_token", "s")]),
    ("UpdateTableEntries", 74, [("request_id", "q"), ("segment", "s"), ("delegation_token", "s"),
                                ("entries", "T"), ("table_segment_offset", "q", -1)]),
    ("TableEntriesUpdated", 75, [("request_id", "q"), ("updated_versions", "L")]),
    ("RemoveTableKeys", 76, [("request_id", "q"), ("segment", "s"), ("delegation_token", "s"),
                             ("keys", "K"), ("table_segment_offset", "q", -1)]),
    ("TableKeysRemoved", 77, [("request_id", "q"), ("segment", "s")]),
    ("ReadTable", 78, [("request_id", "q"), ("segment", "s"), ("delegation_token", "s"),
                       ("keys", "K")]),
    ("TableRead", 79, [("request_id", "q"), ("segment", "s"), ("entries", "T")]),
    ("TableSegmentNotEmpty", 80, [("request_id", "q"), ("segment", "s"),
                                  ("server_stack_trace", "s", "")]),
    ("TableKeyDoesNotExist", 81, [("request_id", "q"), ("segment", "s"),
                                  ("server_stack_trace", "s", "")]),
    ("TableKeyBadVersion", 82, [("request_id", "q"), ("segment", "s"),
                                ("server_stack_trace", "s", "")]),
    # Paged iteration.  The iterator arguments after the continuation token
    # (a prefix filter Pravega ignores since 0.10, then the from / to key
    # bounds) are what Java sends; the Rust client sends the token only.
    ("ReadTableKeys", 83, [("request_id", "q"), ("segment", "s"), ("delegation_token", "s"),
                           ("suggested_key_count", "i"), ("continuation_token", "d"),
                           ("prefix_filter", "d", b""), ("from_key", "d", b""),
                           ("to_key", "d", b"")]),
    ("TableKeysRead", 84, [("request_id", "q"), ("segment", "s"), ("keys", "K"),
                           ("continuation_token", "d")]),
    ("ReadTableEntries", 85, [("request_id", "q"), ("segment", "s"), ("delegation_token", "s"),
                              ("suggested_entry_count", "i"), ("continuation_token", "d"),
                              ("prefix_filter", "d", b""), ("from_key", "d", b""),
                              ("to_key", "d", b"")]),
    ("TableEntriesRead", 86, [("request_id", "q"), ("segment", "s"), ("entries", "T"),
                              ("continuation_token", "d")]),
    ("TableEntriesDeltaRead", 87, [("request_id", "q"), ("segment", "s"), ("entries", "T"),
                                   ("should_clear", "?"), ("reached_end", "?"),
                                   ("last_position", "q")]),
    ("ReadTableEntriesDelta", 88, [("request_id", "q"), ("segment", "s"),
                                   ("delegation_token", "s"), ("from_position", "q"),
                                   ("suggested_entry_count", "i")]),
    ("ConditionalBlockEnd", 89, [("writer_id", "u"), ("event_number", "q"),
                                 ("expected_offset", "q"), ("data", "d"), ("request_id", "q")]),
    ("KeepAlive", 100, []),
]

#: type code -> command class
COMMANDS = {}
#: error reply classes (the reference's C{isFailure()})
FAILURES = ()

_defaults_for_kind = {"q": 0, "i": 0, "b": 0, "?": False, "s": "", "d": b"", "r": b"",
                      "e": b"", "z": 0, "u": None, "T": (), "K": (), "L": ()}


def _build():
    global FAILURES
    failures = []
    for name, code, fields in _SPECS:
        dc_fields = []
        for f in fields:
            default = f[2] if len(f) > 2 else _defaults_for_kind[f[1]]
            if f[1] == "u":
                dc_fields.append((f[0], uuid.UUID, field(default=uuid.UUID(int=0))))
            else:
                dc_fields.append((f[0], object, field(default=default)))
        cls = make_dataclass(name, dc_fields, slots=True, frozen=True)
        cls.TYPE = code
        cls.FIELDS = tuple(fields)
        cls.__module__ = __name__
        cls.__doc__ = f"Pravega wire command {name} (type code {code})."
        COMMANDS[code] = cls
        if 50 <= code <= 61 and code not in (58, 59) or 80 <= code <= 82:
            failures.append(cls)
    FAILURES = tuple(failures)


_build()
del _build

(Hello, Padding, PartialEvent, Event, SetupAppend, AppendSetup, AppendBlock, AppendBlockEnd,
 ConditionalAppend, DataAppended, ConditionalCheckFailed, ReadSegment, SegmentRead,
 GetStreamSegmentInfo, StreamSegmentInfo, CreateSegment, SegmentCreated, SealSegment,
 SegmentSealed, DeleteSegment, SegmentDeleted, GetSegmentAttribute, SegmentAttribute,
 UpdateSegmentAttribute, SegmentAttributeUpdated, CreateTransientSegment, TruncateSegment,
 SegmentTruncated, WrongHost,
 SegmentIsSealed, SegmentAlreadyExists, NoSuchSegment, InvalidEventNumber, SegmentIsTruncated,
 OperationUnsupported, AuthTokenCheckFailed, ErrorMessage, MergeSegments, SegmentsMerged,
 CreateTableSegment, DeleteTableSegment, UpdateTableEntries, TableEntriesUpdated, RemoveTableKeys,
 TableKeysRemoved, ReadTable, TableRead, TableSegmentNotEmpty, TableKeyDoesNotExist,
 TableKeyBadVersion, ReadTableKeys, TableKeysRead, ReadTableEntries, TableEntriesRead,
 TableEntriesDeltaRead, ReadTableEntriesDelta, ConditionalBlockEnd,
 KeepAlive) = [COMMANDS[code] for _, code, _ in _SPECS]


# -- encoding --------------------------------------------------------------

def _encode_fields(cmd, parts):
    for f in cmd.FIELDS:
        name, kind = f[0], f[1]
        v = getattr(cmd, name)
        if kind == "q":
            parts.append(_Q.pack(v))
        elif kind == "i":
            parts.append(_I.pack(v))
        elif kind == "b":
            parts.append(_B.pack(v))
        elif kind == "?":
            parts.append(b"\x01" if v else b"\x00")
        elif kind == "u":
            parts.append(v.bytes)
        elif kind == "s":
            parts.append(encode_utf(v))
        elif kind == "d":
            parts.append(_I.pack(len(v)))
            parts.append(bytes(v))
        elif kind == "r":
            parts.append(bytes(v))
        elif kind == "e":
            parts.append(_HEADER.pack(EVENT, len(v)))
            parts.append(bytes(v))
        elif kind == "z":
            parts.append(bytes(v))
        elif kind == "L":
            parts.append(_I.pack(len(v)))
            parts.extend(_Q.pack(x) for x in v)
        elif kind == "K":
            parts.append(_I.pack(len(v)))
            for key in v:
                _encode_table_key(key, parts)
        elif kind == "T":
            parts.append(_I.pack(len(v)))
            for key, value in v:
                _encode_table_key(key, parts)
                parts.append(_II.pack(4 + len(value), len(value)))
                parts.append(bytes(value))
        else:  # pragma: no cover - the spec table is static
            raise AssertionError(kind)


def _encode_table_key(key, parts):
    parts.append(_II.pack(12 + len(key.data), len(key.data)))
    parts.append(bytes(key.data))
    parts.append(_Q.pack(key.version))


def encode(cmd):
    """
    @return: the whole frame (header and fields) of command C{cmd}.
    @raise ValueError: if the frame would exceed L{MAX_FRAME_SIZE}.
    """
    parts = []
    _encode_fields(cmd, parts)
    body = b"".join(parts)
    if len(body) > MAX_FRAME_SIZE:
        raise ValueError(f"{type(cmd).__name__} of {len(body)} bytes exceeds the frame limit")
    return _HEADER.pack(cmd.TYPE, len(body)) + body


def encode_event(data):
    """An Event frame (type 0): how events are sent in blocks and stored."""
    return _HEADER.pack(EVENT, len(data)) + data


def encode_append_block_header(writer_id, block_length):
    """
    The header and writer id of an AppendBlock whose C{block_length} bytes
    of events (and trailing PartialEvent or Padding frame) follow.
    """
    return _HEADER.pack(3, 16 + block_length) + writer_id.bytes


# -- decoding --------------------------------------------------------------

def decode_fields(cls, buf, pos, end):
    """
    Decode the fields of a C{cls} frame from C{buf[pos:end]}.

    @raise ProtocolError: if the fields do not exactly fill the frame.
    """
    values = []
    try:
        for f in cls.FIELDS:
            kind = f[1]
            if len(f) > 2 and pos == end:
                values.append(f[2])
                continue
            if kind == "q":
                if pos + 8 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated long")
                values.append(_Q.unpack_from(buf, pos)[0])
                pos += 8
            elif kind == "i":
                if pos + 4 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated int")
                values.append(_I.unpack_from(buf, pos)[0])
                pos += 4
            elif kind == "b":
                if pos + 1 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated byte")
                values.append(_B.unpack_from(buf, pos)[0])
                pos += 1
            elif kind == "?":
                if pos + 1 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated boolean")
                values.append(buf[pos] != 0)
                pos += 1
            elif kind == "u":
                if pos + 16 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated UUID")
                values.append(uuid.UUID(bytes=bytes(buf[pos:pos + 16])))
                pos += 16
            elif kind == "s":
                if pos + 2 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated string length")
                n = _H.unpack_from(buf, pos)[0]
                pos += 2
                if pos + n > end:
                    raise ProtocolError(f"{cls.__name__}: string runs past the frame")
                values.append(decode_modified_utf8(buf[pos:pos + n]))
                pos += n
            elif kind == "d":
                if pos + 4 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated data length")
                n = _I.unpack_from(buf, pos)[0]
                pos += 4
                if n < 0 or pos + n > end:
                    raise ProtocolError(f"{cls.__name__}: data length {n} disagrees with frame")
                values.append(bytes(buf[pos:pos + n]))
                pos += n
            elif kind == "r":
                values.append(bytes(buf[pos:end]))
                pos = end
            elif kind == "z":
                values.append(end - pos)
                pos = end
            elif kind in "LKT":
                value, pos = _decode_table_list(cls, kind, buf, pos, end)
                values.append(value)
            elif kind == "e":
                if pos + 8 > end:
                    raise ProtocolError(f"{cls.__name__}: truncated event header")
                t, n = _HEADER.unpack_from(buf, pos)
                if t != EVENT:
                    raise ProtocolError(f"{cls.__name__}: expected an Event, found type {t}")
                pos += 8
                if n < 0 or pos + n > end:
                    raise ProtocolError(f"{cls.__name__}: event length {n} disagrees with frame")
                values.append(bytes(buf[pos:pos + n]))
                pos += n
    except UnicodeDecodeError as e:  # lone bytes in surrogatepass decoding
        raise ProtocolError(f"{cls.__name__}: bad string: {e}")
    if pos != end:
        raise ProtocolError(f"{cls.__name__}: {end - pos} bytes after the last field")
    return cls(*values)


def _table_blob(cls, buf, pos, end, what):
    """A table key or value: int32 payload size, int32 length, bytes."""
    if pos + 8 > end:
        raise ProtocolError(f"{cls.__name__}: truncated table {what}")
    _payload, n = _II.unpack_from(buf, pos)
    pos += 8
    if n < 0 or pos + n > end:
        raise ProtocolError(f"{cls.__name__}: table {what} length {n} disagrees with frame")
    return bytes(buf[pos:pos + n]), pos + n


def _decode_table_list(cls, kind, buf, pos, end):
    """Lists of longs (L), table keys (K) or key/value entries (T)."""
    if pos + 4 > end:
        raise ProtocolError(f"{cls.__name__}: truncated list length")
    count = _I.unpack_from(buf, pos)[0]
    pos += 4
    # every element takes at least 8 bytes: a bad count cannot make us allocate
    if count < 0 or count * 8 > end - pos:
        raise ProtocolError(f"{cls.__name__}: list of {count} does not fit the frame")
    out = []
    for _ in range(count):
        if kind == "L":
            out.append(_Q.unpack_from(buf, pos)[0])
            pos += 8
            continue
        data, pos = _table_blob(cls, buf, pos, end, "key")
        if pos + 8 > end:
            raise ProtocolError(f"{cls.__name__}: truncated key version")
        key = TableKey(data, _Q.unpack_from(buf, pos)[0])
        pos += 8
        if kind == "K":
            out.append(key)
        else:
            value, pos = _table_blob(cls, buf, pos, end, "value")
            out.append((key, value))
    return tuple(out), pos


def decode(frame):
    """Decode exactly one whole frame (bytes-like)."""
    buf = memoryview(frame)
    if len(buf) < HEADER_SIZE:
        raise ProtocolError("frame shorter than its header")
    code, length = _HEADER.unpack_from(buf, 0)
    if length < 0 or length > MAX_FRAME_SIZE:
        raise ProtocolError(f"frame length {length} out of range")
    if HEADER_SIZE + length != len(buf):
        raise ProtocolError("frame length disagrees with its content")
    cls = COMMANDS.get(code)
    if cls is None:
        raise ProtocolError(f"unknown command type {code}")
    if cls is KeepAlive:
        return cls()
    return decode_fields(cls, buf, HEADER_SIZE, len(buf))


#: Type codes of Pravega commands we do not implement (storage flushes and
#: chunk listing, segment policies, LocateOffset, table segment info, batch
#: merges, and the replies to them): decoded as L{UnsupportedCommand} so a
#: server can answer OperationUnsupported instead of dropping the connection.
UNSUPPORTED_CODES = frozenset(
    [-3, -4, -5, -6, 32, 33, 41, 42, 68, 69, 72, 73, 90, 91])


class UnsupportedCommand:
    """A known Pravega command type we do not implement; C{data} is its body."""

    __slots__ = ("type", "data")

    def __init__(self, type, data):
        self.type = type
        self.data = data

    @property
    def request_id(self):
        """Most Pravega requests start with their request id."""
        return _Q.unpack_from(self.data)[0] if len(self.data) >= 8 else -1

    def __eq__(self, other):
        return (isinstance(other, UnsupportedCommand)
                and (self.type, self.data) == (other.type, other.data))

    def __repr__(self):
        return f"UnsupportedCommand(type={self.type}, {len(self.data)} bytes)"


class Decoder:
    """
    Incremental frame decoder: C{feed(bytes)} returns the commands completed
    by those bytes.  The buffer is a bytearray with a read offset, compacted
    once per feed, so many small frames per feed cost no copying.
    """

    def __init__(self, max_frame_size=MAX_FRAME_SIZE):
        if not 0 < max_frame_size <= MAX_FRAME_SIZE:
            raise ValueError("max_frame_size must be in 1..0x00FFFFFF")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self.failed = None

    @property
    def buffered(self):
        """Bytes received but not yet decoded (a partial frame)."""
        return len(self._buf)

    def feed(self, data):
        if self.failed is not None:
            raise self.failed
        buf = self._buf
        buf += data
        out = []
        pos = 0
        n = len(buf)
        view = memoryview(buf)
        try:
            while n - pos >= HEADER_SIZE:
                code, length = _HEADER.unpack_from(view, pos)
                cls = COMMANDS.get(code)
                if cls is None and code not in UNSUPPORTED_CODES:
                    raise ProtocolError(f"unknown command type {code}")
                if length < 0 or length > self.max_frame_size:
                    raise ProtocolError(f"frame length {length} out of range")
                end = pos + HEADER_SIZE + length
                if end > n:
                    break
                if cls is KeepAlive:
                    out.append(_KEEPALIVE)
                elif cls is None:
                    out.append(UnsupportedCommand(code, bytes(view[pos + HEADER_SIZE:end])))
                else:
                    out.append(decode_fields(cls, view, pos + HEADER_SIZE, end))
                pos = end
        except ProtocolError as e:
            self.failed = e
            raise
        finally:
            view.release()
        if pos:
            del buf[:pos]
        return out


_KEEPALIVE = KeepAlive()



class Append:
    """
    One logical append made of whole Event frames, as the reference's
    C{Append}: C{event_count} events ending with C{event_number}.
    C{expected_offset} is None unless conditional.
    """

    __slots__ = ("segment", "writer_id", "event_number", "event_count", "data",
                 "expected_offset", "request_id")

    def __init__(self, segment, writer_id, event_number, event_count, data,
                 expected_offset=None, request_id=-1):
        self.segment = segment
        self.writer_id = writer_id
        self.event_number = event_number
        self.event_count = event_count
        self.data = data
        self.expected_offset = expected_offset
        self.request_id = request_id

    def __repr__(self):
        return (f"<Append {self.segment!r} writer={self.writer_id} "
                f"event_number={self.event_number} count={self.event_count} "
                f"bytes={len(self.data)} expected_offset={self.expected_offset}>")


class AppendAssembler:
    """
    The reference's C{AppendDecoder}, sans-IO: feed it every decoded
    command; it returns the command itself for non-append commands, an
    L{Append} when one is complete, or None (for AppendBlock and Padding).

    Rules, as in the reference: an AppendBlock must be followed directly by
    its AppendBlockEnd; the block holds whole Event frames
    (C{size_of_whole_events} bytes) then at most one PartialEvent or Padding
    frame filling the rest; the PartialEvent's bytes and the BlockEnd's data
    complete the last event.  A BlockEnd without a block carries all the
    data itself.  Event numbers of a writer never go backwards.
    """

    def __init__(self):
        self._writers = {}      # writer_id -> [segment, last event number]
        self._block = None

    def forget(self, writer_id):
        self._writers.pop(writer_id, None)

    def _writer(self, writer_id):
        w = self._writers.get(writer_id)
        if w is None:
            raise ProtocolError(f"writer {writer_id} used before SetupAppend")
        return w

    def process(self, cmd):
        block = self._block
        if block is not None and type(cmd) is not AppendBlockEnd:
            self._block = None
            raise ProtocolError(f"{type(cmd).__name__} inside an append block")
        t = type(cmd)
        if t is AppendBlock:
            self._writer(cmd.writer_id)
            self._block = cmd
            return None
        if t is AppendBlockEnd:
            self._block = None
            return self._block_end(block, cmd)
        if t is ConditionalAppend:
            w = self._writer(cmd.writer_id)
            if cmd.event_number < w[1]:
                raise ProtocolError("event number went backwards")
            w[1] = cmd.event_number
            return Append(w[0], cmd.writer_id, cmd.event_number, 1,
                          encode_event(cmd.data), cmd.expected_offset, cmd.request_id)
        if t is ConditionalBlockEnd:
            # events of a conditional block, numbered as one append as the
            # reference's AppendDecoder does
            w = self._writer(cmd.writer_id)
            if cmd.event_number < w[1]:
                raise ProtocolError("event number went backwards")
            if not cmd.data:
                raise ProtocolError("conditional block without data")
            w[1] = cmd.event_number
            return Append(w[0], cmd.writer_id, cmd.event_number, 1, cmd.data,
                          cmd.expected_offset, cmd.request_id)
        if t is SetupAppend:
            self._writers[cmd.writer_id] = [cmd.segment, NULL_EVENT_NUMBER]
            return cmd
        if t is Padding or t is PartialEvent or t is Event:
            if t is Padding:
                return None
            raise ProtocolError(f"{t.__name__} outside an append block")
        return cmd

    def _block_end(self, block, end):
        w = self._writer(end.writer_id)
        if end.num_events <= 0:
            raise ProtocolError(f"invalid number of events in block: {end.num_events}")
        if end.last_event_number < w[1]:
            raise ProtocolError("last event number went backwards")
        if block is None:
            data = end.data
        else:
            if block.writer_id != end.writer_id:
                raise ProtocolError("writer id of AppendBlockEnd differs from its block")
            whole = end.size_of_whole_events
            bdata = block.data
            if whole < 0 or whole > len(bdata):
                raise ProtocolError(f"invalid size_of_whole_events {whole}")
            if whole == len(bdata):
                data = bdata + end.data if end.data else bdata
            else:
                rest = decode(memoryview(bdata)[whole:])
                if type(rest) is PartialEvent:
                    data = b"".join((memoryview(bdata)[:whole], rest.data, end.data))
                elif type(rest) is Padding:
                    if end.data:
                        raise ProtocolError("data in AppendBlockEnd after Padding")
                    data = bdata[:whole]
                else:
                    raise ProtocolError(f"{type(rest).__name__} at the end of an append block")
        if not data:
            raise ProtocolError("append without data")
        w[1] = end.last_event_number
        return Append(w[0], end.writer_id, end.last_event_number, end.num_events, data,
                      None, end.request_id)
