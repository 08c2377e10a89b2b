"""
The reactor an object uses when none is given to it: defined in
L{streamproto.base.clock} (the log store, under the core kit, uses it too)
and named here for the protocols; and L{SteadyCall}, a timer whose delay
the wall clock cannot shorten.
"""

import time
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from streamproto.base.clock import SteadySeconds, default_reactor, monotonic_seconds, wall_seconds

__all__ = ["SteadyCall", "default_reactor", "monotonic_seconds", "steady_timers",
           "wall_seconds"]


def steady_timers(reactor: Any, seconds: SteadySeconds | None = None) -> bool:
    """
    Put every timer of C{reactor} on the monotonic clock, for a process
    that is a server or a client of ours (not a library's caller, whose
    reactor is theirs).

    A reactor's timers (C{callLater}, C{LoopingCall}, every timeout of
    Twisted and of ours) are kept on C{seconds()}, the wall clock: a step
    forward fires the pending ones at once, and a step back, which NTP
    makes at boot or an operator makes by hand, delays every one of them
    by the step (an hour back: no heartbeat, retry, reconnection or idle
    timeout for an hour).  C{seconds} is a public method each C{DelayedCall}
    and the reactor's loop ask; on the instance it becomes a
    L{SteadySeconds}, the wall time now advanced on the monotonic clock, so
    a step moves none of them.  What needs the wall time asks
    L{wall_seconds} (timestamps stored with records and sessions, tokens'
    expiry).  Left behind: C{twisted.web}'s access-log dates, which follow
    the reactor's time (after a step they are off by the step until the
    process restarts).

    @param seconds: the stand-in to install (a test's); a new
        L{SteadySeconds} by default.
    @return: whether it was installed (not for a reactor whose time is
        not the wall clock, such as a test's C{Clock}, or already steady).
    """
    current = getattr(reactor, "seconds", None)
    if current is not time.time and seconds is None:
        return False
    reactor.seconds = seconds or SteadySeconds()
    return True


class SteadyCall:
    """
    C{clock.callLater(delay, f, *args)} whose C{delay} is measured on the
    monotonic clock.  A real reactor's timers follow the wall clock
    (C{seconds()} is C{time.time}): a forward step of it fires every
    pending call at once.  This one then finds its deadline not reached
    and waits the rest again; a step back still delays it (Twisted offers
    no monotonic timers).

    @param monotonic: the clock the deadline is on (default:
        L{monotonic_seconds} of C{clock}); a test's stand-in.
    """

    def __init__(self, clock: IReactorTime, delay: float, f: Callable[..., Any], *args: Any,
                 monotonic: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._monotonic = monotonic or monotonic_seconds(clock)
        self._deadline = self._monotonic() + delay
        self._f = f
        self._args = args
        self._call: IDelayedCall | None = clock.callLater(delay, self._due)

    def _due(self) -> None:
        remaining = self._deadline - self._monotonic()
        if remaining > 0:
            # fired early: the wall clock stepped forward
            self._call = self._clock.callLater(remaining, self._due)
            return
        self._call = None
        self._f(*self._args)

    def active(self) -> bool:
        return self._call is not None and self._call.active()

    def cancel(self) -> None:
        """Cancel the call (as C{IDelayedCall.cancel}, if it is still pending)."""
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
