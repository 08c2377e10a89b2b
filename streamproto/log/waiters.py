"""Readers waiting for a position (or offset) to become durable: no polling."""

import heapq
import itertools
from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from streamproto.log.errors import LogClosed


class Waiters:
    """
    Deferreds keyed by the value they wait to be exceeded, fired by
    L{advance} from whatever makes data visible (an fsync).
    """

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._heap: list[tuple[int, int, Deferred[int]]] = []  # (target, seq, deferred)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(1 for t in self._heap if not t[2].called)

    def wait(self, target: int, current: Callable[[], int],
             timeout: float | None = None) -> Deferred[int]:
        """
        @return: Deferred firing with the current value once it exceeds
            C{target}, or on timeout with whatever it is then.
        """
        if current() > target:
            done: Deferred[int] = Deferred()
            done.callback(current())
            return done
        timer: IDelayedCall | None = None

        def cancel(d: Deferred[int]) -> None:
            if timer is not None and timer.active():
                timer.cancel()

        d: Deferred[int] = Deferred(cancel)
        if timeout is not None:
            def expire() -> None:
                if not d.called:
                    d.callback(current())
            timer = delayed = self._clock.callLater(max(0, timeout), expire)

            def stop_timer(result: object) -> object:
                if delayed.active():
                    timer.cancel()
                return result
            d.addBoth(stop_timer)
        heapq.heappush(self._heap, (target, next(self._seq), d))
        return d

    def advance(self, value: int) -> None:
        """Fire every waiter whose target is below C{value}."""
        heap = self._heap
        ready = []
        while heap and heap[0][0] < value:
            ready.append(heapq.heappop(heap)[2])
        for d in ready:
            if not d.called:
                d.callback(value)

    def fail_all(self, reason: BaseException | None = None) -> None:
        heap, self._heap = self._heap, []
        for _, _, d in heap:
            if not d.called:
                d.errback(reason or LogClosed("log closed"))
