"""
Log store record batches to Arrow record batches.

A L{streamproto.log.batch.RecordBatch} is a lengths array plus one buffer of
concatenated payloads: Arrow's binary layout but for the offsets.  The value
column is built from those two buffers with one cumulative sum in Arrow's C++
code, so no Python runs per record on the binary and UTF-8 paths.
"""

import functools
import io
from array import array

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from streamproto.log.batch import RecordBatch, lengths_array

# JSON forbids raw control characters inside strings, so a newline in a valid
# JSON record is whitespace between tokens: replacing it with a space keeps the
# meaning and makes every record exactly one line for Arrow's JSON reader.
_NEWLINES_TO_SPACES = bytes.maketrans(b"\r\n", b"  ")


def binary_array(lengths, data, value_type=pa.binary()):
    """
    An Arrow binary (or string) array over C{data} cut by C{lengths}, without
    copying C{data}.

    @param lengths: C{array('I')} of record sizes.
    @param data: the payloads, concatenated (any bytes-like object).
    @param value_type: C{pa.binary()}, C{pa.string()}, or their large variants.
    """
    n = len(lengths)
    if len(data) != sum_lengths(lengths):
        raise ValueError("data size does not match the lengths")
    sizes = pa.Array.from_buffers(pa.uint32(), n, [None, pa.py_buffer(lengths)])
    ends = pc.cumulative_sum(sizes.cast(pa.int64()))
    offsets = pa.concat_arrays([pa.array([0], pa.int64()), ends])
    large = value_type in (pa.large_binary(), pa.large_string())
    if not large:
        # Raises ArrowInvalid past 2 GiB; callers cut batches far below that.
        offsets = offsets.cast(pa.int32())
    return pa.Array.from_buffers(value_type, n, [None, offsets.buffers()[1], pa.py_buffer(data)])


def sum_lengths(lengths):
    if not len(lengths):
        return 0
    sizes = pa.Array.from_buffers(pa.uint32(), len(lengths), [None, pa.py_buffer(lengths)])
    return pc.sum(sizes.cast(pa.int64())).as_py()


def positions_array(first, count):
    """int64 array C{first, first + 1, ..., first + count - 1}."""
    if count == 0:
        return pa.array([], pa.int64())
    return pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), count), start=first - 1)


def utf8_array(lengths, data, value_type=pa.string()):
    """Strings; a record that is not valid UTF-8 is decoded with U+FFFD replacements."""
    array = binary_array(lengths, data, value_type)
    try:
        array.validate(full=True)  # checks the UTF-8, in C++
        return array
    except pa.ArrowInvalid:
        records = RecordBatch(0, lengths, data).records()
        return pa.array([r.decode("utf-8", "replace") for r in records], value_type)


def json_array(lengths, data, struct_type):
    """
    Structs parsed from JSON records with Arrow's JSON reader (unknown fields
    ignored); a record that is not a JSON object of that shape becomes null.
    """
    n = len(lengths)
    if n == 0:
        return pa.array([], struct_type)
    data = bytes(data).translate(_NEWLINES_TO_SPACES)
    records = RecordBatch(0, lengths, data).records()
    schema = pa.schema(list(struct_type))
    parsed = _read_json_lines(b"\n".join(records), schema)
    if parsed is not None and parsed.num_rows == n:
        columns = [c.combine_chunks() for c in parsed.columns]
        return pa.StructArray.from_arrays(columns, fields=list(struct_type))
    # Some record is bad (or blank, which the reader skips): parse them one by
    # one so that only the bad ones are null.
    rows = []
    for record in records:
        one = _read_json_lines(record, schema) if record.strip() else None
        rows.append(one.to_pylist()[0] if one is not None and one.num_rows == 1 else None)
    return pa.array(rows, struct_type)


def _read_json_lines(text, schema):
    try:
        return pa_json.read_json(
            io.BytesIO(text),
            read_options=pa_json.ReadOptions(use_threads=False,
                                             block_size=max(1 << 20, len(text) + 1)),
            parse_options=pa_json.ParseOptions(explicit_schema=schema,
                                               unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None


class ArrowConverter:
    """
    Turns (log name, L{RecordBatch}) into Arrow record batches of a Spark
    schema C{log STRING, position BIGINT, value BINARY|STRING|STRUCT<...>}
    (and C{node STRING} when several servers are read).

    The value conversion follows the value column's type, so a schema given
    with C{.schema(...)} works as well as the one from the options.
    """

    def __init__(self, arrow_schema):
        names = arrow_schema.names
        if names[:3] != ["log", "position", "value"] or names[3:] not in (
                [], ["node"], ["timestamp"]):
            raise ValueError(f"the schema must be (log, position, value[, node | timestamp]), "
                             f"not {names}")
        self.with_node = "node" in names
        self.with_time = "timestamp" in names
        if self.with_time and not pa.types.is_timestamp(arrow_schema.field("timestamp").type):
            raise ValueError("the timestamp column must be a TIMESTAMP")
        if not pa.types.is_string(arrow_schema.field("log").type) \
                or not pa.types.is_int64(arrow_schema.field("position").type):
            raise ValueError("the schema must have log STRING and position BIGINT")
        value_type = arrow_schema.field("value").type
        if pa.types.is_binary(value_type) or pa.types.is_large_binary(value_type):
            self._value = functools.partial(binary_array, value_type=value_type)
        elif pa.types.is_string(value_type) or pa.types.is_large_string(value_type):
            self._value = functools.partial(utf8_array, value_type=value_type)
        elif pa.types.is_struct(value_type):
            self._value = functools.partial(json_array, struct_type=value_type)
        else:
            raise ValueError(f"the value column must be BINARY, STRING or a STRUCT, not {value_type}")
        self.schema = arrow_schema

    def convert(self, log, batch, node=None, times=None):
        """
        @param times: with a C{timestamp} column, C{array('q')} of each
            record's time in microseconds since the epoch.
        """
        n = len(batch)
        columns = [
            _repeat(log, n),
            positions_array(batch.position, n),
            self._value(batch.lengths, batch.data),
        ]
        if self.with_node:
            columns.append(_repeat(node or "", n))
        if self.with_time:
            if times is None or len(times) != n:
                raise ValueError("a timestamp column needs one time per record")
            kind = self.schema.field("timestamp").type
            micros = pa.Array.from_buffers(pa.timestamp("us", tz=kind.tz), n,
                                           [None, pa.py_buffer(times)])
            columns.append(micros if micros.type == kind else micros.cast(kind))
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)


def _repeat(text, n):
    return pa.repeat(pa.scalar(text, pa.string()), n) if n else pa.array([], pa.string())


def coalesce(batches, max_records, max_bytes):
    """
    Join consecutive small L{RecordBatch}es (one per append in the store) into
    batches of about C{max_records} records or C{max_bytes} payload bytes, so
    that Spark gets few large Arrow batches.  A batch already big enough is
    passed on as is (no copy).
    """
    pending = []
    pending_records = 0
    pending_bytes = 0
    for batch in batches:
        if not len(batch):
            continue
        if pending and (pending_records + len(batch) > max_records
                        or pending_bytes + batch.nbytes > max_bytes):
            yield _join(pending)
            pending, pending_records, pending_bytes = [], 0, 0
        pending.append(batch)
        pending_records += len(batch)
        pending_bytes += batch.nbytes
        if pending_records >= max_records or pending_bytes >= max_bytes:
            yield _join(pending)
            pending, pending_records, pending_bytes = [], 0, 0
    if pending:
        yield _join(pending)


def coalesce_timed(pairs, max_records, max_bytes):
    """
    L{coalesce} for C{(RecordBatch, microseconds)} pairs (a JetStream
    store's batches with their append times): yields C{(RecordBatch,
    array('q'))} with each record's time, built per batch, not per record.
    """
    pending = []
    pending_records = 0
    pending_bytes = 0

    def flush():
        times = array("q")
        for batch, when in pending:
            times.extend(array("q", [when]) * len(batch))
        return _join([batch for batch, _ in pending]), times

    for batch, when in pairs:
        if not len(batch):
            continue
        if pending and (pending_records + len(batch) > max_records
                        or pending_bytes + batch.nbytes > max_bytes):
            yield flush()
            pending, pending_records, pending_bytes = [], 0, 0
        pending.append((batch, when))
        pending_records += len(batch)
        pending_bytes += batch.nbytes
        if pending_records >= max_records or pending_bytes >= max_bytes:
            yield flush()
            pending, pending_records, pending_bytes = [], 0, 0
    if pending:
        yield flush()


def _join(batches):
    if len(batches) == 1:
        return batches[0]
    lengths = lengths_array()
    expected = batches[0].position
    for b in batches:
        if b.position != expected:
            raise ValueError(f"batches are not consecutive: {b.position} != {expected}")
        lengths.extend(b.lengths)
        expected = b.next_position
    return RecordBatch(batches[0].position, lengths, b"".join(b.data for b in batches))
