"""End to end over real sockets: TCP, TLS, a durable server killed and restarted, tap, CLI."""

import io
import json
import os

from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ServerEndpoint, serverFromString
from twisted.internet.protocol import Factory
from twisted.python import usage
from twisted.trial.unittest import TestCase

from streamproto.core.tls import client_endpoint
from streamproto.reliable import cli, tap
from streamproto.reliable.client import StatefulClient, StatelessClient
from streamproto.reliable.errors import RemoteError
from streamproto.reliable.mt19937 import first_random_int
from streamproto.reliable.server import ReliableStreamFactory
from streamproto.reliable.session import MemorySessionStore, SQLiteSessionStore
from test.reliable.test_reliable_faults import crc_of
from test.reliable.test_reliable_session import crash
from test.support.tlsutil import certs


def check_stream(test, result, count):
    test.assertEqual(len(result.values), count)
    for previous, value in zip(result.values, result.values[1:]):
        test.assertEqual(first_random_int(previous), value)
    test.assertEqual(result.crc, crc_of(result.values))


class Servers:
    """Listening ports that tests close, with their connections, on cleanup."""

    def __init__(self, test):
        self.test = test

    @defer.inlineCallbacks
    def listen(self, factory, description="tcp:0:interface=127.0.0.1"):
        tracked = TrackingFactory(factory)
        port = yield serverFromString(reactor, description).listen(tracked)
        self.test.addCleanup(tracked.close_all)
        self.test.addCleanup(port.stopListening)
        return port, tracked


class TrackingFactory(Factory):
    """Wraps a factory to remember its connections (to kill them)."""

    def __init__(self, inner):
        self.inner = inner
        self.protocols = []

    def buildProtocol(self, addr):
        p = self.inner.buildProtocol(addr)
        lost = defer.Deferred()
        original = p.connectionLost

        def connectionLost(reason):
            original(reason)
            lost.callback(None)
        p.connectionLost = connectionLost
        p.lost = lost
        self.protocols.append(p)
        return p

    def close_all(self):
        waits = []
        for p in self.protocols:
            if not p.lost.called:
                p.transport.abortConnection()
                waits.append(p.lost)
        return defer.gatherResults(waits)


class EndToEndTests(TestCase):
    timeout = 60

    def setUp(self):
        self.servers = Servers(self)

    def store(self):
        store = MemorySessionStore()
        self.addCleanup(store.close)
        return store

    @defer.inlineCallbacks
    def test_tcp_both_modes(self):
        port, _ = yield self.servers.listen(ReliableStreamFactory(self.store()))
        endpoint = client_endpoint(reactor, "127.0.0.1", port.getHost().port)
        result = yield StatefulClient(endpoint, 3000).run()
        check_stream(self, result, 3000)
        result = yield StatelessClient(endpoint, 50).run()
        values = [int(v) for v in result.values]
        self.assertEqual(values, [values[0] << i for i in range(50)])

    @defer.inlineCallbacks
    def test_tls_with_client_certificate(self):
        c = certs()
        port, tracked = yield self.servers.listen(ReliableStreamFactory(self.store()),
                                                  c.server_endpoint())
        endpoint = client_endpoint(reactor, "127.0.0.1", port.getHost().port,
                                   c.client_options(with_cert=True))
        result = yield StatefulClient(endpoint, 500).run()
        check_stream(self, result, 500)
        result = yield StatelessClient(endpoint, 20).run()
        self.assertEqual(len(result.values), 20)

    @defer.inlineCallbacks
    def test_server_error_ends_the_run(self):
        port, _ = yield self.servers.listen(ReliableStreamFactory(self.store()))
        endpoint = client_endpoint(reactor, "127.0.0.1", port.getHost().port)
        client = StatefulClient(endpoint, 10)
        # resume a session the server never saw: "Unknown client", no retry
        from streamproto.reliable.client import _Reconnector, _StatefulSession
        session = _StatefulSession(10, "never-seen", 16)
        session.last_id = 3
        reconnector = _Reconnector(endpoint, session, reactor, **client._options)
        reconnector.start()
        failure = yield self.assertFailure(reconnector.result, RemoteError)
        self.assertEqual(str(failure), "Unknown client")

    @defer.inlineCallbacks
    def test_durable_server_killed_and_restarted_mid_stream(self):
        path = os.path.join(self.mktemp(), "sessions.sqlite")
        store = SQLiteSessionStore(path)
        factory = ReliableStreamFactory(store, rate=2000)
        port, tracked = yield self.servers.listen(factory)
        number = port.getHost().port
        endpoint = client_endpoint(reactor, "127.0.0.1", number)
        d = StatefulClient(endpoint, 4000, ack_every=16).run()
        # let some hundreds of messages through, then kill the server
        before = 0
        for _ in range(500):
            yield task.deferLater(reactor, 0.02, lambda: None)
            sessions = list(store._table.sessions.values())
            before = sessions[0].last_id if sessions else 0
            if before >= 300:
                break
        self.assertTrue(300 <= before < 4000, before)
        yield port.stopListening()
        crash(store)
        yield tracked.close_all()
        # a new server process on the same file and port
        store2 = SQLiteSessionStore(path)
        self.addCleanup(store2.close)
        self.assertEqual(len(store2._table.sessions), 1)
        port2 = yield TCP4ServerEndpoint(reactor, number, interface="127.0.0.1").listen(
            TrackingFactory(ReliableStreamFactory(store2)))
        self.addCleanup(port2.stopListening)
        result = yield d
        check_stream(self, result, 4000)
        self.assertGreaterEqual(result.reconnects, 1)


class TapAndCLITests(TestCase):
    timeout = 30

    def test_options(self):
        options = tap.Options()
        options.parseOptions(["--store", "memory", "--expiry", "5", "--rate", "100",
                              "--data", self.mktemp()])
        self.assertEqual(options["port"], [tap.DEFAULT_PORT])
        self.assertEqual((options["expiry"], options["rate"]), (5.0, 100.0))
        self.assertRaises(usage.UsageError, tap.Options().parseOptions, ["--store", "redis"])
        self.assertRaises(usage.UsageError, tap.Options().parseOptions, ["--expiry", "-1"])

    @defer.inlineCallbacks
    def test_service_and_cli(self):
        data = self.mktemp()
        options = tap.Options()
        options.parseOptions(["--data", data, "--port", "tcp:0:interface=127.0.0.1"])
        service = tap.makeService(options)
        service.startService()
        self.addCleanup(service.stopService)
        self.assertTrue(os.path.exists(os.path.join(data, tap.SQLITE_FILE)))
        listener = [s for s in service if hasattr(s, "_waitingForPort")][0]
        got = defer.Deferred()

        def keep(port):
            # pass the port on: stopService needs it in this Deferred
            got.callback(port)
            return port
        listener._waitingForPort.addCallback(keep)
        number = (yield got).getHost().port
        parsed = cli.parse_args(["client", "-s", f"127.0.0.1:{number}", "--count", "100"])
        out = io.StringIO()
        status = yield cli._run(reactor, parsed, out)
        self.assertEqual(status, 0)
        self.assertRegex(out.getvalue(), r"received 100 messages, 0 reconnects, CRC \d+ verified")
        parsed = cli.parse_args(["client", "-s", f"127.0.0.1:{number}", "--count", "3",
                                 "--mode", "stateless", "--print"])
        out = io.StringIO()
        self.assertEqual((yield cli._run(reactor, parsed, out)), 0)
        self.assertEqual(len(out.getvalue().splitlines()), 4)
        parsed = cli.parse_args(["client", "-s", f"127.0.0.1:{number}", "-n", "3",
                                 "--mode", "stateless", "--print", "-f", "json"])
        out = io.StringIO()
        self.assertEqual((yield cli._run(reactor, parsed, out)), 0)
        result = json.loads(out.getvalue())
        values = [int(v) for v in result["values"]]
        self.assertEqual((result["received"], len(values)), (3, 3))
        self.assertEqual(values[1:], [2 * v for v in values[:-1]])    # doubling

    def test_cli_usage_errors(self):
        self.assertEqual(cli.main(["server"]), 2)
        self.assertEqual(cli.main(["client", "--count", "0"]), 2)
        self.assertEqual(cli.main(["client", "--retry-delay", "1"]), 2)


class JetStreamSessionsTests(TestCase):
    """Sessions in a JetStream bucket: a session resumes on another front-end."""

    timeout = 120

    def setUp(self):
        self.servers = Servers(self)

    @defer.inlineCallbacks
    def test_front_end_killed_session_resumes_on_another(self):
        """
        The client's front-end dies mid-stream; another front-end (its own
        store, the same cluster) takes the address, as behind a load
        balancer: the client resumes there and gets the whole stream, each
        message once, in order.
        """
        from streamproto.reliable.natsessions import JetStreamSessionStore
        from test.support.natsutil import shared_cluster, unique_prefix
        cluster = shared_cluster()
        prefix = unique_prefix(self)
        store_a = JetStreamSessionStore(cluster.urls, prefix=prefix)
        self.addCleanup(store_a.close)
        port, tracked = yield self.servers.listen(ReliableStreamFactory(store_a, rate=2000))
        number = port.getHost().port
        endpoint = client_endpoint(reactor, "127.0.0.1", number)
        d = StatefulClient(endpoint, 3000, ack_every=16).run()
        before = 0
        for _ in range(500):
            yield task.deferLater(reactor, 0.02, lambda: None)
            known = list(store_a._known.values())
            before = known[0][1].last_id if known else 0
            if before >= 300:
                break
        self.assertTrue(300 <= before < 3000, before)
        yield port.stopListening()
        yield tracked.close_all()
        yield store_a.close()
        store_b = JetStreamSessionStore(cluster.urls, prefix=prefix)
        self.addCleanup(store_b.close)
        port2 = yield TCP4ServerEndpoint(reactor, number, interface="127.0.0.1").listen(
            TrackingFactory(ReliableStreamFactory(store_b)))
        self.addCleanup(port2.stopListening)
        result = yield d
        check_stream(self, result, 3000)
        self.assertGreaterEqual(result.reconnects, 1)
