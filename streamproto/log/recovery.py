"""
Opening a log directory after a crash or a power loss: which segments hold
the log, and what to cut.

What a power loss can leave (only what was fsynced is sure to be there; a
name becomes durable when its directory is fsynced, by anyone, or whenever
the file system commits its journal):

- the newest segments' tails torn, garbled, or missing pages;
- a segment's name durable before its data: an empty file or a torn
  header, and not always the last one (a roll creates segment C while B's
  data is still in the page cache; a directory fsync makes both names
  durable);
- a segment whose predecessor's unsynced tail was lost, so that it starts
  after where the log now ends.

None of that can hold an acknowledged record: an append is acknowledged
only once every segment written up to it is fsynced.  So recovery finds
the first point where the log stops being whole (a torn or corrupt batch,
a bad segment header, a gap) and, unless something says that data from
there on had been fsynced, cuts the log there: the rest of that segment,
and every later segment.  What says so (then the log is refused as
corrupt, never cut):

- a whole, checksummed batch later on whose C{lag} shows that the log was
  durable beyond the damage when it was written;
- a valid index file of the damaged segment or a later one (an index is
  written only after its segment was fsynced);
- a truncation point in the state file beyond the damage.

The cut is made durable (ftruncate and fsync, unlinks and a directory
fsync) before the log takes appends, so a second power loss cannot bring
the cut data back behind new records.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from twisted.logger import Logger

from streamproto.log.config import LogConfig
from streamproto.log.errors import CorruptLog
from streamproto.log.format import (
    BATCH_HEADER_SIZE, SEGMENT_HEADER_SIZE, FormatError, decode_batch_header, decode_index,
    decode_segment_header, index_file_name, verify_batch,
)
from streamproto.log.segments import FileIO, Segment, recover_segment

log = Logger()


class _Damage:
    """Where the log stops being whole: segment C{index} of the names, and why."""

    def __init__(self, index: int, reason: str, position: int | None, offset: int | None,
                 seg: Segment | None = None, fd: int | None = None, good: int = 0) -> None:
        self.index = index
        self.reason = reason
        self.position = position    # the log's end if it is cut here
        self.offset = offset
        self.seg = seg              # the damaged segment, if its header is whole
        self.fd = fd
        self.good = good            # the bytes of seg that are whole


class LogRecovery:
    """
    Recover the segments of the log in C{path} (blocking; run once, on open).

    @ivar segments: the segments of the log, oldest first, each with its
        C{attrs_at_end}; empty when there were none (or the only one was cut).
    @ivar attributes: the log's attributes as of its end.
    """

    def __init__(self, name: str, path: str, config: LogConfig, io: FileIO,
                 state: dict[str, Any]) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.io = io
        self.state = state
        self.segments: list[Segment] = []
        self.attributes: dict[str, int] = {}

    def run(self) -> LogRecovery:
        """@raise CorruptLog: data that had been fsynced is damaged."""
        for leftover in os.listdir(self.path):
            if leftover.endswith(".tmp"):  # an atomic write cut short
                self.io.unlink(os.path.join(self.path, leftover))
        names = sorted(n for n in os.listdir(self.path) if n.endswith(".seg"))
        damage = self._walk(names)
        if damage is not None:
            self._cut(names, damage)
        elif self.segments and self.segments[-1].end_position < self.state["start_position"]:
            end = self.segments[-1].end_position
            last = self.segments[-1]
            if self.state.get("skipped_from") == [last.end_position, last.end_offset]:
                # an ILog.skip_to of the empty log stopped between its state
                # file and its new segment: every segment is truncated, the
                # log goes on from the state's start
                log.info("log {log}: finishing a skip to {start}", log=self.name,
                         start=self.state["start_position"])
                self._drop(self.segments)
                self.segments = []
                self.attributes.clear()
                self.attributes.update(self.state.get("attributes") or {})
                return self
            # whole batches, but fewer than the truncation point says were
            # durable: the end of the log is missing
            for seg in self.segments:
                self.io.close(seg.fd)
            reason = (f"the log ends at {end}, before its truncation point "
                      f"{self.state['start_position']}: acknowledged data is missing")
            log.error("log {log}: {reason}", log=self.name, reason=reason)
            raise CorruptLog(f"log {self.name}: {reason}")
        return self

    # -- the walk ---------------------------------------------------------
    def _walk(self, names: list[str]) -> _Damage | None:
        io = self.io
        # attributes of deleted segments were folded into the state first
        attributes: dict[str, int] = dict(self.state.get("attributes") or {})
        self.attributes = attributes
        position: int | None = None
        offset: int | None = None
        for i, fname in enumerate(names):
            last = i == len(names) - 1
            seg_path = os.path.join(self.path, fname)
            fd = io.open(seg_path, os.O_RDWR | os.O_APPEND)
            try:
                seg_pos, seg_off, created = decode_segment_header(
                    io.pread(fd, SEGMENT_HEADER_SIZE, 0))
            except FormatError:
                return _Damage(i, f"bad segment header in {fname}", position, offset, fd=fd)
            if position is not None and (seg_pos, seg_off) != (position, offset):
                if position < seg_pos <= self.state["start_position"]:
                    # the segments before this one were being deleted (the
                    # state file says so) when the process stopped: finish
                    self._drop(self.segments)
                    self.segments = []
                    attributes.clear()
                    attributes.update(self.state.get("attributes") or {})
                else:
                    return _Damage(i, f"segment {fname} starts at {seg_pos}, expected "
                                      f"{position}", position, offset, fd=fd)
            seg = Segment(seg_path, fd, seg_pos, seg_off, created, self.config.index_after_size)
            # a sealed segment's index says it was fsynced whole: trusted
            if last or not self._load_index(seg, attributes):
                # checksummed unless trusted: a roll's unsynced tail is often
                # whole in structure but not in content
                problem = recover_segment(io, seg, verify=True, attributes=attributes)
                if problem is not None:
                    good, reason = problem
                    return _Damage(i, f"segment {fname} is corrupt at byte {good}: {reason}",
                                   seg.end_position, seg.end_offset, seg, fd, good)
            seg.attrs_at_end = dict(attributes)
            self.segments.append(seg)
            position, offset = seg.end_position, seg.end_offset
        return None

    def _load_index(self, seg: Segment, attributes: dict[str, int]) -> bool:
        payload = self._index(seg.position)
        if payload is None or payload["size"] != self.io.fstat_size(seg.fd):
            return False
        seg.load_index(payload)
        attributes.clear()
        attributes.update(payload.get("attributes") or {})
        return True

    def _index(self, position: int) -> dict[str, Any] | None:
        """The valid index file of the segment at C{position}, or None."""
        try:
            with open(os.path.join(self.path, index_file_name(position)), "rb") as f:
                payload = decode_index(f.read())
            if not isinstance(payload, dict) or payload["position"] != position:
                return None
            int(payload["end_position"])
            int(payload["size"])
        except (OSError, ValueError, KeyError, TypeError, FormatError):
            return None
        return payload

    # -- the cut ----------------------------------------------------------
    def _cut(self, names: list[str], damage: _Damage) -> None:
        io = self.io
        if damage.position is None:
            # the first segment's header is bad: where the log starts is
            # known only from the state file
            damage.position = _name_position(names[damage.index])
            if damage.position == self.state["start_position"]:
                damage.offset = self.state["start_offset"]
        evidence = None if damage.offset is None else self._durable_beyond(names, damage)
        if damage.offset is None or evidence is not None:
            for seg in self.segments:
                io.close(seg.fd)
            if damage.fd is not None:
                io.close(damage.fd)
            why = evidence or "the log's start is unknown"
            log.error("log {log}: {reason}; {why}: refusing to cut acknowledged data",
                      log=self.name, reason=damage.reason, why=why)
            raise CorruptLog(f"log {self.name}: {damage.reason} ({why})")
        doomed = names[damage.index + 1:]
        if damage.seg is not None and damage.fd is not None:
            cut = io.fstat_size(damage.fd) - damage.good
            io.ftruncate(damage.fd, damage.good)
            io.fsync(damage.fd)
            damage.seg.attrs_at_end = dict(self.attributes)
            self.segments.append(damage.seg)
        else:
            cut = 0
            doomed.insert(0, names[damage.index])
            if damage.fd is not None:
                io.close(damage.fd)
        for fname in doomed:
            seg_path = os.path.join(self.path, fname)
            cut += os.path.getsize(seg_path)
            io.unlink(seg_path)
            io.unlink(os.path.join(self.path, index_file_name(_name_position(fname))))
        if doomed:
            io.fsync_dir(self.path)
        log.warn("log {log}: {reason}; nothing from position {at} on was ever fsynced: cut "
                 "{cut} bytes, {n} whole segments", log=self.name, reason=damage.reason,
                 at=damage.position, cut=cut, n=len(doomed))

    def _durable_beyond(self, names: list[str], damage: _Damage) -> str | None:
        """Why data at or after the damage had been fsynced, or None if nothing says so."""
        at = damage.position
        assert at is not None
        if self.state["start_position"] > at:
            return f"the log was truncated to {self.state['start_position']}"
        for i in range(damage.index, len(names)):
            payload = self._index(_name_position(names[i]))
            if payload is not None and payload["end_position"] > at:
                return f"the index of {names[i]} says it was fsynced"
        for i in range(damage.index, len(names)):
            seg_path = os.path.join(self.path, names[i])
            if i == damage.index and damage.fd is not None:
                durable = _claimed_durable(self.io, damage.fd, _after_bad_batch(
                    self.io, damage.fd, damage.good if damage.seg else SEGMENT_HEADER_SIZE,
                    damage.seg is not None))
            else:
                fd = self.io.open(seg_path, os.O_RDONLY)
                try:
                    durable = _claimed_durable(self.io, fd, SEGMENT_HEADER_SIZE)
                finally:
                    self.io.close(fd)
            if durable > at:
                return f"a later batch in {names[i]} says position {durable} was durable"
        return None

    def _drop(self, segments: Iterable[Segment]) -> None:
        for seg in segments:
            log.warn("log {log}: removing {seg}, left by an interrupted deletion",
                     log=self.name, seg=seg.path)
            self.io.close(seg.fd)
            self.io.unlink(seg.path)
            self.io.unlink(os.path.join(self.path, index_file_name(seg.position)))


def _name_position(fname: str) -> int:
    try:
        return int(fname.split(".", 1)[0])
    except ValueError:
        return 0


def _after_bad_batch(io: FileIO, fd: int, at: int, skip: bool) -> int:
    """
    Where whole batches may follow the damaged one at C{at}: after it if
    its header still says how long it is (C{skip}), else C{at} itself.
    """
    if not skip:
        return at
    try:
        h = decode_batch_header(io.pread(fd, BATCH_HEADER_SIZE, at), 0)
    except FormatError:
        return io.fstat_size(fd)    # nothing to go by
    return io.fstat_size(fd) if h is None else at + h.size


def _claimed_durable(io: FileIO, fd: int, start: int) -> int:
    """
    The furthest position that whole, checksummed batches from C{start}
    say was durable when they were written (position - lag), or 0.
    """
    end_file = io.fstat_size(fd)
    best = 0
    at = start
    while at + BATCH_HEADER_SIZE <= end_file:
        try:
            h = decode_batch_header(io.pread(fd, BATCH_HEADER_SIZE, at), 0)
            if h is None or at + h.size > end_file:
                break
            buf = io.pread(fd, h.size, at)
            verify_batch(buf, h)
        except FormatError:
            break
        best = max(best, h.position - h.lag)
        at += h.size
    return best
