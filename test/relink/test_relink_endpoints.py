"""
The server's endpoints in memory: echo, and the bridge to the log store
(acknowledged only once durable; a commit is one atomic append).
"""

import gc

from twisted.trial.unittest import SynchronousTestCase

from streamproto.log import MemoryLogStore
from streamproto.relink.config import LinkConfig
from streamproto.relink.endpoints import EchoHandler, LogBridgeHandler
from streamproto.relink.errors import LinkLost
from test.relink.test_relink_support import Pair, Recorder
from test.support.heldstore import HeldStore


def fired(d):
    results = []
    d.addBoth(results.append)
    return results


def appends_held(store=None):
    """A store over C{store} whose appends wait until the test says they are durable."""
    return HeldStore(store, held=frozenset({"append"}))


class Echo(SynchronousTestCase):
    def test_messages_in_the_same_read_as_the_shutdown(self):
        # the handler hears of the peer's shutdown after the messages before
        # it: the echo opens its channel before our shutdown forbids that
        p = Pair(server=EchoHandler(), id_sizes=(4, 4)).connect()
        sent = fired(p.link.channel(5).send([b"last words"]))
        done = fired(p.connector.shutdown())
        p.run()
        self.assertEqual(p.client.messages, {5: [(b"last words",)]})
        self.assertEqual((sent, done), ([1], [None]))

    def test_shutdown_answer_cut_short_is_no_unhandled_error(self):
        """
        The endpoints answer the peer's shutdown with theirs.  A link
        discarded before that completes (the peer went away, the server
        stops) is no error to log as unhandled.
        """
        # the connector holds the echo unconsumed, the store the append: the
        # shutdown waits for them
        for handler in (EchoHandler(), LogBridgeHandler(appends_held())):
            p = Pair(server=handler, client=Recorder(hold=True), id_sizes=(4, 4)).connect()
            p.link.channel(1).send([b"unanswered"], ack=None)
            fired(p.connector.shutdown())
            p.run()
            server_link = p.server_link
            self.assertTrue(server_link.peer_shutdown)
            p.cut()
            server_link.discard(LinkLost("endpoint closed"))
            gc.collect()
            self.assertEqual(self.flushLoggedErrors(LinkLost), [])

    def test_echo_same_channel(self):
        p = Pair(server=EchoHandler(), id_sizes=(4, 4)).connect()
        for i in range(5):
            p.link.channel(77).send([b"ping %d" % i, b"!"], ack=None)
        p.run()
        self.assertEqual(p.client.messages, {77: [(b"ping %d" % i, b"!") for i in range(5)]})

    def test_echo_waits_for_room(self):
        # a peer that never consumes the echoes slows the sender down,
        # nothing piles up without bound
        config = LinkConfig(window=4, max_queued=4)
        from test.relink.test_relink_support import Recorder
        p = Pair(server=EchoHandler(), client=Recorder(hold=True), config=config).connect()
        ch = p.link.channel(1)
        for i in range(8):
            ch.send([b"%d" % i], ack=None)
            p.run()
        for i in range(8):
            if ch.room:
                ch.send([b"more%d" % i], ack=None)
            p.run()
        out = p.server_link.out_channels[1]
        self.assertLessEqual(out.assigned - out.consumed, 8)
        self.assertLess(ch.consumed, ch.assigned)
        for _ in range(10):
            p.client.release()
            p.run()
        self.assertEqual(ch.consumed, ch.assigned)
        self.assertEqual(len(p.client.messages[1]), ch.assigned)

    def test_echo_shuts_down_with_peer(self):
        p = Pair(server=EchoHandler()).connect()
        d = fired(p.connector.shutdown())
        p.run()
        self.assertEqual(d, [None])
        self.assertEqual(p.endpoint.links, {})


class LogBridge(SynchronousTestCase):
    def setUp(self):
        self.memory = MemoryLogStore()
        self.store = appends_held(self.memory)

    def records(self, name):
        log = self.successResultOf(self.memory.get(name))
        batch = self.successResultOf(log.read(0, -1))
        return list(batch.records())

    def test_consumed_only_once_durable(self):
        p = Pair(server=LogBridgeHandler(self.store), id_sizes=(4, 4)).connect()
        ch = p.link.channel(12)
        d = fired(ch.send_many([[b"one"], [b"tw", b"o"]]))
        p.run()
        self.assertEqual(d, [])
        self.assertEqual(ch.consumed, 0)
        self.store.release_all()
        p.run()
        self.assertEqual(d, [2])
        self.assertEqual(self.records("relink-12"), [b"one", b"two"])

    def test_failed_append_is_never_acknowledged(self):
        """
        A failed append discards the listener's link and acknowledges
        nothing; the connector, on its next connection, gets a new link and
        sends the message again (with C{failover=False} its Deferred fails
        with L{LinkLost} instead).
        """
        for failover in (True, False):
            p = Pair(server=LogBridgeHandler(self.store))
            p.connector.failover = failover
            p.connect()
            d = fired(p.link.channel(1).send([b"x"]))
            p.run()
            self.store.fail_all(RuntimeError("disk full"))
            p.run()
            self.flushLoggedErrors(RuntimeError)
            self.assertEqual(d, [])
            self.assertEqual(p.endpoint.links, {})
            p.connect()
            if failover:
                self.assertEqual(d, [])
                self.store.release_all()
                p.run()
                self.assertEqual(d, [1])
                self.assertEqual(p.connector.relinks, 1)
            else:
                self.assertTrue(d[0].check(LinkLost))

    def test_template(self):
        p = Pair(server=LogBridgeHandler(self.memory, "all"), id_sizes=(1, 1)).connect()
        p.link.channel(1).send([b"a"])
        p.link.channel(2).send([b"b"])
        p.run()
        self.assertEqual(sorted(self.records("all")), [b"a", b"b"])

    def test_commit_is_one_atomic_append(self):
        p = Pair(server=LogBridgeHandler(self.store), transactions=(True, False)).connect()
        ch = p.link.channel(3)
        ch.send_many([[b"a"], [b"b"], [b"c"]], ack=None)
        committed = fired(ch.commit())
        p.run()
        self.assertEqual(committed, [])
        self.assertEqual(self.store.appends(), [[b"a", b"b", b"c"]])
        self.store.release_all()
        p.run()
        self.assertEqual(committed, [True])
        self.assertEqual(self.records("relink-3"), [b"a", b"b", b"c"])

    def test_rollback_writes_nothing(self):
        p = Pair(server=LogBridgeHandler(self.memory), transactions=(True, False)).connect()
        ch = p.link.channel(3)
        ch.send([b"no"], ack=None)
        ch.rollback()
        ch.send([b"yes"], ack=None)
        committed = fired(ch.commit())
        p.run()
        self.assertEqual(committed, [True])
        self.assertEqual(self.records("relink-3"), [b"yes"])

    def test_failed_commit_is_uncommitted(self):
        p = Pair(server=LogBridgeHandler(self.store), transactions=(True, False)).connect()
        ch = p.link.channel(3)
        ch.send([b"x"], ack=None)
        committed = fired(ch.commit())
        p.run()
        self.store.fail_all(RuntimeError("disk full"))
        p.run()
        self.flushLoggedErrors(RuntimeError)
        self.assertEqual(committed, [False])
        # the link goes on
        ch.send([b"y"], ack=None)
        again = fired(ch.commit())
        p.run()
        self.store.release_all()
        p.run()
        self.assertEqual(again, [True])
        self.assertEqual(self.records("relink-3"), [b"y"])

    def test_commit_failed_by_the_store_is_one_line(self):
        """
        A commit the store could not make (no quorum: L{StoreUnavailable})
        is logged as one error line saying why, not as a critical failure
        with a traceback: expected in operation (a JetStream partition).
        """
        from twisted.logger import globalLogPublisher

        from streamproto.log.errors import StoreUnavailable
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        p = Pair(server=LogBridgeHandler(self.store), transactions=(True, False)).connect()
        ch = p.link.channel(3)
        ch.send([b"x"], ack=None)
        committed = fired(ch.commit())
        p.run()
        self.store.fail_all(StoreUnavailable("JetStream did not acknowledge within 20s"))
        p.run()
        self.assertEqual(committed, [False])
        mine = [e for e in events if "commit on channel" in e.get("log_format", "")]
        self.assertEqual(len(mine), 1)
        self.assertNotIn("log_failure", mine[0])
        self.assertEqual(mine[0]["log_level"].name, "error")
        self.assertIn("did not acknowledge", mine[0]["error"])

