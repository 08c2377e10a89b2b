"""
What the operations plumbing (L{streamproto.core.ops}) asks of the
protocols and stores it runs: a graceful drain on shutdown, and readiness
for C{/ready} (L{IReadiness}, declared in L{streamproto.log.interfaces}
beside the stores that provide it, named here for the protocols).
Declared with C{@implementer} so that a provider is found by
L{Interface.providedBy}, not by probing for a method's name.
"""

from twisted.internet.defer import Deferred
from zope.interface import Interface

from streamproto.log.interfaces import IReadiness

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

