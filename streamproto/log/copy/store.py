"""
The copy of a whole store (L{StoreCopy}): every selected log through a
L{LogCopy}, a few at a time; with C{follow}, what the servers go on
appending to the source, until L{StoreCopy.stop}; then a last catch-up,
the check that the source did not move on behind a copy that does not
follow it, and the verification of every log.

The destination keeps a journal of its copies in the internal log
L{JOURNAL_LOG}: a copy that starts writes where it comes from and what it
copies, one that verified writes every log's digest.  A copy cut short
(killed, a destination gone away) leaves its journal without that last
entry: the logs it copied so far are not mistaken for a finished copy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from streamproto.log.copy.engine import CopyFailed, LogCopy, Progress, first_failure
from streamproto.log.copy.plan import JOURNAL_LOG, CopyRefused, Digest, select
from streamproto.log.errors import LogClosed, LogError, LogNotFound
from streamproto.log.interfaces import ILog, ILogStore

#: logs copied at once (many small logs, Pravega segments, are latency-bound)
PARALLEL = 4
#: seconds a follower waits for new records before looking again (and
#: for new logs on the source)
FOLLOW_POLL = 0.5


class SourceWritten(CopyFailed):
    """A copy without C{follow} found the source written while it copied."""


class StoreCopy:
    """
    Copy the logs of C{src} matching C{include} and none of C{exclude} to
    C{dst}.

    @param progress: called with (records, bytes) as each append lands.
    @param describe: what the journal says the source is (a path, a URL).
    @param sessions: what copies the reliable-stream sessions, once the
        logs caught up (they are only still when the servers stopped): a
        callable returning a Deferred of (found, written), failing with
        L{CopyRefused} or L{CopyFailed}.  Passed in by the command
        (L{streamproto.storecli}): the sessions are the reliable protocol's,
        a layer above the store.
    @param refresh: for a source this process does not see written (a data
        directory served by another process: L{readonly.reopening_store}),
        what opens it anew: each round of a follow, and the check that it
        was not written, look at a fresh view.
    """

    def __init__(self, src: ILogStore, dst: ILogStore, clock: IReactorTime,
                 include: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                 follow: bool = False, progress: Progress | None = None,
                 describe: str = "", verify: bool = True,
                 log: Callable[[str], object] | None = None,
                 refresh: Callable[[], Deferred[ILogStore]] | None = None,
                 sessions: Callable[[], Deferred[tuple[int, int]]] | None = None) -> None:
        self.src = src
        self.refresh = refresh
        self.sessions = sessions
        #: (found, written) reliable-stream sessions, once copied
        self.sessions_copied: tuple[int, int] | None = None
        self.dst = dst
        self.clock = clock
        self.include = include
        self.exclude = exclude
        self.follow = follow
        self.progress = progress
        self.describe = describe
        self.verify_logs = verify
        self.say = log or (lambda line: None)
        self.copies: dict[str, LogCopy] = {}
        self.ends: dict[str, int] = {}
        self._stopping = False
        self._waits: set[Deferred[Any]] = set()

    # -- the whole copy ----------------------------------------------------
    def names(self) -> list[str]:
        return select(self.src.names(), self.include, self.exclude)

    @defer.inlineCallbacks
    def totals(self) -> Any:
        """(records, bytes) the selected source logs hold now: the progress bar's total."""
        records = nbytes = 0
        for name in self.names():
            log: ILog = yield self.src.get(name)
            records += log.end_position - log.start_position
            nbytes += log.end_offset - log.start_offset
        return records, nbytes

    @defer.inlineCallbacks
    def run(self) -> Any:
        """
        @return: Deferred firing with {log name: digest dict} (empty digests
            when not verifying).
        @raise CopyRefused, CopyFailed: with the line to show.
        """
        names = self.names()
        yield self._journal({"event": "start", "source": self.describe, "logs": names,
                             "follow": self.follow})
        yield self._each(names, self._first_pass)
        if self.follow:
            yield self._follow()
        else:
            if self.refresh is not None:
                yield self._reopen()
            yield self._each(list(self.copies), self._check_unchanged)
        if self.sessions is not None:
            yield self._copy_sessions()
        # nothing more is copied: front-ends may start on the destination
        # now (what they append is after the ends verified below)
        self.say(f"caught up: {len(self.copies)} logs copied to their ends"
                 + (", verifying" if self.verify_logs else ""))
        result: dict[str, dict[str, int]] = {}
        if self.verify_logs:
            digests = yield self._each(list(self.copies), self._verify)
            result = {name: d.as_dict() for name, d in zip(list(self.copies), digests)}
        yield self._journal({"event": "verified" if self.verify_logs else "copied",
                             "source": self.describe, "logs": result or sorted(self.copies),
                             "ends": self.ends})
        return result

    def _each(self, names: list[str], f: Callable[[str], Deferred[Any]]) -> Deferred[list[Any]]:
        """C{f(name)} for every name, L{PARALLEL} at a time; the first failure is the result."""
        semaphore = defer.DeferredSemaphore(PARALLEL)
        ds = [semaphore.run(f, name) for name in names]
        return defer.gatherResults(ds, consumeErrors=True).addErrback(first_failure)

    @defer.inlineCallbacks
    def _first_pass(self, name: str) -> Any:
        try:
            log: ILog = yield self.src.get(name)
        except LogNotFound:
            return      # deleted on the source since it was listed
        copy = LogCopy(name, log, self.dst, self.progress)
        yield copy.prepare()
        self.copies[name] = copy
        self.ends[name] = yield copy.catch_up()

    @defer.inlineCallbacks
    def _fresh(self, name: str) -> Any:
        """
        The source's log C{name} as its store knows it now: an open log
        may learn of appends late (a JetStream front-end's follower), and
        the end a copy stops at, or checks, must include every append
        acknowledged before (C{get} reads the tail anew).  A log deleted
        on the source keeps the view it had.
        """
        copy = self.copies[name]
        try:
            copy.src = yield self.src.get(name)
        except LogNotFound:
            pass
        return copy

    @defer.inlineCallbacks
    def _check_unchanged(self, name: str) -> Any:
        """Without C{follow}: refuse a source that went on being written."""
        copy = yield self._fresh(name)
        end = copy.src.end_position
        if end != self.ends[name]:
            raise SourceWritten(
                f"log {name} was written during the copy ({end - self.ends[name]} records "
                f"after the {self.ends[name]} copied): stop the writers, or copy with "
                "--follow; run the same copy again to go on")

    @defer.inlineCallbacks
    def _verify(self, name: str) -> Any:
        result: Digest = yield self.copies[name].verify(self.ends[name])
        return result

    # -- following ---------------------------------------------------------
    def stop(self) -> None:
        """
        Stop following: each log finishes the batch it copies, catches up
        once more, and the copy verifies (L{run} then fires).
        """
        self._stopping = True
        for d in list(self._waits):
            d.cancel()

    @defer.inlineCallbacks
    def _reopen(self) -> Any:
        """A fresh view of the source (L{refresh}) for every log copied."""
        assert self.refresh is not None
        old = self.src
        self.src = yield self.refresh()
        try:
            for name, copy in list(self.copies.items()):
                try:
                    copy.src = yield self.src.get(name)
                except LogNotFound:
                    pass    # deleted on the source: what was copied stays
        finally:
            yield old.close()

    @defer.inlineCallbacks
    def _follow_reopening(self) -> Any:
        """Follow a source seen anew each round."""
        while not self._stopping:
            yield self._pause(FOLLOW_POLL)
            yield self._reopen()
            for name in self.names():
                if name not in self.copies:
                    yield self._first_pass(name)
            yield self._each(list(self.copies), self._last_catch_up)

    @defer.inlineCallbacks
    def _follow(self) -> Any:
        if self.refresh is not None:
            yield self._follow_reopening()
            return
        following: dict[str, Deferred[Any]] = {}
        while not self._stopping:
            for name in self.names():
                if name not in self.copies and name not in following:
                    yield self._first_pass(name)  # created on the source meanwhile
                if name in self.copies and name not in following:
                    following[name] = self._follow_log(name)
            for name, d in list(following.items()):
                if d.called:
                    yield d     # a failure ends the copy
                    del following[name]
            yield self._pause(FOLLOW_POLL)
        yield defer.gatherResults(list(following.values()), consumeErrors=True).addErrback(
            first_failure)
        yield self._each(list(self.copies), self._last_catch_up)

    @defer.inlineCallbacks
    def _follow_log(self, name: str) -> Any:
        copy = self.copies[name]
        while not self._stopping:
            d = copy.src.wait(copy.position, timeout=FOLLOW_POLL)
            self._waits.add(d)
            try:
                yield d
            except defer.CancelledError:
                break
            except (LogClosed, LogNotFound):
                return  # deleted on the source: what was copied stays
            finally:
                self._waits.discard(d)
            if copy.src.end_position > copy.position:
                self.ends[name] = yield copy.catch_up()

    @defer.inlineCallbacks
    def _last_catch_up(self, name: str) -> Any:
        copy = yield self._fresh(name)
        self.ends[name] = yield copy.catch_up()

    def _pause(self, seconds: float) -> Deferred[None]:
        d: Deferred[None] = Deferred(lambda d: call.cancel())
        call = self.clock.callLater(seconds, d.callback, None)
        waits: set[Deferred[Any]] = self._waits
        waits.add(d)    # cancelled by stop() alike

        def done(result: object) -> None:
            waits.discard(d)
            return None
        return d.addBoth(done)

    @defer.inlineCallbacks
    def _copy_sessions(self) -> Any:
        assert self.sessions is not None
        self.sessions_copied = yield self.sessions()

    # -- the journal ---------------------------------------------------------
    @defer.inlineCallbacks
    def _journal(self, entry: dict[str, Any]) -> Any:
        entry = dict(entry, time=round(time.time(), 3))
        try:
            log: ILog = yield self.dst.get_or_create(JOURNAL_LOG)
            yield log.append([json.dumps(entry, sort_keys=True).encode()])
        except LogError as e:
            raise CopyFailed(f"the destination's journal {JOURNAL_LOG} cannot be written: {e}")


@defer.inlineCallbacks
def last_journal_entry(store: ILogStore) -> Any:
    """The destination's last journal entry (a dict), or None when it has none."""
    try:
        log: ILog = yield store.get(JOURNAL_LOG)
    except LogNotFound:
        return None
    if log.end_position == log.start_position:
        return None
    batch = yield log.read(log.end_position - 1)
    return json.loads(batch.records()[0])


__all__ = ["CopyFailed", "CopyRefused", "SourceWritten", "StoreCopy", "last_journal_entry"]
