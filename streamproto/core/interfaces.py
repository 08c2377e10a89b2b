"""
What the operations plumbing (L{streamproto.core.ops}) asks of the
protocols and stores it runs: a graceful drain on shutdown, and readiness
for C{/ready}.  Declared with C{@implementer} so that a provider is found
by L{Interface.providedBy}, not by probing for a method's name.
"""

from twisted.internet.defer import Deferred
from zope.interface import Interface

__all__ = ["IGracefulShutdown", "IReadiness"]


class IGracefulShutdown(Interface):
    """
    A server protocol that finishes its in-flight work before its
    connection closes when the server stops
    (L{streamproto.core.ops.TrackingFactory.drain}).  A protocol without it
    is closed once its pending writes are flushed.
    """

    def gracefulShutdown() -> Deferred[None]:
        """
        The server is stopping: read no more, finish (and acknowledge, the
        protocol's way) what was received, say goodbye, close.  Called once
        per connection; the drain aborts a connection still open at its
        deadline.

        @return: a L{twisted.internet.defer.Deferred} firing (with None)
            once the connection is gone.
        """


class IReadiness(Interface):
    """
    Something C{/ready} asks whether the server can serve
    (L{streamproto.core.ops.store_problems}): every store the server was
    given (an L{streamproto.log.interfaces.ILogStore} extends this), or a
    view of another kind of store (the reliable-stream session store).
    """

    def problems() -> list[str]:
        """
        Why the store cannot serve now, for C{/ready}: one line each, with
        the cause (a closed store, a data directory that cannot be written
        and why, a log that fail-stopped and why).  Empty when it can.

        @return: a list of strings (synchronous: a health check must answer
            even when the store's I/O is stuck).
        """
