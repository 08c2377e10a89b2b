"""Operations plumbing: connection tracking, drain, metrics and health endpoints."""

import json
import tempfile

import treq
from prometheus_client import REGISTRY
from twisted.application import service
from twisted.internet import defer, protocol, reactor
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.logger import ILogObserver
from twisted.python.failure import Failure
from twisted.trial import unittest
from zope.interface import implementer

from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.ops import HealthResource, TrackingFactory, store_problems
from streamproto.core.tap import ServerOptions, server_service
from streamproto.log import MemoryLogStore
from test.support.netutil import connect


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Echo(protocol.Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


@implementer(IGracefulShutdown)
class Polite(Echo):
    """Says goodbye its own way on shutdown."""

    def gracefulShutdown(self):
        self.transport.write(b"bye")
        self.transport.loseConnection()
        return defer.succeed(None)


@implementer(IGracefulShutdown)
class Stuck(Echo):
    def gracefulShutdown(self):
        return defer.Deferred()  # never finishes: the deadline must abort it


class Undeclared(Echo):
    """A method of that name, without the interface: not called."""

    def gracefulShutdown(self):
        self.transport.write(b"bye")
        return defer.Deferred()


class Client(protocol.Protocol):
    def connectionMade(self):
        self.received = b""
        self.closed = defer.Deferred()
        self.got = defer.Deferred()

    def dataReceived(self, data):
        self.received += data
        if not self.got.called:
            self.got.callback(data)

    def connectionLost(self, reason):
        self.closed.callback(None)


class Options(ServerOptions):
    defaultPort = "tcp:0:interface=127.0.0.1"


@defer.inlineCallbacks
def start_service(testcase, proto, name, args=()):
    """
    Start a service of C{proto}s (options C{args}; stopped at the end of
    C{testcase} if it still runs): the service and its listening ports.
    """
    o = Options()
    o.parseOptions(["--data", tempfile.mkdtemp()] + list(args))
    top = server_service(o, lambda store: protocol.Factory.forProtocol(proto), name=name)
    top.startService()
    testcase.addCleanup(lambda: top.running and top.stopService())
    listeners = [c for c in top if getattr(c, "_streamproto_listener", False)]
    ports = yield defer.gatherResults([c._waitingForPort for c in listeners])
    return top, [p.getHost().port for p in ports]


class TrackingTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def start(self, proto, name, shutdown_timeout=3.0, metrics=False):
        args = ["--shutdown-timeout", str(shutdown_timeout)]
        if metrics:
            args += ["--metrics", "tcp:0:interface=127.0.0.1"]
        self.top, ports = yield start_service(self, proto, name, args)
        return ports

    @defer.inlineCallbacks
    def echoed_client(self, proto, name, **start_options):
        """A client of a new service of C{proto}s, once a first byte was echoed."""
        (port,) = yield self.start(proto, name, **start_options)
        c = yield connect(port, Client())
        c.transport.write(b"x")
        yield c.got
        return c

    @defer.inlineCallbacks
    def test_counts_connections_and_bytes(self):
        (port,) = yield self.start(Echo, "t-count")
        before = sample("streamproto_connections_total", server="t-count")
        c = yield connect(port, Client())
        c.transport.write(b"hello")
        yield c.got
        self.assertEqual(sample("streamproto_connections_open", server="t-count"), 1)
        self.assertEqual(sample("streamproto_connections_total", server="t-count"), before + 1)
        self.assertEqual(sample("streamproto_received_bytes_total", server="t-count"), 5)
        self.assertEqual(sample("streamproto_sent_bytes_total", server="t-count"), 5)
        c.transport.loseConnection()
        yield c.closed
        yield self.top.stopService()
        self.assertEqual(sample("streamproto_connections_open", server="t-count"), 0)

    @defer.inlineCallbacks
    def test_drain_uses_graceful_shutdown(self):
        c = yield self.echoed_client(Polite, "t-polite")
        yield self.top.stopService()
        yield c.closed
        self.assertEqual(c.received, b"xbye")

    @defer.inlineCallbacks
    def test_drain_closes_plain_protocols(self):
        c = yield self.echoed_client(Echo, "t-plain")
        yield self.top.stopService()
        yield c.closed

    @defer.inlineCallbacks
    def test_drain_asks_the_interface(self):
        """Only an L{IGracefulShutdown} provider is asked to shut down; a
        protocol that merely has a method of that name is closed plainly."""
        c = yield self.echoed_client(Undeclared, "t-undeclared")
        yield self.top.stopService()
        yield c.closed
        self.assertEqual(c.received, b"x")

    @defer.inlineCallbacks
    def test_drain_deadline_aborts(self):
        c = yield self.echoed_client(Stuck, "t-stuck", shutdown_timeout=0.2)
        started = reactor.seconds()
        yield self.top.stopService()
        yield c.closed
        self.assertLess(reactor.seconds() - started, 5)

    @defer.inlineCallbacks
    def test_metrics_and_health_endpoints(self):
        port, metrics_port = yield self.start(Echo, "t-metrics", metrics=True)
        base = f"http://127.0.0.1:{metrics_port}"
        r = yield treq.get(base + "/metrics", persistent=False)
        body = yield r.text()
        self.assertEqual(r.code, 200)
        self.assertIn("streamproto_connections_open", body)
        r = yield treq.get(base + "/health", persistent=False)
        self.assertEqual(json.loads((yield r.text())), {"alive": True})
        r = yield treq.get(base + "/ready", persistent=False)
        self.assertEqual(r.code, 200)
        yield self.top.stopService()

    def test_json_log_format_installs_observer(self):
        o = Options()
        o.parseOptions(["--data", tempfile.mkdtemp(), "--log-format", "json"])
        # a reactor of its own: a server at the top of an application tunes
        # the process (its timers, the collector), not this test run's
        from twisted.internet.testing import MemoryReactorClock
        top = server_service(o, lambda store: protocol.Factory.forProtocol(Echo), name="t-json",
                             reactor=MemoryReactorClock())
        app = service.Application("t")
        top.setServiceParent(app)  # as twistd does
        self.assertIsNotNone(app.getComponent(ILogObserver, None))

    def test_tracking_factory_exposes_wrapped_attributes(self):
        f = protocol.Factory.forProtocol(Echo)
        f.store = "the store"
        self.assertEqual(TrackingFactory(f, "t-attr").store, "the store")


class ReadinessTests(unittest.SynchronousTestCase):
    def test_ready_flips_on_failed_log(self):
        store = MemoryLogStore()
        log = self.successResultOf(store.create("events"))
        self.assertEqual(store_problems([store]), [])
        log.failed = OSError("fsync failed")
        self.assertEqual(store_problems([store]), ["log events: corrupt: fsync failed"])
        store.close()
        self.assertIn("store closed", store_problems([store]))

    def test_health_resource(self):
        from twisted.web.test.requesthelper import DummyRequest
        problems = []
        res = HealthResource(lambda: problems)
        req = DummyRequest([b"ready"])
        req.path = b"/ready"
        self.assertEqual(json.loads(res.render_GET(req))["ready"], True)
        problems.append("log x: tainted")
        req = DummyRequest([b"ready"])
        req.path = b"/ready"
        body = json.loads(res.render_GET(req))
        self.assertEqual((req.responseCode, body["ready"]), (503, False))


class StatusTests(unittest.TestCase):
    timeout = 30

    def test_summary_and_rates(self):
        from streamproto import status
        text = (
            '# TYPE streamproto_connections_open gauge\n'
            'streamproto_connections_open{server="styx"} 3.0\n'
            '# TYPE streamproto_records_in counter\n'
            'streamproto_records_in_total{server="styx"} 1000.0\n'
            '# TYPE streamproto_log_size_bytes gauge\n'
            'streamproto_log_size_bytes{log="events"} 2000000.0\n'
            '# TYPE streamproto_log_failed gauge\n'
            'streamproto_log_failed{log="events"} 0.0\n')
        now = status.summarise(text)
        self.assertEqual(now["servers"]["styx"]["open"], 3.0)
        self.assertEqual(now["logs"]["events"]["size"], 2000000.0)
        before = status.summarise(text.replace("1000.0", "400.0"))
        out = status.render(now, before, 2.0)
        self.assertIn("300", out)  # (1000 - 400) / 2 records/s
        self.assertIn("events", out)
        self.assertIn("2.00", out)

    def test_internal_logs_are_one_line(self):
        from streamproto import status
        text = "".join(
            f'streamproto_log_size_bytes{{log="{name}"}} 1000000.0\n'
            f'streamproto_log_failed{{log="{name}"}} {failed}\n'
            for name, failed in (("events", 0), ("pravega-controller", 0),
                                 ("pravega_a_2fb", 1), ("pravega_c_2fd", 0)))
        out = status.render(status.summarise(text))
        self.assertIn("events", out)
        self.assertNotIn("pravega_", out)
        self.assertNotIn("pravega-controller", out)
        line = [x for x in out.splitlines() if x.startswith("(internal, 3 logs)")]
        self.assertEqual(len(line), 1, out)
        self.assertIn("3.00", line[0])
        self.assertIn("FAILED (1)", line[0])

    @defer.inlineCallbacks
    def test_cli_against_a_server(self):
        import io

        from twisted.internet.threads import deferToThread

        from streamproto import status
        _, ports = yield start_service(self, Echo, "t-st",
                                       ["--metrics", "tcp:0:interface=127.0.0.1"])
        url = f"http://127.0.0.1:{ports[1]}/metrics"
        out = io.StringIO()
        code = yield deferToThread(status.main, ["--once", "--metrics", url], out)
        self.assertEqual(code, 0)
        self.assertIn("t-st", out.getvalue())
        code = yield deferToThread(status.main, ["--once", "--metrics",
                                                 "http://127.0.0.1:1/metrics"], io.StringIO())
        self.assertEqual(code, 1)


class HalfCloseTests(unittest.TestCase):
    """The tracking wrapper passes a client's half-close on to the protocol."""

    timeout = 30

    @defer.inlineCallbacks
    def test_half_close_reaches_protocol(self):
        from twisted.internet.interfaces import IHalfCloseableProtocol
        from zope.interface import implementer

        @implementer(IHalfCloseableProtocol)
        class AnswerAtEOF(protocol.Protocol):
            def connectionMade(self):
                self.got = b""

            def dataReceived(self, data):
                self.got += data

            def readConnectionLost(self):
                # the request is complete: answer on the still-open half
                self.transport.write(b"got " + self.got)
                self.transport.loseConnection()

            def writeConnectionLost(self):
                pass

        _, (port,) = yield start_service(self, AnswerAtEOF, "t-half")
        c = yield connect(port, Client())
        c.transport.write(b"request")
        c.transport.loseWriteConnection()
        yield c.closed
        self.assertEqual(c.received, b"got request")

    @defer.inlineCallbacks
    def test_server_half_close_keeps_reading(self):
        """
        A protocol that half-closes (sends its last bytes, then
        loseWriteConnection) still receives what the client sends after
        that: the wrapper must not turn the end of our writing into a close
        (a client acking late would get a reset and "broken pipe").
        """
        got_after = []
        heard = defer.Deferred()

        class SayByeThenListen(protocol.Protocol):
            def connectionMade(self):
                self.transport.write(b"bye")
                self.transport.loseWriteConnection()

            def dataReceived(self, data):
                got_after.append(data)
                self.transport.loseConnection()
                if not heard.called:
                    heard.callback(None)

        _, (port,) = yield start_service(self, SayByeThenListen, "t-linger")

        from twisted.internet.interfaces import IHalfCloseableProtocol
        from zope.interface import implementer

        @implementer(IHalfCloseableProtocol)
        class LateAcker(Client):
            def readConnectionLost(self):
                # the server is done sending: ack what we read, late, then close
                self.transport.write(b"ack " + self.received)
                self.transport.loseConnection()

            def writeConnectionLost(self):
                pass

        c = yield connect(port, LateAcker())
        yield c.closed
        yield heard
        self.assertEqual(c.received, b"bye")
        self.assertEqual(got_after, [b"ack bye"])


class HostAddressTests(unittest.SynchronousTestCase):
    """twisted.web asks for a connection's own address on every request."""

    def test_asked_of_the_transport_once(self):
        transport = StringTransport()
        asked = []
        real = transport.getHost
        transport.getHost = lambda: asked.append(1) or real()
        factory = TrackingFactory(protocol.Factory.forProtocol(Echo), "t-host")
        wrapper = factory.buildProtocol(None)
        wrapper.makeConnection(transport)
        self.assertEqual([wrapper.getHost(), wrapper.getHost()], [real(), real()])
        self.assertEqual(len(asked), 1)
        wrapper.connectionLost(Failure(ConnectionDone()))
