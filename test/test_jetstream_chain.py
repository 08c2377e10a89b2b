"""
The JetStream store's append chain, driven deterministically on an
in-memory JetStream (L{test.jetstream_fake}): what is acknowledged when,
what happens to a lost acknowledgement, a refused publish, a race with
another front-end, an outage longer than the timeout, and the window.
The real cluster runs the behaviour suite (L{test.test_log}) and the
failover trials (L{test.test_jetstream_failover}).
"""

from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial import unittest

from streamproto.log.errors import StoreUnavailable, WriteFailed
from streamproto.log.jetstream import JetStreamLogStore
from test.jetstream_fake import FakeJetStream, InlineBridge


class ChainTests(unittest.SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()
        self.io = FakeJetStream()

    def store(self, **kwargs):
        kwargs.setdefault("timeout", 10.0)
        store = JetStreamLogStore(["nats://fake:4222"], prefix="t", clock=self.clock,
                                  bridge=InlineBridge(), io=self.io,
                                  retention_interval=None, **kwargs)
        self.successResultOf(store.start())
        self.addCleanup(store.close)
        return store

    def log(self, store, name="events"):
        return self.successResultOf(store.get_or_create(name))

    def records(self, log):
        out = []
        position = log.start_position
        while position < log.end_position:
            batch = self.successResultOf(log.read(position, max_bytes=1 << 30))
            out.extend(bytes(r) for r in batch)
            position += len(batch)
        return out

    def run_clock(self, seconds, step=0.05):
        for _ in range(int(seconds / step) + 1):
            self.clock.advance(step)

    def test_acknowledged_only_after_the_quorum_answers(self):
        """
        An append's Deferred fires only once JetStream acknowledged the
        message holding it; readers see nothing before.
        """
        log = self.log(self.store())
        self.io.hold = True
        self.io.deliver = False
        d = log.append([b"a", b"b"])
        self.assertNoResult(d)
        self.assertEqual(log.end_position, 0)
        self.io.deliver = True
        self.io.release()
        self.assertEqual(self.successResultOf(d).first_position, 0)
        self.assertEqual(self.records(log), [b"a", b"b"])

    def test_lost_acknowledgement_stored_once(self):
        """
        A publish stored by the cluster whose acknowledgement was lost is
        found when the chain re-reads the tail: acknowledged once, not
        stored a second time.
        """
        self.io.deliver = False
        log = self.log(self.store())
        self.io.faults.append("lose-ack")
        d = log.append([b"one"])
        self.run_clock(1)
        self.assertEqual(self.successResultOf(d).first_position, 0)
        self.successResultOf(log.append([b"two"]))
        self.assertEqual(self.records(log), [b"one", b"two"])

    def test_lost_acknowledgement_after_the_follower_saw_it(self):
        """
        The follower can see a message stored before its publish is
        answered; when that answer is then lost, the message is not sent
        again (it would be stored twice).
        """
        log = self.log(self.store())
        self.io.faults.append("lose-ack")
        d = log.append([b"one"])
        self.run_clock(1)
        self.assertEqual(self.successResultOf(d).first_position, 0)
        self.successResultOf(log.append([b"two"]))
        self.assertEqual(self.records(log), [b"one", b"two"])

    def test_unstored_publish_sent_again(self):
        """A publish the cluster never stored is sent again, in order, once."""
        log = self.log(self.store())
        self.io.faults.append("timeout")
        first = log.append([b"one"])
        second = log.append([b"two"])
        self.run_clock(1)
        self.assertEqual(self.successResultOf(first).first_position, 0)
        self.assertEqual(self.successResultOf(second).first_position, 1)
        self.assertEqual(self.records(log), [b"one", b"two"])

    def test_refused_publish_fails_only_its_append(self):
        """
        A publish refused for its own sake (say, no space) fails its append
        and is never acknowledged; the chain goes on for the next one.
        """
        log = self.log(self.store())
        self.io.faults.append(10047)  # insufficient resources
        refused = log.append([b"refused"])
        self.run_clock(1)
        self.failureResultOf(refused, WriteFailed)
        self.assertEqual(self.successResultOf(log.append([b"next"])).first_position, 0)
        self.assertEqual(self.records(log), [b"next"])

    def test_two_front_ends_race(self):
        """
        Two stores on one cluster appending to one log: every record is
        stored exactly once, positions contiguous, each append's records
        together and at the position it was told.
        """
        a = self.store(connection_name="a")
        b = self.store(connection_name="b")
        log_a = self.log(a)
        log_b = self.log(b)
        self.io.hold = True
        results = []
        for i in range(5):
            results.append((log_a.append([b"a%d" % i, b"a%d'" % i]), [b"a%d" % i, b"a%d'" % i]))
            results.append((log_b.append([b"b%d" % i]), [b"b%d" % i]))
        for _ in range(50):
            self.io.release()
            self.run_clock(0.2)
        stored = self.records(log_a)
        self.assertEqual(sorted(stored), sorted(r for _, rs in results for r in rs))
        for d, rs in results:
            position = self.successResultOf(d).first_position
            self.assertEqual(stored[position:position + len(rs)], rs)
        self.assertEqual(self.records(log_b), stored)

    def test_outage_fails_appends_within_the_timeout(self):
        """
        With the cluster unreachable, an append fails with L{StoreUnavailable}
        within the store's timeout (never acknowledged, never hanging), the
        store reports the problem, and appends work again once the cluster
        answers.
        """
        store = self.store(timeout=2.0)
        log = self.log(store)
        self.successResultOf(log.append([b"before"]))
        self.io.down = True
        d = log.append([b"during"])
        self.run_clock(3.5)
        self.failureResultOf(d, StoreUnavailable)
        self.failureResultOf(log.append([b"refused at once"]), StoreUnavailable)
        self.assertIsNone(log.failed)     # transient: not a fail-stop
        self.assertEqual(log.info()["status"], "unavailable")
        self.assertTrue(store.problems())
        self.io.down = False
        self.run_clock(2)
        self.successResultOf(log.append([b"after"]))
        self.assertEqual(self.records(log)[0], b"before")
        self.assertEqual(self.records(log)[-1], b"after")
        self.assertNotIn(b"refused at once", self.records(log))
        self.assertEqual(store.problems(), [])

    def test_window_bounds_messages_in_flight(self):
        """
        A slow cluster slows the appenders down: no more than
        C{max_inflight} messages are sent without an answer.
        """
        log = self.log(self.store(max_inflight=3, max_message_bytes=1024))
        self.io.hold = True
        ds = [log.append([bytes(1000)]) for _ in range(10)]
        self.assertEqual(len(self.io.held), 3)
        while self.io.held:
            self.io.release(1)
            self.assertLessEqual(len(self.io.held), 3)
        self.assertEqual([self.successResultOf(d).first_position for d in ds], list(range(10)))

    def test_attributes_stored_with_the_data(self):
        """Attributes go in the same message as the records (one publish)."""
        log = self.log(self.store())
        before = len(self.io.published)
        self.successResultOf(log.append([b"x"], attributes={"writer": 7}))
        self.assertEqual(len(self.io.published) - before, 1)
        self.assertEqual(log.attributes["writer"], 7)

    def test_conditional_appends_race(self):
        """
        Two front-ends each append conditionally at the same position: one
        wins, the other gets L{AppendConflict} (its write never lands), and
        re-reading then appending at the new end works.
        """
        from streamproto.log.errors import AppendConflict
        log_a = self.log(self.store(connection_name="a"))
        log_b = self.log(self.store(connection_name="b"))
        self.io.hold = True
        da = log_a.append([b"from a"], expected_position=0)
        db = log_b.append([b"from b"], expected_position=0)
        for _ in range(10):
            self.io.release()
            self.run_clock(0.2)
        results = {}
        da.addBoth(lambda r: results.__setitem__("a", r))
        db.addBoth(lambda r: results.__setitem__("b", r))
        won = [k for k, r in results.items() if not isinstance(r, Failure)]
        self.assertEqual(len(won), 1, results)
        lost = "b" if won == ["a"] else "a"
        self.assertTrue(results[lost].check(AppendConflict), results[lost])
        self.assertEqual(len(self.records(log_a)), 1)
        self.io.hold = False
        loser = log_b if lost == "b" else log_a
        self.successResultOf(loser.append([b"again"], expected_position=1))
        self.assertEqual(len(self.records(log_a)), 2)
