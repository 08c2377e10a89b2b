"""
Small network helpers the tests share (the operations tests, the torture
suite, the end-to-end tests): a free port, waiting for a condition on the
real reactor, a raw client that keeps what the server sends, a loopback
TCP pair, reading a non-blocking socket dry, and whether a descriptor is
readable.  No tests here.
"""

import select
import socket
import subprocess

from twisted.internet import defer, protocol, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint

from streamproto.core.tls import client_endpoint


def readable(fd, timeout):
    """Whether C{fd} is readable within C{timeout} seconds (poll: a long
    test run's descriptors go past select's 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def drain_socket(sock):
    """Everything a non-blocking C{sock} holds now, up to its end."""
    out = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except BlockingIOError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (for a subprocess to listen on)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def free_ports(n):
    """
    C{n} distinct TCP ports on 127.0.0.1 that were free a moment ago: each
    socket stays bound until all are picked, so that two picks cannot
    return the same port (a cluster's client and route ports once did).
    """
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@defer.inlineCallbacks
def wait_until(predicate, timeout=10.0):
    """Fire once C{predicate()} is true; fail with AssertionError after C{timeout} seconds."""
    waited = 0.0
    while not predicate():
        if waited > timeout:
            raise AssertionError("condition not reached in time")
        yield task.deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


def with_timeout(d, seconds, clock=reactor):
    """C{d}, cancelled if it has not fired within C{seconds} (on C{clock})."""
    timer = clock.callLater(seconds, d.cancel)

    def fired(result):
        if timer.active():
            timer.cancel()
        return result
    return d.addBoth(fired)


class RawClient(protocol.Protocol):
    """
    Keeps what the server sends in C{received} (and hands each chunk to
    C{on_data} when set); C{closed} fires when the connection ends, and
    C{reason} then holds why.
    """

    def __init__(self):
        self.received = bytearray()
        self.closed = defer.Deferred()
        self.reason = None
        self.on_data = None

    def dataReceived(self, data):
        self.received += data
        if self.on_data is not None:
            self.on_data(data)

    def connectionLost(self, reason):
        self.reason = reason   # a Failure: not handed to callback (it would errback)
        if not self.closed.called:   # a test may have cancelled its wait
            self.closed.callback(None)


class Collect(protocol.Protocol):
    """Keeps what it receives; C{done} fires with all of it at the end."""

    def __init__(self):
        self.received = bytearray()
        self.done = defer.Deferred()

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.done.callback(bytes(self.received))


class _ServerSide(protocol.Protocol):
    def connectionMade(self):
        self.factory.connected.callback(self)


@defer.inlineCallbacks
def loopback_pair(testcase):
    """
    A TCP connection on 127.0.0.1 through the real reactor: fires with
    (the server's protocol, a L{Collect} client).  The listening port is
    closed at C{testcase}'s cleanup.
    """
    factory = protocol.Factory.forProtocol(_ServerSide)
    factory.connected = defer.Deferred()
    port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
    testcase.addCleanup(port.stopListening)
    client = Collect()
    yield TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port).connect(
        protocol.Factory.forProtocol(lambda: client))
    server = yield factory.connected
    return server, client


def connect(port, client=None, tls=None):
    """
    Connect C{client} (a protocol instance; a new L{RawClient} by default)
    to 127.0.0.1:C{port}, over TLS with C{tls} (client TLS options).
    """
    client = client if client is not None else RawClient()
    endpoint = client_endpoint(reactor, "127.0.0.1", port, tls)
    return endpoint.connect(protocol.Factory.forProtocol(lambda: client))


def start_process(testcase, args, **popen_kwargs):
    """
    C{subprocess.Popen(args)} with its output (stdout and stderr) on
    C{process.stdout}; killed and reaped at the end of C{testcase} if it is
    still running.
    """
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               **popen_kwargs)

    def kill():
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()
    testcase.addCleanup(kill)
    return process


class ProcessOutput(protocol.ProcessProtocol):
    """
    A child's stdout, stderr and exit code (C{ended} fires with the three),
    after feeding it C{stdin} (None: leave its stdin open).
    """

    def __init__(self, stdin=None):
        self.stdin = stdin
        self.out = bytearray()
        self.err = bytearray()
        self.ended = defer.Deferred()

    def connectionMade(self):
        if self.stdin is not None:
            self.transport.write(self.stdin)
            self.transport.closeStdin()

    def outReceived(self, data):
        self.out += data

    def errReceived(self, data):
        self.err += data

    def processEnded(self, reason):
        self.ended.callback((bytes(self.out), bytes(self.err), reason.value.exitCode))
