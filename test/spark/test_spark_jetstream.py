"""
The Spark data source reading a JetStream store straight from the cluster
(C{.option("store", "nats://...")}): batch reads and exactly-once streaming
with read limits, executors fetching position ranges.
"""

import os

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from streamproto.spark.options import OptionError, parse_source_options
from test.support.natsutil import shared_cluster, unique_prefix
from test.spark.test_spark import new_dir, spark


class JetStreamSourceTests(SynchronousTestCase):

    def setUp(self):
        from streamproto.log.bridge import SynchronousBridge
        from streamproto.log.jetstream import JetStreamLogStore
        self.cluster = shared_cluster()
        self.prefix = unique_prefix(self)
        self.store = JetStreamLogStore(self.cluster.urls, prefix=self.prefix, clock=Clock(),
                                       bridge=SynchronousBridge(), retention_interval=None,
                                       max_message_bytes=4096)
        self.addCleanup(self.cleanup)
        self.url = self.cluster.url + f"?prefix={self.prefix}"

    def cleanup(self):
        for name in self.store.names():
            self.successResultOf(self.store.delete(name))
        self.successResultOf(self.store.close())

    def append(self, name, records):
        log = self.successResultOf(self.store.get_or_create(name))
        return self.successResultOf(log.append(records))

    def test_batch_read(self):
        self.append("a", [b"a%d" % i for i in range(500)])
        self.append("b", [b"b%d" % i for i in range(3)])
        df = (spark().read.format("streamproto").option("store", self.url)
              .option("maxRecordsPerPartition", "120").load())
        self.assertGreaterEqual(df.rdd.getNumPartitions(), 5)
        rows = sorted((r["log"], r["position"], r["value"]) for r in df.collect())
        self.assertEqual(rows, sorted([("a", i, b"a%d" % i) for i in range(500)]
                                      + [("b", i, b"b%d" % i) for i in range(3)]))

    def test_timestamp_is_the_append_time(self):
        import datetime
        import time
        before = datetime.datetime.now(datetime.timezone.utc)
        self.append("t", [b"first-%d" % i for i in range(3)])
        time.sleep(0.05)
        middle = datetime.datetime.now(datetime.timezone.utc)
        self.append("t", [b"second"])
        after = datetime.datetime.now(datetime.timezone.utc)
        df = spark().read.format("streamproto").option("store", self.url).load()
        self.assertEqual(dict(df.dtypes)["timestamp"], "timestamp")
        # collect() gives naive local times: compare as epoch instants.
        rows = sorted((r["position"], r["timestamp"].timestamp()) for r in df.collect())
        self.assertEqual([p for p, _ in rows], [0, 1, 2, 3])
        slack = 1.0  # the cluster's clock is this machine's; allow rounding
        times = [t for _, t in rows]
        self.assertEqual(len(set(times[:3])), 1)  # one append, one stored time
        self.assertTrue(before.timestamp() - slack <= times[0] <= middle.timestamp() + slack)
        self.assertTrue(times[0] < times[3] <= after.timestamp() + slack)
        # Other stores keep no time: a timestamp column there is refused.
        schema = "log STRING, position BIGINT, value BINARY, timestamp TIMESTAMP"
        with self.assertRaises(Exception) as raised:
            spark().read.format("streamproto").schema(schema) \
                .option("path", new_dir(self)).load().collect()
        self.assertIn("only a JetStream store", str(raised.exception))

    def test_streaming_exactly_once(self):
        work = new_dir(self)
        out, checkpoint = os.path.join(work, "out"), os.path.join(work, "cp")

        def run():
            query = (spark().readStream.format("streamproto").option("store", self.url)
                     .option("maxRecordsPerTrigger", "150").load()
                     .writeStream.format("parquet").option("path", out)
                     .option("checkpointLocation", checkpoint)
                     .trigger(availableNow=True).start())
            query.awaitTermination(120)
            self.assertIsNone(query.exception())
            return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]

        self.append("s", [b"%d" % i for i in range(400)])
        self.assertEqual(run(), [150, 150, 100])
        self.append("s", [b"%d" % i for i in range(400, 450)])
        self.assertEqual(run(), [50])
        rows = sorted((r["position"], r["value"]) for r in spark().read.parquet(out).collect())
        self.assertEqual(rows, [(i, b"%d" % i) for i in range(450)])


class StoreOptionTests(SynchronousTestCase):

    def test_store_alone(self):
        opts = parse_source_options({"store": "nats://a:1,b:2?prefix=x"})
        self.assertEqual(opts.store, "nats://a:1,b:2?prefix=x")
        for bad in ({"store": "nats://a:1", "path": "/d"},
                    {"store": "nats://a:1", "url": "http://h:1"},
                    {"store": "http://a:1"},
                    {"store": "nats://a:1?replicas=9"},
                    {"store": "nats://a:1?colour=red"}):
            self.assertRaises(OptionError, parse_source_options, bad)
