"""Operating the reliable-stream server: its metrics, and shutdown with sessions open."""

import json

from twisted.internet import defer
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint
from streamproto.reliable import codec, tap
from streamproto.reliable.client import StatefulClient
from streamproto.reliable.server import SHUTDOWN_ERROR
from test.support.netutil import RawClient, connect, wait_until
from test.support.test_ops_support import RunningService, Samples
from test.reliable.test_reliable_e2e import check_stream

SERVER = "reliable-stream-server"


class LineClient(RawClient):
    """Sends a first line, collects the server's lines as JSON objects."""

    def __init__(self, first_line):
        super().__init__()
        self.first_line = first_line

    def connectionMade(self):
        self.transport.write(self.first_line)

    @property
    def lines(self):
        text = bytes(self.received).decode()
        return [json.loads(line) for line in text.split("\n")[:-1] if line]

    def ids(self):
        return [m["id"] for m in self.lines if "id" in m]


class ReliableOpsTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_metrics_move(self):
        server = RunningService(tap)
        yield server.start(self)
        s = Samples(SERVER)
        stateful = yield connect(server.port, LineClient(codec.encode_open("metrics-1", 20)))
        yield stateful.closed     # the spec: the server closes after the last message
        self.assertEqual(len(stateful.ids()), 20)
        self.assertIn("crc", stateful.lines[-1]["data"])
        self.assertEqual(s.delta("streamproto_records_in_total"), 20)
        self.assertEqual(s.delta("streamproto_records_out_total"), 20)

        s = Samples(SERVER)
        stateless = yield connect(server.port, LineClient(codec.encode_stateless_start()))
        yield wait_until(lambda: len(stateless.lines) >= 100)
        stateless.transport.loseConnection()
        yield stateless.closed
        self.assertGreaterEqual(s.delta("streamproto_records_out_total"), 100)
        self.assertEqual(s.delta("streamproto_records_in_total"), 0)  # nothing stored

        before = s.error_delta("protocol_error")
        bad = yield connect(server.port, LineClient(b"not json\n"))
        yield bad.closed
        self.assertIn("error", bad.lines[-1])
        self.assertEqual(s.error_delta("protocol_error") - before, 1)

    @defer.inlineCallbacks
    def test_shutdown_keeps_the_session_resumable(self):
        """
        A stateful session streams (acking as it goes) while the service
        stops: the client gets C{{"error": "server shutting down"}} after
        whole messages; after a restart on the same data it resumes from
        the last message it received and the ids go on without a gap.
        """
        server = RunningService(tap, ["--rate", "2000"])
        yield server.start(self)
        client = yield connect(server.port, LineClient(codec.encode_open("shutdown-1", 60000)))

        def ack_some(_data):
            ids = client.ids()
            if ids and ids[-1] % 10 == 0:
                client.transport.write(codec.encode_ack("shutdown-1", ids[-1]))
        client.on_data = ack_some
        yield wait_until(lambda: len(client.ids()) >= 50)
        yield server.stop()
        yield client.closed
        self.assertEqual(client.lines[-1], {"error": SHUTDOWN_ERROR})
        ids = client.ids()
        self.assertEqual(ids, list(range(1, len(ids) + 1)))

        again = RunningService(tap, data=server.data)
        yield again.start(self)
        resumed = yield connect(again.port, LineClient(codec.encode_resume("shutdown-1", ids[-1])))
        yield wait_until(lambda: len(resumed.ids()) >= 5)
        self.assertEqual(resumed.ids()[:5], list(range(ids[-1] + 1, ids[-1] + 6)))
        self.assertFalse([m for m in resumed.lines if "error" in m])
        resumed.transport.loseConnection()
        yield resumed.closed
        yield again.stop()

    @defer.inlineCallbacks
    def test_our_client_resumes_after_a_shutdown(self):
        """
        Our client takes "server shutting down" for a dropped connection:
        it reconnects (after its 5 s retry delay: the spec's minimum) to the
        restarted server and resumes; the stream completes and verifies.
        """
        from twisted.internet import reactor
        server = RunningService(tap, ["--rate", "2000"])
        yield server.start(self)
        sessions = server.top.trackers[0].store
        d = StatefulClient(client_endpoint(reactor, "127.0.0.1", server.port), 2000,
                           ack_every=16).run()
        yield wait_until(lambda: any(s.last_id >= 200
                                     for s in sessions._table.sessions.values()))
        yield server.stop()
        again = RunningService(tap, data=server.data, port=server.port)
        yield again.start(self)
        result = yield d
        check_stream(self, result, 2000)
        self.assertEqual(result.reconnects, 1)

    @defer.inlineCallbacks
    def test_shutdown_before_the_first_line(self):
        server = RunningService(tap)
        yield server.start(self)
        client = yield connect(server.port, LineClient(b""))
        yield wait_until(lambda: len(server.top.trackers[0].protocols) == 1)
        yield server.stop()
        yield client.closed
        self.assertEqual(client.lines, [{"error": SHUTDOWN_ERROR}])


class ReadinessTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_ready_follows_the_session_store(self):
        import treq

        from streamproto.reliable.errors import StoreFailed
        from streamproto.reliable.tap import SessionStoreHealth
        from streamproto.core.ops import store_problems

        server = RunningService(tap, ["--metrics", "tcp:0:interface=127.0.0.1"])
        _, metrics_port = yield server.start(self)
        url = f"http://127.0.0.1:{metrics_port}/ready"
        r = yield treq.get(url, persistent=False)
        self.assertEqual(r.code, 200)
        yield r.content()
        sessions = server.top.trackers[0].store
        yield sessions.close()
        r = yield treq.get(url, persistent=False)
        self.assertEqual(r.code, 503)
        self.assertIn("store closed", (yield r.text()))

        class Failed:
            closed = False
            failure = StoreFailed("session store failed: disk I/O error")
        self.assertEqual(store_problems([SessionStoreHealth(Failed())]),
                         ["log sessions: failed (session store failed: disk I/O error)"])
