"""The server protocol over a StringTransport, with a fake clock: modes and every error path."""

import json
import random
import zlib
from struct import pack

from twisted.internet import defer, task
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from streamproto.reliable.mt19937 import first_random_int
from streamproto.reliable.server import ReliableStreamFactory
from streamproto.reliable.session import MemorySessionStore

U = "bf575c35-c25b-4386-8430-d5e2a93f3b1a"


class TurnClock(task.Clock):
    """
    A fake clock whose advance() runs only the calls due when it starts: a
    callLater(0) made meanwhile waits for the next advance, as it waits for
    the next reactor turn in a real reactor (task.Clock would run it at once
    and never return from a stream that reschedules itself).
    """

    def advance(self, amount):
        self.rightNow += amount
        self._sortCalls()
        due = [call for call in self.calls if call.getTime() <= self.rightNow]
        for call in due:
            if call in self.calls:  # not cancelled by an earlier one
                self.calls.remove(call)
                call.called = 1
                call.func(*call.args, **call.kw)


class Connection:
    def __init__(self, test, factory):
        self.proto = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5000))
        self.transport = StringTransport()
        self.proto.makeConnection(self.transport)
        self.clock = test.clock
        self.read = 0

    def send(self, message):
        line = message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n"
        self.proto.dataReceived(line)
        self.clock.advance(0)
        return self

    def messages(self):
        """Every message received since the last call."""
        data = self.transport.value()
        new, self.read = data[self.read:], len(data)
        return [json.loads(line) for line in new.splitlines()]

    def close(self):
        self.proto.connectionLost(Failure(ConnectionError("gone")))
        self.clock.advance(0)

    @property
    def closed(self):
        return self.transport.disconnecting


def crc_of(values):
    crc = 0
    for v in values:
        crc = zlib.crc32(pack(">I", v), crc)
    return crc


class ServerTestsBase(SynchronousTestCase):
    def setUp(self):
        self.clock = TurnClock()
        self.store = MemorySessionStore(self.clock, expiry=30)
        self.factory = self.make_factory()

    def make_factory(self, **kwargs):
        return ReliableStreamFactory(self.store, clock=self.clock, rng=random.Random(7), **kwargs)

    def connect(self, factory=None):
        return Connection(self, factory or self.factory)

    def pump(self, seconds=0.0, step=None, turns=100):
        """Run C{turns} reactor turns, or C{seconds} of fake time in C{step}s."""
        if seconds:
            for _ in range(round(seconds / step)):
                self.clock.advance(step)
                self.clock.advance(0)
        else:
            for _ in range(turns):
                self.clock.advance(0)

    def assertError(self, connection, text=None):
        messages = connection.messages()
        self.assertTrue(messages, "no message at all")
        self.assertIn("error", messages[-1])
        self.assertIsInstance(messages[-1]["error"], str)
        if text is not None:
            self.assertEqual(messages[-1]["error"], text)
        self.assertTrue(connection.closed, "connection left open after an error")
        return messages[:-1]


class StatelessTests(ServerTestsBase):
    def make_factory(self, **kwargs):
        kwargs.setdefault("turn_batch", 20)
        return super().make_factory(**kwargs)
    def test_new_stream_doubles(self):
        c = self.connect().send({})
        values = [int(m["data"]) for m in c.messages()]
        self.assertGreater(len(values), 10)
        self.assertTrue(1 <= values[0] <= 255)
        self.assertEqual(values, [values[0] << i for i in range(len(values))])
        self.pump(turns=2)
        more = [int(m["data"]) for m in c.messages()]
        self.assertEqual(more[0], values[-1] * 2)
        self.assertFalse(c.closed)

    def test_resume_spec_example(self):
        c = self.connect().send({"state": "23", "unknown": True})
        self.assertEqual([m["data"] for m in c.messages()[:3]], ["46", "92", "184"])

    def test_paused_transport_stops_the_stream(self):
        c = self.connect().send({})
        c.proto.pauseProducing()
        c.messages()
        self.pump(turns=3)
        self.assertEqual(c.messages(), [])
        c.proto.resumeProducing()
        self.pump(turns=3)
        self.assertTrue(c.messages())

    def test_rate(self):
        c = self.connect(self.make_factory(rate=10)).send({})
        self.pump(5.0, 0.05)
        n = len(c.messages())
        self.assertTrue(45 <= n <= 62, n)

    def test_bad_state(self):
        self.assertError(self.connect().send({"state": "12x"}))
        self.assertError(self.connect().send({"state": 12}))

    def test_message_after_start_is_an_error(self):
        c = self.connect().send({})
        c.send({})
        self.assertError(c, "unexpected message in stateless mode")


class StatefulTests(ServerTestsBase):
    def test_spec_stream(self):
        c = self.connect().send({"uuid": U, "params": {"count": 5}})
        messages = c.messages()
        self.assertEqual([m["id"] for m in messages], [1, 2, 3, 4, 5])
        values = [m["data"]["value"] for m in messages]
        for previous, value in zip(values, values[1:]):
            self.assertEqual(first_random_int(previous), value)
        self.assertEqual([("crc" in m["data"]) for m in messages], [False] * 4 + [True])
        self.assertEqual(messages[-1]["data"]["crc"], crc_of(values))
        self.assertTrue(c.closed, "the server closes after the last message")

    def test_resume_replays_identical_messages(self):
        c = self.connect(self.make_factory(turn_batch=40, window=40))
        c.send({"uuid": U, "params": {"count": 300}})
        first = c.messages()
        self.assertEqual(len(first), 40)
        c.send({"uuid": U, "ack": 16})
        c.close()
        d = self.connect().send({"uuid": U, "state": 20})
        self.pump()
        rest = d.messages()
        self.assertEqual(rest[:20], first[20:])
        self.assertEqual([m["id"] for m in rest], list(range(21, 301)))
        values = [m["data"]["value"] for m in first[:20] + rest]
        self.assertEqual(rest[-1]["data"]["crc"], crc_of(values))
        self.assertTrue(d.closed)

    def test_state_zero_is_a_resume(self):
        c = self.connect(self.make_factory(turn_batch=10, window=10))
        c.send({"uuid": U, "params": {"count": 30}})
        first = c.messages()
        c.close()
        d = self.connect().send({"uuid": U, "state": 0})
        self.pump()
        self.assertEqual(d.messages()[:10], first)

    def test_resume_after_the_last_message(self):
        c = self.connect().send({"uuid": U, "params": {"count": 3}})
        self.assertEqual(len(c.messages()), 3)
        c.close()
        d = self.connect().send({"uuid": U, "state": 3})
        self.pump()
        self.assertEqual(d.messages(), [])
        self.assertTrue(d.closed)

    def test_params_again_restarts_the_session(self):
        # the reference client re-sends params when it got nothing yet
        c = self.connect(self.make_factory(turn_batch=5, window=5))
        c.send({"uuid": U, "params": {"count": 100}})
        c.close()
        d = self.connect().send({"uuid": U, "params": {"count": 4}})
        messages = d.messages()
        self.assertEqual([m["id"] for m in messages], [1, 2, 3, 4])
        self.assertIn("crc", messages[-1]["data"])

    def test_takeover(self):
        c = self.connect(self.make_factory(turn_batch=10, window=10))
        c.send({"uuid": U, "params": {"count": 50}})
        first = c.messages()
        d = self.connect(c.proto.factory).send({"uuid": U, "state": 10})
        # the older connection is cut; the new one waits until it is gone
        self.assertTrue(c.transport.disconnecting)
        self.assertEqual(d.messages(), [])
        c.close()
        self.pump()
        rest = d.messages()
        self.assertEqual([m["id"] for m in rest], list(range(11, 51)))
        self.assertEqual(crc_of([m["data"]["value"] for m in first + rest]),
                         rest[-1]["data"]["crc"])

    def test_paused_transport_stops_generation(self):
        c = self.connect(self.make_factory(turn_batch=10, window=10))
        c.proto.pauseProducing()
        c.send({"uuid": U, "params": {"count": 100}})
        self.pump()
        self.assertEqual(c.messages(), [])
        c.proto.resumeProducing()
        self.pump()
        self.assertEqual(len(c.messages()), 100)

    def test_stalled_reader_is_cut(self):
        c = self.connect(self.make_factory(stall_timeout=60))
        c.send({"uuid": U, "params": {"count": 1000}})
        c.proto.pauseProducing()
        self.clock.advance(59)
        c.proto.resumeProducing()
        c.proto.pauseProducing()
        self.clock.advance(59)
        self.assertFalse(c.closed)
        self.clock.advance(2)
        self.assertTrue(c.closed)

    def test_rate(self):
        c = self.connect(self.make_factory(rate=100))
        c.send({"uuid": U, "params": {"count": 1000}})
        self.pump(2.0, 0.01)
        n = len(c.messages())
        self.assertTrue(190 <= n <= 310, n)

    def test_expired_session(self):
        c = self.connect(self.make_factory(turn_batch=10, window=10))
        c.send({"uuid": U, "params": {"count": 100}})
        c.messages()
        c.close()
        self.clock.advance(29)
        d = self.connect().send({"uuid": U, "state": 10})
        d.close()
        self.clock.advance(31)
        self.assertError(self.connect().send({"uuid": U, "state": 10}), "Unknown client")


class ErrorTests(ServerTestsBase):
    """Every refusal is an {"error"} line followed by the close."""

    def open(self, count=100):
        c = self.connect(self.make_factory(turn_batch=10, window=10))
        c.send({"uuid": U, "params": {"count": count}})
        self.assertEqual(len(c.messages()), 10)
        return c

    def test_invalid_lines(self):
        for line in [b"nope\n", b"[1]\n", b'"x"\n', b"\xff\xfe{}\n", b'{"a": NaN}\n',
                     b"[" * 5000 + b"\n"]:
            self.assertError(self.connect().send(line))

    def test_line_too_long(self):
        c = self.connect(self.make_factory(max_line=100))
        c.send(b"{" + b" " * 200)
        self.assertError(c, "line longer than 100 bytes")

    def test_ack_first(self):
        self.assertError(self.connect().send({"uuid": U, "ack": 1}))

    def test_bad_params(self):
        for params in [{"count": 0}, {"count": 0x10000}, {"count": "3"}, {}, 7]:
            self.assertError(self.connect().send({"uuid": U, "params": params}))
        self.assertError(self.connect().send({"uuid": U}))

    def test_unknown_client(self):
        self.assertError(self.connect().send({"uuid": U, "state": 3}), "Unknown client")

    def test_state_beyond_last_id(self):
        c = self.open()
        c.close()
        beyond = self.store._table.sessions[U].last_id + 1
        self.assertError(self.connect().send({"uuid": U, "state": beyond}), "Unknown message ID")

    def test_state_before_an_ack(self):
        c = self.open()
        c.send({"uuid": U, "ack": 5})
        c.close()
        self.assertError(self.connect().send({"uuid": U, "state": 4}), "Out-of-order ACK")

    def test_ack_not_sent_yet(self):
        c = self.open()
        c.proto.pauseProducing()
        self.pump(turns=2)
        last = c.messages()[-1]["id"]
        c.send({"uuid": U, "ack": last})
        self.assertEqual(c.messages(), [])
        c.send({"uuid": U, "ack": last + 1})
        self.assertError(c, "Unknown message ID")

    def test_ack_backwards(self):
        c = self.open()
        c.proto.pauseProducing()
        c.send({"uuid": U, "ack": 8})
        c.send({"uuid": U, "ack": 7})
        self.assertError(c, "Out-of-order ACK")

    def test_ack_other_session(self):
        c = self.open()
        c.proto.pauseProducing()
        c.send({"uuid": "someone-else", "ack": 1})
        self.assertError(c, "ack for another session")

    def test_params_while_streaming(self):
        c = self.open()
        c.proto.pauseProducing()
        c.send({"uuid": U, "params": {"count": 3}})
        self.assertError(c, "unexpected message in stateful mode")

    def test_no_initial_message(self):
        c = self.connect()
        self.clock.advance(29)
        self.assertFalse(c.closed)
        self.clock.advance(2)
        self.assertError(c, "no initial message in time")

    def test_store_failure(self):
        class Broken(MemorySessionStore):
            def put(self, uuid, transformer):
                return defer.fail(OSError("disk on fire"))
        self.store = Broken(self.clock)
        c = self.connect(self.make_factory())
        c.send({"uuid": U, "params": {"count": 5}})
        self.assertError(c, "internal error")
        self.flushLoggedErrors(OSError)

    def test_store_unavailable_drops_without_error(self):
        """
        A session store that does not answer (a cluster electing a leader)
        is transient: what was stored goes out, then the connection closes
        with no error line, so that the client resumes the session later
        (an error line would end its stream for good).
        """
        from streamproto.reliable.errors import StoreUnavailable
        store = self.store

        class Unavailable(MemorySessionStore):
            calls = 0

            def put(self, uuid, transformer):
                Unavailable.calls += 1
                if Unavailable.calls > 2:
                    return defer.fail(StoreUnavailable("session store: nats: timeout"))
                return MemorySessionStore.put(self, uuid, transformer)
        self.store = Unavailable(self.clock)
        self.addCleanup(setattr, self, "store", store)
        c = self.connect(self.make_factory())
        c.send({"uuid": U, "params": {"count": 5}})
        self.clock.advance(1)
        self.assertTrue(c.closed)
        lines = c.messages()
        self.assertFalse([m for m in lines if "error" in m], lines)
        self.assertEqual([m["id"] for m in lines if "id" in m], [1, 2])

    def test_error_keeps_other_connections(self):
        good = self.connect().send({"uuid": U, "params": {"count": 3}})
        bad = self.connect().send(b"garbage\n")
        self.assertError(bad)
        self.assertEqual(len(good.messages()), 3)


class WallClockStepTests(ServerTestsBase):
    """
    The fake reactor clock steps (as the wall clock a real reactor's
    timers follow); the timeouts are on the monotonic stand-in.
    """

    def setUp(self):
        self.mono = [0.0]
        super().setUp()

    def make_factory(self, **kwargs):
        return super().make_factory(monotonic=lambda: self.mono[0], **kwargs)

    def elapse(self, seconds):
        self.mono[0] += seconds
        self.clock.advance(seconds)

    def test_step_does_not_cut_a_new_connection(self):
        c = self.connect()
        self.clock.advance(3600)
        self.assertFalse(c.closed)
        self.elapse(29)
        self.assertFalse(c.closed)
        self.elapse(2)
        self.assertError(c, "no initial message in time")

    def test_first_line_after_a_step_is_served(self):
        # the step fires the timer in the turn that reads the first line
        c = self.connect()
        self.clock.advance(3600)
        c.send({"uuid": U, "params": {"count": 3}})
        self.pump()
        self.assertEqual([m["id"] for m in c.messages()], [1, 2, 3])

    def test_step_does_not_cut_a_paused_reader(self):
        c = self.connect(self.make_factory(stall_timeout=60))
        c.send({"uuid": U, "params": {"count": 1000}})
        c.proto.pauseProducing()
        self.clock.advance(3600)
        self.assertFalse(c.closed)
        self.elapse(59)
        self.assertFalse(c.closed)
        self.elapse(2)
        self.assertTrue(c.closed)
