"""
Start-up warnings for a cluster that can lose acknowledged records
(L{streamproto.log.jetstream.safety}): streams of fewer than 3 replicas,
nodes without C{sync_interval: always}.  The texts, then real nats-server
clusters: an unsafe one warns, a safe one does not.
"""

from twisted.internet import defer
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.trial import unittest

from streamproto.log.config import LogConfig
from streamproto.log.jetstream import JetStreamLogStore
from streamproto.log.jetstream.safety import replica_risks, sync_risks


class RiskTexts(unittest.SynchronousTestCase):

    def test_replicas(self):
        [risk] = replica_risks(1, [])
        self.assertIn("replicas=1", risk)
        self.assertIn("?replicas=3", risk)
        self.assertEqual(replica_risks(3, [("S_a", 3), ("S_b", 5)]), [])
        [risk] = replica_risks(3, [("S_a", 3), ("S_b", 1), ("S_c", 2)])
        self.assertIn("2 existing log stream(s)", risk)
        self.assertIn("S_b, S_c", risk)

    def test_sync(self):
        safe = {"jetstream": {"config": {"sync_always": True}}}
        lazy = {"server_name": "n1",
                "jetstream": {"config": {"sync_interval": 120_000_000_000}}}
        self.assertEqual(sync_risks({"http://a:8222": safe}), [])
        [risk] = sync_risks({"http://a:8222": safe, "http://b:8222": lazy})
        self.assertIn("n1 (fsync every 120 s)", risk)
        self.assertIn("sync_interval: always", risk)


class StartUpWarnings(unittest.TestCase):
    """A store warns at start-up, once connected, of what its cluster risks."""

    timeout = 90

    def warnings(self):
        lines = []

        def observer(event):
            if event.get("log_level") == LogLevel.warn \
                    and event.get("log_namespace") == "streamproto.log.jetstream":
                lines.append(formatEvent(event))
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        return lines

    @defer.inlineCallbacks
    def start(self, cluster, **kwargs):
        from test.support.natsutil import unique_prefix
        store = JetStreamLogStore(cluster.urls, prefix=unique_prefix(self),
                                  monitor=[f"http://127.0.0.1:{p}" for p in cluster.http_ports],
                                  **kwargs)
        self.addCleanup(store.close)
        yield store.start()
        return store

    @defer.inlineCallbacks
    def test_one_lazy_node(self):
        """One node (so one replica), nats-server's default sync_interval: both warned."""
        from twisted.internet import threads

        from test.support.natsutil import NatsCluster
        cluster = NatsCluster(1, sync_interval=None)
        self.addCleanup(cluster.stop)
        yield threads.deferToThread(cluster.start)
        lines = self.warnings()
        yield self.start(cluster)
        text = "\n".join(lines)
        self.assertIn("replica(s) (replicas=1)", text)
        self.assertIn("fsync every 120 s", text)
        self.assertIn("set sync_interval: always", text)

    @defer.inlineCallbacks
    def test_safe_cluster(self):
        """3 nodes with sync_interval: always, replicas 3: not a word."""
        from test.support.natsutil import shared_cluster
        lines = self.warnings()
        yield self.start(shared_cluster(), replicas=3)
        self.assertEqual(lines, [])

    @defer.inlineCallbacks
    def test_existing_stream_of_one_replica(self):
        """A log created with one replica is named by the next store to start."""
        from test.support.natsutil import shared_cluster
        cluster = shared_cluster()
        first = yield self.start(cluster, replicas=1)
        yield first.create("fragile", LogConfig())
        lines = self.warnings()
        second = JetStreamLogStore(cluster.urls, prefix=first.prefix, replicas=3,
                                   monitor=[f"http://127.0.0.1:{p}" for p in cluster.http_ports])
        self.addCleanup(second.close)
        yield second.start()
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("1 existing log stream(s) have fewer than 3 replicas", lines[0])
