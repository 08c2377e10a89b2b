"""
Giving up on a server that stopped answering: the commands' stall watch.

A client library waits for its server as long as the connection stays up
(a service should), and a stopped server (SIGSTOP, a store that never
answers) keeps the connection up: the kernel accepts and buffers, nothing
comes back.  A command must give up instead, within the timeout it states,
with a line saying so.  L{give_up_when_stalled} bounds one wait on the
server by the time since the last I{progress} (an acknowledgement, a
message received), so that a long but moving transfer is never cut, and a
wait that sees nothing move for C{seconds} fails with L{Stalled}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from streamproto.base.clock import monotonic_seconds
from streamproto.core.cli import CommandError

T = TypeVar("T")


class Stalled(CommandError):
    """Nothing moved on the server's side for the command's timeout."""


def _no_progress() -> object:
    return None


def give_up_when_stalled(clock: IReactorTime, waiting: defer.Deferred[T], seconds: float,
                         message: Callable[[], str],
                         progress: Callable[[], object] = _no_progress) -> defer.Deferred[T]:
    """
    C{waiting}'s outcome, or a L{Stalled} failure (C{message()}'s text)
    once C{progress()} returned the same value for C{seconds} while
    C{waiting} had not fired; C{waiting} is then cancelled and whatever it
    does later is ignored.

    The result fires at once on a stall, not when C{waiting}'s clean-up is
    done: a clean-up may wait on the same stalled server.  Checked every
    quarter of C{seconds} (at most every second), so the give-up comes
    within C{seconds} plus one check of the last progress.

    @param seconds: 0 or less waits for ever (C{-t 0}).
    """
    if not seconds or seconds <= 0:
        return waiting
    result: defer.Deferred[T] = defer.Deferred()
    seen = [progress()]
    # durations on the monotonic clock: a step of the wall clock must not
    # read as minutes of silence (streamproto.base.clock)
    now = monotonic_seconds(clock)
    since = [now()]

    def check() -> None:
        value = progress()
        if value != seen[0]:
            seen[0], since[0] = value, now()
        elif now() - since[0] >= seconds:
            watch.stop()
            result.errback(Stalled(message()))
            waiting.cancel()

    watch = task.LoopingCall(check)
    watch.clock = clock
    watch.start(min(1.0, seconds / 4), now=False)

    def done(outcome: Any) -> None:
        if watch.running:
            watch.stop()
        if result.called:
            return None          # given up already: a late outcome is not an error
        if isinstance(outcome, Failure):
            result.errback(outcome)
        else:
            result.callback(outcome)
        return None

    waiting.addBoth(done)
    return result


class Answers:
    """
    What a command got from its server so far (acknowledgements, records),
    as the progress of L{give_up_when_stalled}; while the command waits on
    something else (its stdin: a slow pipe is no stalled server) every check
    sees progress.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self.count = 0
        self.elsewhere = 0
        self._input = 0

    def add(self, n: int = 1) -> None:
        self.count += n

    def touch(self) -> None:
        """
        Progress that is not counted: an answer without records, or a line
        of the command's own input read (time spent on it is not the server's).
        """
        self._input += 1

    def progress(self) -> object:
        if self.elsewhere:
            return ("elsewhere", self.clock.seconds())
        return (self.count, self._input)


def unanswered(clock: IReactorTime, waiting: defer.Deferred[T], seconds: float, server: str,
               option: str, answers: Answers | None = None,
               done: Callable[[], str] = lambda: "") -> defer.Deferred[T]:
    """
    L{give_up_when_stalled} with the commands' one line: C{no answer from
    SERVER for N s (OPTION); giving up} and what was C{done()}.
    """
    def message() -> str:
        return f"no answer from {server} for {seconds:g} s ({option}); giving up{done()}"
    return give_up_when_stalled(clock, waiting, seconds, message,
                                answers.progress if answers is not None else _no_progress)
