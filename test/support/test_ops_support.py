"""
What the per-protocol operations tests (test_ops_<proto>.py) share: a
server built the way twistd builds it, metric samples (the raw client
and the other network helpers are in L{test.support.netutil}).  No tests here.
"""

import json
import os
import tempfile

import treq
from prometheus_client import REGISTRY
from twisted.internet import defer

from streamproto.core import metrics
from streamproto.log import open_store
from streamproto.log.errors import LogFailed


def sample(name, **labels):
    """A metric's current value (0 when the series does not exist yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Samples:
    """Before/after comparisons of several series of one server."""

    NAMES = ("streamproto_records_in_total", "streamproto_records_out_total",
             "streamproto_acks_sent_total", "streamproto_backpressure_pauses_total",
             "streamproto_connections_total")

    def __init__(self, server):
        self.server = server
        self.before = {n: sample(n, server=server) for n in self.NAMES}

    def delta(self, name):
        return sample(name, server=self.server) - self.before[name]

    def error_delta(self, code, before=0.0):
        return sample("streamproto_protocol_errors_total", server=self.server, code=code) - before


@defer.inlineCallbacks
def stored_records(data, name):
    """Every record of log C{name} in the store at C{data} (its server stopped)."""
    store = open_store(data)
    try:
        log = yield store.get(name)
        batch = yield log.read(0, max_bytes=1 << 30)
    finally:
        yield store.close()
    return list(batch.records())


class RunningService:
    """A server's service from its tap's C{makeService}, listening on 127.0.0.1:0."""

    def __init__(self, tap, args=(), data=None, shutdown_timeout=5.0, port=0, listen=None,
                 store=None):
        self.data = data or os.path.join(tempfile.mkdtemp(), "data")
        options = tap.Options()
        listen = listen or f"tcp:{port}:interface=127.0.0.1"
        options.parseOptions(["--data", self.data, "--port", listen,
                              "--shutdown-timeout", str(shutdown_timeout)] + list(args))
        self.options = options
        # with a store given, the service shares it (as under twistd streamproto)
        self.top = tap.makeService(options, store=store)

    @defer.inlineCallbacks
    def start(self, testcase):
        self.top.startService()
        testcase.addCleanup(self.stop)
        listeners = [c for c in self.top if getattr(c, "_streamproto_listener", False)]
        ports = yield defer.gatherResults([c._waitingForPort for c in listeners])
        self.ports = [p.getHost().port for p in ports]
        return self.ports

    @property
    def port(self):
        return self.ports[0]

    @property
    def store(self):
        for child in self.top:
            store = getattr(child, "store", None)
            if store is not None:
                return store
        return None

    def stop(self):
        if self.top.running:
            return self.top.stopService()
        return None


@defer.inlineCallbacks
def start_on_faulty_store(testcase, tap, args=()):
    """
    Start C{tap}'s service with metrics on a file store shared in (as under
    C{twistd streamproto}) whose fsyncs fail once the test sets
    C{io.fail_fsync}: C{(io, the service's port, the metrics base URL)}.
    """
    from streamproto.log.filestore import FileLogStore
    from test.log.test_log import FaultyIO

    io = FaultyIO()
    store = FileLogStore(tempfile.mkdtemp(), io=io, retention_interval=None)
    testcase.addCleanup(store.close)
    # a store shared in is reported by its owner (the umbrella's StoreService)
    metrics.observe_store(store)
    testcase.addCleanup(metrics.forget_store, store)
    server = RunningService(tap, list(args) + ["--metrics", "tcp:0:interface=127.0.0.1"],
                            store=store)
    port, metrics_port = yield server.start(testcase)
    return io, port, f"http://127.0.0.1:{metrics_port}"


@defer.inlineCallbacks
def assert_log_failed(testcase, base, log_name):
    """
    After log C{log_name} fail-stopped: /ready is 503 naming it, /health
    still 200, /metrics shows it failed, and its LogFailed was logged as
    one line (the store says why), not as a traceback.
    """
    r = yield treq.get(base + "/ready", persistent=False)
    body = json.loads((yield r.text()))
    testcase.assertEqual((r.code, body["ready"]), (503, False))
    testcase.assertIn("log " + log_name, body["problems"][0])
    r = yield treq.get(base + "/health", persistent=False)
    testcase.assertEqual(r.code, 200)
    yield r.content()
    r = yield treq.get(base + "/metrics", persistent=False)
    testcase.assertIn(f'streamproto_log_failed{{log="{log_name}"}} 1.0', (yield r.text()))
    testcase.assertEqual(testcase.flushLoggedErrors(LogFailed), [])


class ShutdownWhileStreamingTests:
    """
    Mixin for a protocol's ops test case: its C{shutdown_while_streaming(
    listen=None, tls=None)} run over TCP and over mTLS (client certificates
    required).
    """

    def test_shutdown_while_streaming(self):
        return self.shutdown_while_streaming()

    def test_shutdown_while_streaming_mtls(self):
        from test.support.tlsutil import certs
        return self.shutdown_while_streaming(certs().server_endpoint(),
                                             certs().client_options(with_cert=True))
