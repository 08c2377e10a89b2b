"""
Messages on one connection take effect in arrival order: a resume (C{state})
followed in the same write by an C{ack}, on the memory and the SQLite
session stores; and sessions that outlast a reconnecting client's backoff.
"""

import json
import os
import random

from twisted.internet import defer, reactor, task
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from streamproto.reliable import server as server_module
from streamproto.reliable.session import DEFAULT_EXPIRY, MemorySessionStore, SQLiteSessionStore
from streamproto.reliable.tap import Options
from test.reliable.test_reliable_server import U, Connection, TurnClock, crc_of


#: messages of the sessions in these tests: more than a connection gets before it stops reading
COUNT = 1000


def line(message):
    return json.dumps(message).encode() + b"\n"


class OrderScenarios:
    """
    The scenarios, for any store: C{self.settle()} returns a Deferred (or
    None) that fires once the store's work has come back.
    """

    @defer.inlineCallbacks
    def start_session(self, count=COUNT, first=20):
        """
        A session whose connection got at least C{first} messages and then
        stopped reading (so the rest is not generated yet).  Fires with
        (factory, connection, the messages it got).
        """
        factory = self.make_factory(turn_batch=first, window=first)
        c = Connection(self, factory)
        c.send({"uuid": U, "params": {"count": count}})
        yield self.settle_until(lambda: len(c.transport.value().splitlines()) >= first)
        c.proto.pauseProducing()
        # the puts in flight finish and go out
        yield self.settle_until(lambda: c.proto._in_flight == 0)
        yield self.settle()
        return factory, c, c.messages()

    @defer.inlineCallbacks
    def resume_then_ack(self, ack_id, close_first):
        """
        A session got ids 1..20; a new connection sends C{state: 16} and
        C{ack: ack_id} in one write.  C{close_first}: the old connection is
        gone before (else it is still open: the takeover path).
        """
        factory, c, first = yield self.start_session()
        sent = len(first)
        self.assertEqual([m["id"] for m in first], list(range(1, sent + 1)))
        if close_first:
            c.close()
            yield self.settle()
        d = Connection(self, factory)
        d.proto.dataReceived(line({"uuid": U, "state": 16}) + line({"uuid": U, "ack": ack_id}))
        if not close_first:
            self.assertTrue(c.transport.disconnecting, "the older connection is cut")
            c.close()
        yield self.settle_until(lambda: d.closed)
        rest = d.messages()
        self.assertNotIn("error", rest[-1], rest[-1])
        self.assertEqual([m["id"] for m in rest], list(range(17, COUNT + 1)))
        self.assertEqual(rest[:sent - 16], first[16:], "the replay is the first delivery")
        values = [m["data"]["value"] for m in first[:16] + rest]
        self.assertEqual(rest[-1]["data"]["crc"], crc_of(values))

    def test_ack_of_the_resumed_id_in_the_same_write(self):
        return self.resume_then_ack(16, close_first=True)

    def test_ack_of_a_later_id_the_session_sent(self):
        return self.resume_then_ack(19, close_first=True)

    def test_ack_behind_a_takeover(self):
        return self.resume_then_ack(16, close_first=False)

    def test_later_ack_behind_a_takeover(self):
        return self.resume_then_ack(20, close_first=False)

    @defer.inlineCallbacks
    def test_ack_beyond_what_the_session_sent_is_still_an_error(self):
        factory, c, first = yield self.start_session()
        sent = len(first)
        c.close()
        yield self.settle()
        d = Connection(self, factory)
        d.proto.dataReceived(line({"uuid": U, "state": 16})
                             + line({"uuid": U, "ack": sent + 1}))
        yield self.settle_until(lambda: d.closed)
        messages = d.messages()
        self.assertEqual(messages[-1], {"error": "Unknown message ID"})
        # the replay (17..sent) went out before the ack was judged
        self.assertEqual([m["id"] for m in messages[:-1]], list(range(17, sent + 1)))

    @defer.inlineCallbacks
    def test_params_then_ack_in_one_write(self):
        factory = self.make_factory(turn_batch=20, window=20)
        c = Connection(self, factory)
        # an ack of 0 right behind params is judged once the session exists
        c.proto.dataReceived(line({"uuid": U, "params": {"count": 5}})
                             + line({"uuid": U, "ack": 0}))
        yield self.settle_until(lambda: c.closed)
        messages = c.messages()
        self.assertEqual([m["id"] for m in messages], [1, 2, 3, 4, 5])

    @defer.inlineCallbacks
    def test_reading_stops_while_the_first_message_is_handled(self):
        factory, c, _ = yield self.start_session()
        # the old connection stays: the new one waits for it
        d = Connection(self, factory)
        d.proto.dataReceived(line({"uuid": U, "state": 16}) + line({"uuid": U, "ack": 16}))
        self.assertEqual(d.transport.producerState, "paused")
        c.close()
        yield self.settle_until(lambda: d.transport.producerState == "producing"
                                or d.closed)
        self.assertEqual(d.transport.producerState, "producing")
        yield self.settle_until(lambda: d.transport.value())
        self.assertEqual(d.messages()[0]["id"], 17)

    @defer.inlineCallbacks
    def test_too_many_held_messages(self):
        factory, c, _ = yield self.start_session()
        d = Connection(self, factory)
        flood = line({"uuid": U, "ack": 1}) * (server_module.MAX_HELD_MESSAGES + 1)
        d.proto.dataReceived(line({"uuid": U, "state": 10}) + flood)
        self.assertEqual(d.messages(), [{"error": "too many messages before the session was ready"}])
        self.assertTrue(d.closed)


class MemoryStoreOrderTests(OrderScenarios, SynchronousTestCase):
    def setUp(self):
        self.clock = TurnClock()
        self.store = MemorySessionStore(self.clock, expiry=30)

    def make_factory(self, **kwargs):
        return server_module.ReliableStreamFactory(self.store, clock=self.clock,
                                                   rng=random.Random(7), **kwargs)

    def settle(self):
        for _ in range(50):
            self.clock.advance(0)

    def settle_until(self, predicate):
        for _ in range(50):
            if predicate():
                return
            self.clock.advance(0)
        self.assertTrue(predicate(), "condition not reached")

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        # the scenarios are written with inlineCallbacks; on the memory
        # store everything is synchronous, so each must have finished
        if name.startswith("test_") and callable(attribute):
            def synchronous(*args, **kwargs):
                result = attribute(*args, **kwargs)
                if isinstance(result, defer.Deferred):
                    self.successResultOf(result)
            return synchronous
        return attribute


class SQLiteStoreOrderTests(OrderScenarios, TestCase):
    """The same over the durable store: its Deferreds fire after commits, in a thread."""

    timeout = 30

    def setUp(self):
        self.clock = TurnClock()
        path = os.path.join(self.mktemp(), "sessions.sqlite")
        os.makedirs(os.path.dirname(path))
        self.store = SQLiteSessionStore(path, clock=self.clock, expiry=30)
        self.addCleanup(self.store.close)

    def make_factory(self, **kwargs):
        return server_module.ReliableStreamFactory(self.store, clock=self.clock,
                                                   rng=random.Random(7), **kwargs)

    @defer.inlineCallbacks
    def settle(self):
        for _ in range(20):
            self.clock.advance(0)
            yield task.deferLater(reactor, 0.002, lambda: None)

    @defer.inlineCallbacks
    def settle_until(self, predicate, seconds=10.0):
        waited = 0.0
        while not predicate():
            self.assertLess(waited, seconds, "condition not reached")
            self.clock.advance(0)
            yield task.deferLater(reactor, 0.002, lambda: None)
            waited += 0.002


class ExpiryTests(SynchronousTestCase):
    """The default expiry outlasts a client backing off 5, 10, 15... s."""

    def setUp(self):
        self.clock = TurnClock()
        self.store = MemorySessionStore(self.clock)   # the default expiry
        self.factory = server_module.ReliableStreamFactory(
            self.store, clock=self.clock, rng=random.Random(7), turn_batch=10, window=10)
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def away(self, delays):
        """A session got 1..10, then its client was away for the sum of C{delays}."""
        c = Connection(self, self.factory).send({"uuid": U, "params": {"count": 100}})
        self.assertEqual(len(c.messages()), 10)
        c.close()
        for delay in delays:
            # a refused connect: the server never hears of it
            self.clock.advance(delay)
        return Connection(self, self.factory).send({"uuid": U, "state": 10})

    def test_default_is_120_seconds(self):
        self.assertEqual(DEFAULT_EXPIRY, 120.0)
        options = Options()
        options.parseOptions([])
        self.assertEqual(options["expiry"], 120.0)

    def test_the_reference_backoff_keeps_the_session(self):
        # the reference client: 5 s, then 5 s more after each refusal;
        # 5 + 10 + 15 + 20 + 25 + 30 = 105 s away
        d = self.away([5, 10, 15, 20, 25, 30])
        for _ in range(20):
            self.clock.advance(0)
        messages = d.messages()
        self.assertNotIn("error", messages[0])
        self.assertEqual(messages[0]["id"], 11)

    def test_away_longer_than_the_expiry(self):
        d = self.away([5, 10, 15, 20, 25, 30, 16])
        self.assertEqual(d.messages(), [{"error": "Unknown client"}])
        expired = [e for e in self.events if e.get("log_format", "").startswith("session {uuid} expired")]
        self.assertEqual(len(expired), 1)
        event = expired[0]
        self.assertEqual(event["uuid"], U)
        self.assertGreaterEqual(event["away"], 120.0)
        self.assertEqual(event["age"], event["away"])
        self.assertGreaterEqual(event["messages"], 10)
        self.assertEqual(event["acked"], 0)
