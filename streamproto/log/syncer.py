"""
Where the file store's group commit runs its fsyncs.

A L{FileLog} hands each group commit (the segment files written since the
last one, and the log's directory when a segment was created) to a
syncer and acknowledges when the syncer's Deferred fires:

- L{ThreadSyncer} runs them through the store's C{run_blocking}: the
  reactor's thread pool in a server, inline in tests and tools, and
  through the store's L{FileIO}, so fault injection (fsync errors, power
  loss) sees every call.
- L{NativeSyncer} gives them to native threads of the C accelerator
  (C{streamproto._speedups.Syncer}), which never take the GIL, and learns
  that they are done from an eventfd the reactor watches.  With a Python
  thread, each group commit waits twice for the interpreter (to start the
  fsync, and to hand back its result) and, while the reactor thread is
  busy, each wait can last a switch interval (L{streamproto.core.gil}):
  that wait is in every acknowledgement's latency.  Figures:
  doc/performance.rst.

Each log syncs on a lane of its own: a lane's syncs run one at a time, in
order, and those submitted while one runs are merged into one run that
starts the moment it ends (Go's styx server does the same with a syncer
per log).  The log does not wait to learn that its last fsync is done
before it hands over the next: on the native threads that hand-over took
a wake-up of the reactor and its acknowledgements, and at half the
closed-loop maximum it halved the fsyncs a server ran and added a third
to each acknowledgement's latency (doc/performance.rst, run N).

The native syncer also sends held answers (L{ISyncer.sync}'s
C{answers}): made before the fsync by a server, sent from the fsync's
thread the moment it succeeds, before the reactor learns of it, and never
after a failed fsync of the lane (doc/performance.rst, run P).

L{make_syncer} picks the native one where it can: the accelerator is
built (and not disabled by C{STREAMPROTO_PURE_PYTHON}), the store uses
the real file layer and the thread pool, and the reactor watches file
descriptors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFDSet, IReadDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.base.durable import DirectoryIO
from streamproto.base.observer import Observers
from streamproto.base.speedups import speedups
from streamproto.log import metrics


#: native fsync threads per store at most: logs sync in parallel, as many
#: as the reactor's thread pool (10) ran before, less one for its reads
MAX_THREADS = 8

#: the accelerator's native syncer: None without the accelerator (or with
#: it turned off: L{streamproto.base.speedups.PURE_ENV}) and off Linux (no
#: eventfd)
_Syncer: Callable[..., Any] | None = getattr(speedups, "Syncer", None)


class ISyncer(Protocol):
    #: whether L{sync} sends the answers it is given (else it cancels them)
    sends_answers: bool

    def sync(self, fds: Sequence[int], directory: str | None, lane: int = 0,
             answers: Sequence[Any] = (),
             durable: Callable[[], object] | None = None) -> Deferred[None]:
        """
        fsync C{fds} in order, then C{directory} when given (a segment file
        was created in it).

        @param lane: a positive number (the log's): the lane's syncs run
            one at a time, in the order given, each started no earlier
            than the end of the one before (those given meanwhile as one
            run); their Deferreds fire in that order.  0: none, a sync on
            its own.
        @param answers: held answers (L{streamproto.core.sendpath.SocketSender.hold})
            to send the moment these are durable, and no earlier sync of
            the lane failed; each is finished (sent or cancelled) by the
            time the Deferred fires, or cancelled by its owner then.
        @param durable: with C{answers}: called on the reactor thread from
            L{catch_up} when these are durable but the Deferred has not
            fired yet (its answers may be out): what must be visible to
            readers once a client has its answer (the log's end), and
            nothing else (no Deferred fires in it).

        @return: a Deferred firing once all of them are durable, or failing
            with the first C{OSError}.
        """

    def catch_up(self) -> None:
        """
        Call the C{durable} of each sync whose answers went out from the
        fsync's thread, without waiting for its Deferred (which fires on a
        later turn of the reactor): a reader's view is then never behind
        an answer a client has.  (A failed sync sends none, nor does any
        later one of its lane.)
        """

    def close(self) -> None:
        """Stop once what was handed over is synced (the store closed)."""


class _Run:
    """Syncs that run as one: their files (each once, in order), the first
    directory given, and their waiters."""

    def __init__(self) -> None:
        self.fds: dict[int, None] = {}
        self.directory: str | None = None
        self.waiters: Observers[None] = Observers()

    def add(self, fds: Sequence[int], directory: str | None) -> Deferred[None]:
        self.fds.update(dict.fromkeys(fds))
        if self.directory is None:
            self.directory = directory
        return self.waiters.when()


class ThreadSyncer:
    """The fsyncs through C{run_blocking} and the store's file layer."""

    sends_answers = False

    def __init__(self, run_blocking: Callable[..., Deferred[Any]], io: DirectoryIO) -> None:
        self._run_blocking = run_blocking
        self._io = io
        #: lane -> the run waiting for its running one (None: none yet);
        #: a lane not here is not running
        self._next: dict[int, _Run | None] = {}

    def sync(self, fds: Sequence[int], directory: str | None, lane: int = 0,
             answers: Sequence[Any] = (),
             durable: Callable[[], object] | None = None) -> Deferred[None]:
        for answer in answers:
            answer.cancel()     # sent from the reactor, as every answer here
        if lane and lane in self._next:
            # the lane runs: this waits, with whatever else comes meanwhile
            run = self._next[lane]
            if run is None:
                run = self._next[lane] = _Run()
            return run.add(fds, directory)
        run = _Run()
        d = run.add(fds, directory)     # before: an inline run_blocking fires it at once
        self._run(lane, run)
        return d

    def _run(self, lane: int, run: _Run) -> None:
        if lane:
            self._next[lane] = None
        self._run_blocking(self._sync, list(run.fds), run.directory).addBoth(
            self._ran, lane, run)

    def _ran(self, result: object, lane: int, run: _Run) -> None:
        # in order, before the next run starts: with an inline
        # run_blocking that run would fire its own Deferreds first
        run.waiters.fire(result if isinstance(result, Failure) else None)
        if lane:
            waiting = self._next.pop(lane)
            if waiting is not None:
                self._run(lane, waiting)

    def catch_up(self) -> None:
        pass    # answers only leave once the Deferred fired

    def _sync(self, fds: list[int], directory: str | None) -> None:
        started = time.monotonic()
        for fd in fds:
            self._io.fsync(fd)
        if directory is not None:
            self._io.fsync_dir(directory)
        metrics.FSYNC_SECONDS.observe(time.monotonic() - started)

    def close(self) -> None:
        pass


@implementer(IReadDescriptor)
class NativeSyncer:
    """
    The fsyncs on the accelerator's native threads; their completions read
    from its eventfd on the reactor thread.  The eventfd is watched from
    the first sync until the syncer closes: adding and removing it around
    every group commit, as it first was, cost two C{epoll_ctl} calls each,
    on a quiet server as much of the reactor's time as the answer's send
    (doc/performance.rst, run N).

    A fork (twistd daemonizing after the store opened) keeps no thread: the
    first sync in the new process starts a new native syncer.
    """

    #: answers go out from the native thread that made them durable
    #: (C{streamproto/_sender.c}, "held answers")
    sends_answers = True

    def __init__(self, reactor: IReactorFDSet, max_threads: int = MAX_THREADS) -> None:
        if _Syncer is None:
            raise RuntimeError("the C accelerator's Syncer is not built")
        self._reactor = reactor
        self._max_threads = max_threads
        self._native: Any = None
        self._out: dict[int, Deferred[None]] = {}
        #: job -> its sync's C{durable}, while its answers may be out
        #: before its Deferred fires
        self._durable: dict[int, Callable[[], object]] = {}
        #: the eventfd the reactor watches (kept: the reactor finds a
        #: reader by the descriptor it was added with)
        self._fd = -1
        self._watching = False
        self._closed = False

    def sync(self, fds: Sequence[int], directory: str | None, lane: int = 0,
             answers: Sequence[Any] = (),
             durable: Callable[[], object] | None = None) -> Deferred[None]:
        if self._closed:
            raise RuntimeError("sync() on a closed NativeSyncer")
        # forked(): the accelerator counts forks (a pthread_atfork handler),
        # which asking os.getpid() at every sync would cost a system call
        if self._native is None or self._native.forked():
            assert _Syncer is not None
            self._unwatch()     # a forked child's copy of the parent's eventfd
            self._native = _Syncer(self._max_threads)
            self._out, self._durable = {}, {}
        job = self._native.submit(fds, directory, lane, answers)
        d: Deferred[None] = Deferred()
        self._out[job] = d
        if answers and durable is not None:
            self._durable[job] = durable
        if not self._watching:
            self._fd = self._native.fileno()
            self._reactor.addReader(self)
            self._watching = True
        return d

    def _unwatch(self) -> None:
        if self._watching:
            self._reactor.removeReader(self)
            self._watching = False

    # -- IReadDescriptor ----------------------------------------------------
    def fileno(self) -> int:
        return self._fd

    def doRead(self) -> None:
        # settle the bookkeeping before any callback runs: an acknowledged
        # client may append (and sync) again, or close the store, inside it
        done = []
        for job, error, seconds in self._native.completed():
            self._durable.pop(job, None)    # the Deferred says it now
            done.append((self._out.pop(job), error, seconds))
        if not self._out and self._closed:
            self._stop()
        for d, error, seconds in done:
            if error:
                d.errback(Failure(OSError(error, os.strerror(error))))
            else:
                if seconds >= 0:   # a job merged into the one before: timed there
                    metrics.FSYNC_SECONDS.observe(seconds)
                d.callback(None)

    def catch_up(self) -> None:
        durable = self._durable
        if not durable or self._native is None:
            return
        # the native thread lists a job as done before it sends its
        # answers, and tells the eventfd after: a reader served meanwhile
        # finds it here
        for job, answered in self._native.peek():
            if answered:    # else nobody was told before the Deferred fires
                made = durable.pop(job, None)
                if made is not None:
                    made()

    def connectionLost(self, reason: Failure) -> None:
        # removed by the reactor (removeAll at shutdown): watched again at
        # the next sync
        self._watching = False

    def logPrefix(self) -> str:
        return "fsync"

    def close(self) -> None:
        """
        Stop the threads once what was submitted is synced.  Jobs still out
        are reported first, each to its Deferred, and only then are the
        threads told to exit: a Deferred is never left unfired.
        (L{FileLogStore} closes its logs after their last fsync, so there
        are none then; an embedder's code might close it earlier.)
        """
        self._closed = True
        if not self._out:
            self._stop()

    def _stop(self) -> None:
        self._unwatch()
        if self._native is not None:
            self._native.close()
            self._native = None


def make_syncer(reactor: Any, run_blocking: Callable[..., Deferred[Any]] | None,
                default_run_blocking: Callable[..., Deferred[Any]],
                io: DirectoryIO, default_io: bool) -> ISyncer:
    """
    The native syncer when the store runs its blocking work on the
    reactor's thread pool (C{run_blocking} None) through the real file
    layer (C{default_io}), the accelerator has one, and C{reactor} watches
    file descriptors; L{ThreadSyncer} otherwise.
    """
    native = (_Syncer is not None and run_blocking is None and default_io
              and IReactorFDSet.providedBy(reactor))
    if native:
        return NativeSyncer(reactor)
    return ThreadSyncer(run_blocking or default_run_blocking, io)
