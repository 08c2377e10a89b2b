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

from streamproto.spark.arrow import ArrowConverter, coalesce, coalesce_timed
from streamproto.spark.locations import DataLossError, Location, open_logs, read_range
from streamproto.spark.options import (
    FORMAT_NAME, OptionError, parse_sink_options, parse_source_options, source_schema_ddl,
)
from streamproto.spark.planning import (
    OffsetError, cap_offset, check_offset, limit_offset, ranges_between, resolve_end,
    resolve_start, select_logs, split_key, split_ranges,
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
        if ArrowConverter(_arrow_schema(schema)).with_time and self.opts.store is None:
            raise ValueError("only a JetStream store (option 'store') keeps a time per "
                             "record: no timestamp column here")

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
        node, log = split_key(partition.log) if opts.fleet else (None, partition.log)
        batches = read_range(partition.location, log, partition.start, partition.end,
                             fail_on_data_loss=opts.fail_on_data_loss, timeout=opts.timeout,
                             max_bytes=opts.arrow_batch_bytes, tls=opts.tls,
                             with_time=converter.with_time)
        if converter.with_time:
            for batch, times in coalesce_timed(batches, opts.arrow_batch_records,
                                               opts.arrow_batch_bytes):
                yield converter.convert(log, batch, node, times)
            return
        for batch in coalesce(batches, opts.arrow_batch_records, opts.arrow_batch_bytes):
            yield converter.convert(log, batch, node)


class LogBatchReader(_RangeReading, DataSourceReader):
    """C{spark.read}: every record readable when the query is planned."""

    def __init__(self, options, schema):
        self._setup(options, schema)
        bounds, self.where = open_logs(self.opts).bounds(self.opts.logs)
        bounds = select_logs(bounds, self.opts.logs_pattern)
        self.end = resolve_end(self.opts.ending_offsets, bounds)
        self.start = resolve_start(self.opts.starting_offsets, bounds, batch=True)
        for log, position in self.start.items():
            if position > self.end[log]:
                raise OffsetError(f"log {log!r}: startingOffsets {position} is after "
                                  f"endingOffsets {self.end[log]}")
            if position < bounds[log][0] and self.opts.fail_on_data_loss:
                raise DataLossError(
                    f"log {log!r}: startingOffsets {position} was removed (the log starts at "
                    f"{bounds[log][0]}); set failOnDataLoss=false to start there")
            self.start[log] = max(position, bounds[log][0])

    def partitions(self):
        return self._partitions(self.start, self.end, self.where)


class LogStreamReader(_RangeReading, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """
    C{spark.readStream}: offsets are C{{log: next position}}.

    New logs (when no C{logs} option restricts them) join from position 0.
    C{commit()} only records the committed offset: the log store's retention
    does not depend on readers.
    """

    def __init__(self, options, schema):
        self._setup(options, schema)
        if self.opts.ending_offsets is not None:
            raise OptionError("endingOffsets is for batch queries (spark.read), as in the "
                              "Kafka source; a stream runs on")
        self._logs = open_logs(self.opts)
        self._where = {}
        self._target = None
        self._latest = None
        self.committed = None

    def _available(self):
        bounds, where = self._logs.bounds(self.opts.logs, missing_ok=True)
        bounds = select_logs(bounds, self.opts.logs_pattern)
        self._where.update((key, where[key]) for key in bounds)
        return bounds

    def __getstate__(self):
        # read() is shipped to executors with this object: leave the driver's
        # log handles behind.
        state = dict(vars(self))
        state.pop("_logs", None)
        return state

    def initialOffset(self):
        # only when the query has no checkpoint yet (Kafka's rule too)
        start = resolve_start(self.opts.starting_offsets, self._available(), batch=False)
        return dict(sorted(start.items()))

    def getDefaultReadLimit(self):
        # Only pyspark >= 4.2 asks (and has the ReadLimit classes).
        if self.opts.max_records_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_records_per_trigger)

    def prepareForTriggerAvailableNow(self):
        self._target = {log: b[1] for log, b in self._available().items()}

    def _upgrade(self, offset):
        """
        An offset of a checkpoint written before logs were read per node
        (its keys plain log names), in this query's keys: a name held by
        exactly one node moves to that node's key.
        """
        if not self.opts.fleet or all("/" in key for key in offset):
            return offset
        by_log = {}
        for key in self._where:
            by_log.setdefault(split_key(key)[1], []).append(key)
        upgraded = {}
        for key, position in offset.items():
            if "/" in key:
                upgraded[key] = position
            elif len(by_log.get(key, ())) == 1:
                upgraded.setdefault(by_log[key][0], position)
            elif not by_log.get(key):
                continue                        # the log is gone from every node
            else:
                raise DataLossError(
                    f"the checkpoint's offset for log {key!r} cannot be placed on one node "
                    f"(it is on {len(by_log.get(key, ()))}): start the query with a new "
                    "checkpoint location")
        return upgraded

    def latestOffset(self, start=None, limit=None):
        available = {log: b[1] for log, b in self._available().items()}
        self._latest = dict(sorted(available.items()))
        if self._target is not None:
            available = cap_offset(available, self._target)
        if start is None:  # pyspark < 4.2 calls latestOffset() without a start
            return dict(sorted(available.items()))
        start = self._upgrade(check_offset(start))
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
        missing = [log for log in list(start) + list(end) if log not in self._where]
        if missing:
            # A batch replayed after a restart, for logs not looked up yet.
            self._available()
        start, end = self._upgrade(check_offset(start)), self._upgrade(check_offset(end))
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

    Read options: C{path} | C{url} | C{store}, C{logs} | C{logsPattern},
    C{valueFormat}, C{jsonSchema}, C{startingOffsets}, C{endingOffsets},
    C{maxRecordsPerTrigger} (C{maxOffsetsPerTrigger}),
    C{maxRecordsPerPartition}, C{minPartitions}, C{failOnDataLoss},
    C{timeout}; an unknown option is an error.
    Write options: C{url}, C{log}, C{protocol} (styx | http), C{batchRecords},
    C{createLog}.  See doc/spark.rst.
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
