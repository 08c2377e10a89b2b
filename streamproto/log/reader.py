"""
A synchronous, read-only view of a log store directory, for processes that
have no reactor (Spark executors, tools).  It never writes: a torn tail (a
writer crashed, or is writing right now) simply ends what it sees.

It sees every batch that is whole and checksummed on disk.  A live server
may still be fsyncing the newest of them; for exactly-once readers that
must never see a record that a power failure could still take back, bound
reads by positions the server reported as synced (a styx-server's
C{end_position}).
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from streamproto.log.config import validate_name
from streamproto.log.errors import LogNotFound, PositionOutOfRange
from streamproto.log.format import (
    SEGMENT_HEADER_SIZE, FormatError, decode_index, decode_segment_header, index_file_name,
)
from streamproto.log.batch import RecordBatch
from streamproto.log.segments import FileIO, Segment, read_records, recover_segment


#: Segments already scanned and verified, by (path, inode): a later snapshot
#: only scans what was appended since (readers are called per Spark task and
#: per offset query; re-verifying a large last segment each time is costly).
_SCANNED: OrderedDict[tuple[str, int], Segment] = OrderedDict()
_SCANNED_MAX = 4096


def _remember(key: tuple[str, int], seg: Segment) -> None:
    state = copy.copy(seg)
    state.fd = None  # type: ignore[assignment]  # a remembered scan owns no descriptor
    state.idx_pos, state.idx_off, state.idx_file = \
        state.idx_pos[:], state.idx_off[:], state.idx_file[:]
    _SCANNED[key] = state
    _SCANNED.move_to_end(key)
    while len(_SCANNED) > _SCANNED_MAX:
        _SCANNED.popitem(last=False)


def _scan(io: FileIO, seg: Segment, key: tuple[str, int],
          last: bool) -> tuple[int, str] | None:
    """Bring C{seg} up to date with its file, reusing an earlier scan."""
    known = _SCANNED.get(key)
    size = io.fstat_size(seg.fd)
    if known is not None and known.size <= size and known.position == seg.position:
        fd = seg.fd
        seg.__dict__.update(copy.copy(known).__dict__)
        seg.fd = fd
        seg.idx_pos, seg.idx_off, seg.idx_file = \
            known.idx_pos[:], known.idx_off[:], known.idx_file[:]
        if seg.size == size:
            return None
        problem = recover_segment(io, seg, verify=True, attributes={}, resume=True)
    else:
        problem = recover_segment(io, seg, verify=last, attributes={})
    if problem is None:
        _remember(key, seg)
    return problem


class _Snapshot:
    """The segments of one log as they are on disk now."""

    def __init__(self, io: FileIO, path: str) -> None:
        self.segments: list[Segment] = []
        state: dict[str, Any] = {"start_position": 0}
        try:
            with open(os.path.join(path, "state.json"), "rb") as f:
                state.update(json.loads(f.read()))
        except (OSError, ValueError):
            pass
        names = sorted(n for n in os.listdir(path) if n.endswith(".seg"))
        expected: int | None = None
        for i, name in enumerate(names):
            seg_path = os.path.join(path, name)
            try:
                fd = io.open(seg_path, os.O_RDONLY)
            except FileNotFoundError:   # deleted by retention meanwhile
                continue
            try:
                pos, off, created = decode_segment_header(io.pread(fd, SEGMENT_HEADER_SIZE, 0))
            except FormatError:
                io.close(fd)
                break
            if expected is not None and pos != expected:
                io.close(fd)
                break
            seg = Segment(seg_path, fd, pos, off, created, 1 << 20)
            last = i == len(names) - 1
            if not (not last and self._load_index(io, path, seg)):
                problem = _scan(io, seg, (seg_path, os.fstat(fd).st_ino), last)
                if problem is not None and not last:
                    self.segments.append(seg)
                    break
            self.segments.append(seg)
            expected = seg.end_position
        self.start: int = max(state["start_position"],
                         self.segments[0].position if self.segments else 0)
        self.end = self.segments[-1].end_position if self.segments else self.start

    @staticmethod
    def _load_index(io: FileIO, path: str, seg: Segment) -> bool:
        try:
            with open(os.path.join(path, index_file_name(seg.position)), "rb") as f:
                payload = decode_index(f.read())
            if payload["size"] != io.fstat_size(seg.fd):
                return False
        except (OSError, ValueError, KeyError, FormatError):
            return False
        seg.load_index(payload)
        return True

    def close(self, io: FileIO) -> None:
        for seg in self.segments:
            io.close(seg.fd)


class LogDirectoryReader:
    """
    Read logs of the store at C{path} without a reactor::

        reader = LogDirectoryReader("/var/lib/streamproto")
        start, end = reader.bounds("events")
        for batch in reader.read("events", start, end):
            ...  # RecordBatch: .position, .lengths, .data, .offsets()
    """

    def __init__(self, path: str, io: FileIO | None = None) -> None:
        self.path = os.path.abspath(path)
        self._io = io or FileIO()

    def names(self) -> list[str]:
        return sorted(n for n in os.listdir(self.path) if not n.startswith(".")
                      and os.path.isfile(os.path.join(self.path, n, "config.json")))

    def _log_dir(self, name: str) -> str:
        path = os.path.join(self.path, validate_name(name))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise LogNotFound(f"log {name!r} not found in {self.path}")
        return path

    def bounds(self, name: str) -> tuple[int, int]:
        """(start_position, end_position) of what is readable now."""
        snap = _Snapshot(self._io, self._log_dir(name))
        try:
            return snap.start, snap.end
        finally:
            snap.close(self._io)

    def read(self, name: str, start_position: int, end_position: int,
             max_bytes: int = 8 * 1024 * 1024) -> Iterator[RecordBatch]:
        """
        Yield L{RecordBatch}es covering exactly C{[start_position,
        end_position)}, each of about C{max_bytes} at most.

        @raise PositionOutOfRange: if the range is not (or no longer) all
            readable: a deterministic reader must fail rather than skip.
        """
        snap = _Snapshot(self._io, self._log_dir(name))
        try:
            if not snap.start <= start_position <= end_position <= snap.end:
                raise PositionOutOfRange(
                    f"log {name}: range [{start_position}, {end_position}) outside "
                    f"readable [{snap.start}, {snap.end})")
            position = start_position
            for seg in snap.segments:
                if seg.end_position <= position:
                    continue
                while position < min(end_position, seg.end_position):
                    batch, cursor = read_records(self._io, seg, position,
                                                 min(end_position, seg.end_position), -1,
                                                 max_bytes)
                    if cursor is not None:
                        seg.cursor = cursor
                    if not len(batch):
                        raise PositionOutOfRange(f"log {name}: nothing at {position}")
                    yield batch
                    position = batch.next_position
                if position >= end_position:
                    break
        finally:
            snap.close(self._io)
