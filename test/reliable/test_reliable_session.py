"""Session stores: one behaviour suite run against every implementation."""

import os
import sqlite3

from twisted.internet import defer, reactor, task
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface.verify import verifyObject

from streamproto.reliable.errors import OutOfOrderAck, UnknownMessageID, UnknownSession
from streamproto.reliable.session import (
    ISessionStore,
    MemorySessionStore,
    Message,
    SQLiteSessionStore,
)

EXPIRY = 30.0


def counting(state):
    """A transformer: data is the new counter, the state keeps a history."""
    n = state["n"] + 1
    return {"value": n}, {**state, "n": n, "seen": state["seen"] + [n]}


def exploding(state):
    raise ZeroDivisionError("transformer failed")


class SessionStoreTestsMixin:
    """Subclasses define make_store(clock) and get self.clock = task.Clock()."""

    timeout = 20

    def setUp(self):
        self.clock = task.Clock()
        self.store = self.make_store()

    @defer.inlineCallbacks
    def put_n(self, uuid, n):
        out = []
        for _ in range(n):
            out.append((yield self.store.put(uuid, counting)))
        return out

    def test_interface(self):
        self.assertTrue(verifyObject(ISessionStore, self.store))

    @defer.inlineCallbacks
    def test_closed_and_failure_say_what_ready_reports(self):
        # /ready reads them on every store (reliable.tap.SessionStoreHealth)
        self.assertIs(self.store.closed, False)
        self.assertIsNone(self.store.failure)
        yield self.store.close()
        self.assertIs(self.store.closed, True)
        self.assertIsNone(self.store.failure)

    @defer.inlineCallbacks
    def test_put_numbers_messages_and_threads_state(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        messages = yield self.put_n("a", 3)
        self.assertEqual(messages, [Message(1, {"value": 1}), Message(2, {"value": 2}),
                                    Message(3, {"value": 3})])
        # concurrent puts are applied in order
        more = yield defer.gatherResults([self.store.put("a", counting) for _ in range(5)])
        self.assertEqual([m.id for m in more], [4, 5, 6, 7, 8])
        self.assertEqual([m.data["value"] for m in more], [4, 5, 6, 7, 8])

    @defer.inlineCallbacks
    def test_unknown_session(self):
        for call in (lambda: self.store.put("nobody", counting),
                     lambda: self.store.after("nobody", 0),
                     lambda: self.store.ack("nobody", 0),
                     lambda: self.store.disconnect("nobody")):
            yield self.assertFailure(call(), UnknownSession)

    @defer.inlineCallbacks
    def test_after(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        self.assertIsNone((yield self.store.after("a", 0)))
        yield self.put_n("a", 3)
        self.assertEqual((yield self.store.after("a", 0)), Message(1, {"value": 1}))
        self.assertEqual((yield self.store.after("a", 2)), Message(3, {"value": 3}))
        self.assertIsNone((yield self.store.after("a", 3)))
        yield self.assertFailure(self.store.after("a", 4), UnknownMessageID)

    @defer.inlineCallbacks
    def test_ack(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.put_n("a", 4)
        yield self.store.ack("a", 2)
        yield self.store.ack("a", 2)  # the same ack again is harmless
        self.assertEqual((yield self.store.after("a", 2)), Message(3, {"value": 3}))
        yield self.assertFailure(self.store.after("a", 1), OutOfOrderAck)
        yield self.assertFailure(self.store.ack("a", 1), OutOfOrderAck)
        yield self.assertFailure(self.store.ack("a", 5), UnknownMessageID)
        yield self.store.ack("a", 4)
        self.assertIsNone((yield self.store.after("a", 4)))
        # the id keeps counting after everything was acknowledged
        self.assertEqual((yield self.store.put("a", counting)).id, 5)

    @defer.inlineCallbacks
    def test_ack_zero_is_an_ack(self):
        # the reference treats 0 as absent; it is a valid id to resume after
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.store.ack("a", 0)
        yield self.assertFailure(self.store.ack("a", 1), UnknownMessageID)

    @defer.inlineCallbacks
    def test_failing_transformer_changes_nothing(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.put_n("a", 1)
        yield self.assertFailure(self.store.put("a", exploding), ZeroDivisionError)
        message = yield self.store.put("a", counting)
        self.assertEqual(message, Message(2, {"value": 2}))

    @defer.inlineCallbacks
    def test_register_replaces(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.put_n("a", 3)
        yield self.store.register("a", {"n": 100, "seen": []})
        self.assertIsNone((yield self.store.after("a", 0)))
        self.assertEqual((yield self.store.put("a", counting)), Message(1, {"value": 101}))

    @defer.inlineCallbacks
    def test_sessions_are_independent(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.store.register("b", {"n": 50, "seen": []})
        a, b = yield defer.gatherResults([self.store.put("a", counting),
                                          self.store.put("b", counting)])
        self.assertEqual((a, b), (Message(1, {"value": 1}), Message(1, {"value": 51})))

    @defer.inlineCallbacks
    def test_expiry_after_disconnect(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.store.disconnect("a")
        self.clock.advance(EXPIRY - 1)
        self.assertIsNone((yield self.store.after("a", 0)))  # taken up again: timer off
        self.clock.advance(EXPIRY * 2)
        self.assertIsNone((yield self.store.after("a", 0)))
        yield self.store.disconnect("a")
        self.clock.advance(EXPIRY - 0.5)
        self.assertIn("a", self.store)
        self.clock.advance(1)
        self.assertNotIn("a", self.store)
        yield self.assertFailure(self.store.after("a", 0), UnknownSession)

    @defer.inlineCallbacks
    def test_every_disconnect_arms_expiry(self):
        # the reference only ever armed the first timer
        for uuid in ("a", "b", "c"):
            yield self.store.register(uuid, {"n": 0, "seen": []})
        for _ in range(3):
            yield self.store.ack("a", 0)
            yield self.store.disconnect("a")
            self.clock.advance(1)
        yield self.store.disconnect("b")
        yield self.store.disconnect("c")
        self.clock.advance(EXPIRY)
        for uuid in ("a", "b", "c"):
            self.assertNotIn(uuid, self.store)


class MemorySessionStoreTests(SessionStoreTestsMixin, TestCase):
    def make_store(self):
        return MemorySessionStore(self.clock, expiry=EXPIRY)


def crash(store):
    """Stop a SQLite store the way a kill would: nothing queued is committed."""
    if store._flush_call is not None:
        store._flush_call.cancel()
        store._flush_call = None
    reactor.removeSystemEventTrigger(store._shutdown_trigger)
    store._closed = True
    store._pool.stop()
    store._db.close()
    store._table.cancel_timers()


class SQLiteSessionStoreTests(SessionStoreTestsMixin, TestCase):
    def make_store(self):
        self.path = os.path.join(self.mktemp(), "sessions.sqlite")
        return self.open()

    def open(self):
        store = SQLiteSessionStore(self.path, clock=self.clock, expiry=EXPIRY)
        self.addCleanup(store.close)
        return store

    @defer.inlineCallbacks
    def test_reopen_continues_exactly(self):
        yield self.store.register("a", {"n": 0, "seen": [], "nested": {"x": [1, None]}})
        yield self.put_n("a", 5)
        yield self.store.ack("a", 2)
        yield self.store.close()
        store = self.open()
        self.assertEqual((yield store.after("a", 2)), Message(3, {"value": 3}))
        yield self.assertFailure(store.after("a", 1), OutOfOrderAck)
        message = yield store.put("a", counting)
        self.assertEqual(message, Message(6, {"value": 6}))
        self.assertEqual(store._table.sessions["a"].state["seen"], [1, 2, 3, 4, 5, 6])
        self.assertEqual(store._table.sessions["a"].state["nested"], {"x": [1, None]})

    def test_commit_is_synced(self):
        """
        WAL with synchronous=FULL: each commit syncs the WAL before the
        store's Deferred fires.  NORMAL would sync only at checkpoints, so
        an acknowledged message would not survive a power cut (the fault
        matrix's reliable power-loss row loses ~1,100-1,800 messages a
        run with it).
        """
        db = self.store._db
        self.assertEqual(db.execute("PRAGMA journal_mode").fetchone(), ("wal",))
        self.assertEqual(db.execute("PRAGMA synchronous").fetchone(), (2,))   # FULL

    @defer.inlineCallbacks
    def test_put_fires_after_commit(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        seen = []

        def look(message):
            # another connection sees the row as soon as the Deferred fires
            db = sqlite3.connect(self.path)
            try:
                seen.append(db.execute("SELECT m.data, s.last_id, s.state FROM messages m "
                                       "JOIN sessions s USING (uuid) WHERE id = ?",
                                       (message.id,)).fetchone())
            finally:
                db.close()
            return message
        yield self.store.put("a", counting).addCallback(look)
        self.assertEqual(seen, [('{"value":1}', 1, '{"n":1,"seen":[1]}')])

    @defer.inlineCallbacks
    def test_crash_keeps_message_and_state_together(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.put_n("a", 3)
        # queued but never committed: a kill loses the message AND its state
        lost = self.store.put("a", counting)
        crash(self.store)
        self.assertNoResult(lost)
        store = self.open()
        self.assertIsNone((yield store.after("a", 3)))
        self.assertEqual((yield store.put("a", counting)), Message(4, {"value": 4}))

    @defer.inlineCallbacks
    def test_expiry_survives_restart(self):
        yield self.store.register("a", {"n": 0, "seen": []})
        yield self.store.register("b", {"n": 0, "seen": []})
        yield self.store.disconnect("a")
        self.clock.advance(20)
        yield self.store.close()
        store = self.open()
        # a was disconnected 20 s ago; b was still connected: a full expiry from now
        self.clock.advance(EXPIRY - 20 + 0.5)
        self.assertNotIn("a", store)
        self.assertIn("b", store)
        self.clock.advance(20)
        self.assertNotIn("b", store)
        yield store.close()
        self.assertEqual(self.open()._table.sessions, {})


class JetStreamSessionStoreTests(SessionStoreTestsMixin, TestCase):
    """The same suite on a real three-node JetStream cluster (a key-value bucket)."""

    timeout = 60

    def make_store(self):
        from test.support.natsutil import shared_cluster, unique_prefix
        self.cluster = shared_cluster()
        self.prefix = unique_prefix(self)
        return self.open()

    def open(self, monotonic=None):
        from streamproto.reliable.natsessions import JetStreamSessionStore
        store = JetStreamSessionStore(self.cluster.urls, clock=self.clock, expiry=EXPIRY,
                                      prefix=self.prefix, monotonic=monotonic)
        self.addCleanup(store.close)
        return store

    @defer.inlineCallbacks
    def test_wall_clock_step_forward(self):
        """
        This front-end's wall clock steps forward past the expiry while a
        session is away: its timer fires at once and its wall-time age is
        past the expiry, yet the session is due on the monotonic clock only.
        """
        mono = [0.0]
        store = self.open(monotonic=lambda: mono[0])
        yield store.register("w", {"n": 0, "seen": []})
        yield store.put("w", counting)
        yield store.disconnect("w")
        mono[0] += 1
        self.clock.advance(EXPIRY * 10)      # the step (the sweep runs too)
        self.assertIn("w", store)
        self.assertEqual((yield store.after("w", 0)), Message(1, {"value": 1}))
        yield store.disconnect("w")
        mono[0] += EXPIRY
        self.clock.advance(EXPIRY)
        self.assertNotIn("w", store)

    @defer.inlineCallbacks
    def test_resumes_on_another_front_end(self):
        """
        A session written through one store (front-end A) goes on through
        another on the same cluster (front-end B), exactly where it was.
        """
        yield self.store.register("s", {"n": 0, "seen": []})
        yield self.put_n("s", 3)
        yield self.store.ack("s", 1)
        yield self.store.disconnect("s")
        b = self.open()
        self.assertEqual((yield b.after("s", 1)), Message(2, {"value": 2}))
        self.assertEqual((yield b.put("s", counting)), Message(4, {"value": 4}))
        yield self.assertFailure(b.after("s", 0), OutOfOrderAck)
        yield b.disconnect("s")
        # and back on A, which held an older image: it reads the newer one
        self.assertEqual((yield self.store.after("s", 3)), Message(4, {"value": 4}))
        self.assertEqual((yield self.store.put("s", counting)), Message(5, {"value": 5}))
        yield self.store.disconnect("s")
        self.assertEqual((yield b.after("s", 4)), Message(5, {"value": 5}))

    @defer.inlineCallbacks
    def test_conflict_retries_on_a_stopped_clock(self):
        """
        A front-end whose image is stale loses its compare-and-set, waits a
        moment and tries again.  The wait is real time: the store's clock
        (here a Clock nobody advances) times only the expiry, so a retry
        behind it would never come.
        """
        yield self.store.register("c", {"n": 0, "seen": []})
        yield self.store.put("c", counting)          # this front-end holds revision 2
        b = self.open()
        self.assertEqual((yield b.put("c", counting)), Message(2, {"value": 2}))
        # the image held here is now stale: the first write conflicts
        self.assertEqual((yield self.store.put("c", counting)), Message(3, {"value": 3}))

    @defer.inlineCallbacks
    def test_racing_front_ends_do_not_overwrite(self):
        """Puts through two front-ends at once: every id once, in order, no state lost."""
        yield self.store.register("r", {"n": 0, "seen": []})
        b = self.open()
        messages = yield defer.gatherResults(
            [self.store.put("r", counting) for _ in range(5)]
            + [b.put("r", counting) for _ in range(5)])
        self.assertEqual(sorted(m.id for m in messages), list(range(1, 11)))
        self.assertEqual(sorted(m.data["value"] for m in messages), list(range(1, 11)))
        c = self.open()
        self.assertEqual((yield c.put("r", counting)), Message(11, {"value": 11}))

    @defer.inlineCallbacks
    def test_expired_elsewhere(self):
        """A session left by a front-end that went away expires for the others."""
        yield self.store.register("gone", {"n": 0, "seen": []})
        yield self.store.disconnect("gone")
        b = self.open()
        self.clock.advance(EXPIRY + 1)
        yield self.assertFailure(b.after("gone", 0), UnknownSession)

    @defer.inlineCallbacks
    def test_unreachable_cluster(self):
        from streamproto.reliable.errors import StoreFailed
        from streamproto.reliable.natsessions import JetStreamSessionStore
        from test.support.netutil import free_port
        store = JetStreamSessionStore([f"nats://127.0.0.1:{free_port()}"], clock=self.clock,
                                      expiry=EXPIRY)
        self.addCleanup(store.close)
        yield self.assertFailure(store.register("x", {}), StoreFailed)


class WallClockStepTests(SynchronousTestCase):
    """
    The reactor's timers follow the wall clock: a forward step of it fires
    a detached session's expiry timer at once.  The session must outlive
    that: its deadline is on the monotonic clock, which did not jump.
    """

    def setUp(self):
        self.wall = task.Clock()      # the reactor: seconds() is the wall clock
        self.mono = [0.0]             # the monotonic clock's stand-in
        self.store = MemorySessionStore(self.wall, expiry=EXPIRY,
                                        monotonic=lambda: self.mono[0])
        self.successResultOf(self.store.register("a", {"n": 0, "seen": []}))
        self.successResultOf(self.store.disconnect("a"))

    def elapse(self, seconds):
        """Time passes: both clocks move."""
        self.mono[0] += seconds
        self.wall.advance(seconds)

    def test_forward_step_does_not_expire(self):
        self.elapse(1)
        self.wall.advance(3600)    # the wall clock steps an hour forward
        self.assertIn("a", self.store)
        self.successResultOf(self.store.after("a", 0))   # still resumable

    def test_expires_on_monotonic_deadline(self):
        self.elapse(1)
        self.wall.advance(3600)
        self.elapse(EXPIRY - 1.5)
        self.assertIn("a", self.store)
        self.elapse(1)
        self.assertNotIn("a", self.store)

    def test_backward_step_then_back(self):
        # set back, then forward again (what NTP or a faked clock does):
        # the timer armed meanwhile fires at the forward step
        self.elapse(1)
        self.successResultOf(self.store.after("a", 0))
        self.successResultOf(self.store.disconnect("a"))
        self.wall.advance(1218)
        self.assertIn("a", self.store)
        self.elapse(EXPIRY)
        self.assertNotIn("a", self.store)
