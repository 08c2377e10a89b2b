"""The Lumberjack client against a scripted server, with a fake clock."""

import json
import random

from twisted.internet.defer import fail, succeed
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from streamproto.lumberjack.client import ClientClosed, LumberjackClient
from streamproto.lumberjack.codec import (
    VERSION_2, Events, FrameDecoder, Window, encode_ack,
)


class Transport(StringTransport):
    def __init__(self):
        super().__init__()
        self.aborted = False

    def abortConnection(self):
        self.aborted = True
        self.loseConnection()


@implementer(IStreamClientEndpoint)
class ScriptedEndpoint:
    """Connects to nothing: the test reads what the client wrote and answers."""

    def __init__(self):
        self.connections = []  # (protocol, transport, decoder)
        self.refuse = 0
        self.attempts = 0

    def connect(self, factory):
        self.attempts += 1
        if self.refuse:
            self.refuse -= 1
            return fail(ConnectionRefusedError())
        proto = factory.buildProtocol(None)
        transport = Transport()
        proto.makeConnection(transport)
        self.connections.append((proto, transport, FrameDecoder()))
        return succeed(proto)

    @property
    def current(self):
        return self.connections[-1]

    def batches(self):
        """[(window, [(seq, event dict)])] written since last asked, on the current connection."""
        _, transport, decoder = self.current
        decoder.feed(transport.value())
        transport.clear()
        batches = []
        for frame in decoder.decode():
            if type(frame) is Window:
                batches.append((frame.size, []))
            elif type(frame) is Events:
                batches[-1][1].extend(zip(frame.seqs, map(json.loads, frame.payloads)))
        return batches

    def ack(self, seq):
        self.current[0].dataReceived(encode_ack(seq))

    def drop(self):
        proto, transport, _ = self.current
        proto.connectionLost(Failure(ConnectionDone()))


def events(n, start=0):
    return [{"n": i} for i in range(start, start + n)]


class ClientTests(SynchronousTestCase):
    def make(self, **kwargs):
        self.clock = Clock()
        self.endpoint = ScriptedEndpoint()
        kwargs.setdefault("jitter", 0)     # exact delays: these tests count seconds
        return LumberjackClient(self.endpoint, clock=self.clock, **kwargs)

    def test_slow_start_and_pipelining(self):
        client = self.make(pipelining=2, bulk_max_size=20)
        d = client.send(events(50))
        batches = self.endpoint.batches()
        # two batches of 10 in flight, numbered 1..n each
        self.assertEqual([(w, [s for s, _ in evs]) for w, evs in batches],
                         [(10, list(range(1, 11))), (10, list(range(1, 11)))])
        self.endpoint.ack(10)
        self.assertEqual([w for w, _ in self.endpoint.batches()], [15])
        self.endpoint.ack(10)
        # the window grew to 20 (15 x 1.5, capped), but only 15 events are left
        self.assertEqual(client.batch_size, 20)
        self.assertEqual([w for w, _ in self.endpoint.batches()], [15])
        self.endpoint.ack(15)
        self.assertEqual(self.endpoint.batches(), [])
        self.assertNoResult(d)
        self.endpoint.ack(15)
        self.assertEqual(self.successResultOf(d), 50)
        self.assertEqual(client.events_acked, 50)

    def test_events_in_order(self):
        client = self.make(slow_start=False, bulk_max_size=7, pipelining=3)
        client.send(events(20))
        sent = [e["n"] for _, evs in self.endpoint.batches() for _, e in evs]
        self.assertEqual(sent, list(range(20)))

    def test_send_fires_per_call(self):
        client = self.make(slow_start=False, bulk_max_size=4, pipelining=1)
        first = client.send(events(3))
        second = client.send(events(2, 3))
        third = client.send(events(3, 5))
        self.assertEqual([w for w, _ in self.endpoint.batches()], [3])
        self.endpoint.ack(2)  # partial ack: nothing complete yet
        self.assertNoResult(first)
        self.endpoint.ack(3)
        self.assertEqual(self.successResultOf(first), 3)
        # the next batch spans the second and third sends
        [(window, evs)] = self.endpoint.batches()
        self.assertEqual((window, [e["n"] for _, e in evs]), (4, [3, 4, 5, 6]))
        self.endpoint.ack(1)
        self.assertNoResult(second)
        self.endpoint.ack(4)
        self.assertEqual(self.successResultOf(second), 2)
        self.assertNoResult(third)
        self.assertEqual([w for w, _ in self.endpoint.batches()], [1])
        self.endpoint.ack(1)
        self.assertEqual(self.successResultOf(third), 3)

    def test_count_based_and_highest_seq_acks_agree(self):
        # go-lumber's server acks the number of events, logstash the highest
        # seq: for a batch numbered from 1 both mean the same, and both work
        for ack_of in (lambda evs: len(evs), lambda evs: max(s for s, _ in evs)):
            client = self.make(slow_start=False, bulk_max_size=5, pipelining=1)
            d = client.send(events(5))
            [(_, evs)] = self.endpoint.batches()
            self.endpoint.ack(ack_of(evs))
            self.assertEqual(self.successResultOf(d), 5)

    def test_keepalive_and_partial_acks_restart_timeout(self):
        client = self.make(slow_start=False, bulk_max_size=10, timeout=30)
        d = client.send(events(10))
        self.endpoint.batches()
        self.clock.advance(25)
        self.endpoint.ack(0)          # keepalive
        self.clock.advance(25)
        self.endpoint.ack(6)          # partial
        self.clock.advance(25)
        self.assertFalse(self.endpoint.current[1].aborted)
        self.endpoint.ack(10)
        self.assertEqual(self.successResultOf(d), 10)
        self.clock.advance(100)       # nothing in flight: no timeout
        self.assertFalse(self.endpoint.current[1].aborted)

    def test_timeout_resends_unacked_after_backoff(self):
        client = self.make(slow_start=False, bulk_max_size=10, timeout=30, backoff_initial=1)
        d = client.send(events(10))
        self.endpoint.batches()
        self.endpoint.ack(4)
        self.clock.advance(30)
        self.assertTrue(self.endpoint.current[1].aborted)
        self.endpoint.drop()
        self.assertEqual(client.batch_size, 5)  # halved on error
        self.assertEqual(len(self.endpoint.connections), 1)
        self.clock.advance(1)
        self.assertEqual(len(self.endpoint.connections), 2)
        # events 4..9 again, first, renumbered from 1
        batches = self.endpoint.batches()
        self.assertEqual([e["n"] for _, evs in batches for _, e in evs], list(range(4, 10)))
        self.assertEqual([s for s, _ in batches[0][1]], [1, 2, 3, 4, 5])
        self.endpoint.ack(5)
        self.endpoint.batches()
        self.assertNoResult(d)
        self.endpoint.ack(1)
        self.assertEqual(self.successResultOf(d), 10)

    def test_reconnect_backoff_doubles(self):
        client = self.make(backoff_initial=1, backoff_max=5)
        self.endpoint.refuse = 4
        d = client.send(events(1))
        self.assertEqual(self.endpoint.attempts, 1)
        for delay, attempts in [(1, 2), (2, 3), (4, 4), (5, 5)]:
            self.clock.advance(delay - 0.01)
            self.assertEqual(self.endpoint.attempts, attempts - 1)
            self.clock.advance(0.01)
            self.assertEqual(self.endpoint.attempts, attempts)
        self.endpoint.batches()
        self.endpoint.ack(1)
        self.assertEqual(self.successResultOf(d), 1)
        self.flushLoggedErrors()

    def test_reconnect_backoff_jittered(self):
        """Each delay is drawn between the nominal one and half as much again."""
        client = self.make(backoff_initial=1, backoff_max=5, jitter=0.5,
                           rng=random.Random(11))
        expected = random.Random(11)
        self.endpoint.refuse = 4
        client.send(events(1))
        for nominal, attempts in [(1, 2), (2, 3), (4, 4), (5, 5)]:
            delay = min(5, nominal * (1 + 0.5 * expected.random()))
            self.assertTrue(nominal <= delay <= min(5, nominal * 1.5))
            self.clock.advance(delay - 0.001)
            self.assertEqual(self.endpoint.attempts, attempts - 1)
            self.clock.advance(0.001)
            self.assertEqual(self.endpoint.attempts, attempts)
        self.flushLoggedErrors()

    def test_bad_ack_drops_connection(self):
        client = self.make(slow_start=False, bulk_max_size=3)
        d = client.send(events(3))
        self.endpoint.batches()
        self.endpoint.ack(4)  # more than the batch holds
        self.assertTrue(self.endpoint.current[1].aborted)
        self.endpoint.drop()
        self.clock.advance(1)
        # window halved: 3 -> 1.5, two batches of one in flight
        self.assertEqual([len(evs) for _, evs in self.endpoint.batches()], [1, 1])
        self.assertNoResult(d)

    def test_close_fails_pending(self):
        client = self.make()
        d = client.send(events(3))
        closed = client.close()
        self.assertNoResult(closed)
        self.endpoint.drop()
        self.successResultOf(closed)
        self.failureResultOf(d, ClientClosed)
        self.assertRaises(ClientClosed, client.send, events(1))

    def test_uncompressed_frames(self):
        client = self.make(compression_level=0, slow_start=False, bulk_max_size=2)
        client.send([b'{"raw":true}', '{"s":1}'])
        raw = self.endpoint.current[1].value()
        self.assertEqual(raw[:6], b"2W\x00\x00\x00\x02")
        self.assertEqual(raw[6:8], b"2J")
        self.assertEqual([evs for _, evs in self.endpoint.batches()],
                         [[(1, {"raw": True}), (2, {"s": 1})]])
        self.assertEqual(VERSION_2, raw[0])

    def test_close_while_waiting_to_retry(self):
        client = self.make(backoff_initial=1)
        self.endpoint.refuse = 1
        d = client.send(events(2))
        self.successResultOf(client.close())
        self.failureResultOf(d, ClientClosed)
        self.clock.advance(10)
        self.assertEqual(self.endpoint.attempts, 1)  # no retry after close
        self.flushLoggedErrors()

    def test_close_while_connecting(self):
        from twisted.internet.defer import Deferred

        @implementer(IStreamClientEndpoint)
        class Hanging:
            cancelled = False

            def connect(self, factory):
                def cancel(d):
                    Hanging.cancelled = True
                    d.errback(ConnectionRefusedError("cancelled"))
                return Deferred(cancel)

        client = LumberjackClient(Hanging(), clock=Clock())
        d = client.send(events(1))
        closed = client.close()
        self.assertTrue(Hanging.cancelled)
        self.successResultOf(closed)
        self.failureResultOf(d, ClientClosed)

    def test_idle_after_everything_acked_then_reconnects_on_demand(self):
        client = self.make(slow_start=False, bulk_max_size=5)
        d = client.send(events(2))
        self.endpoint.batches()
        self.endpoint.ack(2)
        self.successResultOf(d)
        self.endpoint.drop()  # e.g. the server's idle timeout
        self.clock.advance(100)
        self.assertEqual(self.endpoint.attempts, 1)  # nothing to send: no reconnect
        d = client.send(events(1))
        self.assertEqual(self.endpoint.attempts, 2)
        self.endpoint.batches()
        self.endpoint.ack(1)
        self.assertEqual(self.successResultOf(d), 1)
