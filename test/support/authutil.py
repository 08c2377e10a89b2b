"""
What the authorization tests share: a policy allowing certificate
C{cn:alice} everything and nothing to C{cn:bob}, a raw TLS exchange, and
the denial counter.
"""

import os
import tempfile

from twisted.internet import defer, protocol, reactor

from streamproto.core import metrics
from streamproto.core.auth import hash_token
from streamproto.core.tls import client_endpoint
from test.support.tlsutil import certs

POLICY = """
[tokens]
dashboards = "%s"

[[allow]]
principal = "cn:alice"
logs = ["*"]
ops = ["read", "write", "admin"]

[[allow]]
principal = "token:dashboards"
logs = ["events"]
ops = ["read"]
""" % hash_token("dash-token")


def write_policy(case, text=POLICY):
    """A policy file removed after the test.  @return: its path."""
    fd, path = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    case.addCleanup(os.unlink, path)
    return path


def denied_count(server, op):
    """C{streamproto_auth_denied_total{server, op}} now."""
    return metrics.REGISTRY.get_sample_value(
        "streamproto_auth_denied_total", {"server": server, "op": op}) or 0


def tls_as(cn):
    """Client TLS options presenting certificate C{cn} (None: no certificate)."""
    if cn is None:
        return certs().client_options(with_cert=False)
    return certs().client_options_for(cn)


class _Exchange(protocol.Protocol):
    def __init__(self, data, until):
        self.data = data
        self.until = until
        self.received = b""
        self.done = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.data)

    def dataReceived(self, data):
        self.received += data
        if self.until is not None and self.until(self.received):
            self.transport.loseConnection()

    def connectionLost(self, reason):
        self.done.callback(self.received)


@defer.inlineCallbacks
def exchange(port, cn, data, until=None, timeout=15):
    """
    Connect over TLS as C{cn}, send C{data}, and collect what the server
    sends until it closes (or C{until(received)} is true: then we close).
    @return: Deferred firing with the bytes received.
    """
    proto = _Exchange(data, until)
    factory = protocol.Factory.forProtocol(lambda: proto)
    yield client_endpoint(reactor, "127.0.0.1", port, tls_as(cn)).connect(factory)
    timer = reactor.callLater(timeout, proto.transport.abortConnection)
    received = yield proto.done
    if timer.active():
        timer.cancel()
    return received
