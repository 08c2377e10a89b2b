"""
What the per-protocol operations tests (test_ops_<proto>.py) share: a
server built the way twistd builds it, a scripted raw client, metric
samples.  No tests here.
"""

import os
import socket
import tempfile

from prometheus_client import REGISTRY
from twisted.internet import defer, protocol, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint


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
def wait_until(predicate, timeout=10.0):
    waited = 0.0
    while not predicate():
        if waited > timeout:
            raise AssertionError("condition not reached in time")
        yield task.deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


def free_port():
    """A TCP port free right now on 127.0.0.1 (for a subprocess to listen on)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


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


class RawClient(protocol.Protocol):
    """Collects what the server sends; C{closed} fires when the connection ends."""

    def __init__(self):
        self.received = bytearray()
        self.closed = defer.Deferred()
        self.on_data = None

    def dataReceived(self, data):
        self.received += data
        if self.on_data is not None:
            self.on_data(data)

    def connectionLost(self, reason):
        self.closed.callback(None)


def connect(port, client=None, tls=None):
    """Connect C{client} (a protocol instance) to 127.0.0.1:C{port}, over TLS
    with C{tls} (client TLS options)."""
    client = client if client is not None else RawClient()
    if tls is None:
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
    else:
        from streamproto.core.tls import client_endpoint
        endpoint = client_endpoint(reactor, "127.0.0.1", port, tls)
    return endpoint.connect(protocol.Factory.forProtocol(lambda: client))
