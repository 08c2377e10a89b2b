"""
What every L{ILog} checks before it changes or reads: the gate of
L{ILog.append} (a closed or fail-stopped log refuses, a conditional append
must hold, records must fit), and the range check of a read.

Why one home: the file, memory and JetStream logs each wrote these checks
themselves, and their messages and order had started to drift (only the
file log checked the attributes' types).  A store now writes only what is
its own: L{GatedLog._append} of an L{AppendRequest} already checked.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from twisted.internet.defer import Deferred, fail, succeed

from streamproto.log.batch import BytesLike, RecordBatch, empty_batch, lengths_array
from streamproto.log.config import LogConfig
from streamproto.log.interfaces import ILog
from streamproto.log.errors import (
    LogClosed, LogFailed, PositionOutOfRange, RecordTooLarge, append_conflict,
)
from streamproto.log.result import AppendResult
from streamproto.log.waiters import Waiters


def check_range(what: str, value: int, low: int, high: int) -> None:
    """
    @raise PositionOutOfRange: C{value} (a position or an offset, named by
        C{what}) is outside C{[low, high]}.
    """
    if not low <= value <= high:
        raise PositionOutOfRange(f"{what} {value} outside [{low}, {high}]")


def read_shortcut(check: Callable[[int], object], position: int, end_position: int,
                  max_records: int) -> Deferred[RecordBatch] | None:
    """
    What L{ILog.read} answers without reading: the failure of C{check(position)}
    (a closed log, a position out of range), or the empty batch at the end or
    for C{max_records} 0; None when the store must read.
    """
    try:
        check(position)
    except Exception as e:
        return fail(e)
    if position == end_position or max_records == 0:
        return succeed(empty_batch(position))
    return None


def read_bytes_shortcut(check: Callable[[int], object], offset: int, end_offset: int,
                        max_bytes: int) -> Deferred[bytes] | None:
    """
    What L{ILog.read_bytes} answers without reading: the failure of
    C{check(offset)}, or no bytes at the end or for C{max_bytes} 0; None
    when the store must read.
    """
    try:
        check(offset)
    except Exception as e:
        return fail(e)
    if offset == end_offset or max_bytes <= 0:
        return succeed(b"")
    return None


class AppendRequest:
    """
    One append, normalized and checked: the records as one buffer and their
    lengths (a L{RecordBatch} is taken as it is, without per-record work),
    and its conditions, passed on untouched.
    """

    __slots__ = ("lengths", "data", "attributes", "expected_position", "expected_attributes",
                 "prepare_answers")

    def __init__(self, records: Sequence[BytesLike] | RecordBatch,
                 attributes: Mapping[str, int] | None, expected_position: int | None,
                 expected_attributes: Mapping[str, int | None] | None,
                 max_record_size: int,
                 prepare_answers: Callable[[AppendResult], Sequence[Any]] | None = None,
                 ) -> None:
        """
        @raise RecordTooLarge: a record is bigger than C{max_record_size}.
        @raise TypeError: the attributes do not map C{str} to C{int}.
        """
        self.lengths: array[int]
        self.data: bytes | memoryview
        if isinstance(records, RecordBatch):
            # already lengths + one buffer (a decoder's output): no per-record work
            self.lengths, self.data = records.lengths, records.data
        else:
            if not isinstance(records, list):
                records = list(records)
            self.lengths = lengths_array(map(len, records))
            self.data = b"".join(records)
        # no record is longer than all of them together: a batch that fits
        # needs no look at each length (max() costs ~10 ns a record)
        if len(self.lengths) and len(self.data) > max_record_size:
            biggest = max(self.lengths)
            if biggest > max_record_size:
                raise RecordTooLarge(f"record of {biggest} bytes exceeds max_record_size "
                                     f"{max_record_size}")
        if attributes:
            for k, v in attributes.items():
                if not isinstance(k, str) or not isinstance(v, int) or isinstance(v, bool):
                    raise TypeError("attributes map str -> int")
        self.attributes = attributes
        self.expected_position = expected_position
        self.expected_attributes = expected_attributes
        #: L{ILog.append}'s hook for answers sent from the fsync's thread
        self.prepare_answers = prepare_answers

    def records(self) -> list[bytes]:
        """A copy of each record (for a store that keeps them one by one)."""
        return RecordBatch(0, self.lengths, self.data).records()


class GatedLog:
    """
    The part of L{ILog} every store shares: L{append} refuses, checks and
    normalizes, then hands the store's own L{_append} a checked
    L{AppendRequest}.  A subclass sets the attributes below.
    """

    name: str
    config: LogConfig
    failed: BaseException | None
    _closed: bool
    _waiters: Waiters
    _offset_waiters: Waiters

    def refusal(self) -> LogClosed | LogFailed | None:
        """Why this log takes no change now (closed, fail-stopped), or None."""
        if self._closed:
            return LogClosed(f"log {self.name} is closed")
        if self.failed is not None:
            return LogFailed(f"log {self.name} fail-stopped: {self.failed}")
        return None

    def append(
        self,
        records: Sequence[BytesLike] | RecordBatch,
        attributes: Mapping[str, int] | None = None,
        expected_position: int | None = None,
        expected_attributes: Mapping[str, int | None] | None = None,
        prepare_answers: Callable[[AppendResult], Sequence[Any]] | None = None,
    ) -> Deferred[AppendResult]:
        refused = self._append_refusal()
        written = self._written()
        if refused is None and written is not None:
            refused = append_conflict(self.name, written[0], expected_position, written[1],
                                      expected_attributes)
        if refused is not None:
            return fail(refused)
        try:
            request = AppendRequest(records, attributes, expected_position, expected_attributes,
                                    self.config.max_record_size, prepare_answers)
        except (RecordTooLarge, TypeError) as e:
            return fail(e)
        return self._append(request)

    def _append_refusal(self) -> Exception | None:
        """Why this log takes no append now; a store adds its own reasons."""
        return self.refusal()

    def _written(self) -> tuple[int, Mapping[str, int]] | None:
        """
        The end position and attributes a conditional append is checked
        against before it is written, counting every append issued; None
        for a store that can only check against its servers, later.
        """
        return None

    def _append(self, request: AppendRequest) -> Deferred[AppendResult]:
        raise NotImplementedError(f"{type(self).__name__} must write appends")

    def wait(self, position: int, timeout: float | None = None) -> Deferred[int]:
        refused = self._wait_refusal()
        if refused is not None:
            return fail(refused)
        # (a GatedLog is an ILog: its end is an attribute or a property, as the store keeps it)
        return self._waiters.wait(position, lambda: cast(ILog, self).end_position, timeout)

    def wait_offset(self, offset: int, timeout: float | None = None) -> Deferred[int]:
        refused = self._wait_refusal()
        if refused is not None:
            return fail(refused)
        return self._offset_waiters.wait(offset, lambda: cast(ILog, self).end_offset, timeout)

    def _check_open(self) -> None:
        """@raise Exception: why this log cannot be read (closed; a store adds its own)."""
        if self._closed:
            raise LogClosed(f"log {self.name} is closed")

    def _check_position(self, position: int) -> None:
        """@raise Exception: why C{position} cannot be read."""
        self._check_open()
        log = cast(ILog, self)
        check_range("position", position, log.start_position, log.end_position)

    def _check_offset(self, offset: int) -> None:
        """@raise Exception: why payload byte C{offset} cannot be read."""
        self._check_open()
        log = cast(ILog, self)
        check_range("offset", offset, log.start_offset, log.end_offset)

    def _info(self, status: str, record_count: int, file_size: int) -> dict[str, Any]:
        """
        L{ILog.info}: every store reports the same keys; it says only its
        status, its record count and its size.
        """
        log = cast(ILog, self)
        return {
            "name": self.name,
            "status": status,
            "record_count": record_count,
            "file_size": file_size,
            "start_position": log.start_position,
            "end_position": log.end_position,
            "start_offset": log.start_offset,
            "end_offset": log.end_offset,
        }

    def _wait_refusal(self) -> Exception | None:
        """Why a wait fails at once: a closed log never grows."""
        return LogClosed(f"log {self.name} is closed") if self._closed else None
