"""
End-to-end tests of the Spark data source and sink on a real SparkSession
(local[2], one per test run: start-up takes seconds).

pyspark is imported unconditionally: CI installs the [spark] extra, and a
missing pyspark must fail these tests, not skip them.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pyspark  # noqa: F401  (fail loudly without the [spark] extra)
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

import streamproto
from streamproto.log import open_store
from streamproto.log.file import synchronous
from streamproto.spark import register
from streamproto.spark.remote import StyxHTTPClient

_session = None


def spark():
    """The shared SparkSession (created on first use)."""
    global _session
    if _session is None:
        # Python workers must run this interpreter and find this checkout.
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
        root = os.path.dirname(os.path.dirname(os.path.abspath(streamproto.__file__)))
        paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        from pyspark.sql import SparkSession
        _session = (SparkSession.builder.master("local[2]").appName("streamproto-tests")
                    .config("spark.ui.enabled", "false")
                    .config("spark.ui.showConsoleProgress", "false")
                    .config("spark.sql.shuffle.partitions", "2")
                    .config("spark.sql.streaming.pollingDelay", "10ms")
                    .getOrCreate())
        _session.sparkContext.setLogLevel("ERROR")
        register(_session)
    return _session


def new_dir(testcase):
    """A fresh absolute directory under trial's _trial_temp."""
    path = os.path.abspath(testcase.mktemp())
    os.makedirs(path)
    return path


def append(path, name, records):
    """Append to a log of the store at C{path} (opened synchronously, then closed)."""
    store = open_store(path, reactor=Clock(), run_blocking=synchronous, retention_interval=0)
    try:
        results = []
        store.get_or_create(name).addBoth(results.append)
        log = results.pop()
        log.append(records).addBoth(results.append)
        outcome = results.pop()
        if not hasattr(outcome, "end_position"):
            outcome.raiseException()
        return outcome
    finally:
        store.close()


def remove_checksummed(path):
    """Remove a file Spark wrote, and the Hadoop checksum file beside it."""
    os.remove(path)
    head, tail = os.path.split(path)
    crc = os.path.join(head, f".{tail}.crc")
    if os.path.exists(crc):
        os.remove(crc)


def rows_of(df):
    return sorted((r["log"], r["position"], r["value"]) for r in df.collect())


SERVER_SCRIPT = """
import sys
from twisted.internet import reactor
from twisted.internet.endpoints import serverFromString
from streamproto.log import open_store
from streamproto.styx.resource import make_site

store = open_store(sys.argv[1], reactor=reactor)
timeout = int(sys.argv[3]) if len(sys.argv) > 3 else 30
def listening(port):
    sys.stdout.write("%d\\n" % port.getHost().port)
    sys.stdout.flush()
serverFromString(reactor, sys.argv[2]).listen(make_site(store, timeout=timeout)).addCallback(
    listening)
reactor.run()
"""


class StyxServer:
    """A styx-server in a subprocess (Spark calls block, so not in this reactor)."""

    def __init__(self, testcase, endpoint="tcp:0:interface=127.0.0.1", scheme="http",
                 host="127.0.0.1", tls=None, timeout=30):
        self.path = new_dir(testcase)
        root = os.path.dirname(os.path.dirname(os.path.abspath(streamproto.__file__)))
        env = dict(os.environ, PYTHONPATH=root)
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER_SCRIPT, self.path, endpoint, str(timeout)],
            stdout=subprocess.PIPE, env=env)
        testcase.addCleanup(self.stop)
        line = self.process.stdout.readline()
        if not line.strip():
            raise RuntimeError("styx-server did not start")
        self.url = f"{scheme}://{host}:{int(line)}"
        self.client = StyxHTTPClient(self.url, timeout=10, tls=tls)

    def stop(self):
        self.process.terminate()
        self.process.wait(10)
        self.process.stdout.close()


class BatchReadTests(SynchronousTestCase):
    def test_read_equals_appended(self):
        path = new_dir(self)
        appended = {"alpha": [b"", b"x" * 3000] + [b"a%d" % i for i in range(98)],
                    "beta": [bytes([i % 256]) * (i % 7) for i in range(37)]}
        for name, records in appended.items():
            append(path, name, records[:20])
            append(path, name, records[20:])
        df = (spark().read.format("streamproto").option("path", path)
              .option("maxRecordsPerPartition", "16").load())
        self.assertEqual(df.columns, ["log", "position", "value"])
        # 100 + 37 records in pieces of at most 16: 7 + 3 partitions.
        self.assertEqual(df.rdd.getNumPartitions(), 10)
        expected = sorted((name, i, r) for name, records in appended.items()
                          for i, r in enumerate(records))
        self.assertEqual(rows_of(df), expected)
        only = spark().read.format("streamproto").option("path", path).option("logs", "beta").load()
        self.assertEqual(only.count(), 37)
        append(path, "empty", [])
        nothing = spark().read.format("streamproto").option("path", path).option("logs", "empty")
        self.assertEqual(nothing.load().collect(), [])

    def test_value_formats(self):
        path = new_dir(self)
        events = [{"host": "web-%d" % (i % 3), "bytes": i} for i in range(20)]
        append(path, "events", [json.dumps(e).encode() for e in events] + [b"{broken"])
        text = (spark().read.format("streamproto").option("path", path)
                .option("valueFormat", "utf8").load())
        self.assertEqual(dict(text.dtypes)["value"], "string")
        self.assertEqual(text.orderBy("position").collect()[-1]["value"], "{broken")
        parsed = (spark().read.format("streamproto").option("path", path)
                  .option("valueFormat", "json").option("jsonSchema", "host STRING, bytes BIGINT")
                  .load())
        self.assertEqual(dict(parsed.dtypes)["value"], "struct<host:string,bytes:bigint>")
        totals = {r["host"]: r["total"] for r in
                  parsed.where("value IS NOT NULL").groupBy("value.host")
                  .agg({"value.bytes": "sum"}).withColumnRenamed("sum(value.bytes AS bytes)", "total")
                  .toDF("host", "total").collect()}
        self.assertEqual(totals, {h: sum(e["bytes"] for e in events if e["host"] == h)
                                  for h in ("web-0", "web-1", "web-2")})
        self.assertEqual(parsed.where("value IS NULL").count(), 1)


class StreamingTests(SynchronousTestCase):
    def _run_query(self, path, out, checkpoint, **options):
        reader = spark().readStream.format("streamproto").option("path", path)
        for key, value in options.items():
            reader = reader.option(key, str(value))
        query = (reader.load().writeStream.format("parquet").option("path", out)
                 .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
        query.awaitTermination(120)
        self.assertFalse(query.isActive)
        self.assertIsNone(query.exception())
        return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]

    def _output(self, out):
        return sorted((r["log"], r["position"], r["value"])
                      for r in spark().read.parquet(out).collect())

    def test_restart_exactly_once_with_lost_commit(self):
        path = new_dir(self)
        work = new_dir(self)
        out, checkpoint = os.path.join(work, "out"), os.path.join(work, "checkpoint")
        expected = []

        def grow(name, n):
            values = [b"%s-%d" % (name.encode(), len(expected) + i) for i in range(n)]
            first = append(path, name, values).first_position
            expected.extend((name, first + i, value) for i, value in enumerate(values))

        grow("a", 30)
        grow("b", 5)
        self._run_query(path, out, checkpoint, maxRecordsPerTrigger=20)
        self.assertEqual(self._output(out), sorted(expected))

        # The log grows while the query is down; the restart reads only what is new.
        grow("a", 12)
        grow("c", 4)  # a log that did not exist before joins from position 0
        self._run_query(path, out, checkpoint)
        self.assertEqual(self._output(out), sorted(expected))

        # A crash after the offsets of the last batch were logged but before
        # the batch committed: its commit (and its sink output) are gone.
        last = max(int(n) for n in os.listdir(os.path.join(checkpoint, "commits"))
                   if n.isdigit())
        remove_checksummed(os.path.join(checkpoint, "commits", str(last)))
        metadata = os.path.join(out, "_spark_metadata", str(last))
        with open(metadata) as f:
            files = [json.loads(line)["path"] for line in f.read().splitlines()[1:]]
        for written in files:
            remove_checksummed(urllib.request.url2pathname(written.replace("file:", "", 1)))
        remove_checksummed(metadata)
        lost = set(expected) - set(self._output(out))
        self.assertTrue(lost)
        # More records arrive: the replayed batch must stop at its logged end.
        grow("a", 7)
        self._run_query(path, out, checkpoint)
        self.assertEqual(self._output(out), sorted(expected))

    def test_max_records_per_trigger_and_available_now(self):
        path = new_dir(self)
        work = new_dir(self)
        append(path, "a", [b"%d" % i for i in range(70)])
        append(path, "b", [b"%d" % i for i in range(30)])
        sizes = self._run_query(path, os.path.join(work, "out"), os.path.join(work, "cp"),
                          maxRecordsPerTrigger=40)
        self.assertEqual(sizes, [40, 40, 20])
        self.assertEqual(len(self._output(os.path.join(work, "out"))), 100)

    def test_continuous_trigger_over_growing_log(self):
        path = new_dir(self)
        append(path, "a", [b"first-%d" % i for i in range(10)])
        query = (spark().readStream.format("streamproto").option("path", path)
                 .option("startingPosition", "earliest").load()
                 .writeStream.format("memory").queryName("grow").start())
        try:
            query.processAllAvailable()
            append(path, "a", [b"second-%d" % i for i in range(5)])
            query.processAllAvailable()
            rows = sorted((r["position"], r["value"]) for r in spark().table("grow").collect())
        finally:
            query.stop()
        self.assertEqual(rows, [(i, b"first-%d" % i) for i in range(10)]
                         + [(10 + i, b"second-%d" % i) for i in range(5)])


class RemoteTests(SynchronousTestCase):
    def test_remote_read_from_two_servers(self):
        one, two = StyxServer(self), StyxServer(self)
        records = {"a": [b"one-%d" % i for i in range(50)] + [b""],
                   "b": [b"two-%d" % i * (i % 5) for i in range(23)]}
        one.client.create("a")
        one.client.append("a", records["a"][:30])
        one.client.append("a", records["a"][30:])
        two.client.create("b")
        two.client.append("b", records["b"])
        df = (spark().read.format("streamproto").option("url", f"{one.url},{two.url}")
              .option("maxRecordsPerPartition", "20").load())
        self.assertEqual(rows_of(df), sorted((log, i, r) for log, rs in records.items()
                                             for i, r in enumerate(rs)))
        self.assertEqual(sorted({r["node"] for r in df.collect()}),
                         sorted([one.url.split("//")[1], two.url.split("//")[1]]))

    def test_fleet_one_log_on_several_nodes(self):
        """
        The same log name on several styx-servers (a fleet of file-store
        nodes) is one partitioned stream: one partition per node, a C{node}
        column, and in streaming offsets per node and log, exactly once.
        """
        one, two = StyxServer(self), StyxServer(self)
        nodes = {one: one.url.split("//")[1], two: two.url.split("//")[1]}
        for server, n in ((one, 30), (two, 7)):
            server.client.create("beats")
            server.client.append("beats", [b"%s-%d" % (nodes[server].encode(), i)
                                           for i in range(n)])
        urls = f"{one.url},{two.url}"
        df = spark().read.format("streamproto").option("url", urls).load()
        rows = sorted((r["node"], r["log"], r["position"], r["value"]) for r in df.collect())
        self.assertEqual(rows, sorted(
            [(nodes[one], "beats", i, b"%s-%d" % (nodes[one].encode(), i)) for i in range(30)]
            + [(nodes[two], "beats", i, b"%s-%d" % (nodes[two].encode(), i))
               for i in range(7)]))
        # only one node's log of that name: still per node
        self.assertEqual(spark().read.format("streamproto").option("url", urls)
                         .option("logs", "beats").load().count(), 37)

        from streamproto.spark.source import LogStreamReader
        from streamproto.spark.options import parse_source_options, source_schema_ddl
        from pyspark.sql.types import _parse_datatype_string
        options = {"url": urls, "logs": "beats"}
        schema = _parse_datatype_string(source_schema_ddl(parse_source_options(options)))
        reader = LogStreamReader(options, schema)
        end = reader.latestOffset({}, None)
        self.assertEqual(end, {f"{nodes[one]}/beats": 30, f"{nodes[two]}/beats": 7})
        two.client.append("beats", [b"more"])
        later = reader.latestOffset(end, None)
        self.assertEqual(later, {f"{nodes[one]}/beats": 30, f"{nodes[two]}/beats": 8})
        parts = reader.partitions(end, later)
        got = [(b.column(3).to_pylist(), b.column(2).to_pylist())
               for p in parts for b in reader.read(p)]
        self.assertEqual(got, [([nodes[two]], [b"more"])])

    def test_fleet_upgrades_an_old_checkpoint(self):
        """
        A checkpoint written when several servers each held different logs
        (keys: plain log names) goes on with per-node keys.
        """
        from streamproto.spark.source import LogStreamReader
        from streamproto.spark.options import parse_source_options, source_schema_ddl
        from pyspark.sql.types import _parse_datatype_string
        one, two = StyxServer(self), StyxServer(self)
        one.client.create("a")
        one.client.append("a", [b"%d" % i for i in range(5)])
        two.client.create("b")
        two.client.append("b", [b"%d" % i for i in range(3)])
        options = {"url": f"{one.url},{two.url}"}
        schema = _parse_datatype_string(source_schema_ddl(parse_source_options(options)))
        reader = LogStreamReader(options, schema)
        old = {"a": 4, "b": 3}
        end = reader.latestOffset(old, None)
        node_one = one.url.split("//")[1]
        self.assertEqual(end[f"{node_one}/a"], 5)
        parts = reader.partitions(old, end)
        self.assertEqual([(p.log, p.start, p.end) for p in parts], [(f"{node_one}/a", 4, 5)])

    def test_local_records_within_synced_bounds(self):
        from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

        from streamproto.spark.source import LogStreamReader
        server = StyxServer(self)
        server.client.create("events")
        server.client.append("events", [b"e%d" % i for i in range(12)])
        schema = StructType([StructField("log", StringType(), False),
                             StructField("position", LongType(), False),
                             StructField("value", BinaryType())])
        reader = LogStreamReader({"path": server.path, "url": server.url}, schema)
        end = reader.latestOffset({}, None)
        self.assertEqual(end, {"events": 12})
        parts = reader.partitions({}, end)
        self.assertEqual({p.location.kind for p in parts}, {"path"})
        values = [v for p in parts for b in reader.read(p) for v in b.column(2).to_pylist()]
        self.assertEqual(values, [b"e%d" % i for i in range(12)])

    def test_mutual_tls(self):
        from test.support.tlsutil import certs

        from streamproto.spark.options import parse_sink_options
        from streamproto.spark.remote import StyxHTTPError, TLSFiles
        from streamproto.spark.sink import StyxStreamProducer
        c = certs()
        tls = TLSFiles(c.ca, c.client_cert, c.client_key)
        server = StyxServer(self, c.server_endpoint(), scheme="https", host="localhost", tls=tls)
        server.client.create("secure")
        options = {"url": server.url, "log": "secure", "caCerts": c.ca,
                   "certificate": c.client_cert, "privateKey": c.client_key}
        producer = StyxStreamProducer(parse_sink_options(options))
        try:
            producer.send([b"s%d" % i for i in range(25)])
            producer.finish()
        finally:
            producer.close()
        reader = spark().read.format("streamproto")
        for key, value in options.items():
            if key != "log":
                reader = reader.option(key, value)
        self.assertEqual(sorted(r["value"] for r in reader.load().collect()),
                         sorted(b"s%d" % i for i in range(25)))
        # Without a client certificate the server refuses the handshake.
        anonymous = StyxHTTPClient(server.url, timeout=10, tls=TLSFiles(c.ca))
        self.assertRaises(StyxHTTPError, anonymous.bounds, "secure")

    def test_producers_direct(self):
        from streamproto.spark.options import parse_sink_options
        from streamproto.spark.remote import StyxHTTPError
        from streamproto.spark.sink import HTTPProducer, SinkError, StyxStreamProducer
        server = StyxServer(self)
        missing = parse_sink_options({"url": server.url, "log": "missing", "timeout": "5"})
        self.assertRaises(SinkError, StyxStreamProducer, missing)
        self.assertRaises(StyxHTTPError, HTTPProducer(missing).send, [b"x"])
        server.client.create("direct")
        producer = StyxStreamProducer(parse_sink_options({"url": server.url, "log": "direct"}))
        try:
            for i in range(5):
                producer.send([b"%d-%d" % (i, j) for j in range(1000)])
            producer.finish()
        finally:
            producer.close()
        self.assertEqual((producer.count, producer.end_position), (5000, 5000))
        self.assertEqual(server.client.bounds("direct"), (0, 5000))
        got = [r for b in server.client.read("direct", 4990, 5000) for r in b.records()]
        self.assertEqual(got, [b"4-%d" % j for j in range(990, 1000)])

    def test_producer_outlives_idle_close(self):
        from streamproto.spark.options import parse_sink_options
        from streamproto.spark.sink import StyxStreamProducer
        # The server closes a styx/0 stream after 2 s without a message; a
        # task busy upstream for longer must not lose or repeat records.
        server = StyxServer(self, timeout=2)
        server.client.create("idle")
        producer = StyxStreamProducer(parse_sink_options({"url": server.url, "log": "idle"}))
        try:
            producer.send([b"before-%d" % i for i in range(10)])
            time.sleep(2.6)
            producer.send([b"after-%d" % i for i in range(10)])
            producer.finish()
        finally:
            producer.close()
        self.assertEqual(producer.count, 20)
        got = [r for b in server.client.read("idle", 0, 20) for r in b.records()]
        self.assertEqual(got, [b"before-%d" % i for i in range(10)]
                         + [b"after-%d" % i for i in range(10)])
        self.assertEqual(server.client.bounds("idle"), (0, 20))

    def test_writer_round_trip(self):
        server = StyxServer(self)
        source = spark().createDataFrame([(b"v%d" % i,) for i in range(300)], "value BINARY")
        source.repartition(3).write.format("streamproto").mode("append") \
            .option("url", server.url).option("log", "styx-out").save()
        spark().createDataFrame([("text-%d" % i,) for i in range(10)], "value STRING") \
            .write.format("streamproto").mode("append").option("url", server.url) \
            .option("log", "http-out").option("protocol", "http").option("batchRecords", "3") \
            .save()
        back = spark().read.format("streamproto").option("url", server.url)
        self.assertEqual(sorted(r["value"] for r in back.option("logs", "styx-out").load()
                                .collect()), sorted(b"v%d" % i for i in range(300)))
        # Two tasks write at once: their records interleave in any order.
        self.assertEqual(sorted(r["value"] for r in back.option("logs", "http-out")
                                .option("valueFormat", "utf8").load().collect()),
                         sorted("text-%d" % i for i in range(10)))
        # Streaming: a local log copied to the server's log, once.
        path = new_dir(self)
        work = new_dir(self)
        append(path, "in", [b"s%d" % i for i in range(40)])
        query = (spark().readStream.format("streamproto").option("path", path).load()
                 .select("value").writeStream.format("streamproto")
                 .option("url", server.url).option("log", "stream-out")
                 .option("checkpointLocation", work).trigger(availableNow=True).start())
        query.awaitTermination(120)
        self.assertIsNone(query.exception())
        deadline = time.monotonic() + 10
        while server.client.bounds("stream-out")[1] < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        copied = [r for b in server.client.read("stream-out", 0, 40) for r in b.records()]
        self.assertEqual(sorted(copied), sorted(b"s%d" % i for i in range(40)))
        self.assertEqual(server.client.bounds("stream-out"), (0, 40))


def load_example():
    import importlib.util
    # examples/ is next to test/ in the source tree (it is not installed).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        "beats_pipeline", os.path.join(root, "examples", "beats_pipeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ExamplePipelineTests(SynchronousTestCase):
    """examples/beats_pipeline.py's job, restarted from its checkpoints."""

    def test_counts_exactly_once_across_restart(self):
        example = load_example()
        server = StyxServer(self)
        store = new_dir(self)
        work = new_dir(self)
        out, checkpoint = os.path.join(work, "counts"), os.path.join(work, "cp")

        def land(events):
            # What lumberjack-server appends for each event.
            append(store, "lumberjack", [json.dumps({"peer": "127.0.0.1:5000", "event": e})
                                         .encode() for e in events] + [b"not json"])

        sent = example.beats_events(0, 3, ["web-1", "db-1"], 5)
        land(sent)
        example.run_until_caught_up(example.start_job(spark(), store, server.url, out, checkpoint,
                                                      available_now=True))
        more = example.beats_events(3, 2, ["web-1", "db-1"], 5)
        land(more)
        sent += more
        example.run_until_caught_up(example.start_job(spark(), store, server.url, out, checkpoint,
                                                      available_now=True))
        rows = spark().read.parquet(out).collect()
        got = [(r["minute"].strftime("%Y-%m-%dT%H:%M"), r["host"], r["count"]) for r in rows]
        want = example.expected_counts(sent)
        self.assertEqual(len(want), 6)  # minutes 12:00-12:02 are final, for two hosts
        self.assertEqual(sorted(got), sorted((m, h, c) for (m, h), c in want.items()))
        start, end = server.client.bounds("host-counts")
        published = [json.loads(r) for b in server.client.read("host-counts", start, end)
                     for r in b.records()]
        self.assertEqual(sorted((p["minute"][:16], p["host"], p["count"]) for p in published),
                         sorted(got))
