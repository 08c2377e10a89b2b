"""
In-memory implementation of L{ILogStore}/L{ILog} for tests and for
embedding where durability is not wanted.  Appends "sync" at once, but still
fire their Deferreds only after the records are visible, like the file store.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from streamproto.base.clock import default_reactor
from streamproto.log.batch import RecordBatch, lengths_array
from streamproto.log.config import LogConfig, validate_name
from streamproto.log.errors import (
    LogClosed, LogExists, LogNotFound, PositionOutOfRange,
    skip_conflict,
)
from streamproto.log.gate import (
    AppendRequest, GatedLog, read_bytes_shortcut, read_shortcut,
)
from streamproto.log.interfaces import ILog, ILogStore, StoreHealth
from streamproto.log.result import AppendResult
from streamproto.log.waiters import Waiters


@implementer(ILog)
class MemoryLog(GatedLog):
    #: set by L{truncate_offset} inside the first record; absent otherwise
    _start_offset: int

    holds_unsynced = True

    def __init__(self, name: str, config: LogConfig, clock: IReactorTime) -> None:
        self.name = name
        self.config = config
        self.failed: BaseException | None = None
        self._records: list[bytes] = []  # payloads from start_position on
        self._offsets = [0]       # payload offset of each record, then the end
        self.start_position = 0
        self._closed = False
        self._attributes: dict[str, int] = {}
        self._waiters = Waiters(clock)
        self._offset_waiters = Waiters(clock)

    # -- coordinates -----------------------------------------------------
    @property
    def end_position(self) -> int:
        return self.start_position + len(self._records)

    @property
    def start_offset(self) -> int:
        return self._start_offset if hasattr(self, "_start_offset") else self._offsets[0]

    @property
    def end_offset(self) -> int:
        return self._offsets[-1]

    @property
    def attributes(self) -> dict[str, int]:
        return dict(self._attributes)

    # -- writing ---------------------------------------------------------
    def _written(self) -> tuple[int, Mapping[str, int]]:
        return self.end_position, self._attributes

    def _append(self, request: AppendRequest) -> Deferred[AppendResult]:
        copies, attributes = request.records(), request.attributes
        first = self.end_position
        for r in copies:
            self._records.append(r)
            self._offsets.append(self._offsets[-1] + len(r))
        if attributes:
            self._attributes.update(attributes)
        self._apply_retention()
        self._waiters.advance(self.end_position)
        self._offset_waiters.advance(self.end_offset)
        return succeed(AppendResult(first, self.end_position, self.end_offset))

    def sync(self) -> Deferred[int]:
        return succeed(self.end_position)

    def _apply_retention(self) -> None:
        drop = 0
        n = len(self._records)
        if self.config.log_max_count > 0 and n > self.config.log_max_count:
            drop = n - self.config.log_max_count
        if self.config.log_max_size > 0:
            while self._offsets[-1] - self._offsets[drop] > self.config.log_max_size and drop < n:
                drop += 1
        if drop:
            self._drop(drop)

    def _drop(self, n: int) -> None:
        del self._records[:n]
        del self._offsets[:n]
        self.start_position += n
        if hasattr(self, "_start_offset") and self._start_offset < self._offsets[0]:
            del self._start_offset

    # -- reading ---------------------------------------------------------
    def read(self, position: int, max_records: int = -1,
             max_bytes: int = 1048576) -> Deferred[RecordBatch]:
        answered = read_shortcut(self._check_position, position, self.end_position, max_records)
        if answered is not None:
            return answered
        i = position - self.start_position
        stop = len(self._records) if max_records < 0 else min(len(self._records), i + max_records)
        # at least one record, then whole records while within max_bytes
        limit = self._offsets[i] + max(max_bytes, 0)
        j = bisect.bisect_right(self._offsets, limit, i + 1, stop + 1) - 1
        j = max(j, i + 1)
        chunk = self._records[i:j]
        return succeed(RecordBatch(position, lengths_array(map(len, chunk)), b"".join(chunk)))

    def read_bytes(self, offset: int, max_bytes: int = 1048576) -> Deferred[bytes]:
        answered = read_bytes_shortcut(self._check_offset, offset, self.end_offset, max_bytes)
        if answered is not None:
            return answered
        out: list[bytes] = []
        remaining = max_bytes
        i = bisect.bisect_right(self._offsets, offset) - 1
        while remaining > 0 and i < len(self._records):
            rec = self._records[i]
            skip = offset - self._offsets[i] if offset > self._offsets[i] else 0
            piece = rec[skip:skip + remaining]
            out.append(piece)
            remaining -= len(piece)
            i += 1
        return succeed(b"".join(out))

    def position_of_offset(self, offset: int) -> Deferred[int]:
        if not self._offsets[0] <= offset <= self.end_offset:
            return fail(PositionOutOfRange(f"offset {offset} out of range"))
        if offset == self.end_offset:
            return succeed(self.end_position)
        i = bisect.bisect_right(self._offsets, offset) - 1
        return succeed(self.start_position + i)

    def offset_of_position(self, position: int) -> Deferred[int]:
        try:
            self._check_position(position)
        except Exception as e:
            return fail(e)
        return succeed(self._offsets[position - self.start_position])

    def skip_to(self, position: int, offset: int) -> Deferred[int]:
        if self._closed:
            return fail(LogClosed(self.name))
        conflict = skip_conflict(self.name, self.start_position, self.end_position,
                                 self.end_offset, position, offset)
        if conflict is not None:
            return fail(conflict)
        self.start_position = position
        self._offsets = [offset]
        if hasattr(self, "_start_offset"):
            del self._start_offset
        self._waiters.advance(self.end_position)
        self._offset_waiters.advance(self.end_offset)
        return succeed(self.end_position)

    # -- maintenance -----------------------------------------------------
    def truncate(self, position: int | None = None) -> Deferred[int]:
        if position is None or position > self.end_position:
            position = self.end_position
        if position > self.start_position:
            self._drop(position - self.start_position)
        return succeed(self.start_position)

    def truncate_offset(self, offset: int) -> Deferred[int]:
        if offset > self.end_offset:
            return fail(PositionOutOfRange(f"offset {offset} beyond end {self.end_offset}"))
        if offset > self.start_offset:
            i = bisect.bisect_right(self._offsets, offset) - 1
            if i:
                self._drop(i)
            self._start_offset = offset
        return succeed(self.start_offset)

    def info(self) -> dict[str, Any]:
        return self._info("ok" if self.failed is None else "corrupt", len(self._records),
                          self.end_offset - self._offsets[0])

    def _close(self) -> None:
        self._closed = True
        self._waiters.fail_all(LogClosed(self.name))
        self._offset_waiters.fail_all(LogClosed(self.name))


@implementer(ILogStore)
class MemoryLogStore(StoreHealth):
    """Logs kept in a dict.  C{clock} (an IReactorTime) times L{ILog.wait}."""

    def __init__(self, clock: IReactorTime | None = None) -> None:
        self._clock = cast(IReactorTime, default_reactor(clock))
        self._logs: dict[str, MemoryLog] = {}
        self.closed = False

    def names(self) -> list[str]:
        return sorted(self._logs)

    def create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        try:
            validate_name(name)
        except Exception as e:
            return fail(e)
        if name in self._logs:
            return fail(LogExists(f"log {name!r} exists"))
        log = self._logs[name] = MemoryLog(name, config or LogConfig(), self._clock)
        return succeed(log)

    def get(self, name: str) -> Deferred[ILog]:
        try:
            validate_name(name)
        except Exception as e:
            return fail(e)
        if name not in self._logs:
            return fail(LogNotFound(f"log {name!r} not found"))
        return succeed(self._logs[name])

    def get_or_create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        if name in self._logs:
            return succeed(self._logs[name])
        return self.create(name, config)

    def delete(self, name: str) -> Deferred[None]:
        log = self._logs.pop(name, None)
        if log is None:
            return fail(LogNotFound(f"log {name!r} not found"))
        log._close()
        return succeed(None)

    def close(self) -> Deferred[None]:
        self.closed = True
        for log in self._logs.values():
            log._close()
        return succeed(None)
