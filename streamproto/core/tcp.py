"""TCP socket settings shared by the protocols' servers and clients."""

import socket
from typing import cast

from twisted.internet.interfaces import ISSLTransport, ISystemHandle, ITCPTransport, ITransport


def set_no_delay(transport: ITransport | None) -> None:
    """
    Turn Nagle's algorithm off (as Go does for every TCP connection): acks
    are tiny and latency-bound, and with Nagle plus the peer's delayed ACK a
    second ack in a row can wait ~40 ms.  Reaches under a TLS layer or a
    protocol wrapper (one level); a no-op for transports that are not TCP.
    """
    for candidate in (transport, getattr(transport, "transport", None)):
        set_tcp_no_delay = getattr(candidate, "setTcpNoDelay", None)
        if set_tcp_no_delay is not None:
            try:
                set_tcp_no_delay(True)
            except OSError:  # not a TCP socket after all (e.g. a UNIX socket)
                pass
            return


def tcp_socket(transport: object) -> socket.socket | None:
    """
    The socket under a plain TCP transport, or None for one that is not
    (TLS, a UNIX socket, a test transport) or whose socket is closed.
    """
    if transport is None or ISSLTransport.providedBy(transport):
        return None
    if not ITCPTransport.providedBy(transport):
        return None
    try:
        handle = cast(socket.socket, cast(ISystemHandle, transport).getHandle())
        return handle if handle.fileno() >= 0 else None
    except Exception:  # noqa: BLE001 - no socket to be had
        return None


def max_segment_size(transport: ITransport | None) -> int | None:
    """
    The connection's TCP maximum segment size (C{TCP_MAXSEG}): how many
    bytes of a write the peer receives at once, at most.  None for a
    transport that is not plain TCP (see L{tcp_socket}).
    """
    handle = tcp_socket(transport)
    if handle is None:
        return None
    try:
        return int(handle.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))
    except OSError:
        return None
