"""
The relink C{log} and C{log-tx} bridge against a store whose opens and
appends answer later (L{HeldStore}): a batch is acknowledged consumed, a
commit committed, only once its append is stored; a failed open or append
acknowledges nothing (and nothing after it).
"""

from twisted.trial.unittest import SynchronousTestCase

from streamproto.relink.endpoints import LogBridgeHandler
from test.support.heldstore import HeldStore, unreachable
from test.relink.test_relink_endpoints import fired
from test.relink.test_relink_support import Pair


class LogBridgeAckTests(SynchronousTestCase):
    def setUp(self):
        self.store = HeldStore()

    def records(self, name):
        log = self.successResultOf(self.store.inner.get(name))
        return list(self.successResultOf(log.read(0, -1)).records())

    def test_consumed_after_the_open_and_the_append(self):
        p = Pair(server=LogBridgeHandler(self.store), id_sizes=(4, 4)).connect()
        ch = p.link.channel(7)
        sent = fired(ch.send_many([[b"one"], [b"two"]]))
        p.run()
        self.assertEqual([h.operation for h in self.store.pending()], ["get_or_create"])
        self.store.release_all("get_or_create")
        p.run()
        self.assertEqual(self.store.appended(), [b"one", b"two"])
        self.assertEqual((sent, ch.consumed), ([], 0), "consumed before the append was stored")
        self.store.release_all()
        p.run()
        self.assertEqual(sent, [2])
        self.assertEqual(self.records("relink-7"), [b"one", b"two"])

    def test_later_batch_does_not_acknowledge_a_failed_one(self):
        p = Pair(server=LogBridgeHandler(self.store), id_sizes=(4, 4)).connect()
        p.connector.failover = False
        ch = p.link.channel(7)
        self.store.held.discard("get_or_create")
        first = fired(ch.send([b"lost"]))
        p.run()
        second = fired(ch.send([b"kept"]))
        p.run()
        held = self.store.pending("append")
        self.assertEqual(len(held), 2)
        held[0].fail(unreachable())
        held[1].release()
        p.run()
        self.flushLoggedErrors()
        self.assertEqual(ch.consumed, 0)
        self.assertNotIn(1, first)
        self.assertNotIn(2, second)

    def test_open_fails(self):
        p = Pair(server=LogBridgeHandler(self.store), id_sizes=(4, 4)).connect()
        p.connector.failover = False
        ch = p.link.channel(7)
        sent = fired(ch.send([b"x"]))
        p.run()
        self.store.fail_all(unreachable())
        p.run()
        self.flushLoggedErrors()
        self.assertEqual(ch.consumed, 0)
        self.assertNotIn(1, sent)
        self.assertEqual(self.store.appended(), [])

    def test_commit_after_the_append(self):
        p = Pair(server=LogBridgeHandler(self.store), transactions=(True, False)).connect()
        ch = p.link.channel(3)
        ch.send_many([[b"a"], [b"b"]], ack=None)
        committed = fired(ch.commit())
        p.run()
        self.store.release_all("get_or_create")
        p.run()
        self.assertEqual(committed, [])
        self.store.release_all()
        p.run()
        self.assertEqual(committed, [True])
        self.assertEqual(self.records("relink-3"), [b"a", b"b"])

    def test_commit_whose_open_fails_is_uncommitted(self):
        p = Pair(server=LogBridgeHandler(self.store), transactions=(True, False)).connect()
        ch = p.link.channel(3)
        ch.send([b"a"], ack=None)
        committed = fired(ch.commit())
        p.run()
        self.store.fail_all(unreachable())
        p.run()
        self.flushLoggedErrors()
        self.assertEqual(committed, [False])
