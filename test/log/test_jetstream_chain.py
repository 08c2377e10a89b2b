"""
The JetStream store's append chain, driven deterministically on an
in-memory JetStream (L{test.support.jetstream_fake}): what is acknowledged when,
what happens to a lost acknowledgement, a refused publish, a race with
another front-end, an outage longer than the timeout, and the window.
The real cluster runs the behaviour suite (L{test.log.test_log}) and the
failover trials (L{test.log.test_jetstream_failover}).
"""

from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial import unittest

from streamproto.log.errors import (
    AppendConflict, LogNotFound, StoreUnavailable, WriteFailed,
)
from streamproto.log.jetstream import JetStreamLogStore
from streamproto.log.natsio import WRONG_LAST_SEQUENCE
from test.support.jetstream_fake import FakeJetStream, InlineBridge


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

    def test_one_message_in_flight(self):
        """
        One message per log is sent without an answer; what is appended
        meanwhile goes out merged in the next (a group commit), and a slow
        cluster slows the appenders down.
        """
        log = self.log(self.store(max_message_bytes=4096))
        self.io.hold = True
        ds = [log.append([bytes(1000)]) for _ in range(10)]
        self.assertEqual(len(self.io.held), 1)
        sent = []
        while self.io.held:
            self.io.release(1)
            self.assertLessEqual(len(self.io.held), 1)
            sent.append(len(self.io.published))
        self.assertEqual([self.successResultOf(d).first_position for d in ds], list(range(10)))
        # the first alone, the nine queued behind it in messages of <= 4096 bytes
        data_publishes = [h for _, h, _ in self.io.published if "Sp-Batch" in h][-4:]
        self.assertEqual([int(h["Sp-Batch"].split()[2]) for h in data_publishes], [1, 4, 4, 1])

    def test_refused_message_never_acknowledged(self):
        """
        The race of two front-ends that lost acknowledged records: this
        front-end's view of the tail is stale (another front-end appended
        unseen), so its next message is refused; the appends behind it must
        not be stored after the other front-end's message with positions
        that assumed the refused one, and the refused records must not be
        acknowledged as stored.  Every acknowledged append is where it was
        told, read through a third front-end started afterwards.
        """
        a = self.store(connection_name="a")
        b = self.store(connection_name="b")
        log_a = self.log(a)
        log_b = self.log(b)
        self.io.deliver = False      # a does not hear of b's append
        self.successResultOf(log_b.append([b"b0"]))
        self.io.hold = True
        d1 = log_a.append([b"a1"])   # the same size as b0: positions would match
        d2 = log_a.append([b"a2"])
        for _ in range(20):
            self.io.release()
            self.run_clock(0.2)
        self.io.deliver = True
        self.io.deliver_now()
        fresh = self.log(self.store(connection_name="c"))
        stored = self.records(fresh)
        self.assertEqual(sorted(stored), [b"a1", b"a2", b"b0"])
        for d, record in ((d1, b"a1"), (d2, b"a2")):
            position = self.successResultOf(d).first_position
            self.assertEqual(stored[position], record)
        self.assertLess(stored.index(b"a1"), stored.index(b"a2"))
        self.assertEqual(self.records(log_a), stored)
        self.assertEqual(self.records(log_b), stored)
        self.assertEqual(log_a.info()["status"], "ok")

    def test_front_ends_racing_many_rounds(self):
        """
        Three front-ends appending to one log in random interleavings
        (acknowledgements held and released in random amounts, followers
        delayed at random): over many seeded rounds every acknowledged
        append is stored once, at the position it was told, each
        front-end's acknowledged appends in the order they were made, and
        every front-end and a fresh one read the same log, none stopped.
        """
        import random
        for seed in range(60):
            rng = random.Random(seed)
            self.io = FakeJetStream()
            stores = [self.store(connection_name=f"s{i}", timeout=30.0) for i in range(3)]
            logs = [self.log(s) for s in stores]
            appends = []   # (front-end, records, deferred)
            self.io.hold = True
            for step in range(40):
                i = rng.randrange(3)
                records = [b"%d-%d-%d" % (seed, step, k) for k in range(rng.randint(1, 3))]
                appends.append((i, records, logs[i].append(records)))
                self.io.deliver = rng.random() < 0.5
                if self.io.deliver:
                    self.io.deliver_now()
                if rng.random() < 0.5:
                    self.io.release(rng.randint(1, 3))
                self.run_clock(rng.choice([0, 0.05, 0.2]))
            self.io.deliver = True
            self.io.deliver_now()
            for _ in range(100):
                self.io.release()
                self.run_clock(0.2)
            fresh = self.log(self.store(connection_name="fresh"))
            stored = self.records(fresh)
            self.assertEqual(len(stored), len(set(stored)), f"seed {seed}: duplicates")
            acked_order = {0: [], 1: [], 2: []}
            for i, records, d in appends:
                position = self.successResultOf(d).first_position
                self.assertEqual(stored[position:position + len(records)], records,
                                 f"seed {seed}: acknowledged append not where it was told")
                acked_order[i].append(position)
            for i, positions in acked_order.items():
                self.assertEqual(positions, sorted(positions), f"seed {seed}: order of {i}")
            for log in logs:
                self.assertEqual(log.info()["status"], "ok", f"seed {seed}")
                self.assertEqual(self.records(log), stored, f"seed {seed}")
            for s in stores:
                s.close()

    def test_no_expected_last_msg_id(self):
        """
        Publishes expect the last sequence only, never the last message id:
        nats-server replicas check that one when they apply an entry, and a
        replica restarted and caught up from a snapshot does not know the
        last id ("last msgid mismatch", a critical write error: it never
        catches up, and one more node lost is no quorum).
        """
        from streamproto.log.natsformat import EXPECTED_LAST_MSG_ID, EXPECTED_LAST_SEQUENCE
        log = self.log(self.store())
        for i in range(3):
            self.successResultOf(log.append([b"%d" % i]))
        self.assertTrue(all(EXPECTED_LAST_SEQUENCE in h for _, h, _ in self.io.published))
        self.assertFalse([h for _, h, _ in self.io.published if EXPECTED_LAST_MSG_ID in h])

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


class LateMessageTests(unittest.SynchronousTestCase):
    """
    A publish whose acknowledgement timed out can still be stored later: a
    new stream leader applies what the old one had replicated.  An
    exactly-once writer that resent its events meanwhile (its append
    failed, it set up again on the event number the front-end knew) must
    not get them stored twice: its resend expects the writer's attribute
    as it was, and the store judges that where the message lands.
    """

    def setUp(self):
        self.clock = Clock()
        self.io = FakeJetStream()

    store = ChainTests.store
    log = ChainTests.log
    records = ChainTests.records
    run_clock = ChainTests.run_clock

    def lose_append(self, log, records, attributes, expected):
        """An append that fails after its deadline with its message landing later."""
        self.io.faults.append("late")
        self.io.down = True
        d = log.append(records, attributes, expected_attributes=expected)
        self.run_clock(3)
        self.failureResultOf(d, StoreUnavailable)
        self.io.down = False
        self.run_clock(2)
        self.assertEqual(len(self.io.late), 1)

    def test_late_message_then_resend(self):
        """The late message lands first: the resend fails with AppendConflict."""
        log = self.log(self.store(timeout=2.0))
        self.successResultOf(log.append([b"e0"], {"w": 0}, expected_attributes={"w": None}))
        self.lose_append(log, [b"e1"], {"w": 1}, {"w": 0})
        self.assertEqual(log.attributes["w"], 0)    # what a writer sets up on
        # the new leader applies it; this front-end has not seen it yet
        self.io.deliver = False
        self.assertEqual([o.error for o in self.io.apply_late()], [None])
        resend = log.append([b"e1"], {"w": 1}, expected_attributes={"w": 0})
        self.io.deliver = True
        self.run_clock(1)
        self.failureResultOf(resend, AppendConflict)
        self.assertEqual(self.records(log), [b"e0", b"e1"])
        self.assertEqual(log.attributes["w"], 1)

    def test_resend_then_late_message(self):
        """The resend lands first: the late message can no longer be stored."""
        log = self.log(self.store(timeout=2.0))
        self.successResultOf(log.append([b"e0"], {"w": 0}, expected_attributes={"w": None}))
        self.lose_append(log, [b"e1"], {"w": 1}, {"w": 0})
        self.successResultOf(log.append([b"e1"], {"w": 1}, expected_attributes={"w": 0}))
        self.assertIsNotNone(self.io.apply_late()[0].error)
        self.run_clock(1)
        self.assertEqual(self.records(log), [b"e0", b"e1"])

    def test_unconditional_resend_is_stored_twice(self):
        """
        What the expectation prevents: the same resend without it is stored
        a second time after the late message (the test above can fail).
        """
        log = self.log(self.store(timeout=2.0))
        self.successResultOf(log.append([b"e0"], {"w": 0}))
        self.lose_append(log, [b"e1"], {"w": 1}, None)
        self.io.deliver = False
        self.io.apply_late()
        resend = log.append([b"e1"], {"w": 1})
        self.io.deliver = True
        self.run_clock(1)
        self.successResultOf(resend)
        self.assertEqual(self.records(log), [b"e0", b"e1", b"e1"])

    def test_merged_appends_judged_one_by_one(self):
        """
        Appends merged into one message are judged in order: one that no
        longer holds is left out, the others go.
        """
        log = self.log(self.store())
        self.io.hold = True
        a = log.append([b"a"], {"w": 1}, expected_attributes={"w": None})
        b = log.append([b"b"], {"w": 2}, expected_attributes={"w": 1})
        c = log.append([b"c"], {"w": 2}, expected_attributes={"w": 1})
        d = log.append([b"d"], {"v": 1}, expected_attributes={"w": 2})
        self.io.hold = False
        self.io.release()
        self.run_clock(1)
        self.successResultOf(a)
        self.successResultOf(b)
        self.failureResultOf(c, AppendConflict)
        self.successResultOf(d)
        self.assertEqual(self.records(log), [b"a", b"b", b"d"])


class RefusedYetStoredTests(unittest.SynchronousTestCase):
    """
    A refusal is no proof that a message is not stored (doc/reliability.rst,
    finding 22): a stream leader cut off from the others refuses it (its
    count includes the message it could not commit) while a route holds a
    copy that the new leader stores once the partition heals.  The chain
    must recognise that message wherever it learns it, and not send its
    records again.
    """

    setUp = LateMessageTests.setUp
    store = ChainTests.store
    log = ChainTests.log
    records = ChainTests.records
    run_clock = ChainTests.run_clock

    def refused_append(self, deliver):
        """
        C{e0} stored, then C{e1}'s message refused (the refusal held back)
        while its copy is stored (the new leader's); @return: (log, e1's
        Deferred).
        """
        log = self.log(self.store())
        self.successResultOf(log.append([b"e0"]))
        self.io.faults.append("refused-late")
        self.io.hold = True
        self.io.deliver = deliver
        d = log.append([b"e1"])
        self.assertEqual(self.io.apply_late()[0].error, None)   # the new leader's copy
        return log, d

    def refused_then_stored(self, deliver):
        log, d = self.refused_append(deliver)
        self.io.hold = False
        self.io.release()                                        # the stale leader's refusal
        self.io.deliver = True
        self.io.deliver_now()
        self.run_clock(1)
        self.assertEqual(self.successResultOf(d).first_position, 1)
        self.assertEqual(self.records(log), [b"e0", b"e1"])
        self.successResultOf(log.append([b"e2"]))
        self.assertEqual(self.records(log), [b"e0", b"e1", b"e2"])

    def test_found_by_the_read_of_the_tail(self):
        self.refused_then_stored(deliver=False)

    def test_seen_by_the_follower_first(self):
        self.refused_then_stored(deliver=True)

    def test_found_past_a_long_gap(self):
        """
        Another front-end wrote more than the chain reads one by one: the
        read of the tail jumps to the newest snapshot, but still looks at
        the one place where the refused message may stand.
        """
        log, d = self.refused_append(deliver=False)
        other = self.log(self.store())
        self.io.hold = False
        for i in range(70):
            self.successResultOf(other.append([b"x%d" % i]))
        self.io.release()
        self.run_clock(1)
        self.assertEqual(self.successResultOf(d).first_position, 1)
        self.io.deliver = True
        self.io.deliver_now()
        self.assertEqual(self.records(log).count(b"e1"), 1)

    def test_refusals_against_the_tail_wait(self):
        """
        Refused for expecting the very tail the cluster reports (between two
        leaders): the chain waits longer each time rather than asking again
        at once, and the append goes through once the cluster agrees.
        """
        log = self.log(self.store())
        self.io.faults.extend([WRONG_LAST_SEQUENCE] * 6)
        d = log.append([b"e1"])
        self.assertLessEqual(len(self.io.published), 3)     # marker, then one or two tries
        self.run_clock(0.05)
        self.assertLessEqual(len(self.io.published), 5)
        self.run_clock(3)
        self.successResultOf(d)
        self.assertEqual(self.records(log), [b"e1"])


class FakeClusterTestCase(unittest.SynchronousTestCase):
    """Stores (front-ends) on one in-memory JetStream, on a clock."""

    def setUp(self):
        self.clock = Clock()
        self.io = FakeJetStream()

    store = ChainTests.store
    run_clock = ChainTests.run_clock

    def two_front_ends(self, make, name):
        """C{make(store)} on two stores of the cluster; C{name} created through the first."""
        a = make(self.store(connection_name="a"))
        b = make(self.store(connection_name="b"))
        self.successResultOf(a.create(name))
        return a, b


class PravegaWriterTests(FakeClusterTestCase):
    """
    The Pravega segment store's writers on the chain: the scenario a leader
    kill produced in CI (an event stored twice), played deterministically.
    """


    def segment(self, segments, name):
        return self.successResultOf(segments.get(name))

    def test_resent_event_stored_once(self):
        import uuid

        from streamproto.pravega.codec import NULL_EVENT_NUMBER
        from streamproto.pravega.segments import SegmentStore
        segments = SegmentStore(self.store(timeout=2.0))
        name = "scope/stream/0.#epoch.0"
        self.successResultOf(segments.create(name))
        writer = uuid.uuid4()
        seg = self.segment(segments, name)
        self.successResultOf(seg.append(b"event 1", writer, 1))
        # event 2: the acknowledgement times out and the append fails...
        self.io.faults.append("late")
        self.io.down = True
        d = seg.append(b"event 2", writer, 2)
        self.run_clock(3)
        self.failureResultOf(d, StoreUnavailable)
        self.io.down = False
        self.run_clock(2)
        # ...the writer sets up again (a new connection, the segment
        # reopened) on the event number the front-end knows...
        seg = self.segment(segments, name)
        self.assertEqual(seg.durable_event_number(writer, NULL_EVENT_NUMBER), 1)
        # ...and resends event 2 while the new leader applies the old one
        self.io.deliver = False
        self.io.apply_late()
        resent = seg.append(b"event 2", writer, 2)
        self.io.deliver = True
        self.run_clock(1)
        self.failureResultOf(resent, AppendConflict)
        # set up again: event 2 is there, the writer's resend is a duplicate
        seg = self.segment(segments, name)
        self.assertEqual(seg.durable_event_number(writer, NULL_EVENT_NUMBER), 2)
        stored = b""
        while len(stored) < seg.info()["write_offset"]:
            data, _at_tail, _end = self.successResultOf(seg.read(len(stored), 1 << 20))
            stored += bytes(data)
        self.assertEqual(stored, b"event 1event 2")


class PravegaConditionalAcrossFrontEndsTests(FakeClusterTestCase):
    """
    Pravega's ConditionalAppend (by segment length) through two front-ends
    of one cluster: judged by the cluster, never on one front-end's stale
    view.
    """

    NAME = "scope/stream/0.#epoch.0"


    def front_ends(self):
        from streamproto.pravega.segments import SegmentStore
        a, b = self.two_front_ends(SegmentStore, self.NAME)
        return (self.successResultOf(a.get(self.NAME)),
                self.successResultOf(b.get(self.NAME)))

    def test_other_front_ends_appends_seen(self):
        """B, idle, checks a condition against the length A made."""
        import uuid

        from streamproto.pravega.segments import BadOffset
        seg_a, seg_b = self.front_ends()
        self.assertEqual(self.successResultOf(seg_a.append(b"12345", uuid.uuid4(), 1, 0)), 5)
        self.run_clock(0.5)
        self.failureResultOf(seg_b.append(b"late", uuid.uuid4(), 1, 0), BadOffset)
        self.assertEqual(self.successResultOf(seg_b.append(b"678", uuid.uuid4(), 1, 5)), 8)
        self.run_clock(0.5)
        self.assertEqual(seg_a.log_.end_offset, 8)

    def test_racing_conditions_one_wins(self):
        """
        Both front-ends see length 0 and take a ConditionalAppend at 0 at
        the same moment: the cluster stores exactly one, the other fails
        with BadOffset (ConditionalCheckFailed), and neither segment fails.
        """
        import uuid

        from streamproto.pravega.segments import BadOffset
        seg_a, seg_b = self.front_ends()
        self.io.hold = True
        da = seg_a.append(b"from a", uuid.uuid4(), 1, 0)
        db = seg_b.append(b"from b", uuid.uuid4(), 1, 0)
        for _ in range(20):
            self.io.release()
            self.run_clock(0.2)
        results = [self.successResultOf(d) if d.called and not isinstance(d.result, Failure)
                   else None for d in (da, db)]
        winners = [r for r in results if r is not None]
        self.assertEqual(winners, [6])
        loser = db if results[0] is not None else da
        self.failureResultOf(loser, BadOffset)
        self.assertIsNone(seg_a.failed)
        self.assertIsNone(seg_b.failed)
        # both go on from the cluster's length
        self.io.hold = False
        self.run_clock(0.5)
        self.assertEqual(self.successResultOf(seg_b.append(b"!", uuid.uuid4(), 1, 6)), 7)
        self.run_clock(0.5)
        self.assertEqual(self.successResultOf(seg_a.append(b"?", uuid.uuid4(), 1, 7)), 8)


class PravegaTablesAcrossFrontEndsTests(FakeClusterTestCase):
    """A Pravega table segment served by two front-ends of one cluster."""

    NAME = "scope/_tables/kvt.#epoch.0"


    def front_ends(self):
        from streamproto.pravega.tables import TableStore
        return self.two_front_ends(TableStore, self.NAME)

    def table(self, tables):
        return self.successResultOf(tables.get(self.NAME))

    def test_each_sees_the_others_updates(self):
        from streamproto.pravega.codec import TableKey
        a, b = self.front_ends()
        (v1,) = self.successResultOf(self.table(a).update([(TableKey(b"k", TableKey.NOT_EXISTS),
                                                            b"one")]))
        self.run_clock(0.5)
        self.assertEqual(self.table(b).read([TableKey(b"k", TableKey.NO_VERSION)]),
                         [(TableKey(b"k", v1), b"one")])
        (v2,) = self.successResultOf(self.table(b).update([(TableKey(b"k", v1), b"two")]))
        self.assertGreater(v2, v1)
        self.run_clock(0.5)
        self.assertEqual(self.table(a).read([TableKey(b"k", TableKey.NO_VERSION)]),
                         [(TableKey(b"k", v2), b"two")])
        # the stale version is refused by A too, which applied B's update
        from streamproto.pravega.tables import KeyBadVersion
        self.failureResultOf(self.table(a).update([(TableKey(b"k", v1), b"three")]),
                             KeyBadVersion)

    def test_racing_updates_of_one_version(self):
        """
        Both front-ends update key k from the same version at the same
        moment: one is stored, the other fails with KeyBadVersion once its
        front-end has applied the winner's record.
        """
        from streamproto.pravega.codec import TableKey
        from streamproto.pravega.tables import KeyBadVersion
        a, b = self.front_ends()
        (v1,) = self.successResultOf(self.table(a).update([(TableKey(b"k", TableKey.NOT_EXISTS),
                                                            b"one")]))
        self.run_clock(0.5)
        table_a, table_b = self.table(a), self.table(b)
        self.io.hold = True
        da = table_a.update([(TableKey(b"k", v1), b"from a")])
        db = table_b.update([(TableKey(b"k", v1), b"from b")])
        for _ in range(20):
            self.io.release()
            self.run_clock(0.2)
        self.io.hold = False
        self.run_clock(0.5)
        outcomes = [isinstance(d.result, Failure) for d in (da, db)]
        self.assertEqual(sorted(outcomes), [False, True])
        winner, loser = (da, db) if not outcomes[0] else (db, da)
        self.failureResultOf(loser, KeyBadVersion)
        (v2,) = self.successResultOf(winner)
        value = b"from a" if winner is da else b"from b"
        for tables in (a, b):
            self.assertEqual(self.table(tables).read([TableKey(b"k", TableKey.NO_VERSION)]),
                             [(TableKey(b"k", v2), value)])


class SteppedClock(Clock):
    """
    A real reactor's clock: C{seconds()} is the wall clock, which a step
    (NTP, an operator) moves at once, firing whatever is due by it;
    C{monotonic()} only moves with time passing (L{advance}).
    """

    def __init__(self):
        super().__init__()
        self.elapsed = 0.0

    def advance(self, amount):
        self.elapsed += amount
        super().advance(amount)

    def step(self, amount):
        self.rightNow += amount
        super().advance(0)

    def monotonic(self):
        return self.elapsed


class ClockStepTests(unittest.SynchronousTestCase):
    """
    Steps of the wall clock, forward and back: the store measures its
    deadlines, ages and rate limits on monotonic time, so a step neither
    fails appends in flight (whose messages the quorum then stores: a
    refusal whose record is there) nor stops retention for the length of
    the step.
    """

    def setUp(self):
        self.clock = SteppedClock()
        self.io = FakeJetStream()

    def store(self):
        store = JetStreamLogStore(["nats://fake:4222"], prefix="t", clock=self.clock,
                                  bridge=InlineBridge(), io=self.io, retention_interval=None,
                                  timeout=10.0, monotonic=self.clock.monotonic)
        self.successResultOf(store.start())
        self.addCleanup(store.close)
        return store

    def test_forward_step_does_not_fail_appends_in_flight(self):
        log = self.successResultOf(self.store().get_or_create("events"))
        self.io.hold = True
        d = log.append([b"in flight"])
        self.clock.step(3600)
        self.clock.advance(1.0)
        self.assertNoResult(d)
        self.io.release()
        self.assertEqual(self.successResultOf(d).first_position, 0)

    def test_appends_still_fail_within_the_timeout(self):
        """Durations still pass: an outage fails an append after the timeout."""
        log = self.successResultOf(self.store().get_or_create("events"))
        self.io.down = True
        d = log.append([b"during"])
        self.clock.step(3600)
        self.clock.advance(5.0)
        self.assertNoResult(d)
        for _ in range(120):
            self.clock.advance(0.05)
        self.failureResultOf(d, StoreUnavailable)

    def test_backward_step_does_not_stop_retention(self):
        from streamproto.log.config import LogConfig
        store = self.store()
        log = self.successResultOf(store.create("events", LogConfig(log_max_count=10)))
        for i in range(5):
            self.successResultOf(log.append([b"r%d" % i] * 10))
            self.clock.advance(2.0)
        first = log.start_position
        self.assertGreater(first, 0)
        self.clock.step(-3600)
        for i in range(5):
            self.successResultOf(log.append([b"s%d" % i] * 10))
            self.clock.advance(2.0)
        self.assertGreaterEqual(log.start_position, log.end_position - 20)


class NewStreamTests(unittest.SynchronousTestCase):
    """
    A log's first marker on a stream just added: until the stream's
    replicas elect a leader its publishes are answered "no responders"
    (seen in CI right after a cluster started), so the marker is sent
    again, paced on the client's loop, until the store's timeout.
    """

    def setUp(self):
        self.clock = Clock()
        self.io = FakeJetStream()

    store = ChainTests.store

    def markers(self):
        (stream,) = self.io.streams.values()
        return [m for m in stream.messages.values() if m[0].endswith(".m")]

    def test_create_waits_for_the_stream_leader(self):
        self.io.faults.extend(["timeout"] * 3)
        log = self.successResultOf(self.store().create("events"))
        self.assertEqual(self.io.paused, [0.05, 0.1, 0.2])
        self.assertEqual(len(self.markers()), 1)
        self.successResultOf(log.append([b"a"]))
        self.assertEqual((log.start_position, log.end_position), (0, 1))

    def test_own_marker_whose_answer_was_lost(self):
        """
        A marker stored though its answer was lost comes back as a
        duplicate of this create's own message id: the create succeeds
        (it is not another front-end's log), one marker stored.
        """
        self.io.faults.append("lose-ack")
        self.successResultOf(self.store().create("events"))
        self.assertEqual(len(self.io.paused), 1)
        self.assertEqual(len(self.markers()), 1)

    def test_another_writers_marker(self):
        """
        Two front-ends adding the same stream at once both pass
        C{add_stream}; the marker decides: the second's comes back as a
        wrong last sequence, not raised by the marker's writer, and
        C{create} calls it an existing log.
        """
        from streamproto.log.jetstream.log import JetStreamLog
        from streamproto.log.config import LogConfig
        from streamproto.log.natsio import WRONG_LAST_SEQUENCE
        a, b = self.store(), self.store()
        self.successResultOf(a.create("events"))
        outcome = self.successResultOf(JetStreamLog(b, "events", LogConfig())._write_init())
        self.assertEqual(outcome.error.err_code, WRONG_LAST_SEQUENCE)
        self.assertEqual(len(self.markers()), 1)

    def test_no_leader_within_the_timeout(self):
        """No leader for longer than the timeout: the create fails as unavailable."""
        self.io.faults.extend(["timeout"] * 1000)
        self.failureResultOf(self.store(timeout=2.0).create("events"), StoreUnavailable)
        self.assertLessEqual(sum(self.io.paused), 2.0)
        self.assertGreater(sum(self.io.paused), 1.0)

    def test_opening_a_stream_without_its_marker(self):
        """
        A stream left without its marker (its creator gone before the
        leader was elected) is finished by the next front-end opening it,
        as patiently.
        """
        now = [1_800_000_000.0]
        self.io.wall = lambda: now[0]
        self.io.faults.extend(["timeout"] * 1000)
        self.failureResultOf(self.store(timeout=1.0).create("events"), StoreUnavailable)
        self.assertEqual(self.markers(), [])
        self.io.faults.clear()
        other = self.store()
        # its creator may still be writing it: not there yet, and left alone
        self.failureResultOf(other.get("events"), LogNotFound)
        self.assertEqual(self.markers(), [])
        now[0] += 10.5
        self.io.faults.extend(["timeout"] * 2)
        log = self.successResultOf(other.get("events"))
        self.assertEqual(len(self.markers()), 1)
        self.successResultOf(log.append([b"a"]))
        self.assertEqual(log.end_position, 1)

    def test_placement_refused_for_a_moment(self):
        """
        "No suitable peers for placement" (a peer the meta leader sees
        offline for a moment; seen in CI on a loaded machine): the stream
        is asked for again, within the timeout.
        """
        from streamproto.log.natsio import NO_SUITABLE_PEERS
        self.io.add_stream_faults.extend([NO_SUITABLE_PEERS] * 3)
        log = self.successResultOf(self.store().create("events"))
        self.assertEqual(len(self.io.added), 4)
        self.assertEqual(self.io.paused, [0.05, 0.1, 0.2])
        self.successResultOf(log.append([b"a"]))

    def test_placement_never_met(self):
        """A placement refused for longer than the timeout fails the create, as unavailable."""
        from streamproto.log.natsio import NO_SUITABLE_PEERS
        self.io.add_stream_faults.extend([NO_SUITABLE_PEERS] * 1000)
        failure = self.failureResultOf(self.store(timeout=2.0).create("events"),
                                       StoreUnavailable)
        self.assertIn("refused", failure.getErrorMessage())
        self.assertLessEqual(sum(self.io.paused), 2.0)

    def test_other_refusals_not_asked_again(self):
        """Any other refusal of the stream is the create's answer at once."""
        self.io.add_stream_faults.append(10052)
        self.failureResultOf(self.store().create("events"), StoreUnavailable)
        self.assertEqual(len(self.io.added), 1)
        self.assertEqual(self.io.paused, [])

    def test_reader_leaves_a_new_stream_to_its_creator(self):
        """
        A reader opening a log whose stream was just added, its marker not
        written yet (its creator is still at it), finds no log and writes
        nothing: a marker of the reader's first made that create fail as
        "exists" (seen in CI with the store copy).  get_or_create, a
        creator too, writes the marker.
        """
        now = [1_800_000_000.0]
        self.io.wall = lambda: now[0]
        creator, reader = self.store(), self.store()
        self.io.faults.extend(["timeout"] * 1000)
        self.failureResultOf(creator.create("events"), StoreUnavailable)
        self.io.faults.clear()
        self.failureResultOf(reader.get("events"), LogNotFound)
        self.assertEqual(self.markers(), [])
        log = self.successResultOf(reader.get_or_create("events"))
        self.assertEqual(len(self.markers()), 1)
        self.successResultOf(log.append([b"a"]))
        self.assertEqual(self.successResultOf(creator.get("events")).end_position, 1)


class OpenPatientlyTests(unittest.SynchronousTestCase):
    """
    Opening a log (C{get}, C{get_or_create}) is asked again while the
    cluster has no meta leader (elections after a restart, a loaded
    machine), with the same pauses as a new stream's first marker
    (L{streamproto.log.jetstream.common.Patience}), up to the timeout.
    """

    def setUp(self):
        self.clock = Clock()
        self.io = FakeJetStream()

    store = ChainTests.store

    def test_get_waits_for_a_meta_leader(self):
        store = self.store()
        self.successResultOf(store.create("events"))
        self.io.paused.clear()
        self.io.info_unavailable = 3
        self.successResultOf(self.store().get("events"))
        self.assertEqual(self.io.paused, [0.05, 0.1, 0.2])

    def test_get_or_create_too(self):
        self.io.info_unavailable = 2
        self.successResultOf(self.store().get_or_create("events"))
        self.assertEqual(self.io.paused[:2], [0.05, 0.1])

    def test_no_meta_leader_within_the_timeout(self):
        from streamproto.log.errors import StoreUnavailable
        store = self.store(timeout=2.0)
        self.io.info_unavailable = 10 ** 6
        self.failureResultOf(store.get("events"), StoreUnavailable)
        self.assertLessEqual(sum(self.io.paused), 2.0)
        self.assertGreater(sum(self.io.paused), 1.0)
