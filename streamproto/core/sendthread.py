"""
Small answers sent from a native thread: the reactor's side of the C
accelerator's C{SendThread} (C{streamproto/_sender.c}).

Why: a server of many small requests spends about half of its reactor
thread in C{send(2)}; on loopback, and wherever the peer waits for its
answer, that call also does the receiving side's work (its TCP receive
path, the wake-up of its thread).  Measured on a Styx server under
C{wrk -c64}: 42% of the reactor thread in C{send}, 20% in C{recv}, 38%
Python (doc/performance.rst).  L{NativeSendThread} hands such writes to
one native thread that never takes the GIL, so the reactor goes on
reading and answering while the kernel delivers.

What the reactor keeps: the thread sends only what a socket takes at once.
When a send would block or fails, the thread blocks that connection: the
rest of that write and every later one of the connection come back
unsent, in order, and the token of the connection is reported on an
eventfd the reactor watches.  L{streamproto.core.sendpath.SocketSender}
then sends them itself, the usual way, and lets the thread send again
once its own queue is empty.  A connection whose sends all go through
costs no report at all.

The first write of each reactor turn stays on the reactor thread
(L{NativeSendThread.direct_free}): when the server is not busy, a turn
answers one request, and handing that answer to the thread added the
thread's wake-up (about 60 us on this machine) to its latency; when it
is, one fsync's acknowledgements answer many requests in one turn, and
all but the first go to the thread (doc/performance.rst, run N).

An answer made before the fsync it acknowledges can be held
(L{streamproto.core.sendpath.SocketSender.hold}): the file store's native
syncer then sends it from the thread that ran that fsync, the moment it
succeeds, without the reactor's wake-up and the Python of the
acknowledgement before it (doc/performance.rst, run P).

One thread per reactor and process (L{for_reactor}); its eventfd is
watched only while a connection uses it, so a server without such
connections leaves nothing in the reactor.  A fork (twistd daemonizing)
keeps no thread: the first connection in the new process starts one.
Linux only, and only with the accelerator: L{for_reactor} is None
otherwise, and the writes stay on the reactor thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorFDSet, IReadDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.base.speedups import speedups

#: the accelerator's native sender: None without the accelerator (or with
#: it turned off: L{streamproto.base.speedups.PURE_ENV}) and off Linux
_SendThread: Callable[[], Any] | None = getattr(speedups, "SendThread", None)


@implementer(IReadDescriptor)
class NativeSendThread:
    """
    One reactor's native send thread and the connections using it.

    L{socket} gives a connection its C{SendSocket}; when the thread reports
    the connection's token (its sends came back, or a wait for it to
    settle is over), the callback given with it runs on the reactor
    thread.
    """

    def __init__(self, reactor: IReactorFDSet) -> None:
        if _SendThread is None:
            raise RuntimeError("the C accelerator's SendThread is not built")
        self._reactor = reactor
        self._native: Any = None
        self._fd = -1
        self._next_token = 0
        self._settled: dict[int, Callable[[], object]] = {}
        self._watching = False
        #: whether this reactor turn's write on the reactor thread is still to come
        self.direct_free = True

    def take_direct(self) -> None:
        """
        A write of this turn goes out on the reactor thread: the next ones
        go to the native thread, until the next turn.
        """
        self.direct_free = False
        self._reactor.callLater(0, self._next_turn)  # type: ignore[attr-defined]

    def _next_turn(self) -> None:
        self.direct_free = True

    def socket(self, fd: int, on_settled: Callable[[], object]) -> Any:
        """
        A C{SendSocket} that sends to C{fd} on the thread, and owns it from
        now on (it closes it once its last send is done).

        @param on_settled: called on the reactor thread when the socket
            settles (see L{streamproto.core.sendpath.SocketSender}).
        """
        if self._native is None or self._native.forked():
            assert _SendThread is not None
            self._native = _SendThread()
            self._settled, self._watching = {}, False
        self._next_token += 1
        token = self._next_token
        sock = self._native.socket(fd, token)
        self._settled[token] = on_settled
        if not self._watching:
            self._fd = self._native.fileno()
            self._reactor.addReader(self)
            self._watching = True
        return sock

    def forget(self, sock: Any) -> None:
        """The connection closed: no more reports for it (close C{sock}
        after)."""
        self._settled.pop(sock.token, None)
        if not self._settled and self._watching:
            self._reactor.removeReader(self)
            self._watching = False

    # -- IReadDescriptor ----------------------------------------------------
    def fileno(self) -> int:
        return self._fd

    def doRead(self) -> None:
        for token in self._native.ready():
            callback = self._settled.get(token)
            if callback is not None:   # else closed since the report
                callback()

    def connectionLost(self, reason: Failure) -> None:
        # removed by the reactor (removeAll at shutdown): watched again at
        # the next connection
        self._watching = False

    def logPrefix(self) -> str:
        return "SendThread"


_threads: weakref.WeakKeyDictionary[Any, NativeSendThread] = weakref.WeakKeyDictionary()


def for_reactor(reactor: Any) -> NativeSendThread | None:
    """
    C{reactor}'s L{NativeSendThread}; None where there is none to have (no
    accelerator, not Linux, or a reactor that does not watch descriptors).
    """
    if _SendThread is None or not IReactorFDSet.providedBy(reactor):
        return None
    thread = _threads.get(reactor)
    if thread is None:
        thread = _threads[reactor] = NativeSendThread(reactor)
    return thread
