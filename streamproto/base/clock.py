"""
The reactor an object uses when none is given to it.

Library code takes its reactor (or clock) as an argument, so that a test
can hand it a L{twisted.internet.task.Clock} or a
L{twisted.internet.testing.MemoryReactor}, and so that C{makeService} can
pass down the reactor it was given.  Without one, the global reactor is
imported when it is needed, never when a module is imported: twistd (or
an application) installs the reactor it wants before that.
"""

import time
from collections.abc import Callable
from typing import Any

__all__ = ["SteadySeconds", "default_reactor", "monotonic_seconds", "wall_seconds"]


def default_reactor(reactor: Any = None) -> Any:
    """
    @param reactor: a reactor or clock, or None.
    @return: C{reactor}, or the global reactor when it is None (any other
        value, such as C{False} for "no reactor", is returned as it is).
    """
    if reactor is None:
        from twisted.internet import reactor as installed
        return installed
    return reactor


class SteadySeconds:
    """
    A reactor's C{seconds()} that no step of the wall clock moves: the wall
    time when it was made, advanced on the monotonic clock since
    (L{streamproto.core.clock.steady_timers} installs it).  Every timer of
    that reactor then waits what it was asked to, whatever NTP or an
    operator does to the wall clock; what needs the wall time itself asks
    L{wall_seconds}.

    @ivar monotonic: the monotonic clock it advances on.
    @ivar wall: the wall clock it started from.
    """

    def __init__(self, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.wall = wall
        self.monotonic = monotonic
        self._offset = wall() - monotonic()

    def __call__(self) -> float:
        return self.monotonic() + self._offset


def monotonic_seconds(clock: Any) -> Callable[[], float]:
    """
    The time source for durations (deadlines, ages, rate limits) of code
    whose timers run on C{clock}.

    A real reactor's C{seconds()} is the wall clock (C{time.time}): an NTP
    step or an operator setting the time moves it by minutes or hours, and
    a deadline measured on it expires at once (forward) or an hour late
    (back).  For such a clock this is C{time.monotonic}; any other clock
    (a test's L{twisted.internet.task.Clock}) is its own monotonic time.

    @param clock: an C{IReactorTime}.
    """
    seconds: Callable[[], float] = clock.seconds
    if seconds is time.time:
        return time.monotonic
    if isinstance(seconds, SteadySeconds):
        return seconds.monotonic
    return seconds


def wall_seconds(clock: Any) -> Callable[[], float]:
    """
    The time source for instants of the wall clock (a timestamp stored
    with a record or a session, a token's expiry that another host checks)
    of code whose timers run on C{clock}: C{clock.seconds} itself, unless
    it is a L{SteadySeconds}, whose wall clock it is then.

    @param clock: an C{IReactorTime}.
    """
    seconds: Callable[[], float] = clock.seconds
    if isinstance(seconds, SteadySeconds):
        return seconds.wall
    return seconds
