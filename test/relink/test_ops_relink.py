"""Operating the relink server: its metrics, and shutdown while a connector streams."""

import time

from twisted.internet import defer, reactor
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint
from streamproto.relink import codec, tap
from streamproto.relink.api import Connector
from test.support.netutil import RawClient, connect, wait_until
from test.support.test_ops_support import (
    RunningService, Samples, ShutdownWhileStreamingTests, stored_records,
)
from test.relink.test_relink_support import Recorder

SERVER = "relink-server"


def appending(server):
    """Whether the server's log bridge is appending messages of a link right now."""
    for tracker in server.top.trackers:
        for conn in tracker.protocols:
            link = conn.wrappedProtocol.link
            if link is not None and any(ch.busy for ch in link.in_channels.values()):
                return True
    return False


class RelinkOpsTests(ShutdownWhileStreamingTests, unittest.TestCase):
    timeout = 30

    def connector(self, port, name, tls=None):
        c = Connector(client_endpoint(reactor, "127.0.0.1", port, tls), name, Recorder(),
                      connector_id_size=4, listener_id_size=4)
        c.start()
        self.addCleanup(c.stop)
        return c

    @defer.inlineCallbacks
    def test_metrics_move(self):
        server = RunningService(tap)
        yield server.start(self)
        s = Samples(SERVER)
        link = yield self.connector(server.port, "echo").when_linked()
        consumed = yield link.channel(1).send_many([[b"m%d" % i] for i in range(300)])
        self.assertEqual(consumed, 300)
        yield wait_until(lambda: s.delta("streamproto_records_out_total") == 300)
        self.assertGreaterEqual(s.delta("streamproto_acks_sent_total"), 1)

        link = yield self.connector(server.port, "log").when_linked()
        consumed = yield link.channel(2).send_many([[b"r%d" % i] for i in range(100)])
        self.assertEqual(consumed, 100)
        self.assertEqual(s.delta("streamproto_records_in_total"), 100)

        before = s.error_delta("handshake_refused")
        client = yield connect(server.port, RawClient())
        client.transport.write(codec.encode_version() + codec.encode_connector_handshake(
            codec.ConnectorHandshake("no-such-endpoint", 4, 4)))
        yield client.closed
        self.assertEqual(s.error_delta("handshake_refused") - before, 1)

    @defer.inlineCallbacks
    def shutdown_while_streaming(self, listen=None, tls=None):
        """
        A connector streams to the log bridge while the service stops: the
        log holds exactly the messages acknowledged consumed (durable ones
        are all acknowledged: none would be resent as a duplicate; acked
        ones are all durable), in order; the link is detached, not lost.

        Regression (doc/reliability.rst, bug 9): the listening port's close
        ran C{ListenerFactory.stopFactory} before the drain, which
        discarded the attached links, so the appends in flight became
        durable with their consumed acknowledgements dropped.
        """
        server = RunningService(tap, listen=listen)
        yield server.start(self)
        link = yield self.connector(server.port, "log", tls).when_linked()
        channel = link.channel(7)
        state = {"sent": 0, "consumed": 0, "in_flight_at_stop": None}

        def consumed(count):
            state["consumed"] = max(state["consumed"], count)

        def send_more():
            if not link.attached or state["in_flight_at_stop"] is not None:
                return
            batch = [[b"rec%06d" % i] for i in range(state["sent"], state["sent"] + 20)]
            state["sent"] += 20
            channel.send_many(batch).addCallbacks(consumed, lambda f: None)
            reactor.callLater(0.001, send_more)
        send_more()
        yield wait_until(lambda: state["consumed"] >= 100)
        # stop while the server has an append in flight (being fsynced)
        yield wait_until(lambda: appending(server))
        started = time.monotonic()
        state["in_flight_at_stop"] = channel.assigned - channel.consumed
        yield server.stop()
        self.assertLess(time.monotonic() - started, 4.0)   # not the 5 s deadline
        yield wait_until(lambda: not link.attached)
        self.assertIsNone(link.lost)
        self.assertGreater(state["in_flight_at_stop"], 0)

        stored = yield stored_records(server.data, "relink-7")
        # acknowledgements are per message: a batch split by the stop is
        # acknowledged in part, so compare with the link's consumed count
        acked = channel.consumed
        self.assertGreater(acked, 0)
        self.assertGreaterEqual(acked, state["consumed"])
        self.assertEqual(len(stored), acked,
                         f"{len(stored)} stored, {acked} acknowledged consumed")
        self.assertEqual(stored, [b"rec%06d" % i for i in range(acked)])
