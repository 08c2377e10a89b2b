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


class LogTxFailoverTests(SynchronousTestCase):
    """
    C{log-tx} is exactly once: a commit the listener stored whose answer
    was lost with the listener (kill -9 after the append, before the
    acknowledgement) must not be stored again by the next listener.  The
    connector cannot know whether it was stored: it reports the commit's
    outcome unknown (L{CommitOutcomeUnknown}) instead of resending it.
    Before the fix the connector resent the transaction to the restarted
    listener, which stored it a second time.
    """

    def setUp(self):
        from streamproto.log import MemoryLogStore
        self.store = MemoryLogStore()

    def records(self, name):
        log = self.successResultOf(self.store.get(name))
        return list(self.successResultOf(log.read(0, -1)).records())

    def test_commit_stored_answer_lost_is_not_stored_twice(self):
        from streamproto.relink.errors import CommitOutcomeUnknown
        from test.support.memnet import SERVER
        p = Pair(server=LogBridgeHandler(self.store), id_sizes=(4, 4),
                 transactions=(True, False)).connect()
        ch = p.link.channel(5)
        ch.send_many([[b"t1"], [b"t2"]], ack=None)
        committed = fired(ch.commit())
        p.clock.advance(0)
        p.conn.send(SERVER)     # the listener has the commit; its answer is not back
        p.clock.advance(0)
        self.assertEqual(self.records("relink-5"), [b"t1", b"t2"])
        # kill -9 of the listener; a new one on the same store
        p.fail_over(LogBridgeHandler(self.store))
        p.connect()
        self.assertEqual(self.records("relink-5"), [b"t1", b"t2"],
                         "a stored commit was stored again by the next listener")
        self.assertEqual(len(committed), 1)
        self.assertIsInstance(committed[0].value, CommitOutcomeUnknown)
        # and the channel goes on: the next transaction is committed once
        ch.send_many([[b"t3"]], ack=None)
        later = fired(ch.commit())
        p.run()
        self.assertEqual(later, [True])
        self.assertEqual(self.records("relink-5"), [b"t1", b"t2", b"t3"])

    def test_commit_never_transmitted_is_committed_on_the_next_listener(self):
        """A commit the old listener never saw is safe to send to the next one."""
        p = Pair(server=LogBridgeHandler(self.store), id_sizes=(4, 4),
                 transactions=(True, False)).connect()
        ch = p.link.channel(5)
        p.fail_over(LogBridgeHandler(self.store))   # cut before anything was written
        ch.send_many([[b"t1"]], ack=None)
        committed = fired(ch.commit())
        p.connect()
        p.run()
        self.assertEqual(committed, [True])
        self.assertEqual(self.records("relink-5"), [b"t1"])
