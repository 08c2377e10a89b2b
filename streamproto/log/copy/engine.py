"""
The copy of one log from one L{ILogStore} to another, with the same
positions, offsets, record boundaries and attributes (L{LogCopy}).

Every append to the destination is conditional on the position it must
get (C{expected_position}), so a copy can never put a record anywhere
else, two copies racing on one log cannot interleave, and one killed
halfway resumes where the destination's log ends (L{plan.resume_point}).
Reads from the source are checksummed by its store: a corrupt record
fails the read, which stops the copy naming the log and position, before
anything of it is written.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from streamproto.log.batch import RecordBatch
from streamproto.log.errors import CorruptLog, LogError, LogNotFound
from streamproto.log.interfaces import ILog, ILogStore
from streamproto.log.copy.plan import (
    Bounds, CopyRefused, Digest, Start, attributes_to_copy, resume_point,
)

#: what one read from the source asks for: small enough that a batch fits
#: one conditional append of every store (a JetStream message is 1 MiB)
BATCH_BYTES = 512 * 1024
BATCH_RECORDS = 16384
#: appends in flight per log: the destination's group commit (file) or
#: publish window (JetStream) covers several at once
WINDOW = 32

Progress = Callable[[int, int], None]


def first_failure(failure: Failure) -> Failure:
    """The failure of the first Deferred of a failed C{gatherResults}."""
    value = failure.value
    assert isinstance(value, defer.FirstError)
    return value.subFailure


class CopyFailed(Exception):
    """A log could not be copied: the message names it and says why."""


def _named(name: str, position: int | None, what: str) -> Callable[[Any], Any]:
    def failed(failure: Any) -> Any:
        if failure.check(CopyRefused, CopyFailed):
            return failure
        where = f" at position {position}" if position is not None else ""
        kind = "corrupt" if failure.check(CorruptLog) else "failed"
        raise CopyFailed(f"log {name}: {what}{where} {kind}: {failure.getErrorMessage()}")
    return failed


class LogCopy:
    """
    Copies one log: L{prepare} once, then L{catch_up} as often as the
    source grows (each copies what the source had when it began), then
    L{verify}.

    @ivar position: the next position to copy (the destination's end).
    """

    def __init__(self, name: str, src: ILog, dst_store: ILogStore,
                 progress: Progress | None = None, batch_bytes: int = BATCH_BYTES,
                 batch_records: int = BATCH_RECORDS, window: int = WINDOW) -> None:
        self.name = name
        self.src = src
        self.dst_store = dst_store
        self.dst: ILog | None = None
        self.position = 0
        self.progress = progress or (lambda records, nbytes: None)
        self.batch_bytes = batch_bytes
        self.batch_records = batch_records
        self.window = window
        self.copied_records = 0
        self.copied_bytes = 0
        #: the source's records from C{digest_start} to C{position}, as
        #: read to be copied: the verification reads only the destination
        self.src_digest = Digest()
        self.digest_start = 0

    @defer.inlineCallbacks
    def prepare(self) -> Any:
        """Open (or create) the destination's log and find where to go on."""
        src = self.src
        try:
            dst: ILog = yield self.dst_store.get(self.name)
        except LogNotFound:
            dst = yield self.dst_store.create(self.name, src.config)
        if dst.config != src.config:
            raise CopyRefused(f"log {self.name}: the destination's log has another "
                              f"configuration ({dst.config} here, {src.config} there): "
                              "a different log of the same name")
        self.dst = dst
        bounds = Bounds.of(src)
        first_offset = bounds.start_offset
        if not bounds.empty:
            first_offset = yield src.offset_of_position(bounds.start_position).addErrback(
                _named(self.name, bounds.start_position, "finding the first record"))
        start: Start = resume_point(self.name, bounds, first_offset, Bounds.of(dst))
        if start.skip is not None:
            yield dst.skip_to(*start.skip)
        if start.check is not None:
            yield self._check_same(start)
        self.position = start.position
        self.digest_start = bounds.start_position
        if start.position > bounds.start_position:
            # resumed: what earlier runs copied is read once more, here
            self.src_digest = yield digest(src, bounds.start_position, start.position)

    @defer.inlineCallbacks
    def _check_same(self, start: Start) -> Any:
        """The destination's last record is the source's: the same log, copied that far."""
        assert self.dst is not None and start.check is not None
        at = start.check
        offset = yield self.src.offset_of_position(start.position)
        theirs: RecordBatch = yield self.src.read(at, max_records=1)
        ours: RecordBatch = yield self.dst.read(at, max_records=1)
        if offset != start.offset or theirs.records() != ours.records():
            raise CopyRefused(
                f"log {self.name}: the destination's record {at} differs from the "
                f"source's (or ends at another offset): a different log of the same name")

    def catch_up(self) -> Deferred[int]:
        """
        Copy what the source holds now (and its attributes, as of that
        end), then its start when it moved past the destination's.

        @return: Deferred firing with the source's end copied to.
        """
        target = self.src.end_position
        attributes = self.src.attributes
        return self._copy(target, attributes).addErrback(
            _named(self.name, None, "copy")).addCallback(lambda _: target)

    @defer.inlineCallbacks
    def _copy(self, target: int, attributes: dict[str, int]) -> Any:
        dst = self.dst
        assert dst is not None
        inflight: deque[Deferred[Any]] = deque()
        try:
            while self.position < target:
                at = self.position
                batch: RecordBatch = yield self.src.read(
                    at, max_records=min(self.batch_records, target - at),
                    max_bytes=self.batch_bytes).addErrback(
                    _named(self.name, at, "reading the source"))
                if not len(batch):
                    raise CopyFailed(f"log {self.name}: the source has no record at {at}, "
                                     f"below its end {target}")
                last = batch.next_position >= target
                extra = attributes_to_copy(attributes, dst.attributes) if last else None
                self.position = batch.next_position
                self.src_digest.feed(batch)
                d = dst.append(batch, attributes=extra, expected_position=at)
                d.addErrback(_named(self.name, at, "appending to the destination"))
                d.addCallback(self._appended, len(batch), batch.nbytes)
                inflight.append(d)
                while len(inflight) >= self.window:
                    yield inflight.popleft()
            while inflight:
                yield inflight.popleft()
        except BaseException:
            # what is in flight lands or fails on its own; the first error wins
            for d in inflight:
                d.addErrback(lambda _: None)
            self.position = dst.end_position
            self.digest_start = -1  # no longer what was copied: verify reads both
            raise
        extra = attributes_to_copy(attributes, dst.attributes)
        if extra:
            yield dst.append([], attributes=extra, expected_position=self.position)
        yield self._follow_start()

    def _appended(self, _: object, count: int, nbytes: int) -> None:
        self.copied_records += count
        self.copied_bytes += nbytes
        self.progress(count, nbytes)

    @defer.inlineCallbacks
    def _follow_start(self) -> Any:
        """The destination starts where the source does (its retention, its truncations)."""
        dst = self.dst
        assert dst is not None
        src_start = self.src.start_offset
        if src_start > dst.start_offset and src_start <= dst.end_offset:
            yield dst.truncate_offset(src_start)

    @defer.inlineCallbacks
    def verify(self, end: int) -> Any:
        """
        Count and checksum both logs over the records they both hold below
        C{end} (the source's retention may have moved its start meanwhile).

        @return: Deferred firing with the L{Digest}.
        @raise CopyFailed: they differ.
        """
        dst = self.dst
        assert dst is not None
        start = max(self.src.start_position, dst.start_position)
        if dst.end_position < end:
            raise CopyFailed(f"log {self.name}: the destination ends at {dst.end_position}, "
                             f"the copy at {end}")
        if start == self.digest_start and end == self.position:
            ours = self.src_digest
            theirs = yield digest(dst, start, end)
        else:   # the source's start moved: both read again where they overlap
            ours, theirs = yield defer.gatherResults(
                [digest(self.src, start, end), digest(dst, start, end)], consumeErrors=True
            ).addErrback(first_failure)
        if ours != theirs:
            raise CopyFailed(f"log {self.name}: verification failed over [{start}, {end}): "
                             f"source {ours.as_dict()}, destination {theirs.as_dict()}")
        src_offsets = yield self.src.offset_of_position(end) if end < self.src.end_position \
            else defer.succeed(self.src.end_offset)
        if dst.end_position == end and src_offsets != dst.end_offset:
            raise CopyFailed(f"log {self.name}: the destination ends at offset "
                             f"{dst.end_offset}, the source's record {end} at {src_offsets}")
        return ours


@defer.inlineCallbacks
def digest(log: ILog, start: int, end: int, batch_bytes: int = 4 * BATCH_BYTES) -> Any:
    """The L{Digest} of C{log}'s records C{[start, end)}."""
    result = Digest()
    position = start
    while position < end:
        try:
            batch: RecordBatch = yield log.read(position, max_records=end - position,
                                                max_bytes=batch_bytes)
        except LogError as e:
            raise CopyFailed(f"log {log.name}: reading position {position} to verify: {e}")
        if not len(batch):
            raise CopyFailed(f"log {log.name}: nothing to read at {position}, below {end}")
        result.feed(batch)
        position = batch.next_position
    return result
