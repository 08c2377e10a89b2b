"""
Many deadlines on one timer: what every connection's idle timeout and
heartbeat share.

A server with 10,000 mostly idle connections used to hold two
L{IDelayedCall}s per connection (its idle timeout, its heartbeat) in the
reactor's heap, and reset one on every message received.  Each costs a
few objects the garbage collector walks at every full collection (a
collection's pause grows with the number of live objects), each heap
operation compares C{DelayedCall}s in Python, and each reset is a method
call into the reactor.  A L{Sweeper} keeps one reactor call, at its
earliest deadline, and its own heap of C{(time, sequence, Deadline)}
tuples (compared in C).  A L{Deadline} moved later, which is what
activity does, only stores the new time: the heap entry is left where it
is and, when its time comes, the sweeper sees the deadline moved and
queues it again (the lazy reset Twisted's own C{DelayedCall.reset}
uses).  Deadlines fire at their exact time, as C{callLater} would: tests
drive a L{twisted.internet.task.Clock} the same way.  Their time is the
monotonic clock (L{monotonic_seconds}): a real reactor's timers follow
the wall clock, and a step of it forward would otherwise time out every
idle connection at once; the reactor call that comes early then finds
nothing due and is made again for the rest.

    sweeper = shared_sweeper(reactor)       # one per clock
    idle = sweeper.deadline(expired)
    idle.arm(30)            # fire expired() in 30 s
    idle.arm(30)            # activity: 30 s from now (cheap)
    idle.cancel()
"""

import heapq
import itertools
import weakref
from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from streamproto.base.clock import monotonic_seconds

__all__ = ["Deadline", "Sweeper", "shared_sweeper"]

_log = Logger()

#: heap entries of cancelled deadlines are dropped in one pass once they
#: are more than half of a heap at least this big (closed connections'
#: entries would otherwise stay until their time, keeping them alive)
_COMPACT_MIN = 64


def _nothing() -> None:
    pass


class Deadline:
    """
    One deadline of a L{Sweeper}: C{callback()} runs once its time comes,
    unless it was cancelled or moved.

    @ivar when: the time it fires (on the sweeper's monotonic clock), or
        None when not armed.
    """

    __slots__ = ("_sweeper", "_callback", "when", "_queued", "_queued_at", "__weakref__")

    def __init__(self, sweeper: "Sweeper", callback: Callable[[], object]) -> None:
        self._sweeper = sweeper
        self._callback = callback
        self.when: float | None = None
        #: the sequence number and time of this deadline's live heap entry
        self._queued: int | None = None
        self._queued_at = 0.0

    @property
    def active(self) -> bool:
        """Whether it is armed (and has not fired)."""
        return self.when is not None

    def arm(self, delay: float) -> None:
        """Fire C{delay} seconds from now (whether or not it was armed)."""
        self._sweeper._arm(self, self._sweeper.now() + max(0.0, delay))

    def cancel(self) -> None:
        """Do not fire (nothing if not armed)."""
        if self.when is not None:
            self.when = None
            self._sweeper._cancelled(self)

    def close(self) -> None:
        """
        Cancel for good, and let go of the callback: its owner usually
        holds this deadline, a cycle that only a full collection would
        free otherwise (servers make those rarely: core.gcpolicy).
        """
        self.cancel()
        self._callback = _nothing


class Sweeper:
    """
    Fires many L{Deadline}s from one reactor call (see the module
    docstring).  One per clock is enough: L{shared_sweeper}.

    @ivar clock: the L{IReactorTime} it runs on.
    @ivar now: its time: the monotonic clock for a real reactor, a test's
        clock itself (L{monotonic_seconds}).
    """

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self.now = monotonic_seconds(clock)
        self._call_at = 0.0     # the time (self.now) the reactor call is for
        self._heap: list[tuple[float, int, Deadline]] = []
        self._sequence = itertools.count()
        self._call: IDelayedCall | None = None
        self._stale = 0     # heap entries whose deadline was cancelled or re-queued
        self._armed = 0     # deadlines armed

    def __len__(self) -> int:
        """Heap entries (armed deadlines, and stale entries not yet dropped)."""
        return len(self._heap)

    def deadline(self, callback: Callable[[], object]) -> Deadline:
        """A new deadline calling C{callback()}, not armed."""
        return Deadline(self, callback)

    def _arm(self, deadline: Deadline, when: float) -> None:
        if deadline.when is None:
            self._armed += 1
        deadline.when = when
        if deadline._queued is not None:
            if when >= deadline._queued_at:
                return      # later (activity): the entry finds out when its time comes
            self._stale += 1    # sooner: the old entry becomes stale
        self._push(deadline, when)
        self._schedule()

    def _push(self, deadline: Deadline, when: float) -> None:
        seq = next(self._sequence)
        deadline._queued, deadline._queued_at = seq, when
        heapq.heappush(self._heap, (when, seq, deadline))

    def _cancelled(self, deadline: Deadline) -> None:
        self._armed -= 1
        if not self._armed:
            # nothing left to fire: no reactor call left behind either
            for _, _, each in self._heap:
                each._queued = None
            self._heap = []
            self._stale = 0
            if self._call is not None and self._call.active():
                self._call.cancel()
            self._call = None
            return
        self._stale += 1
        if self._stale > len(self._heap) // 2 and len(self._heap) >= _COMPACT_MIN:
            kept = []
            for entry in self._heap:
                deadline = entry[2]
                if deadline._queued != entry[1]:
                    continue        # stale: a newer entry stands for it
                if deadline.when is None:
                    deadline._queued = None     # cancelled: a new arm queues again
                    continue
                kept.append(entry)
            heapq.heapify(kept)
            self._heap = kept
            self._stale = 0

    def _schedule(self) -> None:
        """The reactor call at the earliest entry's time."""
        if not self._heap:
            return
        first = self._heap[0][0]
        call = self._call
        if call is not None and call.active():
            if self._call_at <= first:
                return
            call.cancel()
        self._call_at = first
        self._call = self.clock.callLater(max(0.0, first - self.now()), self._sweep)

    def _sweep(self) -> None:
        self._call = None
        now = self.now()
        heap = self._heap
        due = []
        while heap and heap[0][0] <= now:
            _, seq, deadline = heapq.heappop(heap)
            if deadline._queued != seq:
                self._stale = max(0, self._stale - 1)
                continue        # moved sooner: a newer entry stands for it
            deadline._queued = None
            when = deadline.when
            if when is None:
                self._stale = max(0, self._stale - 1)
                continue        # cancelled
            if when > now:
                self._push(deadline, when)      # moved later by activity
                continue
            deadline.when = None
            self._armed -= 1
            due.append(deadline)
        for deadline in due:
            # one failing callback must not keep the others from firing
            try:
                deadline._callback()
            except Exception:
                _log.failure("a deadline's callback failed")
        self._schedule()


_shared: "weakref.WeakKeyDictionary[IReactorTime, Sweeper]" = weakref.WeakKeyDictionary()


def shared_sweeper(clock: IReactorTime) -> Sweeper:
    """The one L{Sweeper} of C{clock} (made on first use)."""
    sweeper = _shared.get(clock)
    if sweeper is None:
        sweeper = _shared[clock] = Sweeper(clock)
    return sweeper
