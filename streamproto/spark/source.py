"""
The C{streamproto} PySpark data source: batch and streaming reads of the
log store (a local directory or styx-servers), plus the Styx sink.

    from streamproto.spark import register
    register(spark)
    df = spark.read.format("streamproto").option("path", "/var/lib/streamproto").load()

Rows are C{(log STRING, position BIGINT, value BINARY)}; C{valueFormat=utf8}
makes C{value} a STRING, C{valueFormat=json} with C{jsonSchema} a STRUCT.
"""

from pyspark.sql.datasource import (
    DataSource, DataSourceReader, DataSourceStreamReader, InputPartition,
)

from streamproto.spark.arrow import ArrowConverter, coalesce
from streamproto.spark.locations import DataLossError, Location, open_logs, read_range
from streamproto.spark.options import (
    FORMAT_NAME, check_batch_read, check_stream_read, parse_sink_options, parse_source_options,
    source_schema_ddl,
)
from streamproto.spark.planning import (
    cap_offset, check_offset, ending_offset, limit_offset, ranges_between, split_ranges,
    starting_offset,
)

try:  # pyspark >= 4.2: admission control and Trigger.AvailableNow
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover - older pyspark: no read limits
    ReadAllAvailable = ReadMaxRows = None

    class SupportsTriggerAvailableNow:
        pass


class LogRangePartition(InputPartition):
    """One Spark task: records C{[start, end)} of C{log} at C{location}."""

    def __init__(self, log, start, end, location):
        self.log = log
        self.start = start
        self.end = end
        self.location = location

    def __eq__(self, other):
        return isinstance(other, LogRangePartition) and vars(self) == vars(other)

    def __hash__(self):
        return hash((self.log, self.start, self.end))


def _arrow_schema(spark_schema):
    from pyspark.sql.pandas.types import to_arrow_schema
    # The same conversion Spark checks the batches against.
    return to_arrow_schema(spark_schema, timezone="UTC")


class _RangeReading:
    """What the batch and the stream reader share: planning and reading ranges."""

    def _setup(self, options, schema):
        self.opts = parse_source_options(options)
        self.schema = schema
        # Fails now, on the driver, if the schema is not one we can produce.
        ArrowConverter(_arrow_schema(schema))

    def _partitions(self, start, end, where):
        ranges = split_ranges(ranges_between(start, end), self.opts.max_records_per_partition,
                              self.opts.min_partitions)
        return [LogRangePartition(r.log, r.start, r.end, where[r.log]) for r in ranges]

    def read(self, partition):
        """
        The records of one partition as Arrow batches.  Runs on an executor;
        depends only on the partition, so a retried or replayed task yields
        the same rows.
        """
        if not isinstance(partition, LogRangePartition):
            # Spark reads one InputPartition(None) when partitions() is empty.
            return
        converter = ArrowConverter(_arrow_schema(self.schema))
        opts = self.opts
        batches = read_range(partition.location, partition.log, partition.start, partition.end,
                             fail_on_data_loss=opts.fail_on_data_loss, timeout=opts.timeout,
                             max_bytes=opts.arrow_batch_bytes, tls=opts.tls)
        for batch in coalesce(batches, opts.arrow_batch_records, opts.arrow_batch_bytes):
            yield converter.convert(partition.log, batch)


class LogBatchReader(_RangeReading, DataSourceReader):
    """
    C{spark.read}: the records readable when the query is planned, from
    C{startingOffsets} (default: each log's earliest) to C{endingOffsets}
    (exclusive; default: each log's latest).
    """

    def __init__(self, options, schema):
        self._setup(options, schema)
        check_batch_read(self.opts)
        bounds, self.where = open_logs(self.opts).bounds(self.opts.logs,
                                                         pattern=self.opts.logs_pattern)
        self.start = starting_offset(self.opts.starting_offsets, bounds)
        self.end = ending_offset(self.opts.ending_offsets, bounds, self.start)

    def partitions(self):
        return self._partitions(self.start, self.end, self.where)


class LogStreamReader(_RangeReading, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """
    C{spark.readStream}: offsets are C{{log: next position}}.

    New logs (when no C{logs} option restricts them; with C{logsPattern},
    those whose name matches) join from position 0.  C{startingOffsets}
    only places a new query: a restarted one goes on from its checkpoint.
    C{commit()} only records the committed offset: the log store's retention
    does not depend on readers.
    """

    def __init__(self, options, schema):
        self._setup(options, schema)
        check_stream_read(self.opts)
        self._logs = open_logs(self.opts)
        self._where = {}
        self._target = None
        self._latest = None
        self.committed = None

    def _available(self):
        bounds, where = self._logs.bounds(self.opts.logs, missing_ok=True,
                                          pattern=self.opts.logs_pattern)
        self._where.update(where)
        return bounds

    def __getstate__(self):
        # read() is shipped to executors with this object: leave the driver's
        # log handles behind.
        state = dict(vars(self))
        state.pop("_logs", None)
        return state

    def initialOffset(self):
        # Spark asks only when the checkpoint has no offset yet (a new query).
        return starting_offset(self.opts.starting_offsets, self._available())

    def getDefaultReadLimit(self):
        # Only pyspark >= 4.2 asks (and has the ReadLimit classes).
        if self.opts.max_records_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_records_per_trigger)

    def prepareForTriggerAvailableNow(self):
        self._target = {log: b[1] for log, b in self._available().items()}

    def latestOffset(self, start=None, limit=None):
        available = {log: b[1] for log, b in self._available().items()}
        self._latest = dict(sorted(available.items()))
        if self._target is not None:
            available = cap_offset(available, self._target)
        if start is None:  # pyspark < 4.2 calls latestOffset() without a start
            return dict(sorted(available.items()))
        start = check_offset(start)
        for log, position in start.items():
            if available.get(log, position) < position and self.opts.fail_on_data_loss:
                raise DataLossError(
                    f"log {log!r} ends at {available[log]}, before the query's position "
                    f"{position}: was it deleted and recreated?  (failOnDataLoss=false waits "
                    "until it grows past the old position)")
        max_rows = None
        if ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
            max_rows = limit.max_rows
        end = limit_offset(start, available, max_rows)
        return dict(sorted(end.items()))

    def reportLatestOffset(self):
        # For the query's progress report: what latestOffset just saw (looking
        # again would scan every log's tail once more per trigger).
        return self._latest

    def partitions(self, start, end):
        missing = [log for log in end if log not in self._where]
        if missing:
            # A batch replayed after a restart, for logs not looked up yet.
            self._available()
        where = {log: self._where.get(log) for log in end}
        for r in ranges_between(start, end):
            if where[r.log] is None:
                raise RuntimeError(f"log {r.log!r} of a planned batch cannot be found any more")
        return self._partitions(start, end, where)

    def commit(self, end):
        self.committed = check_offset(end)


class LogDataSource(DataSource):
    """
    The C{streamproto} format.

    Read options: C{path} | C{url}, C{logs} | C{logsPattern}, C{valueFormat},
    C{jsonSchema}, C{startingOffsets} (or C{startingPosition}),
    C{endingOffsets} (batch), C{maxRecordsPerTrigger} (or
    C{maxOffsetsPerTrigger}), C{maxRecordsPerPartition}, C{minPartitions},
    C{failOnDataLoss}, C{timeout}.
    Write options: C{url}, C{log}, C{protocol} (styx | http), C{batchRecords},
    C{createLog}.  An unknown option is an C{OptionError}.  See doc/spark.rst.
    """

    @classmethod
    def name(cls):
        return FORMAT_NAME

    def schema(self):
        return source_schema_ddl(parse_source_options(self.options))

    def reader(self, schema):
        return LogBatchReader(self.options, schema)

    def streamReader(self, schema):
        return LogStreamReader(self.options, schema)

    def writer(self, schema, overwrite):
        from streamproto.spark.sink import LogBatchWriter
        return LogBatchWriter(parse_sink_options(self.options), schema, overwrite)

    def streamWriter(self, schema, overwrite):
        from streamproto.spark.sink import LogStreamWriter
        return LogStreamWriter(parse_sink_options(self.options), schema, overwrite)


def register(spark):
    """Register the C{streamproto} format with a SparkSession."""
    spark.dataSource.register(LogDataSource)


__all__ = ["LogBatchReader", "LogDataSource", "LogRangePartition", "LogStreamReader",
           "Location", "register"]
