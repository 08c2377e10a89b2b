"""
The private Twisted attributes streamproto relies on, in one place.

Twisted has no public way to do these few things; each is used here and
only here, and C{test/core/test_compat.py} checks each against the installed
Twisted, so a release that renames one fails that test loudly instead of
breaking a server at run time.

- L{request_gone}: whether a C{twisted.web} request lost its connection
  (C{Request._disconnected}; C{notifyFinish} tells it once, asynchronously,
  but a streaming renderer needs to ask at any moment).
- L{request_line}: the method and path of the request whose body an
  C{HTTPChannel} is receiving (C{HTTPChannel._command}, C{_path}): the
  request gets them only once its body is complete, but a request that
  streams or refuses its body must route on them as soon as its length is
  known.
- L{take_buffered_data}: the bytes an C{HTTPChannel} read past a request's
  headers and holds for the next request (C{HTTPChannel._dataBuffer}), for
  a connection upgraded to another protocol (styx/0).
- L{redirect_channel_input}: what the channel still receives from the read
  it is in goes to the new protocol (C{rawDataReceived}/C{lineReceived} of
  C{LineReceiver}, on the instance).
- L{endpoint_tls_options}: the C{CertificateOptions} of an C{ssl:} server
  endpoint (C{SSL4ServerEndpoint._sslContextFactory}), to accept clients
  that offer ALPN protocols we do not speak.
- L{fail_at_start}: a listening service that raises from
  C{privilegedStartService} when it cannot bind, as C{strports.service}
  does (C{StreamServerEndpointService._raiseSynchronously}).
- L{listening_port}: the Deferred of a listening service's port
  (C{StreamServerEndpointService._waitingForPort}).
- L{replace_protocol}: give a connection to another protocol
  (C{Connection.protocol} of a TCP connection; the wrapped protocol of a
  TLS layer or other protocol wrapper), for an upgrade (styx/0) or a
  server that hands a connection from its own HTTP parser to twisted.web.
- L{set_read_size}: how many bytes a TCP connection reads from its socket
  at once (C{FileDescriptor.bufferSize}, documented only as an attribute;
  64 KiB by default), for streams that take bulk input.
"""

from collections.abc import Callable

from twisted.application.internet import StreamServerEndpointService
from twisted.internet import ssl
from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import SSL4ServerEndpoint
from twisted.internet.interfaces import IListeningPort, IStreamServerEndpoint
from twisted.protocols.policies import ProtocolWrapper
from twisted.web.http import HTTPChannel, Request


def request_gone(request: Request) -> bool:
    """Whether C{request}'s connection was lost (it may not be finished)."""
    return bool(request._disconnected)


def request_line(channel: HTTPChannel) -> tuple[bytes, bytes]:
    """
    The method and the raw path (with its query) of the request C{channel}
    is receiving, as bytes, from its headers on until its body is complete;
    C{(b"", b"")} outside a request.
    """
    return (getattr(channel, "_command", b"") or b"",
            getattr(channel, "_path", b"") or b"")


def take_buffered_data(channel: HTTPChannel) -> list[bytes]:
    """Remove and return the bytes C{channel} holds for later requests."""
    buffered = getattr(channel, "_dataBuffer", None)
    if not buffered:
        return []
    channel._dataBuffer = []
    return list(buffered)


def redirect_channel_input(channel: HTTPChannel, receive: Callable[[bytes], object]) -> None:
    """Send whatever C{channel} still parses from its current read to C{receive(bytes)}."""
    channel.rawDataReceived = receive  # type: ignore[method-assign,assignment]
    channel.lineReceived = (  # type: ignore[method-assign]
        lambda line: receive(line + b"\r\n"))


def forget_requests(channel: HTTPChannel) -> None:
    """
    Drop C{channel}'s list of its requests once its connection was taken
    over (an upgrade): each request points back at its channel, a cycle
    only a full collection would free, and servers make those rarely
    (L{streamproto.core.gcpolicy}).  Without the list, the two go as soon
    as nothing else holds them.
    """
    del channel.requests[:]


def endpoint_tls_options(endpoint: IStreamServerEndpoint) -> ssl.CertificateOptions | None:
    """The C{CertificateOptions} of an C{ssl:} server endpoint, or None."""
    if not isinstance(endpoint, SSL4ServerEndpoint):
        return None
    options = getattr(endpoint, "_sslContextFactory", None)
    return options if isinstance(options, ssl.CertificateOptions) else None


def fail_at_start(listener: StreamServerEndpointService) -> StreamServerEndpointService:
    """Make a C{StreamServerEndpointService} raise at start when it cannot listen."""
    listener._raiseSynchronously = True
    return listener


def listening_port(
    listener: StreamServerEndpointService,
) -> Deferred[IListeningPort] | None:
    """
    The Deferred firing with a C{StreamServerEndpointService}'s listening
    port once it listens, or None before it started.
    """
    return getattr(listener, "_waitingForPort", None)


def replace_protocol(transport: object, protocol: object) -> None:
    """
    Make C{protocol} receive what C{transport} (the one given to the
    protocol it replaces) delivers from now on: its data and its
    C{connectionLost}.  C{protocol.makeConnection} is left to the caller.
    """
    if isinstance(transport, ProtocolWrapper):  # TLS: TLSMemoryBIOProtocol
        transport.wrappedProtocol = protocol  # type: ignore[assignment]
    elif isinstance(getattr(transport, "protocol", None), ProtocolWrapper):
        transport.protocol.wrappedProtocol = protocol  # type: ignore[attr-defined]
    else:
        transport.protocol = protocol  # type: ignore[attr-defined]


def set_read_size(transport: object, nbytes: int) -> bool:
    """
    Make the socket below C{transport} (through protocol wrappers and a TLS
    layer) read up to C{nbytes} at a time.  A no-op for transports without
    one (test transports).

    C{bufferSize} also sets when a registered producer is paused on output,
    so it is only raised for connections that mostly read.
    """
    seen = 0
    while transport is not None and seen < 8:
        seen += 1
        if isinstance(transport, FileDescriptor):
            transport.bufferSize = nbytes
            return True
        # a ProtocolWrapper or TLSMemoryBIOProtocol: the transport below
        transport = transport.__dict__.get("transport")
    return False
