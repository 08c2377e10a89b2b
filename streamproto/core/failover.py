"""
Several addresses of one service: the front-ends of one shared store
(C{--store nats://...}, doc/scale-out.rst).  L{FailoverEndpoint} is an
C{IStreamClientEndpoint} over them, so that every client that reconnects
through an endpoint (Lumberjack, Pravega, Relink, reliable) moves to the
next front-end when the one it used dies, with nothing else changed: what
a protocol does to neither lose nor repeat what was acknowledged
(Pravega's writer event numbers, reliable's session resume, Lumberjack's
resend of unacknowledged batches) happens on the new connection as after
any reconnection.
"""

from collections.abc import Iterable

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer


class AllAddressesFailed(ConnectError):
    """No address of a L{FailoverEndpoint} took the connection."""


@implementer(IStreamClientEndpoint)
class FailoverEndpoint:
    """
    Connect to the address that worked last; when it refuses (or times
    out), to the next, and so on once round.  The client's own
    reconnection (its backoff, L{streamproto.core.reconnect.Reconnector})
    decides when to try the round again.

    @param endpoints: client endpoints, one per address, in order of
        preference.
    @param names: what to call each in logs and errors (default: repr).
    """

    log = Logger()

    def __init__(self, endpoints: Iterable[IStreamClientEndpoint],
                 names: Iterable[str] | None = None) -> None:
        self.endpoints = list(endpoints)
        if not self.endpoints:
            raise ValueError("a FailoverEndpoint needs at least one endpoint")
        self.names = list(names) if names else [repr(e) for e in self.endpoints]
        #: index of the address to try first (the last that worked)
        self.current = 0

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        return self._attempt(factory, 0, [])

    def _attempt(self, factory: IProtocolFactory, tried: int,
                 errors: list[str]) -> Deferred[IProtocol]:
        index = self.current
        d = self.endpoints[index].connect(factory)

        def connected(protocol: IProtocol) -> IProtocol:
            if tried:
                self.log.info("connected to {name} (after {n} address(es) failed)",
                              name=self.names[index], n=tried)
            return protocol

        def failed(failure: Failure) -> Deferred[IProtocol]:
            errors.append(f"{self.names[index]}: {failure.getErrorMessage()}")
            self.current = (index + 1) % len(self.endpoints)
            if tried + 1 >= len(self.endpoints):
                # ConnectError.__init__ is untyped in Twisted
                raise AllAddressesFailed("; ".join(errors))  # type: ignore[no-untyped-call]
            self.log.info("{name} failed ({error}); trying {next}", name=self.names[index],
                          error=failure.getErrorMessage(), next=self.names[self.current])
            return self._attempt(factory, tried + 1, errors)
        return d.addCallbacks(connected, failed)
