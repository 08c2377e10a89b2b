"""
The Spark data source's pure parts (options, offsets, partition planning,
Arrow conversion, the binary-records codec, local range reads), without a
SparkSession.  The end-to-end tests on Spark are in test_spark.py.
"""

import json
import os

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from streamproto.log import open_store
from streamproto.log.batch import RecordBatch, lengths_array
from streamproto.log.errors import LogNotFound
from streamproto.log.file import synchronous
from streamproto.spark.arrow import ArrowConverter, binary_array, coalesce, json_array
from streamproto.spark.locations import DataLossError, Location, LocalLogs, read_range
from streamproto.spark.options import (
    OptionError, parse_sink_options, parse_source_options, source_schema_ddl,
)
from streamproto.spark.planning import (
    LogRange, OffsetError, cap_offset, limit_offset, ranges_between, split_ranges,
)
from streamproto.spark.source import LogBatchReader, LogRangePartition, LogStreamReader
from streamproto.spark.remote import (
    BinaryRecordsDecoder, BinaryRecordsError, encode_binary_records,
)

SCHEMA = pa.schema([pa.field("log", pa.string(), False), pa.field("position", pa.int64(), False),
                    pa.field("value", pa.binary())])


def new_dir(testcase):
    """A fresh absolute directory under trial's _trial_temp."""
    path = os.path.abspath(testcase.mktemp())
    os.makedirs(path)
    return path


def sync_store(testcase):
    """A file store on a temp dir whose Deferreds fire at once (no reactor)."""
    path = new_dir(testcase)
    store = open_store(path, reactor=Clock(), run_blocking=synchronous, retention_interval=0)
    testcase.addCleanup(store.close)
    return path, store


def fired(testcase, d):
    return testcase.successResultOf(d)


class OptionsTests(SynchronousTestCase):
    def test_path_or_url(self):
        opts = parse_source_options({"path": "/data", "logs": "a, b,a"})
        self.assertEqual((opts.path, opts.urls, opts.logs), ("/data", (), ("a", "b")))
        opts = parse_source_options({"url": "http://h:1/, http://g:2", "maxRecordsPerTrigger": "5"})
        self.assertEqual(opts.urls, ("http://h:1", "http://g:2"))
        self.assertEqual(opts.max_records_per_trigger, 5)
        tls = parse_source_options({"url": "https://h:1", "caCerts": "ca.pem",
                                    "certificate": "c.pem", "privateKey": "k.pem"}).tls
        self.assertEqual((tls.ca_certs, tls.certificate, tls.private_key),
                         ("ca.pem", "c.pem", "k.pem"))
        self.assertIsNone(parse_source_options({"url": "https://h:1"}).tls)
        self.assertRaises(OptionError, parse_source_options,
                          {"url": "https://h:1", "certificate": "c.pem"})
        both = parse_source_options({"path": "/data", "url": "http://h:1"})
        self.assertEqual((both.path, both.urls), ("/data", ("http://h:1",)))
        for bad in ({}, {"path": "/d", "url": "http://h:1,http://g:2"}, {"url": "ftp://h"},
                    {"path": "/d", "logs": "../x"}, {"path": "/d", "maxRecordsPerTrigger": "0"},
                    {"path": "/d", "valueFormat": "xml"}, {"path": "/d", "valueFormat": "json"},
                    {"path": "/d", "jsonSchema": "a INT"}, {"path": "/d", "timeout": "x"},
                    {"path": "/d", "startingPosition": "middle"}):
            self.assertRaises(OptionError, parse_source_options, bad)

    def test_schema(self):
        self.assertEqual(source_schema_ddl(parse_source_options({"path": "/d"})),
                         "log STRING NOT NULL, position BIGINT NOT NULL, value BINARY")
        self.assertTrue(source_schema_ddl(parse_source_options(
            {"path": "/d", "valueFormat": "utf8"})).endswith("value STRING"))
        self.assertTrue(source_schema_ddl(parse_source_options(
            {"path": "/d", "valueFormat": "json", "jsonSchema": "host STRING, n INT"}))
            .endswith("value STRUCT<host STRING, n INT>"))
        as_json = json.dumps({"type": "struct", "fields": [
            {"name": "n", "type": "long", "nullable": True, "metadata": {}}]})
        self.assertTrue(source_schema_ddl(parse_source_options(
            {"path": "/d", "valueFormat": "json", "jsonSchema": as_json}))
            .endswith("value struct<n:bigint>"))

    def test_sink(self):
        opts = parse_sink_options({"url": "http://h:1", "log": "out", "protocol": "HTTP"})
        self.assertEqual((opts.url, opts.log, opts.protocol), ("http://h:1", "out", "http"))
        for bad in ({"log": "x"}, {"url": "http://h:1"}, {"url": "http://h:1,http://g:1", "log": "x"},
                    {"url": "http://h:1", "log": "x", "protocol": "kafka"}):
            self.assertRaises(OptionError, parse_sink_options, bad)


class PlanningTests(SynchronousTestCase):
    def test_ranges_between(self):
        self.assertEqual(ranges_between({"a": 5, "b": 3}, {"b": 3, "a": 9, "c": 2}),
                         [LogRange("a", 5, 9), LogRange("c", 0, 2)])
        self.assertRaises(OffsetError, ranges_between, {"a": 5}, {"a": 4})
        self.assertRaises(OffsetError, ranges_between, {"a": -1}, {"a": 4})
        self.assertRaises(OffsetError, ranges_between, {"a": True}, {"a": 4})
        self.assertRaises(OffsetError, ranges_between, [], {"a": 4})

    def test_split(self):
        pieces = split_ranges([LogRange("a", 0, 10), LogRange("b", 10, 13)], 4)
        self.assertEqual(pieces, [LogRange("a", 0, 4), LogRange("a", 4, 7), LogRange("a", 7, 10),
                                  LogRange("b", 10, 13)])
        # min_partitions splits a small range so that every core works.
        self.assertEqual(split_ranges([LogRange("a", 0, 10)], 100, 2),
                         [LogRange("a", 0, 5), LogRange("a", 5, 10)])
        self.assertEqual(split_ranges([LogRange("a", 0, 1)], 100, 4), [LogRange("a", 0, 1)])

    @given(st.dictionaries(st.sampled_from("abcde"), st.tuples(st.integers(0, 10**6),
                                                                st.integers(0, 10**4))),
           st.integers(1, 5000), st.integers(1, 8))
    @settings(max_examples=200, deadline=None)
    def test_split_covers_exactly(self, spans, per_partition, min_partitions):
        ranges = [LogRange(log, s, s + n) for log, (s, n) in sorted(spans.items())]
        pieces = split_ranges(ranges, per_partition, min_partitions)
        self.assertEqual(pieces, split_ranges(ranges, per_partition, min_partitions))
        for r in ranges:
            mine = [p for p in pieces if p.log == r.log]
            covered = [pos for p in mine for pos in (p.start, p.end)]
            if len(r):
                self.assertEqual(mine[0].start, r.start)
                self.assertEqual(mine[-1].end, r.end)
                self.assertEqual(covered[1:-1:2], covered[2::2])  # contiguous
            self.assertTrue(all(0 < len(p) <= per_partition for p in mine))

    @given(st.dictionaries(st.sampled_from("abcd"), st.tuples(st.integers(0, 100),
                                                               st.integers(0, 100))),
           st.one_of(st.none(), st.integers(1, 150)))
    @settings(max_examples=200, deadline=None)
    def test_limit(self, spans, budget):
        start = {log: s for log, (s, n) in spans.items()}
        available = {log: s + n for log, (s, n) in spans.items()}
        end = limit_offset(start, available, budget)
        pending = sum(available.values()) - sum(start.values())
        taken = sum(end.values()) - sum(start.values())
        self.assertTrue(all(start[log] <= end[log] <= available[log] for log in start))
        if budget is None:
            self.assertEqual(end, available)
        else:
            # Never more than the budget; all of it when there is enough data.
            self.assertEqual(taken, min(pending, budget))

    def test_limit_fair_share(self):
        self.assertEqual(limit_offset({"a": 0, "b": 0, "c": 0}, {"a": 2, "b": 100, "c": 100}, 50),
                         {"a": 2, "b": 24, "c": 24})
        # A log known only to the start stays where it was.
        self.assertEqual(limit_offset({"gone": 7}, {"a": 3}, None), {"gone": 7, "a": 3})

    def test_cap(self):
        self.assertEqual(cap_offset({"a": 10, "b": 5, "new": 3}, {"a": 7, "b": 9}),
                         {"a": 7, "b": 5})


class ArrowTests(SynchronousTestCase):
    def test_binary(self):
        records = [b"", b"abc", b"\x00\xff", b"z" * 1000]
        batch = RecordBatch.from_records(41, records)
        out = ArrowConverter(SCHEMA).convert("events", batch)
        self.assertEqual(out.schema, SCHEMA)
        self.assertEqual(out.column(0).to_pylist(), ["events"] * 4)
        self.assertEqual(out.column(1).to_pylist(), [41, 42, 43, 44])
        self.assertEqual(out.column(2).to_pylist(), records)
        self.assertRaises(ValueError, binary_array, lengths_array([3]), b"ab")

    def test_utf8_replaces_invalid(self):
        schema = SCHEMA.set(2, pa.field("value", pa.string()))
        batch = RecordBatch.from_records(0, ["h\u00e9".encode(), b"\xff", b"ok"])
        out = ArrowConverter(schema).convert("l", batch)
        self.assertEqual(out.column(2).to_pylist(), ["h\u00e9", "\ufffd", "ok"])

    def test_json(self):
        struct = pa.struct([("host", pa.string()), ("n", pa.int32()),
                            ("at", pa.timestamp("us", tz="UTC"))])
        records = [b'{"host": "a", "n": 1, "extra": [1]}', b'{\n"host": "b",\n"n": 2}',
                   b"not json", b"", b'{"host": "c", "at": "2024-05-01T12:00:00Z"}', b"[1]"]
        values = json_array(lengths_array(map(len, records)), b"".join(records), struct).to_pylist()
        self.assertEqual([v and v["host"] for v in values], ["a", "b", None, None, "c", None])
        self.assertEqual(values[1]["n"], 2)
        self.assertEqual(values[4]["at"].isoformat(), "2024-05-01T12:00:00+00:00")
        good = [b'{"host": "x", "n": %d}' % i for i in range(100)]
        fast = json_array(lengths_array(map(len, good)), b"".join(good), struct)
        self.assertEqual(fast.field("n").to_pylist(), list(range(100)))

    def test_timestamp_column(self):
        from array import array

        from streamproto.log.natsreader import stored_time_us
        from streamproto.spark.arrow import coalesce_timed
        schema = SCHEMA.append(pa.field("timestamp", pa.timestamp("us", tz="UTC"), False))
        t1 = stored_time_us("2024-05-01T12:00:00.123456789Z")
        self.assertEqual(t1, 1714564800123456)
        self.assertEqual(stored_time_us("2024-05-01T14:00:00.5+02:00"), 1714564800500000)
        self.assertEqual(stored_time_us("2024-05-01T12:00:00Z"), 1714564800000000)
        pairs = [(RecordBatch.from_records(0, [b"a", b"b"]), t1),
                 (RecordBatch.from_records(2, [b"c"]), t1 + 7),
                 (RecordBatch.from_records(3, [b"d"] * 3), t1 + 9)]
        joined = list(coalesce_timed(pairs, max_records=4, max_bytes=1000))
        self.assertEqual([(b.position, len(b), list(t)) for b, t in joined],
                         [(0, 3, [t1, t1, t1 + 7]), (3, 3, [t1 + 9] * 3)])
        out = ArrowConverter(schema).convert("l", joined[0][0], None, joined[0][1])
        self.assertEqual(out.schema, schema)
        self.assertEqual([t.isoformat() for t in out.column(3).to_pylist()],
                         ["2024-05-01T12:00:00.123456+00:00"] * 2
                         + ["2024-05-01T12:00:00.123463+00:00"])
        self.assertRaises(ValueError, ArrowConverter(schema).convert, "l", joined[0][0])
        self.assertRaises(ValueError, ArrowConverter(schema).convert, "l", joined[0][0], None,
                          array("q", [1]))
        self.assertRaises(ValueError, ArrowConverter,
                          SCHEMA.append(pa.field("timestamp", pa.int64())))

    def test_bad_schema(self):
        self.assertRaises(ValueError, ArrowConverter, pa.schema([("value", pa.binary())]))
        self.assertRaises(ValueError, ArrowConverter,
                          SCHEMA.set(2, pa.field("value", pa.int32())))

    def test_coalesce(self):
        batches = [RecordBatch.from_records(i * 3, [b"ab"] * 3) for i in range(5)]
        out = list(coalesce(batches, max_records=7, max_bytes=1000))
        self.assertEqual([(b.position, len(b)) for b in out], [(0, 6), (6, 6), (12, 3)])
        self.assertEqual(b"".join(bytes(b.data) for b in out), b"ab" * 15)
        out = list(coalesce(batches, max_records=100, max_bytes=4))
        self.assertEqual(len(out), 5)
        self.assertRaises(ValueError, list, coalesce(
            [RecordBatch.from_records(0, [b"a"]), RecordBatch.from_records(5, [b"b"])], 10, 10))


class BinaryRecordsTests(SynchronousTestCase):
    @given(st.lists(st.binary(max_size=300), max_size=30), st.lists(st.integers(1, 50)))
    @settings(max_examples=200, deadline=None)
    def test_round_trip_any_chunking(self, records, cuts):
        wire = encode_binary_records(records)
        decoder = BinaryRecordsDecoder(position=7)
        got = []
        offset = 0
        for cut in cuts + [len(wire)]:
            batch = decoder.feed(wire[offset:offset + cut])
            self.assertEqual(batch.position, 7 + len(got))
            got.extend(batch.records())
            offset += cut
        self.assertEqual(got, records)
        self.assertEqual(decoder.pending, 0)

    @given(st.binary(max_size=200))
    @settings(max_examples=300, deadline=None)
    def test_garbage_raises_only_codec_error(self, data):
        decoder = BinaryRecordsDecoder(max_record_size=1000)
        try:
            decoder.feed(data)
        except BinaryRecordsError:
            pass

    def test_bad_sizes(self):
        self.assertRaises(BinaryRecordsError, BinaryRecordsDecoder().feed, b"\xff\xff\xff\xff")
        self.assertRaises(BinaryRecordsError, BinaryRecordsDecoder(max_record_size=4).feed,
                          b"\x00\x00\x00\x05")


class LocalReadTests(SynchronousTestCase):
    def test_read_range_and_bounds(self):
        path, store = sync_store(self)
        log = fired(self, store.create("a"))
        for i in range(5):
            fired(self, log.append([b"%d-%d" % (i, j) for j in range(10)]))
        fired(self, store.create("b"))
        bounds, where = LocalLogs(path).bounds()
        self.assertEqual(bounds, {"a": (0, 50), "b": (0, 0)})
        self.assertEqual(where["a"], Location("path", path))
        self.assertRaises(LogNotFound, LocalLogs(path).bounds, ["a", "zz"])
        self.assertEqual(LocalLogs(path).bounds(["a", "zz"], missing_ok=True)[0], {"a": (0, 50)})
        got = [r for b in read_range(Location("path", path), "a", 13, 37) for r in b.records()]
        self.assertEqual(got, [b"%d-%d" % divmod(p, 10) for p in range(13, 37)])
        self.assertEqual(list(read_range(Location("path", path), "a", 5, 5)), [])
        # Planned past the end: the log lost records (deleted and recreated?).
        self.assertRaises(DataLossError, list, read_range(Location("path", path), "a", 40, 60))

    def test_truncated_head(self):
        path, store = sync_store(self)
        log = fired(self, store.create("t"))
        fired(self, log.append([b"x%d" % i for i in range(20)]))
        fired(self, log.truncate(10))
        start = LocalLogs(path).bounds()[0]["t"][0]
        self.assertGreater(start, 0)
        self.assertRaises(DataLossError, list, read_range(Location("path", path), "t", 0, 20))
        got = [r for b in read_range(Location("path", path), "t", 0, 20, fail_on_data_loss=False)
               for r in b.records()]
        self.assertEqual(got, [b"x%d" % i for i in range(start, 20)])



def spark_schema(value_type="binary"):
    from pyspark.sql.types import (
        BinaryType, LongType, StringType, StructField, StructType,
    )
    value = {"binary": BinaryType(), "string": StringType()}[value_type]
    return StructType([StructField("log", StringType(), False),
                       StructField("position", LongType(), False),
                       StructField("value", value, True)])


class ReaderTests(SynchronousTestCase):
    """The readers' driver side (offsets, limits, partitions) and read(), without Spark."""

    def setUp(self):
        self.path, self.store = sync_store(self)
        self.logs = {}
        for name, n in (("a", 30), ("b", 5)):
            self.logs[name] = fired(self, self.store.create(name))
            fired(self, self.logs[name].append([b"%s%d" % (name.encode(), i) for i in range(n)]))

    def test_stream_offsets_and_limits(self):
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
        reader = LogStreamReader({"path": self.path, "maxRecordsPerTrigger": "10",
                                  "maxRecordsPerPartition": "4"}, spark_schema())
        self.assertEqual(reader.initialOffset(), {"a": 0, "b": 0})
        self.assertEqual(reader.getDefaultReadLimit(), ReadMaxRows(10))
        end = reader.latestOffset({"a": 0, "b": 0}, ReadMaxRows(10))
        self.assertEqual(end, {"a": 5, "b": 5})
        self.assertEqual(reader.reportLatestOffset(), {"a": 30, "b": 5})
        parts = reader.partitions({"a": 0, "b": 0}, end)
        self.assertEqual([(p.log, p.start, p.end) for p in parts],
                         [("a", 0, 3), ("a", 3, 5), ("b", 0, 3), ("b", 3, 5)])
        self.assertEqual(parts, reader.partitions({"a": 0, "b": 0}, end))
        rows = [row for p in parts for batch in reader.read(p)
                for row in zip(*(c.to_pylist() for c in batch.columns))]
        self.assertEqual(rows, [("a", i, b"a%d" % i) for i in range(5)]
                         + [("b", i, b"b%d" % i) for i in range(5)])
        self.assertEqual(reader.latestOffset(end, ReadAllAvailable()), {"a": 30, "b": 5})
        reader.commit(end)
        self.assertEqual(reader.committed, end)
        self.assertEqual(reader.partitions(end, end), [])

    def test_available_now_stops_at_target(self):
        from pyspark.sql.streaming.datasource import ReadAllAvailable
        reader = LogStreamReader({"path": self.path, "startingPosition": "latest"},
                                 spark_schema())
        start = reader.initialOffset()
        self.assertEqual(start, {"a": 30, "b": 5})
        fired(self, self.logs["a"].append([b"more"] * 3))
        reader.prepareForTriggerAvailableNow()
        fired(self, self.logs["a"].append([b"later"] * 4))
        fired(self, self.store.create("c"))
        fired(self, self.store.get("c").addCallback(lambda log: log.append([b"c"])))
        # Stops at what was there when the run began: 33, and no "c".
        self.assertEqual(reader.latestOffset(start, ReadAllAvailable()), {"a": 33, "b": 5})

    def test_log_recreated_below_the_query_position(self):
        reader = LogStreamReader({"path": self.path}, spark_schema())
        fired(self, self.store.delete("b"))
        fired(self, self.store.create("b"))
        self.assertRaises(DataLossError, reader.latestOffset, {"a": 30, "b": 5}, None)
        lenient = LogStreamReader({"path": self.path, "failOnDataLoss": "false"}, spark_schema())
        self.assertEqual(lenient.latestOffset({"a": 30, "b": 5}, None), {"a": 30, "b": 5})

    def test_replayed_batch_after_restart(self):
        first = LogStreamReader({"path": self.path}, spark_schema())
        end = first.latestOffset({"a": 10}, None)
        planned = first.partitions({"a": 10}, end)
        fired(self, self.logs["a"].append([b"new"] * 7))
        # A new reader (a restarted query) replays the logged batch: same plan.
        again = LogStreamReader({"path": self.path}, spark_schema())
        self.assertEqual(again.partitions({"a": 10}, end), planned)

    def test_batch_reader_and_pickling(self):
        import pickle
        reader = LogBatchReader({"path": self.path, "valueFormat": "utf8",
                                 "maxRecordsPerPartition": "20"}, spark_schema("string"))
        parts = reader.partitions()
        self.assertEqual([(p.log, p.start, p.end) for p in parts],
                         [("a", 0, 15), ("a", 15, 30), ("b", 0, 5)])
        clone = pickle.loads(pickle.dumps(reader))
        values = [v for p in parts for b in clone.read(p) for v in b.column(2).to_pylist()]
        self.assertEqual(values, ["a%d" % i for i in range(30)] + ["b%d" % i for i in range(5)])
        stream = pickle.loads(pickle.dumps(LogStreamReader({"path": self.path}, spark_schema())))
        self.assertEqual(len(list(stream.read(LogRangePartition("b", 1, 4, parts[2].location)))),
                         1)

    def test_schema_mismatch_fails_on_driver(self):
        from pyspark.sql.types import StructField, StructType, StringType
        self.assertRaises(ValueError, LogBatchReader, {"path": self.path},
                          StructType([StructField("value", StringType())]))
