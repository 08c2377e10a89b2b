"""
The reactor an object uses when none is given to it: defined in
L{streamproto.base.clock} (the log store, under the core kit, uses it too)
and named here for the protocols; and L{SteadyCall}, a timer whose delay
the wall clock cannot shorten.
"""

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from streamproto.base.clock import default_reactor, monotonic_seconds

__all__ = ["SteadyCall", "default_reactor", "monotonic_seconds"]


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
