"""
One log of the file-backed store (L{FileLog}): appending, group commit,
reads, retention.  The store, a directory of logs, is
L{streamproto.log.filestore.FileLogStore} (still importable from here);
opening a log after a crash or power loss is L{streamproto.log.recovery}.

Writes go to the OS at once, from the reactor thread (page-cache writes do
not wait on the disk).  Durability comes from group commit: one fsync, run
through C{run_blocking} (a thread by default), covers everything written
before it started; when it returns, every append it covered is acknowledged
at once and readers see the new records.  An fsync error fail-stops the log:
nothing is acknowledged after it and appends are refused until the store is
reopened and recovery has run (retrying fsync is unsafe: the kernel may have
dropped the dirty pages and report success the second time).

A new segment's name may reach the disk before its data, or before the end
of the segment it follows (any directory fsync, or the file system's own
journal commit, makes it durable): nothing written after the last fsync is
acknowledged, so recovery cuts such a log where it stops being whole.

See doc/logstore.rst for the format, guarantees and tuning.
"""

from __future__ import annotations

import bisect
import errno
import json
import os
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any, Protocol, TypeVar, cast

from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorThreads, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.base import durable
from streamproto.base.clock import wall_seconds
from streamproto.base.durable import write_all
from streamproto.log import metrics
from streamproto.log.batch import BytesLike, RecordBatch
from streamproto.log.config import LogConfig
from streamproto.log.errors import (
    CorruptLog, LogClosed, LogFailed, PositionOutOfRange, WriteFailed, skip_conflict,
)
from streamproto.log.gate import (
    AppendRequest, GatedLog, read_bytes_shortcut, read_shortcut,
)
from streamproto.log.format import (
    MAX_BATCH_DATA, encode_batch, encode_index, encode_segment_header, index_file_name, segment_file_name,
)
from streamproto.log.interfaces import ILog
from streamproto.log.recovery import LogRecovery
from streamproto.log.result import AppendResult
from streamproto.log.syncer import ISyncer, ThreadSyncer
from streamproto.log.segments import (
    Cursor, FileIO, PageCacheIO, Segment, offset_in_segment, position_in_segment, read_payload,
    read_records,
)
from streamproto.log.waiters import Waiters

CONFIG_FILE = "config.json"
STATE_FILE = "state.json"

_T = TypeVar("_T")

#: Reads asking for more than this go to C{run_blocking} even when the page
#: cache holds them: copying and checksumming 4 MiB keeps the reactor busy
#: for about a millisecond, and no more.
INLINE_READ_MAX_BYTES = 4 * 1024 * 1024


class RunBlocking(Protocol):
    """
    How a store runs a blocking call: C{run_blocking(f, *args, **kwargs)}
    returns a Deferred firing with C{f}'s result (L{synchronous},
    L{thread_runner}).
    """

    def __call__(self, f: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Deferred[_T]:
        ...


def synchronous(f: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Deferred[_T]:
    """A C{run_blocking} that runs in the calling thread (tests, tools)."""
    return maybeDeferred(f, *args, **kwargs)


def thread_runner(reactor: IReactorThreads) -> RunBlocking:
    """The default C{run_blocking}: the reactor's thread pool."""
    from twisted.internet.threads import deferToThreadPool

    def run(f: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Deferred[_T]:
        return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args, **kwargs)
    return run


def write_file_atomically(io: FileIO, path: str, data: bytes) -> None:
    """Write C{path} so that a crash leaves either the old or the new content."""
    # a name of its own, so that two writers can never swap each other's file
    durable.write_file_atomically(io, path, data, uuid.uuid4().hex)


def _now_ms(clock: IReactorTime) -> int:
    return int(wall_seconds(clock)() * 1000)


class _Pending:
    __slots__ = ("seq", "first", "deferred", "prepare_answers")

    def __init__(self, seq: int, first: int, deferred: Deferred[AppendResult],
                 prepare_answers: Callable[[AppendResult], Sequence[Any]] | None = None) -> None:
        self.seq = seq
        self.first = first
        self.deferred = deferred
        self.prepare_answers = prepare_answers


@implementer(ILog)
class FileLog(GatedLog):
    """One log: a directory of segment files.  Build it through L{FileLogStore}."""

    log = Logger()
    #: appends are written to the OS at once: what waits for fsync is in
    #: the page cache, not in this process
    holds_unsynced = False

    def __init__(self, name: str, path: str, config: LogConfig, io: FileIO,
                 run_blocking: RunBlocking, clock: IReactorTime,
                 inline_reads: bool = False, syncer: ISyncer | None = None) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.failed: BaseException | None = None
        self.corrupt: str | None = None
        self._io = io
        self._run_blocking = run_blocking
        #: where the group commit's fsyncs run (the store's; L{streamproto.log.syncer})
        self._syncer: ISyncer = syncer or ThreadSyncer(run_blocking, io)
        # reads try the page cache on the calling thread first
        self._inline_io: PageCacheIO | None = PageCacheIO(io) if inline_reads else None
        #: the last read answered, with its request and the end it was read
        #: up to: followers woken together by one fsync all ask the same
        #: read (L{read})
        self._last_read: tuple[tuple[int, int, int, int], RecordBatch] | None = None
        self._clock = clock
        self._closed = False
        self._segments: list[Segment] = []
        self._waiters = Waiters(clock)
        self._offset_waiters = Waiters(clock)
        self._pending: deque[_Pending] = deque()
        self._wseq = 0            # bumped by every append
        self._synced_seq = 0
        #: the last append a sync handed to the syncer covers
        self._submitted_seq = 0
        #: syncs handed to the syncer and not yet done (on the log's lane,
        #: they end in order: L{streamproto.log.syncer.ISyncer.sync})
        self._syncs_out = 0
        # acknowledgements are running: appends they make wait for the
        # one fsync that follows them (group commit across connections)
        self._acking = False
        self._dirty: set[Segment] = set()  # segments written since their last fsync
        self._dir_dirty = False   # a segment file was created
        self._state: dict[str, Any] = {"start_position": 0, "start_offset": 0}
        # state/index writes and segment deletions run one at a time, in order
        self._maintenance_tail: Deferred[None] = succeed(None)
        self._recover()

    # -- recovery --------------------------------------------------------
    def _recover(self) -> None:
        state_path = os.path.join(self.path, STATE_FILE)
        if os.path.exists(state_path):
            with open(state_path, "rb") as f:
                self._state.update(json.loads(f.read()))
        recovered = LogRecovery(self.name, self.path, self.config, self._io, self._state).run()
        self._segments = recovered.segments
        attributes = recovered.attributes
        self._attrs_written = attributes
        if not self._segments:
            start = max(self._state["start_position"], 0)
            self._new_segment(start, self._state["start_offset"])
            self._sync_now()
        self._attributes = dict(attributes)
        end = self._segments[-1]
        self._end_position = self._w_pos = end.end_position
        self._end_offset = self._w_off = end.end_offset
        first = self._segments[0]
        self._start_position: int = max(first.position, self._state["start_position"])
        self._start_offset: int = max(first.offset, self._state["start_offset"])
        self._apply_retention()

    def _sync_now(self) -> None:
        """Fsync (blocking) what recovery or creation wrote."""
        for seg in self._dirty:
            self._io.fsync(seg.fd)
        self._dirty.clear()
        if self._dir_dirty:
            self._io.fsync_dir(self.path)
            self._dir_dirty = False

    # -- coordinates -----------------------------------------------------
    @property
    def start_position(self) -> int:
        return self._start_position

    @property
    def start_offset(self) -> int:
        return self._start_offset

    # The synced end.  While an fsync is out, its answers may have left
    # from the fsync's thread before the reactor learns that it is done
    # (held answers: streamproto/_sender.c): the syncer's catch_up makes
    # what a client was told visible first, so that no reader is served a
    # view behind it.
    @property
    def end_position(self) -> int:
        if self._syncs_out:
            self._syncer.catch_up()
        return self._end_position

    @property
    def end_offset(self) -> int:
        if self._syncs_out:
            self._syncer.catch_up()
        return self._end_offset

    @property
    def attributes(self) -> dict[str, int]:
        if self._syncs_out:
            self._syncer.catch_up()
        return dict(self._attributes)

    def _made_durable(self, target: tuple[int, int, int, dict[str, int]]) -> None:
        """What an fsync made durable becomes the synced end (never an older
        one: the syncer's catch_up may have shown a later fsync's first)."""
        seq, w_pos, w_off, attrs = target
        if self.failed is None and seq > self._synced_seq:
            self._synced_seq = seq
            self._end_position, self._end_offset = w_pos, w_off
            self._attributes = attrs

    # -- writing ---------------------------------------------------------
    def _new_segment(self, position: int, offset: int) -> Segment:
        if self._segments:
            # what the sealed segment's index records: the attributes as of
            # its end (those of an append in progress land after it)
            self._segments[-1].attrs_at_end = dict(self._attrs_written)
        created = _now_ms(self._clock)
        seg_path = os.path.join(self.path, segment_file_name(position))
        fd = self._io.open(seg_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        write_all(self._io, fd, [encode_segment_header(position, offset, created)])
        seg = Segment(seg_path, fd, position, offset, created, self.config.index_after_size)
        self._segments.append(seg)
        self._dirty.add(seg)
        self._dir_dirty = True
        return seg

    def _roll_if_needed(self, nbytes: int, count: int) -> Segment:
        seg = self._segments[-1]
        if seg.count == 0:
            return seg
        c = self.config
        if (c.segment_max_size > 0 and seg.size + nbytes > c.segment_max_size) or \
                (c.segment_max_count > 0 and seg.count + count > c.segment_max_count) or \
                (c.segment_max_age > 0 and
                 _now_ms(self._clock) - seg.created_ms >= c.segment_max_age * 1000):
            return self._new_segment(self._w_pos, self._w_off)
        return seg

    def _chunks(self, lengths: array[int],
                data: BytesLike) -> list[tuple[array[int], BytesLike]]:
        """
        Split an append into (lengths, data) batches bounded in bytes
        (MAX_BATCH_DATA, a single bigger record alone) and in segment record
        count; the common case is one batch and costs no per-record work.
        """
        max_count = self.config.segment_max_count if self.config.segment_max_count > 0 \
            else len(lengths) or 1
        if len(lengths) <= max_count and len(data) <= MAX_BATCH_DATA:
            return [(lengths, data)]
        offsets = list(accumulate(lengths, initial=0))
        view = memoryview(data)
        chunks: list[tuple[array[int], BytesLike]] = []
        start, n = 0, len(lengths)
        while start < n:
            stop = bisect.bisect_right(offsets, offsets[start] + MAX_BATCH_DATA, start + 1) - 1
            stop = min(max(stop, start + 1), start + max_count, n)
            chunks.append((lengths[start:stop], view[offsets[start]:offsets[stop]]))
            start = stop
        return chunks

    def _written(self) -> tuple[int, Mapping[str, int]]:
        # what is written (synced or not): appends are issued in order
        return self._w_pos, self._attrs_written

    def _append(self, request: AppendRequest) -> Deferred[AppendResult]:
        lengths, attributes = request.lengths, request.attributes
        first = self._w_pos
        undo = (self._segments[-1], self._segments[-1].size, self._w_pos, self._w_off,
                len(self._segments))
        try:
            chunks = self._chunks(lengths, request.data)
            for i, (chunk_lengths, chunk_data) in enumerate(chunks):
                self._write_batch(chunk_lengths, chunk_data,
                                  attributes if i == len(chunks) - 1 else None)
        except OSError as e:
            return fail(self._write_error(e, undo))
        if attributes:
            self._attrs_written.update(attributes)
        self._wseq += 1
        d: Deferred[AppendResult] = Deferred()
        self._pending.append(_Pending(self._wseq, first, d, request.prepare_answers))
        self._kick()
        return d

    def _write_batch(self, lengths: array[int], data: BytesLike,
                     attributes: Mapping[str, int] | None) -> None:
        lag = min(self._w_pos - self._end_position, 0xFFFFFFFF)
        parts = encode_batch(self._w_pos, self._w_off, lengths, data, attributes, lag)
        size = sum(len(p) for p in parts)
        seg = self._roll_if_needed(size, len(lengths))
        at = seg.size
        write_all(self._io, seg.fd, parts)
        seg.note_batch(at, self._w_pos, self._w_off, len(lengths), len(data), size)
        self._dirty.add(seg)
        self._w_pos += len(lengths)
        self._w_off += len(data)

    def _write_error(self, error: OSError,
                     undo: tuple[Segment, int, int, int, int]) -> LogFailed | WriteFailed:
        """
        Roll back a failed write (ENOSPC, EIO) so no partial append is ever
        visible; if that is impossible, fail-stop.
        """
        seg, size, w_pos, w_off, nsegs = undo
        if len(self._segments) == nsegs and self._segments[-1] is seg:
            try:
                self._io.ftruncate(seg.fd, size)
            except OSError as e2:
                self._fail_stop(e2)
                return LogFailed(f"log {self.name}: write failed ({error}), rollback failed")
            seg.end_position, seg.end_offset, seg.size = w_pos, w_off, size
            while seg.idx_file and seg.idx_file[-1] >= size:
                seg.idx_pos.pop()
                seg.idx_off.pop()
                seg.idx_file.pop()
            if seg.cursor and seg.cursor[2] >= size:
                seg.cursor = None
            self._w_pos, self._w_off = w_pos, w_off
            self.log.error("log {log}: write failed and was rolled back: {error}",
                           log=self.name, error=error)
            return WriteFailed(f"log {self.name}: write failed: {error}")
        self._fail_stop(error)
        return LogFailed(f"log {self.name}: write failed: {error}")

    def sync(self) -> Deferred[int]:
        refused = self.refusal()
        if refused is not None:
            return fail(refused)
        if self._synced_seq == self._wseq and not self._syncs_out:
            return succeed(self.end_position)
        d: Deferred[AppendResult] = Deferred()
        # first position: none of its own; only the end position is reported
        self._pending.append(_Pending(self._wseq, self._w_pos, d))
        self._kick()
        return d.addCallback(lambda result: result.end_position)

    # -- group commit ----------------------------------------------------
    def _kick(self) -> None:
        # an fsync already handed over covers what was written before it:
        # a new one only for what came since (it starts once the one
        # before ends, with whatever else came meanwhile: the lane)
        if (self._acking or self.failed is not None or not self._pending
                or self._submitted_seq == self._wseq):
            return
        target = (self._wseq, self._w_pos, self._w_off, dict(self._attrs_written))
        answers = self._answers(target) if self._syncer.sends_answers else ()
        # oldest first: a segment's tail is on the disk before the next one's data
        segs = sorted(self._dirty, key=lambda s: s.position)
        self._dirty.clear()
        dir_dirty, self._dir_dirty = self._dir_dirty, False
        for s in segs:
            s.refs += 1
        self._submitted_seq = self._wseq
        self._syncs_out += 1
        fds = [s.fd for s in segs]
        # what readers must see once an answer went out before the reactor
        # learns of this fsync (only then: see end_position)
        durable = (lambda: self._made_durable(target)) if answers else None
        d = self._syncer.sync(fds, self.path if dir_dirty else None, id(self), answers,
                              durable)
        d.addCallbacks(self._synced, self._sync_failed, callbackArgs=(target, segs),
                       errbackArgs=(segs,))

    def _answers(self, target: tuple[int, int, int, dict[str, int]]) -> list[Any]:
        """
        The held answers of the appends this fsync covers (those written
        since the last one handed over), in the order of the appends: each
        asked for once, with the result its Deferred will fire with.
        """
        _, w_pos, w_off, _ = target
        covered = []
        for p in reversed(self._pending):
            if p.seq <= self._submitted_seq:
                break
            if p.prepare_answers is not None:
                covered.append((p, p.prepare_answers))
                p.prepare_answers = None
        answers: list[Any] = []
        for p, prepare in reversed(covered):
            try:
                answers.extend(prepare(AppendResult(p.first, w_pos, w_off)))
            except Exception:
                # the answer then goes the usual way; the fsync must not wait
                self.log.failure("log {log}: preparing answers failed", log=self.name)
        return answers

    def _release(self, segs: Iterable[Segment]) -> None:
        for s in segs:
            s.refs -= 1
            if s.doomed and s.refs == 0:
                self._io.close(s.fd)

    def _synced(self, _: None, target: tuple[int, int, int, dict[str, int]],
                segs: list[Segment]) -> None:
        self._release(segs)
        self._syncs_out -= 1
        if self.failed is not None:
            return   # an fsync before this one failed: nothing is acknowledged
        seq, w_pos, w_off = target[:3]
        self._made_durable(target)
        pending = self._pending
        done = []
        while pending and pending[0].seq <= seq:
            done.append(pending.popleft())
        self._acking = True
        try:
            for p in done:
                p.deferred.callback(AppendResult(p.first, w_pos, w_off))
            self._waiters.advance(w_pos)
            self._offset_waiters.advance(w_off)
        finally:
            self._acking = False
        # after the acknowledgements, not in their latency
        if done:
            metrics.GROUP_COMMIT_APPENDS.observe(len(done))
        self._seal_and_retain()
        # what the acknowledged clients sent next (a keep-alive connection's
        # next request, parsed when its answer went out) shares one fsync,
        # handed over once the last sync out is acknowledged: syncs that
        # ran as one are reported together, and each would otherwise hand
        # over its clients' appends alone.  (Starting that fsync before
        # the acknowledgements ran, to overlap them, split the batches:
        # 1.5 times fewer one-record HTTP requests a second.)
        if not self._syncs_out:
            self._kick()

    def _sync_failed(self, failure: Failure, segs: list[Segment]) -> None:
        self._release(segs)
        self._syncs_out -= 1
        self._fail_stop(cast(BaseException, failure.value))

    def _fail_stop(self, error: BaseException) -> None:
        if self.failed is None:
            self.failed = error
            self.log.critical("log {log} fail-stopped after a storage error: {error}; "
                              "nothing more is acknowledged until it is reopened",
                              log=self.name, error=error)
        pending, self._pending = self._pending, deque()
        for p in pending:
            p.deferred.errback(LogFailed(f"log {self.name} fail-stopped: {error}"))
        self._waiters.fail_all(LogFailed(f"log {self.name} fail-stopped: {error}"))
        self._offset_waiters.fail_all(LogFailed(f"log {self.name} fail-stopped: {error}"))

    # -- sealing and retention ---------------------------------------------
    def _seal_and_retain(self) -> None:
        """Index segments that are sealed and synced, then apply retention."""
        for seg in self._segments[:-1]:
            if not seg.indexed and seg.end_position <= self.end_position and \
                    seg not in self._dirty:
                seg.indexed = True
                self._write_index(seg)
        self._apply_retention()

    def _write_index(self, seg: Segment) -> None:
        payload = encode_index(seg.index_payload(seg.attrs_at_end or {}))
        path = os.path.join(self.path, index_file_name(seg.position))

        def write() -> None:
            try:
                write_file_atomically(self._io, path, payload)
            except OSError as e:  # an index only speeds up opening
                self.log.warn("log {log}: could not write index {path}: {e}",
                              log=self.name, path=path, e=e)
        self._maintain(write)

    def _apply_retention(self) -> None:
        c = self.config
        now = _now_ms(self._clock)
        while len(self._segments) > 1:
            oldest, nxt = self._segments[0], self._segments[1]
            if nxt.position > self.end_position:
                break   # the next segment is not synced yet
            expired = nxt.position <= self._start_position  # truncated away
            # count and size limits keep at least the limit (as Kafka does):
            # a segment goes only if what remains still reaches it
            if c.log_max_count > 0 and self.end_position - nxt.position >= c.log_max_count:
                expired = True
            # durable payload bytes (the synced end offset): what remains
            # keeps at least the limit of data, even after a crash
            if c.log_max_size > 0 and self.end_offset - nxt.offset >= c.log_max_size:
                expired = True
            if c.log_max_age > 0 and now - nxt.created_ms >= c.log_max_age * 1000:
                expired = True
            if not expired:
                break
            self._delete_segment(oldest)
            self._start_position = max(self._start_position, nxt.position)
            self._start_offset = max(self._start_offset, nxt.offset)

    def _delete_segment(self, seg: Segment) -> None:
        """
        Drop a whole old segment: at once for readers, then on disk, after
        the attributes it carried are saved in the state file (so a crash
        in between loses nothing).
        """
        self._segments.remove(seg)
        self._dirty.discard(seg)
        seg.refs += 1
        seg.doomed = True
        if seg.attrs_at_end:
            self._state["attributes"] = dict(seg.attrs_at_end)
        # recorded before the file goes: recovery then knows that anything
        # left below this point was being deleted
        self._state["start_position"] = max(self._state["start_position"], seg.end_position)
        self._state["start_offset"] = max(self._state["start_offset"], seg.end_offset)
        state = json.dumps(self._state, sort_keys=True).encode()
        io, path = self._io, self.path

        def remove() -> None:
            write_file_atomically(io, os.path.join(path, STATE_FILE), state)
            io.unlink(seg.path)
            io.unlink(os.path.join(path, index_file_name(seg.position)))

        def done(result: object) -> object:
            self._release([seg])
            metrics.RETENTION_DELETIONS.inc()
            self.log.info("log {log}: deleted segment {seg}", log=self.name, seg=seg.path)
            return result

        def failed(failure: Failure) -> None:
            self.log.failure("log {log}: could not delete segment {seg}", failure,
                             log=self.name, seg=seg.path)
        self._maintain(remove).addBoth(done).addErrback(failed)

    # -- reading ---------------------------------------------------------
    def _segment_index(self, key: int, value: int) -> int:
        """Index of the segment holding position (key 0) / offset (key 1) C{value}."""
        segs = self._segments
        lo, hi = 0, len(segs) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = segs[mid].position if key == 0 else segs[mid].offset
            if start <= value:
                lo = mid
            else:
                hi = mid - 1
        # several empty segments can start at the same place: take the first
        # one that holds data past value
        while lo + 1 < len(segs) and (segs[lo].end_position if key == 0
                                       else segs[lo].end_offset) <= value:
            lo += 1
        return lo

    def _check_open(self) -> None:
        super()._check_open()
        if self.corrupt is not None:
            raise CorruptLog(self.corrupt)

    def _run_on_segment(self, seg: Segment, f: Callable[..., _T], *args: Any) -> Deferred[_T]:
        seg.refs += 1

        def done(result: _T) -> _T:
            self._release([seg])
            return result
        return self._run_blocking(f, self._io, seg, *args).addBoth(done)

    def _read_segment(self, seg: Segment, max_bytes: int, f: Callable[..., _T],
                      *args: Any) -> Deferred[_T]:
        """
        Run the blocking read C{f(io, seg, *args)}: on this thread if every
        byte it needs is in the page cache (and it asks for at most
        L{INLINE_READ_MAX_BYTES}), else through C{run_blocking}.

        Why: a read of bytes that were just written (a consumer following
        its producers, the common case) costs less than handing it to a
        thread and back; the hand-off was 6% of a styx/0 consumer's CPU.
        A read that would wait for the disk still never blocks the reactor.
        """
        if self._inline_io is not None and max_bytes <= INLINE_READ_MAX_BYTES:
            try:
                return succeed(f(self._inline_io, seg, *args))
            except BlockingIOError:
                pass    # some of it is on the disk only
            except NotImplementedError:
                self._inline_io = None
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    return fail(e)
                self._inline_io = None  # this file system cannot tell
            except Exception as e:
                return fail(e)
        return self._run_on_segment(seg, f, *args)

    def read(self, position: int, max_records: int = -1,
             max_bytes: int = 1048576) -> Deferred[RecordBatch]:
        answered = read_shortcut(self._check_position, position, self.end_position, max_records)
        if answered is not None:
            return answered
        # Followers of one log (styx/0 consumers, long polls) are woken
        # together by the fsync that makes new records visible, and each
        # asks the same read: one reads and decodes, the others get its
        # batch (immutable; the records below the end never change).  With
        # 500 followers the repeated reads were most of the server's loop.
        key = (position, max_records, max_bytes, self.end_position)
        last = self._last_read
        if last is not None and last[0] == key:
            return succeed(last[1])
        seg = self._segments[self._segment_index(0, position)]
        stop = min(self.end_position, seg.end_position)
        d = self._read_segment(seg, max_bytes, read_records, position, stop, max_records,
                               max_bytes)

        def got(result: tuple[RecordBatch, Cursor | None]) -> RecordBatch:
            batch, cursor = result
            if cursor is not None:
                seg.cursor = cursor
            self._last_read = (key, batch)
            return batch
        return d.addCallbacks(got, self._read_failed)

    def _read_failed(self, failure: Failure) -> Failure:
        if failure.check(CorruptLog):
            self.corrupt = str(failure.value)
            self.log.error("log {log} is corrupt: {why}", log=self.name, why=self.corrupt)
        return failure

    def read_bytes(self, offset: int, max_bytes: int = 1048576) -> Deferred[bytes]:
        answered = read_bytes_shortcut(self._check_offset, offset, self.end_offset, max_bytes)
        if answered is not None:
            return answered
        seg = self._segments[self._segment_index(1, offset)]
        stop = min(self.end_offset, seg.end_offset)
        return self._read_segment(seg, max_bytes, read_payload, offset, stop,
                                  max_bytes).addErrback(
            self._read_failed)

    def position_of_offset(self, offset: int) -> Deferred[int]:
        try:
            self._check_open()
            if not self._segments[0].offset <= offset <= self.end_offset:
                raise PositionOutOfRange(f"offset {offset} outside the log")
        except Exception as e:
            return fail(e)
        if offset == self.end_offset:
            return succeed(self.end_position)
        seg = self._segments[self._segment_index(1, offset)]
        return self._run_on_segment(seg, position_in_segment, offset)

    def _wait_refusal(self) -> Exception | None:
        # a fail-stopped log never grows either, until the store is reopened
        return self.refusal()

    # -- maintenance -----------------------------------------------------
    def _maintain(self, f: Callable[..., None], *args: Any) -> Deferred[None]:
        """
        Run a blocking maintenance job (state file, index, segment deletion)
        after every earlier one has finished: they touch the same files, and
        a deletion must follow the state write that makes it safe.
        """
        result: Deferred[None] = Deferred()

        def run(_: None) -> Deferred[None]:
            job = self._run_blocking(f, *args)
            job.chainDeferred(result)
            return job.addBoth(lambda _: None)
        self._maintenance_tail.addCallback(run)
        return result

    def _save_state(self) -> Deferred[None]:
        data = json.dumps(self._state, sort_keys=True).encode()
        return self._maintain(write_file_atomically, self._io,
                              os.path.join(self.path, STATE_FILE), data)

    def truncate(self, position: int | None = None) -> Deferred[int]:
        if self._closed:
            return fail(LogClosed(f"log {self.name} is closed"))
        if position is None or position > self.end_position:
            position = self.end_position
        if position <= self._start_position:
            return succeed(self._start_position)
        return self.position_offset(position).addCallback(self._truncate_to, position)

    def position_offset(self, position: int) -> Deferred[int]:
        """Deferred: the payload offset at which record C{position} starts."""
        if position >= self.end_position:
            return succeed(self.end_offset)
        seg = self._segments[self._segment_index(0, position)]
        return self._run_on_segment(seg, offset_in_segment, position)

    def offset_of_position(self, position: int) -> Deferred[int]:
        try:
            self._check_position(position)
        except Exception as e:
            return fail(e)
        return self.position_offset(position)

    def skip_to(self, position: int, offset: int) -> Deferred[int]:
        refused = self.refusal()
        if refused is not None:
            return fail(refused)
        conflict = skip_conflict(self.name, self._start_position, self._w_pos, self._w_off,
                                 position, offset)
        if conflict is None and self._w_pos != self.end_position:
            conflict = skip_conflict(self.name, 0, 1, 0, position, offset)  # unsynced appends
        if conflict is not None:
            return fail(conflict)
        if (position, offset) == (self._w_pos, self._w_off):
            return succeed(self.end_position)
        # the state first: a crash before the new segment leaves a log that
        # recovery starts afresh at the state's start (LogRecovery.run)
        self._state["start_position"] = position
        self._state["start_offset"] = offset
        # where the (empty) log ended: recovery tells a skip cut short from
        # acknowledged data gone missing by it
        self._state["skipped_from"] = [self._w_pos, self._w_off]

        def saved(_: None) -> int:
            self._w_pos = self._end_position = self._start_position = position
            self._w_off = self._end_offset = self._start_offset = offset
            self._new_segment(position, offset)
            self._sync_now()
            self._waiters.advance(position)
            self._offset_waiters.advance(offset)
            self._apply_retention()
            return position
        return self._save_state().addCallback(saved)

    def _truncate_to(self, offset: int, position: int) -> Deferred[int]:
        self._state["start_position"] = position
        self._state["start_offset"] = offset
        self._start_position = max(self._start_position, position)
        self._start_offset = max(self._start_offset, offset)

        def saved(_: None) -> int:
            self._drop_truncated()
            return self._start_position
        return self._save_state().addCallback(saved)

    def truncate_offset(self, offset: int) -> Deferred[int]:
        if self._closed:
            return fail(LogClosed(f"log {self.name} is closed"))
        if offset > self.end_offset:
            return fail(PositionOutOfRange(f"offset {offset} beyond end {self.end_offset}"))
        if offset <= self._start_offset:
            return succeed(self._start_offset)

        def got(position: int) -> Deferred[int]:
            self._state["start_position"] = position
            self._state["start_offset"] = offset
            self._start_position = max(self._start_position, position)
            self._start_offset = offset

            def saved(_: None) -> int:
                self._drop_truncated()
                return self._start_offset
            return self._save_state().addCallback(saved)
        return self.position_of_offset(offset).addCallback(got)

    def _drop_truncated(self) -> None:
        last = self._segments[-1]
        if last.count and last.end_position <= self._start_position and \
                self._w_pos == self.end_position and not self._syncs_out:
            # everything is truncated: start a fresh segment so the old one can go
            self._new_segment(self._w_pos, self._w_off)
            self._sync_now()
        self._apply_retention()

    def info(self) -> dict[str, Any]:
        if self.corrupt is not None:
            status = "corrupt"
        elif self.failed is not None:
            status = "tainted"
        else:
            status = "ok"
        return self._info(status, self.end_position - self._start_position,
                          sum(s.size for s in self._segments))

    def _close(self, error: BaseException | None = None) -> None:
        """Fail what is pending and release the files (sync first via L{sync})."""
        if self._closed:
            return
        self._closed = True
        error = error or LogClosed(f"log {self.name} is closed")
        pending, self._pending = self._pending, deque()
        for p in pending:
            p.deferred.errback(error)
        self._waiters.fail_all(error)
        self._offset_waiters.fail_all(error)
        for seg in self._segments:
            seg.doomed = True
            if seg.refs == 0:
                self._io.close(seg.fd)

