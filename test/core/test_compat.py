"""
streamproto.core.compat against the installed Twisted: each private
attribute it relies on is exercised for real, so a Twisted release that
changes one fails here, by name, rather than in a server.
"""

from twisted.application.internet import StreamServerEndpointService
from twisted.internet import defer, ssl
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web import server
from twisted.web.resource import Resource

from streamproto.core import compat
from test.support.tlsutil import certs


class _Hold(Resource):
    """Keeps every request open (NOT_DONE_YET), remembering them."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests = []

    def render(self, request):
        self.requests.append(request)
        return server.NOT_DONE_YET


def _channel():
    resource = _Hold()
    site = server.Site(resource)
    channel = site.buildProtocol(None)
    channel.makeConnection(StringTransport())
    return channel, resource


class CompatTests(SynchronousTestCase):

    def test_request_gone(self):
        channel, resource = _channel()
        channel.dataReceived(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        request = resource.requests[0]
        self.assertFalse(compat.request_gone(request))
        channel.connectionLost(Failure(Exception("gone")))
        self.assertTrue(compat.request_gone(request))

    def test_request_line(self):
        """
        The request line is known to the channel from the headers on (when
        the request learns its body's length) until the body is complete.
        """
        seen = []

        class Request(server.Request):
            def gotLength(self, length):
                seen.append(compat.request_line(self.channel))
                super().gotLength(length)

            def handleContentChunk(self, data):
                seen.append(compat.request_line(self.channel))
                super().handleContentChunk(data)

        resource = _Hold()
        site = server.Site(resource, requestFactory=Request)
        channel = site.buildProtocol(None)
        channel.makeConnection(StringTransport())
        self.assertEqual(compat.request_line(channel), (b"", b""))
        channel.dataReceived(b"POST /logs/a%20b/records?x=1 HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 3\r\n\r\nab")
        self.assertEqual(seen, [(b"POST", b"/logs/a%20b/records?x=1")] * 2)
        channel.dataReceived(b"c")
        self.assertEqual(len(resource.requests), 1)
        self.assertEqual(compat.request_line(channel), (b"", b""))

    def test_take_buffered_data(self):
        """A pipelined request behind one in progress is held by the channel: we get it."""
        channel, resource = _channel()
        channel.dataReceived(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.dataReceived(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(len(resource.requests), 1)
        channel = resource.requests[0].channel
        held = b"".join(compat.take_buffered_data(channel))
        self.assertIn(b"GET /b HTTP/1.1", held)
        self.assertEqual(compat.take_buffered_data(channel), [])

    def test_redirect_channel_input(self):
        from twisted.web.http import HTTPChannel
        channel = HTTPChannel()
        channel.makeConnection(StringTransport())
        got = []
        compat.redirect_channel_input(channel, got.append)
        channel.dataReceived(b"line one\r\n")
        channel.setRawMode()
        channel.dataReceived(b"raw bytes")
        self.assertEqual(b"".join(got), b"line one\r\nraw bytes")

    def test_endpoint_tls_options(self):
        c = certs()
        endpoint = serverFromString(MemoryReactor(), c.server_endpoint(client_ca=False))
        self.assertIsInstance(compat.endpoint_tls_options(endpoint), ssl.CertificateOptions)
        self.assertIsNone(compat.endpoint_tls_options(
            serverFromString(MemoryReactor(), "tcp:0")))

    def test_fail_at_start(self):
        class Refusing:
            def listen(self, factory):
                return defer.fail(CannotListenError("127.0.0.1", 1, Exception("in use")))
        listener = compat.fail_at_start(StreamServerEndpointService(Refusing(), Factory()))
        self.assertRaises(CannotListenError, listener.privilegedStartService)

    def test_listening_port(self):
        port = object()

        class Listening:
            def listen(self, factory):
                return defer.succeed(port)
        listener = StreamServerEndpointService(Listening(), Factory())
        self.assertIsNone(compat.listening_port(listener))
        listener.privilegedStartService()
        self.assertIs(self.successResultOf(compat.listening_port(listener)), port)


class ReadSizeTests(TestCase):
    """L{compat.set_read_size} on a real TCP transport, under a protocol
    wrapper, as the styx/0 upgrade uses it."""

    @defer.inlineCallbacks
    def test_set_read_size(self):
        from twisted.internet import reactor
        from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
        from twisted.internet.protocol import Protocol
        from twisted.protocols.policies import WrappingFactory

        connected = defer.Deferred()

        class Server(Protocol):
            def connectionMade(self):
                connected.callback(self)

        wrapping = WrappingFactory(Factory.forProtocol(Server))
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(wrapping)
        self.addCleanup(port.stopListening)
        client = yield TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port).connect(
            Factory.forProtocol(Protocol))
        self.addCleanup(client.transport.loseConnection)
        server = yield connected
        self.addCleanup(server.transport.loseConnection)
        wrapper = server.transport                  # the ProtocolWrapper
        tcp_transport = wrapper.transport
        self.assertEqual(tcp_transport.bufferSize, 2 ** 16)      # Twisted's default
        self.assertTrue(compat.set_read_size(wrapper, 1 << 20))
        self.assertEqual(tcp_transport.bufferSize, 1 << 20)
        self.assertNotIn("bufferSize", wrapper.__dict__)          # not on the wrapper
        self.assertFalse(compat.set_read_size(StringTransport(), 1 << 20))
