"""The shared TLS plumbing: our tls: server endpoint and client verification."""

from twisted.internet import defer, protocol, reactor
from twisted.internet.endpoints import serverFromString
from twisted.protocols.basic import LineReceiver
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint, client_tls_options, peer_identity
from test.support.tlsutil import certs


class Echo(LineReceiver):
    def lineReceived(self, line):
        ident = peer_identity(self.transport)
        self.sendLine(line + b" " + (ident["cn"].encode() if ident else b"anonymous"))


class Ask(LineReceiver):
    def connectionMade(self):
        self.answer = defer.Deferred()
        self.closed = defer.Deferred()
        self.sendLine(b"hello")

    def lineReceived(self, line):
        self.answer.callback(line)

    def connectionLost(self, reason):
        self.closed.callback(None)
        if not self.answer.called:
            self.answer.errback(reason)


class TLSEndpointTests(unittest.TestCase):
    timeout = 20

    @defer.inlineCallbacks
    def listen(self, description):
        port = yield serverFromString(reactor, description).listen(
            protocol.Factory.forProtocol(Echo))
        self.addCleanup(port.stopListening)
        return port.getHost().port

    @defer.inlineCallbacks
    def ask(self, port, options):
        endpoint = client_endpoint(reactor, "127.0.0.1", port, options)
        proto = yield endpoint.connect(protocol.Factory.forProtocol(Ask))
        try:
            answer = yield proto.answer
        finally:
            proto.transport.loseConnection()
            yield proto.closed
        return answer

    @defer.inlineCallbacks
    def test_client_certificate_accepted(self):
        port = yield self.listen(certs().server_endpoint())
        answer = yield self.ask(port, certs().client_options())
        self.assertEqual(answer, b"hello test-client")

    @defer.inlineCallbacks
    def test_no_client_certificate_refused(self):
        port = yield self.listen(certs().server_endpoint())
        yield self.assertFailure(self.ask(port, certs().client_options(with_cert=False)),
                                 Exception)

    @defer.inlineCallbacks
    def test_other_ca_refused(self):
        c = certs()
        port = yield self.listen(c.server_endpoint())
        options = client_tls_options("localhost", ca_certs=c.ca, cert=c.other_client_cert,
                                     private_key=c.other_client_key)
        yield self.assertFailure(self.ask(port, options), Exception)

    @defer.inlineCallbacks
    def test_expired_client_refused(self):
        c = certs()
        port = yield self.listen(c.server_endpoint())
        options = client_tls_options("localhost", ca_certs=c.ca, cert=c.expired_client_cert,
                                     private_key=c.expired_client_key)
        yield self.assertFailure(self.ask(port, options), Exception)

    @defer.inlineCallbacks
    def test_optional_client_certificate(self):
        c = certs()
        port = yield self.listen(c.server_endpoint().replace(
            f":caCerts={c.ca}", f":caCerts={c.ca}:requireClientCert=no"))
        answer = yield self.ask(port, c.client_options(with_cert=False))
        self.assertEqual(answer, b"hello anonymous")

    @defer.inlineCallbacks
    def test_ssl_endpoint_without_client_verification(self):
        port = yield self.listen(certs().ssl_endpoint())
        answer = yield self.ask(port, certs().client_options(with_cert=False))
        self.assertEqual(answer, b"hello anonymous")

    @defer.inlineCallbacks
    def test_server_identity_checked(self):
        port = yield self.listen(certs().server_endpoint(client_ca=False))
        options = certs().client_options(with_cert=False, hostname="not-this-host.example")
        yield self.assertFailure(self.ask(port, options), Exception)
