"""TCP socket settings shared by the protocols' servers and clients."""

from twisted.internet.interfaces import ITransport


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
