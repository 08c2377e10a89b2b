"""
L{LumberjackServerState} on its own: bytes in, effects out, recorded by a
fake L{ILumberjackConnection}; a fake clock for the timers.  (The protocol
around it, over a fake transport: test_lumberjack_server.)
"""

import json

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from streamproto.core.metrics import ServerMetrics
from streamproto.lumberjack.codec import (
    VERSION_1, VERSION_2, FrameDecoder, encode_batch, encode_json, encode_json_frames,
    encode_key_values, encode_window,
)
from streamproto.lumberjack.server_state import ILumberjackConnection, LumberjackServerState


@implementer(ILumberjackConnection)
class RecordingConnection:
    """
    Records every effect as a tuple in L{effects}; the sink's Deferreds are
    in L{stores} for the test to fire.

    @ivar allowed: what L{may_write} answers.
    @ivar room: what L{admit} answers.
    """

    def __init__(self):
        self.effects = []
        self.stores = []        # (events, Deferred)
        self.allowed = True
        self.room = True

    def take(self):
        effects, self.effects = self.effects, []
        return effects

    def send_ack(self, seq, version):
        self.effects.append(("ack", seq, version))

    def pause_reading(self):
        self.effects.append(("pause",))

    def resume_reading(self):
        self.effects.append(("resume",))

    def close(self):
        self.effects.append(("close",))

    def may_write(self):
        self.effects.append(("may_write",))
        return self.allowed

    def store(self, events):
        d = Deferred()
        self.stores.append((list(events), d))
        self.effects.append(("store", len(events)))
        return d

    def admit(self):
        self.effects.append(("admit", self.room))
        return self.room

    def hold(self, nbytes):
        self.effects.append(("hold", nbytes))

    def events_stored(self, count, nbytes):
        self.effects.append(("stored", count, nbytes))

    def finished(self, nbytes):
        self.effects.append(("finished", nbytes))


def payloads(n, start=0):
    return [json.dumps({"n": i, "message": "x" * 20}).encode() for i in range(start, start + n)]


SIZE = len(payloads(1)[0])


class LogCodes:
    """The C{code} of every warning logged while a test runs."""

    def __init__(self, case):
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        case.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def codes(self):
        return [e.get("code") for e in self.events
                if e.get("log_level") in (LogLevel.warn, LogLevel.error)]


class StateTestCase(SynchronousTestCase):
    def make(self, idle_timeout=0, keepalive_interval=0, flush_bytes=1 << 20, **decoder):
        self.clock = Clock()
        self.conn = RecordingConnection()
        self.state = LumberjackServerState(
            self.conn, FrameDecoder(**decoder), self.clock, idle_timeout=idle_timeout,
            keepalive_interval=keepalive_interval, flush_bytes=flush_bytes,
            metrics=ServerMetrics("lj-state-test"))
        self.state.connection_made("10.0.0.1:4000")
        return self.state

    def effects(self, kind):
        return [e for e in self.conn.effects if e[0] == kind]


class InterfaceTests(SynchronousTestCase):
    def test_recorder_provides_the_interface(self):
        # so that the recorder cannot drift from what the protocol implements
        verifyObject(ILumberjackConnection, RecordingConnection())

    def test_protocol_provides_the_interface(self):
        from streamproto.lumberjack.server import LumberjackServerFactory
        factory = LumberjackServerFactory(object(), clock=Clock())
        verifyObject(ILumberjackConnection, factory.buildProtocol(None))

    def test_every_input_bound_once(self):
        # the machine's inputs are bound in __init__ (automat rebuilds one
        # at every access): an input left out of _INPUTS would still work,
        # only slower, so the list is checked against the machine here
        inputs = {name for name, value in vars(LumberjackServerState).items()
                  if type(value).__name__ == "MethodicalInput"}
        self.assertEqual(set(LumberjackServerState._INPUTS), inputs)
        state = LumberjackServerState(RecordingConnection(), FrameDecoder(), Clock())
        for name in inputs:
            self.assertIs(getattr(state, name), getattr(state, name))


class BatchTests(StateTestCase):
    def test_window_then_events_stored_then_acked(self):
        state = self.make()
        state.data_received(encode_batch(payloads(3), 0, first_seq=41))
        self.assertEqual(self.conn.take(), [
            ("may_write",), ("admit", True), ("hold", 3 * SIZE), ("store", 3), ("pause",)])
        [(events, d)] = self.conn.stores
        self.assertEqual(events, payloads(3))
        d.callback(None)
        # durable first, then counted, acked with the last seq, and reading again
        self.assertEqual(self.conn.take(), [
            ("stored", 3, 3 * SIZE), ("ack", 43, VERSION_2), ("resume",)])
        self.assertEqual(state.pending_events, 0)

    def test_events_arriving_a_byte_at_a_time(self):
        state = self.make()
        data = encode_window(2) + encode_json_frames(payloads(2))
        for i in range(len(data) - 1):
            state.data_received(data[i:i + 1])
        self.assertEqual(self.conn.stores, [])
        self.assertEqual(state.pending_events, 1)
        state.data_received(data[-1:])
        self.assertEqual([e for e, _ in self.conn.stores], [payloads(2)])

    def test_v1_batch_acked_with_v1(self):
        state = self.make()
        state.data_received(encode_window(1, VERSION_1) + encode_key_values(7, {"a": "b"}))
        self.conn.stores[0][1].callback(None)
        self.assertIn(("ack", 7, VERSION_1), self.conn.effects)

    def test_empty_window_acked_at_once(self):
        state = self.make()
        state.data_received(encode_window(0))
        self.assertEqual(self.conn.take(), [("may_write",), ("ack", 0, VERSION_2)])

    def test_pipelined_batch_waits_for_the_first(self):
        state = self.make()
        state.data_received(encode_batch(payloads(2), 0) + encode_batch(payloads(1, 2), 0,
                                                                         first_seq=3))
        self.assertEqual(len(self.conn.stores), 1)
        self.conn.take()
        self.conn.stores[0][1].callback(None)
        self.assertEqual(self.conn.take(), [
            ("stored", 2, 2 * SIZE), ("ack", 2, VERSION_2), ("resume",),
            ("may_write",), ("admit", True), ("hold", SIZE), ("store", 1), ("pause",)])

    def test_partial_ack_past_flush_bytes(self):
        state = self.make(flush_bytes=SIZE * 4)
        state.data_received(encode_window(10) + encode_json_frames(payloads(6), first_seq=100))
        self.assertEqual([len(e) for e, _ in self.conn.stores], [4])
        self.conn.take()
        self.conn.stores[0][1].callback(None)
        # the part is acked, the two events after it are read (not yet a part)
        self.assertEqual(self.conn.take(), [
            ("stored", 4, 4 * SIZE), ("ack", 103, VERSION_2), ("resume",),
            ("hold", 2 * SIZE)])
        self.assertEqual(state.pending_events, 2)


class ShutdownTests(StateTestCase):
    def test_partial_ack_of_what_arrived_then_close(self):
        state = self.make()
        state.data_received(encode_window(10) + encode_json_frames(payloads(4), first_seq=1))
        self.assertEqual(self.conn.stores, [])
        self.conn.take()
        state.shutdown()
        self.assertEqual(self.conn.take(), [("store", 4), ("pause",)])
        # nothing more is read once shutting down
        state.data_received(encode_json_frames(payloads(6, 4), first_seq=5))
        self.assertEqual(self.conn.take(), [])
        self.conn.stores[0][1].callback(None)
        # reading is resumed before the close: a TLS close needs the peer's close_notify
        self.assertEqual(self.conn.take(), [
            ("stored", 4, 4 * SIZE), ("ack", 4, VERSION_2), ("finished", 0), ("resume",),
            ("close",)])
        self.assertTrue(state.closed)
        self.assertEqual(len(self.conn.stores), 1)

    def test_batch_with_the_sink_acked_then_closed(self):
        state = self.make()
        state.data_received(encode_batch(payloads(2), 0))
        self.conn.take()
        state.shutdown()
        state.shutdown()    # asked twice: once is enough
        self.assertEqual(self.conn.take(), [])
        self.conn.stores[0][1].callback(None)
        self.assertEqual(self.conn.take(), [
            ("stored", 2, 2 * SIZE), ("ack", 2, VERSION_2), ("finished", 0), ("resume",),
            ("close",)])

    def test_between_batches_closes_at_once(self):
        state = self.make()
        state.shutdown()
        self.assertEqual(self.conn.take(), [("finished", 0), ("close",)])
        state.connection_lost()
        self.assertEqual(self.conn.take(), [("finished", 0)])


class KeepaliveTests(StateTestCase):
    def test_keepalive_while_storage_is_slow(self):
        state = self.make(keepalive_interval=2.0, idle_timeout=3.0)
        state.data_received(encode_batch(payloads(1), 0))
        self.conn.take()
        for _ in range(5):
            self.clock.advance(2.0)
        # an ACK 0 every interval; the idle timeout does not close: we are the slow side
        self.assertEqual(self.conn.take(), [("ack", 0, VERSION_2)] * 5)
        self.conn.stores[0][1].callback(None)
        self.assertEqual(self.conn.take(), [("stored", 1, SIZE), ("ack", 1, VERSION_2),
                                            ("resume",)])
        # nothing pending: no more keepalives, and a silent client is idle again
        self.clock.advance(3.0)
        self.assertEqual(self.conn.take(), [("finished", 0), ("close",)])

    def test_no_keepalive_for_v1(self):
        state = self.make(keepalive_interval=2.0)
        state.data_received(encode_window(1, VERSION_1) + encode_key_values(1, {"a": "b"}))
        self.clock.advance(10)
        self.assertEqual(self.effects("ack"), [])


class IdleTests(StateTestCase):
    def test_idle_timeout_closes(self):
        logs = LogCodes(self)
        state = self.make(idle_timeout=30)
        self.clock.advance(20)
        state.data_received(encode_window(2))
        self.clock.advance(29.9)
        self.assertEqual(self.effects("close"), [])     # input reset the countdown
        self.clock.advance(0.2)
        self.assertEqual(self.conn.take(), [("may_write",), ("admit", True), ("finished", 0),
                                            ("close",)])
        self.assertEqual(logs.codes(), ["idle_timeout"])
        # input after the close is ignored
        state.data_received(encode_json(1, b"{}"))
        self.assertEqual(self.conn.take(), [])

    def test_idle_off(self):
        self.make(idle_timeout=0)
        self.clock.advance(10**6)
        self.assertEqual(self.conn.effects, [])


class BadInputTests(StateTestCase):
    def test_bad_frame_closes_without_storing(self):
        logs = LogCodes(self)
        state = self.make()
        state.data_received(encode_window(2) + encode_json(1, b"{}") + encode_json(2, b"{oops"))
        self.assertEqual(self.conn.stores, [])
        self.assertEqual(self.effects("close"), [("close",)])
        self.assertEqual(logs.codes(), ["malformed_json"])
        self.assertTrue(state.closed)

    def test_window_too_large(self):
        logs = LogCodes(self)
        state = self.make(max_window=10)
        state.data_received(encode_window(11))
        self.assertEqual(self.conn.take(), [("finished", 0), ("close",)])
        self.assertEqual(logs.codes(), ["window_too_large"])

    def test_bad_frame_after_part_held_gives_its_bytes_back(self):
        state = self.make()
        state.data_received(encode_window(3) + encode_json(1, b"{}"))
        self.assertEqual(self.conn.take()[-1:], [("hold", 2)])
        state.data_received(b"2X")
        self.assertEqual(self.conn.take(), [("finished", 2), ("close",)])

    def test_store_failure_closes_without_ack(self):
        state = self.make()
        state.data_received(encode_batch(payloads(1), 0))
        self.conn.take()
        self.conn.stores[0][1].errback(OSError("disk on fire"))
        self.assertEqual(self.conn.take(), [("finished", SIZE), ("resume",), ("close",)])
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        self.assertTrue(state.closed)

    def test_denied_closes_before_anything_is_stored(self):
        state = self.make()
        self.conn.allowed = False
        state.data_received(encode_batch(payloads(1), 0))
        self.assertEqual(self.conn.take(), [("may_write",), ("finished", 0), ("close",)])
        self.assertEqual(self.conn.stores, [])


class BudgetTests(StateTestCase):
    def test_waits_for_the_budget_then_reads(self):
        state = self.make()
        self.conn.room = False
        state.data_received(encode_batch(payloads(1), 0))
        self.assertEqual(self.conn.take(), [("may_write",), ("admit", False), ("pause",)])
        state.budget_freed()
        self.assertEqual(self.conn.take(), [("resume",), ("hold", SIZE), ("store", 1),
                                            ("pause",)])

    def test_connection_lost_while_storing(self):
        state = self.make()
        state.data_received(encode_batch(payloads(2), 0))
        self.conn.take()
        state.connection_lost()
        self.assertEqual(self.conn.take(), [("finished", 2 * SIZE)])
        # storage finishing after the client left: no ack, nothing counted twice
        self.conn.stores[0][1].callback(None)
        state.budget_freed()
        self.assertEqual(self.conn.take(), [])
