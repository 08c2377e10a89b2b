"""
A send path for bulk output that bypasses Twisted's write buffer on plain
TCP connections.

Why: a consumer stream moves the log's bytes out as fast as the peer takes
them.  Through C{transport.write} every batch is first framed into a new
buffer, then joined with whatever the transport still holds, then sent
C{SEND_LIMIT} (128 KiB) at a time, one reactor turn each: three copies in
user space before the kernel's.  L{SocketSender} sends records framed on the
fly from the buffer the log read them into: one C{sendmsg} per up to 512
records with the 6-byte frame headers and the payloads as separate iovecs
(the C accelerator): nothing is copied in user space between the log's
read and the send, as in the Go reference, and each send is as big as the
socket's send buffer allows.

How it stays inside public APIs: it registers a duplicate of the
connection's descriptor (C{os.dup} of C{ITCPTransport.getHandle()}) as an
C{IWriteDescriptor} with the reactor (C{IReactorFDSet.addWriter}); the
transport keeps reading from the original.  epoll and kqueue key their
registrations on the descriptor number, so the two never collide.  The
duplicate is closed before the transport closes the connection, so a close
is still the transport's (and a FIN only goes out once both are closed).

Every byte of the connection must then go through the sender, in order: the
stream writes its heartbeats and last messages through it too, and closes
the transport only once the sender has drained.  TLS connections (the bytes
must be encrypted in user space anyway) and transports without a socket
keep C{transport.write}: L{SocketSender.usable} tells which.

A sender made C{native} (small answers: Styx's quick path) hands its
writes to the accelerator's send thread (L{streamproto.core.sendthread})
while nothing waits in its own queue: the reactor thread copies an answer
and goes on, the native thread makes the C{send}.  (An C{eager} one sends
the first write of each reactor turn itself, when the thread holds
nothing of it: that one answer's latency is then not the thread's
wake-up.)  What the thread could
not send comes back, in order, before anything written since, and goes
out the usual way; once that is all sent, the thread sends again.
"""

from __future__ import annotations

import os
import socket
from array import array
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IPushProducer, IReactorFDSet, ISystemHandle, IWriteDescriptor,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.log.batch import BytesLike, RecordBatch

from streamproto.core.framing import _speedups, frame_records
from streamproto.core.observer import Observers
from streamproto.core.sendthread import for_reactor
from streamproto.core.tcp import tcp_socket

#: Below this average record size the frames are built in one buffer (a
#: fast C copy) rather than sent as two iovecs a record: tiny iovecs would
#: make each sendmsg carry too few bytes.
MIN_IOVEC_RECORD = 512

_log = Logger()


class _Frames:
    """Records of a batch still to send: (lengths, data) from C{index} on,
    C{skip} bytes of record C{index}'s frame already sent."""

    __slots__ = ("lengths", "data", "prefix", "index", "skip", "nbytes")

    def __init__(self, lengths: array[int], data: BytesLike, prefix: bytes) -> None:
        self.lengths = lengths
        self.data = data
        self.prefix = prefix
        self.index = 0
        self.skip = 0
        self.nbytes = len(data) + len(lengths) * (len(prefix) + 4)


@implementer(IWriteDescriptor)
class SocketSender:
    """
    Sends a TCP connection's output straight to its socket (see the module
    docstring), with streaming-producer flow control: the registered
    producer is paused while more than C{high_water} bytes wait, and resumed
    once they are all sent.

    @ivar pending: bytes accepted and not yet sent.
    @ivar sent: bytes sent so far.
    @ivar failed: why sending stopped before everything was sent (the
        peer went away), or None.
    """

    def __init__(self, transport: ISystemHandle, reactor: IReactorFDSet,
                 high_water: int = 2 * 1024 * 1024,
                 on_sent: Callable[[int], object] | None = None,
                 eager: bool = False, native: bool = False) -> None:
        """
        @param eager: L{write} sends at once what the socket takes when
            nothing is queued, instead of on the reactor's next turn: for
            small answers, where registering the descriptor for writing
            and removing it again (two C{epoll_ctl} calls each) costs more
            than the send.
        @param native: L{write} hands what it is given to the native send
            thread when nothing is queued (see the module docstring), where
            the accelerator has one; L{write_records} then frames into one
            buffer and writes that.  For small writes, each one is copied.
            As for any sender, close the transport only once
            L{when_drained} fired: Twisted shuts a socket down as it closes
            it (C{shutdown(2)}), which ends sends still queued on the
            thread's duplicate too.
        """
        self._transport = transport
        self.eager = eager
        self._reactor = reactor
        self._fd: int | None = os.dup(cast(socket.socket, transport.getHandle()).fileno())
        self.high_water = high_water
        self._on_sent = on_sent
        self._queue: list[memoryview | _Frames] = []
        self.pending = 0
        self.sent = 0
        self._writing = False
        self._producer: IPushProducer | None = None
        self._producer_paused = False
        self._drain_waiters: Observers[None] = Observers()
        self.failed: BaseException | None = None
        #: the native thread's socket (which owns a second duplicate
        #: descriptor, closed once its last send is done), or None
        self._native: Any = None
        self._native_thread = for_reactor(reactor) if native else None
        if self._native_thread is not None:
            self._native = self._native_thread.socket(os.dup(self._fd), self._native_settled)
        #: the native thread blocked: what it did not send comes back and
        #: goes before the queue, which waits until then
        self._held = False
        #: bytes that came back from the native thread, counted by
        #: C{on_sent} already when handed to it
        self._recount = 0

    @staticmethod
    def usable(transport: object, reactor: object) -> bool:
        """
        True if C{transport} is plain TCP with a socket this sender can
        write to and C{reactor} lets descriptors be added.
        """
        return IReactorFDSet.providedBy(reactor) and tcp_socket(transport) is not None

    # -- the writer's side -----------------------------------------------
    def write(self, data: BytesLike) -> None:
        """Queue bytes (an eager sender first sends what it can; a native
        one hands them to the native thread)."""
        if data and self.failed is None and self._fd is not None:
            native = self._native
            if native is not None and not self._queue and not self._held:
                thread = self._native_thread
                assert thread is not None
                if self.eager and thread.direct_free and not native.inflight:
                    # the turn's first write: sent on this thread, below
                    # (module docstring)
                    thread.take_direct()
                elif native.send(data):
                    n = len(data)
                    self.sent += n
                    if self._on_sent is not None:
                        self._on_sent(n)
                    return
                else:
                    # the thread blocked this connection: what it did not
                    # send comes back first (now, or when it settles)
                    self._held = True
                    self._queue.append(memoryview(data))
                    self.pending += len(data)
                    self._schedule()
                    self._native_settled()
                    return
            eager = self.eager and not self._queue
            self._queue.append(memoryview(data))
            self.pending += len(data)
            if eager and (not self._send() or not self._queue):
                return  # all sent (or the peer is gone)
            self._schedule()

    def hold(self, data: bytes) -> Any:
        """
        Keep C{data} for the accelerator's syncer to send the moment the
        fsync it answers succeeds (C{streamproto._speedups.Syncer.submit}'s
        answers), from that fsync's thread: the answer then does not wait
        for the reactor to learn of the fsync.  It takes the connection's
        next place: what is written meanwhile waits behind it.

        @return: the held answer (give it to one fsync, then settle it with
            L{finish_held}), or None when this sender cannot hold one now
            (not native, output queued or out, or a held one pending).
        """
        native = self._native
        if (native is None or self._queue or self._held or self.failed is not None
                or self._fd is None):
            return None
        return native.hold(data)

    def finish_held(self, held: Any, size: int) -> bool:
        """
        Once the fsync's outcome is known on the reactor thread: whether the
        held answer (of C{size} bytes) went out; if not (the fsync failed,
        or it was not given to one), it never will, and the caller writes
        its answer.
        """
        held.cancel()   # a no-op once sent; wins a race with the syncer's thread otherwise
        if not held.sent:
            return False
        self.sent += size
        if self._on_sent is not None:
            self._on_sent(size)
        return True

    def write_records(self, lengths: array[int], data: BytesLike, prefix: bytes) -> None:
        """
        Queue records as C{[prefix][u32 BE size][payload]} frames.

        @param lengths: C{array('I')} of the records' sizes.
        @param data: their payloads, concatenated.
        """
        if not len(lengths) or self.failed is not None or self._fd is None:
            return
        if (_speedups is None or self._native is not None
                or len(data) < MIN_IOVEC_RECORD * len(lengths)):
            self.write(frame_records(lengths, data, prefix))
            return
        frames = _Frames(lengths, data, prefix)
        self._queue.append(frames)
        self.pending += frames.nbytes
        self._schedule()

    def write_batch(self, batch: RecordBatch, prefix: bytes) -> None:
        """
        Queue a batch's records as frames (see L{write_records}), each of
        its chunks from the buffer it was read into.
        """
        for lengths, data in batch.chunks():
            self.write_records(lengths, data, prefix)

    def registerProducer(self, producer: IPushProducer) -> None:
        """A streaming producer, paused while the queue is over the high
        water mark."""
        self._producer = producer
        self._producer_paused = False

    def unregisterProducer(self) -> None:
        self._producer = None

    def when_drained(self) -> Deferred[None]:
        """A Deferred that fires once everything queued is sent (or the
        sender failed: then with that failure's exception swallowed, since
        the connection is going anyway)."""
        from twisted.internet.defer import succeed
        if self.failed is not None or self._fd is None:
            return succeed(None)
        if not self._queue and not self._held:
            if self._native is None or self._native.settle():
                return succeed(None)
            # the native thread reports when its last send is done
        return self._drain_waiters.when()

    @property
    def drained(self) -> bool:
        """Whether every byte written has been sent (or the sender
        stopped)."""
        if self.failed is not None or self._fd is None:
            return True
        return not self._queue and not self._held and (
            self._native is None or not self._native.inflight)

    def close(self) -> None:
        """Stop for good and close the duplicate descriptor (the
        connection itself is the transport's to close)."""
        self._stop_writing()
        self._queue = []
        self.pending = 0
        self._held = False
        native, self._native = self._native, None
        if native is not None:
            assert self._native_thread is not None
            self._native_thread.forget(native)
            native.close()      # its descriptor once its last send is done
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._fire_drained()

    def _native_settled(self) -> None:
        """The native thread has no send of ours left: take back what it
        did not send (it blocked), or tell the drain waiters."""
        native = self._native
        if native is None:
            return
        got = native.returned()
        if got is None:
            return      # more sends out since: reported again when settled
        back, error = got
        if error:
            # the peer is gone (EPIPE, ECONNRESET): as in _send
            self.failed = OSError(error, os.strerror(error))
            _log.debug("native send failed: {error}", error=self.failed)
            self.close()
            return
        if back:
            n = sum(len(b) for b in back)
            self._queue[:0] = [memoryview(b) for b in back]
            self.pending += n
            self.sent -= n
            self._recount += n
        self._held = False
        if self._queue:
            self._schedule()    # unblocked once the queue is sent
        else:
            native.unblock()
            self._fire_drained()

    # -- flow control ------------------------------------------------------
    def _schedule(self) -> None:
        if self.pending > self.high_water and self._producer is not None \
                and not self._producer_paused:
            self._producer_paused = True
            self._producer.pauseProducing()
        if self._held:
            return      # what the native thread gives back goes first
        if not self._writing:
            self._writing = True
            self._reactor.addWriter(self)

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            self._reactor.removeWriter(self)

    def _fire_drained(self) -> None:
        if (self._queue or self._held) and self._fd is not None:
            return      # written to again meanwhile (by a producer we resumed)
        if self._native is not None and not self._native.settle():
            return      # the native thread reports when its sends are done
        self._drain_waiters.fire()

    # -- IWriteDescriptor --------------------------------------------------
    def fileno(self) -> int:
        return self._fd if self._fd is not None else -1

    def logPrefix(self) -> str:
        return "SocketSender"

    def doWrite(self) -> None:
        if not self._send():
            return None
        if not self._queue:
            self._stop_writing()
            if self._native is not None:
                self._native.unblock()  # the native thread may send again
            # the waiters first: a producer resumed next may write again (and
            # a waiter it adds then must wait for that too)
            self._fire_drained()
            if self._producer is not None and self._producer_paused:
                self._producer_paused = False
                self._producer.resumeProducing()
        elif self._producer is not None and self._producer_paused \
                and self.pending <= self.high_water // 2:
            self._producer_paused = False
            self._producer.resumeProducing()
        return None

    def connectionLost(self, reason: Failure) -> None:
        # the reactor calls this on a hang-up or error of the descriptor
        # (epoll's EPOLLHUP/EPOLLERR), or at shutdown
        if self._queue and self.failed is None:
            self.failed = reason.value
        self.close()

    def _send(self) -> bool:
        """L{_send_some}; False if the peer is gone (the sender stopped)."""
        try:
            self._send_some()
        except OSError as e:
            # the peer is gone (EPIPE, ECONNRESET): the transport's own
            # read side notices and loses the connection; stop here
            self.failed = e
            _log.debug("direct send failed: {error}", error=e)
            self.close()
            return False
        return True

    def _send_some(self) -> None:
        """Send until the socket would block or the queue is empty."""
        fd = self._fd
        if fd is None:  # closed
            return
        queue = self._queue
        while queue:
            item = queue[0]
            if isinstance(item, _Frames):
                # at most 512 records a call: go on until one sends nothing
                index, skip, n = _speedups.send_frames(
                    fd, item.lengths, item.data, item.prefix, item.index, item.skip)
                item.index, item.skip = index, skip
                done = index >= len(item.lengths)
            else:
                try:
                    n = os.write(fd, item)
                except BlockingIOError:
                    n = 0
                done = n == len(item)
                if n and not done:
                    queue[0] = item[n:]
            if n:
                self.pending -= n
                self.sent += n
                new = n
                if self._recount:
                    # sent once already, as far as on_sent knows
                    again = min(n, self._recount)
                    self._recount -= again
                    new -= again
                if new and self._on_sent is not None:
                    self._on_sent(new)
            if done:
                queue.pop(0)
            elif not n:
                return
