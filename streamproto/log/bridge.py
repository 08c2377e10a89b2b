"""
Where the asyncio NATS client meets the Twisted reactor.

nats-py is asyncio; our servers run on whatever reactor twistd (or an
embedding program) chose.  L{AsyncioThreadBridge} runs one asyncio event
loop in its own daemon thread, per store:

- the reactor side calls L{AsyncioThreadBridge.call} (a coroutine function,
  result as a Deferred fired on the reactor thread) or
  L{AsyncioThreadBridge.call_soon} (a plain function run on the loop
  thread, in order: publishes keep their order this way);
- the loop side hands results and events back with
  L{AsyncioThreadBridge.post}, which runs a function on the reactor thread.

Both directions are coalesced: calls queued while the other side has not
yet woken up ride on the same wake-up (one C{call_soon_threadsafe} or one
C{callFromThread} for many), so a burst of appends costs one thread
switch, not one each.

Why a thread and not Twisted's asyncio reactor: the servers are Twisted
programs that users run with their reactor of choice (epoll by default,
or embedded in their own application); installing the asyncio reactor is
a process-wide decision a log store must not force, and it has to happen
before anything imports C{twisted.internet.reactor}.  The thread keeps
nats-py's per-message work (header parsing, JSON acks) off the reactor
turn; the cost is a thread switch per coalesced batch in each direction
(measured in C{bench/jetstream_bench.py --bridge}).  The reactor never
waits on the loop: every result comes back through L{post}.

L{SynchronousBridge} is the test double, like the file store's
C{run_blocking=synchronous}: the caller's thread waits for the loop, so
Deferreds fire before the call returns and a C{SynchronousTestCase}
can drive a store on a real NATS cluster.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Literal, ParamSpec, TypeVar, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.failure import Failure
from streamproto.base.clock import default_reactor

_T = TypeVar("_T")
_P = ParamSpec("_P")
#: a function and its arguments, queued for the other side
_Call = tuple[Callable[..., object], tuple[Any, ...]]


class BridgeClosed(Exception):
    """The bridge was stopped: nothing runs on its loop any more."""


class _Loop:
    """An asyncio loop running in a daemon thread (restarted after a fork)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.pid: int | None = None

    def ensure(self) -> asyncio.AbstractEventLoop:
        # twistd forks after makeService: a loop thread started before the
        # fork does not exist in the daemon, so start (again) in this process
        if self.loop is None or self.pid != os.getpid():
            self.pid = os.getpid()
            self.loop = loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self._run, args=(loop,), name=self.name,
                                           daemon=True)
            self.thread.start()
            return loop
        return self.loop

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    def stop(self, timeout: float = 10.0) -> None:
        loop, thread = self.loop, self.thread
        if loop is None or thread is None or self.pid != os.getpid():
            return
        self.loop = self.thread = None

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        if thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), loop)
            thread.join(timeout)
        if not thread.is_alive():
            loop.close()


class _CallQueue:
    """
    The calls queued for one side of the bridge, coalesced: the first call
    queued asks C{wake} (that side's thread-safe scheduler) to run the queue
    once, and every call queued before it runs rides on that one wake-up.

    @ivar queued: how many calls were queued.
    @ivar wakeups: how many times the queue was run (queued per wake-up is
        the coalescing factor the bench reports).
    """

    def __init__(self, side: str, lock: threading.Lock) -> None:
        self.side = side
        self._lock = lock
        self.calls: deque[_Call] = deque()
        self._scheduled = False
        self.queued = 0
        self.wakeups = 0

    def put(self, f: Callable[..., object], args: tuple[Any, ...],
            wake: Callable[[Callable[[], None]], object]) -> None:
        """Queue C{f(*args)}; wake the other side unless a wake-up is on its way."""
        with self._lock:
            self.calls.append((f, args))
            self.queued += 1
            if self._scheduled:
                return
            self._scheduled = True
        wake(self.run)

    def run(self) -> None:
        """On the queue's side: run every call queued so far, in order."""
        self.wakeups += 1
        with self._lock:
            batch, self.calls = self.calls, deque()
            self._scheduled = False
        for f, args in batch:
            try:
                f(*args)
            except Exception:
                from twisted.logger import Logger
                Logger().failure("nats bridge: a {side} call failed", side=self.side)


class AsyncioThreadBridge:
    """
    An asyncio loop in its own thread, and the two coalesced queues between
    it and the reactor.

    @ivar wakeups: how many times each side was woken up (for the bench:
        calls per wake-up is the coalescing factor).
    """

    def __init__(self, reactor: IReactorFromThreads | Literal[False] | None = None,
                 name: str = "streamproto-nats") -> None:
        # False: no reactor (the synchronous bridge, whose post does not use it)
        self._reactor = cast(IReactorFromThreads, default_reactor(reactor))
        self._loop = _Loop(name)
        self._lock = threading.Lock()
        self._to_loop = _CallQueue("loop", self._lock)
        self._to_reactor = _CallQueue("reactor", self._lock)
        self._stopped = False

    @property
    def wakeups(self) -> dict[str, int]:
        return {"loop": self._to_loop.wakeups, "reactor": self._to_reactor.wakeups}

    @property
    def calls(self) -> dict[str, int]:
        return {"loop": self._to_loop.queued, "reactor": self._to_reactor.queued}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop.ensure()

    def in_loop_thread(self) -> bool:
        return self._loop.thread is threading.current_thread()

    # reactor -> loop ----------------------------------------------------
    def call_soon(self, f: Callable[..., object], *args: Any) -> None:
        """Run C{f(*args)} on the loop thread, after every earlier call_soon."""
        if self._stopped:
            raise BridgeClosed("store closed")
        self._to_loop.put(f, args, self.loop.call_soon_threadsafe)

    def call(self, coroutine_function: Callable[_P, Coroutine[Any, Any, _T]],
             *args: _P.args, **kwargs: _P.kwargs) -> Deferred[_T]:
        """
        Run C{coroutine_function(*args, **kwargs)} on the loop.

        @return: Deferred firing on the reactor thread with its result.
        """
        if self._stopped:
            return fail(BridgeClosed("store closed"))
        d: Deferred[_T] = Deferred()
        self.call_soon(self._start, d, coroutine_function, args, kwargs)
        return d

    def _start(self, d: Deferred[_T], coroutine_function: Callable[..., Coroutine[Any, Any, _T]],
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        task = self.loop.create_task(coroutine_function(*args, **kwargs))
        task.add_done_callback(lambda t: self.post(_fire, d, t))

    # loop -> reactor ----------------------------------------------------
    def post(self, f: Callable[..., object], *args: Any) -> None:
        """From the loop thread: run C{f(*args)} on the reactor thread."""
        self._to_reactor.put(f, args, self._reactor.callFromThread)

    # work the synchronous bridge waits for ------------------------------
    def begin(self) -> None:
        """The loop started work whose outcome will be posted (no-op here)."""

    def end(self) -> None:
        """That work's outcome was posted."""

    def stop(self) -> None:
        """Stop the loop (its tasks are cancelled); nothing is called after."""
        self._stopped = True
        self._loop.stop()


def _fire(d: Deferred[_T], task: asyncio.Task[_T]) -> None:
    if task.cancelled():
        d.errback(Failure(BridgeClosed("cancelled: store closed")))
        return
    error = task.exception()
    if error is not None:
        d.errback(Failure(error))
    else:
        d.callback(task.result())


class SynchronousBridge(AsyncioThreadBridge):
    """
    For tests: every call waits for the loop, so its Deferred has fired
    when it returns.  What the loop posts runs on the caller's thread at
    the end of the next call, or on L{drain}.  L{call_soon} also waits
    until every outstanding piece of work the loop announced with L{begin}
    (a publish waiting for its ack) has posted its outcome.
    """

    def __init__(self, timeout: float = 30.0) -> None:
        super().__init__(reactor=False, name="streamproto-nats-sync")
        self.timeout = timeout
        self._busy = 0
        self._idle = threading.Condition(self._lock)

    def call_soon(self, f: Callable[..., object], *args: Any) -> None:
        if self._stopped:
            raise BridgeClosed("store closed")
        done = threading.Event()
        errors: list[Exception] = []

        def run() -> None:
            try:
                f(*args)
            except Exception as e:
                errors.append(e)
            done.set()
        self.loop.call_soon_threadsafe(run)
        if not done.wait(self.timeout):
            raise RuntimeError("loop call did not run in time")
        with self._idle:
            if not self._idle.wait_for(lambda: self._busy == 0, self.timeout):
                raise RuntimeError("loop work not finished in time")
        if errors:
            raise errors[0]
        self.drain()

    def call(self, coroutine_function: Callable[_P, Coroutine[Any, Any, _T]],
             *args: _P.args, **kwargs: _P.kwargs) -> Deferred[_T]:
        if self._stopped:
            return fail(BridgeClosed("store closed"))
        future = asyncio.run_coroutine_threadsafe(coroutine_function(*args, **kwargs),
                                                  self.loop)
        try:
            result = future.result(self.timeout)
        except Exception as e:
            self.drain()
            return fail(e)
        self.drain()
        return succeed(result)

    def post(self, f: Callable[..., object], *args: Any) -> None:
        with self._lock:
            self._to_reactor.calls.append((f, args))

    def drain(self) -> None:
        """Run what the loop posted, on this thread."""
        while True:
            with self._lock:
                if not self._to_reactor.calls:
                    return
                f, args = self._to_reactor.calls.popleft()
            f(*args)

    def begin(self) -> None:
        with self._idle:
            self._busy += 1

    def end(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()
