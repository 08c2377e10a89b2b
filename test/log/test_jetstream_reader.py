"""
L{JetStreamReader}: the synchronous reader of a JetStream store's logs
(what Spark executors use), against what L{JetStreamLogStore} wrote on a
real three-node cluster.
"""

import pickle
import random

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from streamproto.log.errors import LogNotFound, PositionOutOfRange
from streamproto.log.natsreader import JetStreamReader
from test.support.natsutil import shared_cluster, unique_prefix


class JetStreamReaderTests(SynchronousTestCase):

    def setUp(self):
        from streamproto.log.bridge import SynchronousBridge
        from streamproto.log.jetstream import JetStreamLogStore
        self.cluster = shared_cluster()
        self.prefix = unique_prefix(self)
        self.store = JetStreamLogStore(self.cluster.urls, prefix=self.prefix, clock=Clock(),
                                       bridge=SynchronousBridge(), retention_interval=None,
                                       max_message_bytes=64 * 1024)
        self.addCleanup(self.cleanup)
        self.reader = JetStreamReader(self.cluster.urls, prefix=self.prefix)

    def cleanup(self):
        for name in self.store.names():
            self.successResultOf(self.store.delete(name))
        self.successResultOf(self.store.close())

    def write(self, name, appends, attributes=None):
        log = self.successResultOf(self.store.get_or_create(name))
        for records in appends:
            self.successResultOf(log.append(records, attributes=attributes))
        return log

    def read(self, name, start, end, **kwargs):
        out = []
        expect = start
        for batch in self.reader.read(name, start, end, **kwargs):
            self.assertEqual(batch.position, expect)
            expect = batch.next_position
            out.extend(batch.records())
        self.assertEqual(expect, end)
        return out

    def test_names_and_bounds(self):
        self.write("alpha", [[b"a"] * 3])
        self.write("beta", [])
        self.assertEqual(self.reader.names(), ["alpha", "beta"])
        self.assertEqual(self.reader.bounds("alpha"), (0, 3))
        self.assertEqual(self.reader.bounds("beta"), (0, 0))
        self.assertRaises(LogNotFound, self.reader.bounds, "gamma")

    def test_ranges_read_as_written(self):
        """
        Small appends merged into messages, large ones split across
        messages: any range reads back exactly.
        """
        rng = random.Random(7)
        appends = []
        for i in range(40):
            n = rng.choice([1, 5, 50, 300])
            appends.append([b"%d.%d:" % (i, j) + bytes(rng.randrange(0, 900)) for j in range(n)])
        self.write("mixed", appends)
        records = [r for a in appends for r in a]
        self.assertEqual(self.reader.bounds("mixed"), (0, len(records)))
        self.assertEqual(self.read("mixed", 0, len(records)), records)
        for _ in range(15):
            a = rng.randrange(0, len(records))
            b = rng.randrange(a, len(records) + 1)
            self.assertEqual(self.read("mixed", a, b, max_bytes=rng.choice([1, 5000, 1 << 20])),
                             records[a:b])

    def test_truncated_start(self):
        log = self.write("cut", [[b"%d" % i for i in range(100)]] * 3)
        self.successResultOf(log.truncate(150))
        start, end = self.reader.bounds("cut")
        self.assertEqual((start, end), (150, 300))
        self.assertEqual(self.read("cut", 150, 160), [b"%d" % i for i in range(50, 60)])
        self.assertRaises(PositionOutOfRange, list, self.reader.read("cut", 10, 20))
        self.assertRaises(PositionOutOfRange, list, self.reader.read("cut", 290, 301))

    def test_attributes(self):
        self.write("attrs", [[b"x"]], attributes={"writer": 3})
        self.assertEqual(self.reader.attributes("attrs")["writer"], 3)

    def test_pickles(self):
        self.write("p", [[b"1", b"2"]])
        copy = pickle.loads(pickle.dumps(self.reader))
        self.assertEqual([bytes(r) for b in copy.read("p", 0, 2) for r in b.records()],
                         [b"1", b"2"])

    def test_unreachable(self):
        from streamproto.log.natsio import NotAvailable
        from test.support.netutil import free_port
        reader = JetStreamReader([f"nats://127.0.0.1:{free_port()}"], timeout=2)
        self.assertRaises(NotAvailable, reader.names)
