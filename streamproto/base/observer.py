"""
Deferreds waiting for something to happen: the one mechanism behind every
"when connected", "when drained", "when idle", "when closed" of the suite.

Three shapes, each a small class (txtorcon's C{SingleObserver} is the
model for the first):

  - L{OneShotObserver}: an event that happens once (a connection closed, a
    session released).  Waiters after it fire at once with its result.
  - L{Observers}: an event that happens again and again (the send buffer
    drained, no appends in flight).  A waiter gets the next occurrence.
  - L{SharedCall}: one operation at a time (connect, open a bucket); callers
    while it runs share its result instead of starting another.

Every waiter is a new Deferred of its own: a callback chain added by one
waiter never changes what another receives.  Cancelling a waiter forgets
it.  Waiters added while the waiters are being fired wait for the next
occurrence (they never see the one being delivered twice).
"""

from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

__all__ = ["Observers", "OneShotObserver", "SharedCall"]

_T = TypeVar("_T")


class Observers(Generic[_T]):
    """
    Deferreds waiting for the next occurrence of an event, whose result is
    a C{_T} (C{Observers[None]}: the event says nothing more).
    """

    def __init__(self) -> None:
        self._waiting: list[Deferred[_T]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def when(self) -> Deferred[_T]:
        """
        @return: a Deferred firing with the result given to the next
            L{fire} (or failing with the next L{fail}'s reason).
        """
        d: Deferred[_T] = Deferred(self._forget)
        self._waiting.append(d)
        return d

    def _forget(self, d: Deferred[_T]) -> None:
        try:
            self._waiting.remove(d)
        except ValueError:
            pass

    def fire(self, result: _T | Failure | None = None) -> None:
        """
        Fire every waiter with C{result} (a L{Failure} errbacks them).
        Without one (None) for an event whose result is None.
        """
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(cast(_T, result))

    def fail(self, reason: BaseException | Failure) -> None:
        """Errback every waiter with C{reason} (an exception or a L{Failure})."""
        self.fire(reason if isinstance(reason, Failure) else Failure(reason))

    def take(self) -> list[Deferred[_T]]:
        """
        The waiters of this occurrence, forgotten here, for a caller that
        fires them itself a little later: after its bookkeeping, in one
        batch with other Deferreds (a writer's acknowledgements and its
        idle waiters, in order).  Waiters added meanwhile wait for the next.
        """
        waiting, self._waiting = self._waiting, []
        return waiting


class OneShotObserver(Generic[_T]):
    """
    An event that happens once.  L{fire} delivers its result to every
    waiter; L{when_fired} after that fires at once with the same result.
    """

    _unfired = object()

    def __init__(self) -> None:
        self._observers: Observers[_T] = Observers()
        self._result: _T | Failure | None | object = self._unfired

    @property
    def fired(self) -> bool:
        return self._result is not self._unfired

    def when_fired(self) -> Deferred[_T]:
        """@return: a Deferred firing with the event's result."""
        if not self.fired:
            return self._observers.when()
        if isinstance(self._result, Failure):
            return fail(self._result)
        return succeed(cast(_T, self._result))

    def fire(self, result: _T | Failure | None = None) -> None:
        """The event happened (a later call is ignored: it happens once)."""
        if self.fired:
            return
        self._result = result
        self._observers.fire(result)


class SharedCall(Generic[_T]):
    """
    One call of C{function} at a time per arguments: while one runs,
    callers with equal arguments share its result instead of starting
    another (opening one log twice at once opens it once).  The next call
    after it finished runs C{function} again.
    """

    def __init__(self, function: Callable[..., Deferred[_T] | _T]) -> None:
        self._function = function
        # arguments -> Observers of the call running
        self._running: dict[object, Observers[_T]] = {}

    @property
    def running(self) -> bool:
        """Whether a call is running (with any arguments)."""
        return bool(self._running)

    def __call__(self, *args: Any, **kwargs: Any) -> Deferred[_T]:
        key = (args, tuple(sorted(kwargs.items())))
        running = self._running.get(key)
        if running is not None:
            return running.when()
        self._running[key] = running = Observers()
        d = running.when()
        outcome: Deferred[_T]
        try:
            called = self._function(*args, **kwargs)
        except Exception:
            outcome = fail()
        else:
            outcome = called if isinstance(called, Deferred) else succeed(called)
        outcome.addBoth(self._done, key, running)
        return d

    def _done(self, result: _T | Failure, key: object, running: Observers[_T]) -> None:
        del self._running[key]
        running.fire(result)
        return None
