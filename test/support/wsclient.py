"""
A WebSocket client for the tests, on wsproto.

C{twisted.web.websocket}'s client (Twisted 26.10) does not do what the
tests need: it sends no extra request headers (C{Authorization}, the
C{X-HTTP-Method-Override} of a browser's produce), and its
C{loseConnection} drops TCP right behind its Close, so a test could not
see when the server answers the closing handshake.
"""

from twisted.internet import defer, reactor
from twisted.internet.protocol import Factory, Protocol
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Message, Ping,
                            RejectConnection, RejectData, Request, TextMessage)

#: Seconds to wait for the server's side of the closing handshake (the
#: server may hold its answer back while it syncs).
CLOSE_TIMEOUT = 15


class Refused(Exception):
    """The server answered the opening handshake with C{status}, not 101."""

    def __init__(self, status, body=b""):
        super().__init__(status)
        self.status = status
        self.body = body

    def __str__(self):
        return f"refused: {self.status} {self.body!r}"


class WebSocketClient(Protocol):
    """
    Opens C{path}, then records what comes.

    @ivar opened: fires with the client once the server accepted the
        upgrade; fails with L{Refused} otherwise.
    @ivar closed: fires with C{(was_clean, code)} once the connection is
        gone: clean when Close frames went both ways before it.
    @ivar received: C{(payload, is_binary)} per message.
    @ivar close_reason: the reason in the server's Close.
    """

    def __init__(self, host, path, headers=None, clock=reactor):
        self.host = host
        self.path = path
        self.headers = headers or {}
        self.clock = clock
        self.received = []
        self.opened = defer.Deferred()
        self.closed = defer.Deferred()
        self.close_code = None
        self.close_reason = None
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._message = []
        self._refused = None
        self._close_timer = None

    @property
    def is_open(self):
        return self._ws.state is ConnectionState.OPEN and self.opened.called

    def connectionMade(self):
        extra = [(k.encode(), v.encode()) for k, v in self.headers.items()]
        self.transport.write(self._ws.send(
            Request(host=self.host, target=self.path, extra_headers=extra)))

    def send(self, payload, binary=True):
        """Send one message (bytes; as text if not C{binary})."""
        event = BytesMessage(payload) if binary else TextMessage(payload.decode("utf-8"))
        self.transport.write(self._ws.send(event))

    def close(self, code=1000, reason=""):
        """Start the closing handshake; drop the connection if unanswered."""
        if self._ws.state is ConnectionState.OPEN:
            self.transport.write(self._ws.send(CloseConnection(code, reason)))
            self._close_timer = self.clock.callLater(CLOSE_TIMEOUT,
                                                     self.transport.abortConnection)

    def dataReceived(self, data):
        if self._ws.state is ConnectionState.CLOSED:
            return
        self._ws.receive_data(data)
        for event in self._ws.events():
            if isinstance(event, AcceptConnection):
                self.opened.callback(self)
            elif isinstance(event, RejectConnection):
                self._refused = Refused(event.status_code)
                if not event.has_body:
                    self.transport.loseConnection()
            elif isinstance(event, RejectData):
                self._refused.body += event.data
                if event.body_finished:     # the HTTP response is whole: done
                    self.transport.loseConnection()
            elif isinstance(event, Message):
                data = event.data.encode("utf-8") if isinstance(event, TextMessage) else event.data
                self._message.append(data)
                if event.message_finished:
                    self.received.append((b"".join(self._message),
                                          isinstance(event, BytesMessage)))
                    self._message = []
            elif isinstance(event, Ping):
                if self._ws.state is ConnectionState.OPEN:
                    self.transport.write(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self.close_code, self.close_reason = event.code, event.reason
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    self.transport.write(self._ws.send(event.response()))
                # RFC 6455 7.1.1: the server closes TCP first; give it the time
                if self._close_timer is None:
                    self._close_timer = self.clock.callLater(
                        CLOSE_TIMEOUT, self.transport.abortConnection)

    def connectionLost(self, reason):
        if self._close_timer is not None and self._close_timer.active():
            self._close_timer.cancel()
        if not self.opened.called:
            self.opened.errback(self._refused or Refused(None))
        was_clean = self._ws.state is ConnectionState.CLOSED
        # 1006: no Close frame came (RFC 6455 7.1.5)
        self.closed.callback((was_clean, 1006 if self.close_code is None else self.close_code))


def connect(endpoint, url, headers=None):
    """
    Connect a L{WebSocketClient} to C{url} (C{ws://host:port/path}) through
    C{endpoint}.

    @return: a Deferred firing with the connected client, not yet open.
    """
    rest = url.split("://", 1)[1]
    host, _, path = rest.partition("/")
    return endpoint.connect(Factory.forProtocol(
        lambda: WebSocketClient(host, "/" + path, headers)))
