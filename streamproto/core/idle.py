"""
A connection's idle timeout: one small class on an injected clock, for
every protocol that closes a connection after so long without input.

Twisted's L{twisted.protocols.policies.TimeoutMixin} does the same job as a
mixin: it adds methods to the protocol (C{timeoutConnection},
C{resetTimeout}) and schedules on the global reactor unless C{callLater} is
overridden.  Our protocols take their clock from the factory (tests drive a
L{twisted.internet.task.Clock}) and some are automat machines whose inputs
should not share a namespace with a mixin's, so the timer is an object the
protocol owns instead::

    def connectionMade(self):
        self._idle = IdleTimeout(self.factory.clock, self.factory.idle_timeout,
                                 self._idle_expired)
        self._idle.start()

    def dataReceived(self, data):
        self._idle.reset()
        ...

    def connectionLost(self, reason):
        self._idle.cancel()
"""

import math
from collections.abc import Callable

from twisted.internet.interfaces import IReactorTime

from streamproto.core.sweeper import Sweeper, shared_sweeper

__all__ = ["IdleTimeout", "timeout_seconds"]


def timeout_seconds(seconds: float | None) -> float | None:
    """
    C{seconds} as a timeout: None for "never" (None, 0 or infinity: the
    command lines' "0 turns it off"), else a positive float.

    @raise ValueError: for a negative or NaN value (a timer that fires at
        once or never, by accident).
    """
    if seconds is None:
        return None
    seconds = float(seconds)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"idle timeout must be a non-negative number of seconds, "
                         f"not {seconds!r}")
    if seconds == 0 or math.isinf(seconds):
        return None
    return seconds


class IdleTimeout:
    """
    Calls C{expired()} once C{seconds} pass without activity.

    Not running until L{start}.  L{reset} (activity) restarts a running
    countdown; L{pause} stops counting until L{resume} (which starts a full
    period: time spent paused, for instance not reading while storage
    catches up, is not the peer's silence); L{cancel} stops it for good (the
    connection is gone).  After it expired, L{start} arms it again (a
    protocol that decides it was not idle after all).

    @ivar seconds: the timeout, or None when it is off (L{start} then does
        nothing).
    """

    def __init__(self, clock: IReactorTime, seconds: float | None,
                 expired: Callable[[], object], sweeper: Sweeper | None = None) -> None:
        """
        @param clock: an L{twisted.internet.interfaces.IReactorTime}.
        @param seconds: the timeout; None, 0 or infinity turn it off.
        @param expired: called with no arguments when it expires.
        @param sweeper: the L{Sweeper} holding the countdown (default: the
            clock's shared one: one reactor call for every connection's
            timeout, and activity only stores a time).
        @raise ValueError: for a negative or NaN C{seconds}.
        """
        self.seconds = timeout_seconds(seconds)
        self._expired = expired
        self._deadline = (sweeper or shared_sweeper(clock)).deadline(self._expire)
        self._paused = False
        self._cancelled = False

    @property
    def running(self) -> bool:
        """Whether the countdown is on (started, not paused, expired or cancelled)."""
        return self._deadline.active

    def start(self) -> None:
        """
        Start the countdown, a full period from now (restart it if it is
        running).  Nothing when off, paused or cancelled.
        """
        if self.seconds is None or self._paused or self._cancelled:
            return
        self._deadline.arm(self.seconds)

    def reset(self) -> None:
        """
        Activity: a running countdown starts again from now.  Nothing
        otherwise (off, not started, paused, expired, cancelled), so that
        input arriving after the timeout decided to close does not revive it.
        """
        # armed only while seconds is set (see start); called for every
        # message received, so it only moves a time (see Sweeper)
        if self._deadline.active and self.seconds is not None:
            self._deadline.arm(self.seconds)

    def pause(self) -> None:
        """Stop counting (until L{resume})."""
        self._paused = True
        self._deadline.cancel()

    def resume(self) -> None:
        """Count again, a full period from now (nothing if not paused)."""
        if self._paused:
            self._paused = False
            self.start()

    def cancel(self) -> None:
        """Stop for good: L{start}, L{resume} and L{reset} do nothing after."""
        self._cancelled = True
        self._deadline.close()

    def _expire(self) -> None:
        self._expired()
