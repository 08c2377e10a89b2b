"""
What the modules of L{streamproto.log.jetstream} share: the type of their
C{inlineCallbacks} generators, the logger they log to, the translation
of the cluster's own errors into what every protocol reports, the pauses
between tries of a call the cluster cannot answer yet (L{Patience}), and
what each side of a log's work (L{LogPart}) knows of its log.

Kept apart so that the log, its collaborators and the store import it
without importing each other.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeAlias, TypeVar

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from streamproto.log.errors import StoreUnavailable
from streamproto.log.natsio import JetStreamError, NotAvailable

if TYPE_CHECKING:
    from streamproto.log.jetstream.views import StoreView
    from streamproto.log.jetstream.views import LogView as JetStreamLog

_T = TypeVar("_T")
_P = ParamSpec("_P")
#: what an C{inlineCallbacks} generator yields, is sent, and returns
_Inline: TypeAlias = Generator[Deferred[Any], Any, _T]

# the store's log lines keep the namespace they had in one module
log = Logger(namespace="streamproto.log.jetstream")


def _store_errors(method: Callable[_P, Deferred[_T]]) -> Callable[_P, Deferred[_T]]:
    """
    The cluster's own errors (no answer, no leader) out of an ILog/ILogStore
    method as L{StoreUnavailable}, a L{LogFailed}: what every protocol
    already reports as its "not available" error.
    """
    def translated(failure: Failure) -> Failure:
        if failure.check(NotAvailable, JetStreamError):
            raise StoreUnavailable(f"JetStream: {failure.getErrorMessage()}")
        return failure

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> Deferred[_T]:
        return method(*args, **kwargs).addErrback(translated)
    return wrapper


#: seconds between two tries of a call the cluster could not answer yet
#: (doubling up to the last)
RETRY_DELAYS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)


class Patience:
    """
    The pauses between tries of one call that the cluster refused for a
    passing reason (a new stream without a leader yet, a peer seen offline
    for a moment), up to the store's timeout in all.

    Paced on the client's loop (C{io.pause}) and counted, not on the
    store's clock: a synchronous bridge (Spark, the store copy) runs no
    reactor to fire a timer.  The timeout bounds both the pauses counted
    and the real time since the first try (the tries themselves take time
    when the cluster is slow to answer), whichever is more.
    """

    def __init__(self, store: StoreView) -> None:
        self._store = store
        self._delays = iter(RETRY_DELAYS)
        self._delay = next(self._delays)
        self.waited = 0.0
        self._started = time.monotonic()

    @defer.inlineCallbacks
    def pause(self) -> _Inline[bool]:
        """
        Wait before the next try.

        @return: (a Deferred of) False, at once, when the next try would
            go past the store's timeout or the store is closed: give up.
        """
        store = self._store
        spent = max(self.waited, time.monotonic() - self._started)
        if store.closed or spent + self._delay > store.timeout:
            return False
        yield store._call(store.io.pause, self._delay)
        self.waited += self._delay
        self._delay = next(self._delays, self._delay)
        return True


class LogPart:
    """
    One side of a L{JetStreamLog}'s work as an object of its own (the
    append chain, reading, truncation): it reads the log's acknowledged
    state through C{_log}, and keeps the log's fixed facts at hand.
    """

    def __init__(self, log: JetStreamLog) -> None:
        self._log = log
        self.store = log.store
        self.name = log.name
        self.stream = log.stream
        self._id = log._id
        self._clock = log._clock
