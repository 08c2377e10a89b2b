"""Readers waiting for a position (or offset) to become durable: no polling."""

import heapq
import itertools

from twisted.internet.defer import Deferred

from streamproto.log.errors import LogClosed


class Waiters:
    """
    Deferreds keyed by the value they wait to be exceeded, fired by
    L{advance} from whatever makes data visible (an fsync).
    """

    def __init__(self, clock):
        self._clock = clock
        self._heap = []  # (target, seq, deferred)
        self._seq = itertools.count()

    def __len__(self):
        return sum(1 for t in self._heap if not t[2].called)

    def wait(self, target, current, timeout=None):
        """
        @return: Deferred firing with the current value once it exceeds
            C{target}, or on timeout with whatever it is then.
        """
        if current() > target:
            d = Deferred()
            d.callback(current())
            return d
        timer = None

        def cancel(d):
            if timer is not None and timer.active():
                timer.cancel()

        d = Deferred(cancel)
        if timeout is not None:
            def expire():
                if not d.called:
                    d.callback(current())
            timer = self._clock.callLater(max(0, timeout), expire)

            def stop_timer(result):
                if timer.active():
                    timer.cancel()
                return result
            d.addBoth(stop_timer)
        heapq.heappush(self._heap, (target, next(self._seq), d))
        return d

    def advance(self, value):
        """Fire every waiter whose target is below C{value}."""
        heap = self._heap
        ready = []
        while heap and heap[0][0] < value:
            ready.append(heapq.heappop(heap)[2])
        for d in ready:
            if not d.called:
                d.callback(value)

    def fail_all(self, reason=None):
        heap, self._heap = self._heap, []
        for _, _, d in heap:
            if not d.called:
                d.errback(reason or LogClosed("log closed"))
