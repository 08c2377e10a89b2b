"""
TLS clients that offer ALPN (curl, browsers, Go's net/http, the Go styx CLI
over https) against an HTTP server wrapped in L{TrackingFactory}, as every
C{twistd} server is: the handshake must negotiate http/1.1, not fail.
"""

from twisted.internet import defer, protocol, reactor, ssl
from twisted.internet.endpoints import serverFromString, wrapClientTLS
from twisted.internet.interfaces import IProtocolNegotiationFactory
from twisted.trial import unittest

from streamproto.core.ops import TrackingFactory
from streamproto.core.tls import _pem_certificates, client_endpoint
from streamproto.log import MemoryLogStore
from streamproto.styx.resource import make_site
from test.support.tlsutil import certs


class OneRequest(protocol.Protocol):
    """Sends one HTTP request, collects the answer until the server closes."""

    def __init__(self):
        self.received = b""
        self.negotiated = None
        self.reason = None
        self.closed = defer.Deferred()

    def connectionMade(self):
        self.transport.write(b"GET /logs HTTP/1.1\r\nHost: localhost\r\n"
                             b"Connection: close\r\n\r\n")

    def dataReceived(self, data):
        if self.negotiated is None:
            self.negotiated = self.transport.negotiatedProtocol
        self.received += data

    def connectionLost(self, reason):
        self.reason = reason
        self.closed.callback(None)


@defer.inlineCallbacks
def exchange(testcase, endpoint, factory, client, client_cert=False):
    """
    Serve C{factory} on C{endpoint}, connect C{client} (a protocol with a
    C{closed} Deferred) over TLS offering ALPN h2 and http/1.1, and wait
    until the connection ends.
    """
    port = yield endpoint.listen(factory)
    testcase.addCleanup(port.stopListening)
    kwargs = {}
    if client_cert:
        kwargs["clientCertificate"] = ssl.PrivateCertificate.loadPEM(
            open(certs().client_key, "rb").read() + open(certs().client_cert, "rb").read())
    options = ssl.optionsForClientTLS(
        "localhost", trustRoot=ssl.trustRootFromCertificates(_pem_certificates(certs().ca)),
        acceptableProtocols=[b"h2", b"http/1.1"], **kwargs)
    yield wrapClientTLS(options, client_endpoint(reactor, "127.0.0.1",
                                                 port.getHost().port)).connect(
        protocol.Factory.forProtocol(lambda: client))
    yield client.closed
    return client


class TrackingFactoryALPNTests(unittest.TestCase):

    def _request(self, endpoint_string):
        site = TrackingFactory(make_site(MemoryLogStore(reactor), timeout=30), "styx-server")
        return exchange(self, serverFromString(reactor, endpoint_string), site, OneRequest())

    @defer.inlineCallbacks
    def test_alpn_client_over_ssl(self):
        client = yield self._request(certs().ssl_endpoint())
        self.assertTrue(client.received.startswith(b"HTTP/1.1 200 "), client.reason)
        self.assertEqual(client.negotiated, b"http/1.1")

    @defer.inlineCallbacks
    def test_alpn_client_over_mtls(self):
        # requireClientCert=no: an anonymous ALPN client (curl without --cert)
        client = yield self._request(certs().server_endpoint() + ":requireClientCert=no")
        self.assertTrue(client.received.startswith(b"HTTP/1.1 200 "), client.reason)
        self.assertEqual(client.negotiated, b"http/1.1")


class TrackingFactoryInterfaceTests(unittest.SynchronousTestCase):

    def test_only_negotiating_factories(self):
        # a factory that does not negotiate must not look as if it did: TLS would
        # call acceptableProtocols() on it
        plain = TrackingFactory(protocol.Factory.forProtocol(protocol.Protocol), "plain")
        self.assertFalse(IProtocolNegotiationFactory.providedBy(plain))
        site = TrackingFactory(make_site(MemoryLogStore(reactor), timeout=30), "styx")
        self.assertTrue(IProtocolNegotiationFactory.providedBy(site))
        self.assertIn(b"http/1.1", site.acceptableProtocols())


class Echo(protocol.Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


class EchoOnce(protocol.Protocol):
    """Sends a line, closes once it is echoed."""

    def __init__(self):
        self.received = b""
        self.negotiated = "unset"
        self.reason = None
        self.closed = defer.Deferred()

    def connectionMade(self):
        self.transport.write(b"ping\n")

    def dataReceived(self, data):
        self.negotiated = self.transport.negotiatedProtocol
        self.received += data
        if self.received.endswith(b"\n"):
            self.transport.loseConnection()

    def connectionLost(self, reason):
        self.reason = reason
        self.closed.callback(None)


class NonHTTPServerALPNTests(unittest.TestCase):
    """
    A server that speaks no ALPN protocol (every protocol here but HTTP),
    listening through L{streamproto.core.tap.server_endpoint} as under
    twistd: a client offering ALPN protocols is served without ALPN.
    """

    def _echo(self, endpoint_string, client_cert=False):
        from streamproto.core.tap import server_endpoint
        factory = TrackingFactory(protocol.Factory.forProtocol(Echo), "echo")
        return exchange(self, server_endpoint(endpoint_string, reactor), factory, EchoOnce(),
                        client_cert)

    @defer.inlineCallbacks
    def test_ssl(self):
        client = yield self._echo(certs().ssl_endpoint())
        self.assertEqual(client.received, b"ping\n", client.reason)
        self.assertIsNone(client.negotiated)

    @defer.inlineCallbacks
    def test_mtls(self):
        client = yield self._echo(certs().server_endpoint(), client_cert=True)
        self.assertEqual(client.received, b"ping\n", client.reason)
        self.assertIsNone(client.negotiated)
