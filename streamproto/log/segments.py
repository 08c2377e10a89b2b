"""
Segment files and the blocking operations on them: scanning, reading
ranges, the file layer.  Nothing here touches the reactor, so it runs in a
worker thread for the live store and directly in the synchronous reader.
"""

from __future__ import annotations

import bisect
import errno
import os
from array import array
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any, TypeAlias

from streamproto.base.durable import DirectoryIO
from streamproto.log.batch import RecordBatch, empty_batch
from streamproto.log.errors import CorruptLog
from streamproto.log.format import (
    BATCH_HEADER_SIZE, SEGMENT_HEADER_SIZE, BatchHeader, FormatError, batch_attributes,
    batch_lengths, decode_batch_header, verify_batch,
)

_pread_cached: Callable[[int, int, int], bytes] | None
try:
    from streamproto._speedups import pread_cached as _pread_cached
except ImportError:     # no accelerator, or an OS without RWF_NOWAIT
    _pread_cached = None

#: (position, offset, file_pos) of a batch start in a segment file.
Cursor: TypeAlias = tuple[int, int, int]

#: How much a read asks the OS for at once when scanning batch headers.
READ_CHUNK = 256 * 1024


class FileIO(DirectoryIO):
    """
    The file layer, one method per system call the store makes, so fault
    injection (fsync errors, ENOSPC, torn writes, power loss) can wrap it.
    The calls that create, name and sync files are L{DirectoryIO}'s.
    """

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        return os.pread(fd, n, offset)

    def pread_cached(self, fd: int, n: int, offset: int) -> bytes:
        """
        C{pread} served by the page cache alone (C{preadv2} with
        C{RWF_NOWAIT}): fewer than C{n} bytes only at the end of the file.

        @raise BlockingIOError: some of the range would have to come from
            the disk.
        @raise NotImplementedError: this build or OS cannot tell (no C
            accelerator, no C{RWF_NOWAIT}).
        """
        if _pread_cached is None:
            raise NotImplementedError("no page-cache-only reads here")
        return _pread_cached(fd, n, offset)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fstat_size(self, fd: int) -> int:
        return os.fstat(fd).st_size


class PageCacheIO(FileIO):
    """
    The reads of another file layer, from the page cache only: a read that
    would wait for the disk raises L{BlockingIOError} instead (see
    L{FileIO.pread_cached}).  The live store reads through it on the
    reactor thread first, and in a thread only when that raises.
    """

    def __init__(self, io: FileIO, max_read: int = 8 * 1024 * 1024) -> None:
        self._io = io
        self.max_read = max_read

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        if n > self.max_read:
            # one huge record: not worth holding the calling thread for
            raise BlockingIOError(errno.EAGAIN, f"a read of {n} bytes is left to a thread")
        return self._io.pread_cached(fd, n, offset)


class Segment:
    """
    One segment file: where it starts, what it holds, and a sparse index of
    batch starts (one entry every C{index_after_size} bytes) for seeks.

    C{end_position}/C{end_offset}/C{size} count what was written, synced or
    not; the log bounds reads by its synced end.
    """

    def __init__(self, path: str, fd: int, position: int, offset: int, created_ms: int,
                 index_after_size: int) -> None:
        self.path = path
        self.fd = fd
        self.position = position
        self.offset = offset
        self.created_ms = created_ms
        self.size = SEGMENT_HEADER_SIZE
        self.end_position = position
        self.end_offset = offset
        self.index_after_size = index_after_size
        self.idx_pos = array("q")
        self.idx_off = array("q")
        self.idx_file = array("q")
        self.refs = 0          # blocking operations in flight on fd
        self.doomed = False    # deleted: close fd when refs drops to 0
        self.indexed = False   # an .idx file was written for it
        self.cursor: Cursor | None = None  # (position, offset, file_pos) of a recent batch
        self.attrs_at_end: dict[str, int] | None = None  # log attributes as of the segment's end, once sealed

    def __repr__(self) -> str:
        return f"<Segment {self.position}..{self.end_position} {self.path}>"

    @property
    def count(self) -> int:
        return self.end_position - self.position

    def note_batch(self, file_pos: int, position: int, offset: int, count: int, data_len: int,
                   size: int) -> None:
        """Account for a batch written (or recovered) at C{file_pos}."""
        if not self.idx_file or file_pos - self.idx_file[-1] >= self.index_after_size:
            self.idx_pos.append(position)
            self.idx_off.append(offset)
            self.idx_file.append(file_pos)
        self.end_position = position + count
        self.end_offset = offset + data_len
        self.size = file_pos + size

    def seek_position(self, position: int) -> Cursor:
        """(position, offset, file_pos) of a batch at or before C{position}."""
        return self._seek(0, self.idx_pos, position)

    def seek_offset(self, offset: int) -> Cursor:
        """(position, offset, file_pos) of a batch at or before C{offset}."""
        return self._seek(1, self.idx_off, offset)

    def _seek(self, key: int, column: array[int], value: int) -> Cursor:
        """
        The nearest known batch start at or before C{value} (item C{key} of
        a L{Cursor}, looked up in the index C{column}): the sparse index's
        entry, or the last read's cursor when that is nearer (a consumer
        reading on needs no rescan from the index entry).
        """
        i = bisect.bisect_right(column, value) - 1
        best = (self.position, self.offset, SEGMENT_HEADER_SIZE) if i < 0 else \
            (self.idx_pos[i], self.idx_off[i], self.idx_file[i])
        c = self.cursor
        if c is not None and best[key] <= c[key] <= value:
            return c
        return best

    def index_payload(self, attributes: dict[str, int] | None) -> dict[str, Any]:
        return {
            "position": self.position, "offset": self.offset, "created_ms": self.created_ms,
            "end_position": self.end_position, "end_offset": self.end_offset,
            "size": self.size, "attributes": attributes,
            "index": [list(self.idx_pos), list(self.idx_off), list(self.idx_file)],
        }

    def load_index(self, payload: dict[str, Any]) -> None:
        self.end_position = payload["end_position"]
        self.end_offset = payload["end_offset"]
        self.size = payload["size"]
        pos, off, fil = payload["index"]
        self.idx_pos, self.idx_off, self.idx_file = array("q", pos), array("q", off), \
            array("q", fil)
        self.indexed = True


def iter_batches(
    io: FileIO,
    fd: int,
    file_pos: int,
    position: int,
    offset: int,
    end_file: int,
    verify: bool = True,
    skip_verify_before: int | None = None,
    chunk: int = READ_CHUNK,
    wanted: Callable[[BatchHeader, int], bool] | None = None,
) -> Iterator[tuple[bytes, BatchHeader, int]]:
    """
    Yield (buf, header, file_pos) for consecutive batches from C{file_pos}
    up to C{end_file}, reading in large chunks.  C{buf} holds the whole
    batch; C{header.start} is relative to C{buf}, C{file_pos} to the file.

    @param wanted: if given, called with each batch's header and file
        position before its body is read and checked; a false answer ends the iteration (a
        reader that will not take the batch saves reading it).

    @raise CorruptLog: a batch fails its checksum or breaks continuity.
    """
    buf = b""
    buf_start = file_pos
    pos = file_pos
    while pos < end_file:
        rel = pos - buf_start
        if rel + BATCH_HEADER_SIZE > len(buf):
            buf = io.pread(fd, max(chunk, BATCH_HEADER_SIZE), pos)
            buf_start, rel = pos, 0
        try:
            h = decode_batch_header(buf, rel)
        except FormatError as e:
            raise CorruptLog(f"segment data at byte {pos}: {e}")
        if h is None:
            raise CorruptLog(f"segment ends inside a batch header at byte {pos}")
        if wanted is not None and not wanted(h, pos):
            return
        if h.end > len(buf):
            want = h.size + (chunk if h.size < chunk else 0)
            buf = io.pread(fd, min(want, max(end_file - pos, h.size)), pos)
            buf_start, rel = pos, 0
            h = decode_batch_header(buf, 0)
            if h is None or h.end > len(buf):
                raise CorruptLog(f"segment ends inside a batch at byte {pos}")
        if h.position != position or h.offset != offset:
            raise CorruptLog(f"batch at byte {pos} says position {h.position}, "
                             f"expected {position}")
        if verify and (skip_verify_before is None or h.end_position > skip_verify_before):
            try:
                verify_batch(buf, h)
            except FormatError as e:
                raise CorruptLog(str(e))
        yield buf, h, pos
        position, offset = h.end_position, h.end_offset
        pos = buf_start + h.end


def read_records(
    io: FileIO, seg: Segment, position: int, stop_position: int, max_records: int,
    max_bytes: int,
) -> tuple[RecordBatch, Cursor | None]:
    """
    Blocking: records from C{position} (up to C{stop_position}, C{max_records},
    and C{max_bytes} but at least one record) within one segment.

    @return: (RecordBatch, cursor) where cursor is a (position, offset,
        file_pos) batch start from which a follow-up read can continue.
    """
    start_pos, start_off, file_pos = seg.seek_position(position)
    parts: list[tuple[array[int], memoryview]] = []
    total = 0
    count = 0
    cursor: Cursor | None = None
    budget_records = max_records if max_records >= 0 else stop_position - position
    # one read for the whole answer where the index lets us start close by
    chunk = min(max(READ_CHUNK, max_bytes + max_bytes // 8 + 4096), 16 * 1024 * 1024)

    def wanted(h: BatchHeader, at: int) -> bool:
        # a whole batch after the first records that does not fit the byte
        # budget is left to the next read: not read, not checked, not cut
        # (a cut costs a pass over its lengths); the next read starts there
        nonlocal cursor
        if count and h.position >= position and h.data_len > max_bytes - total:
            cursor = (h.position, h.offset, at)
            return False
        return True

    for buf, h, at in iter_batches(io, seg.fd, file_pos, start_pos, start_off, seg.size,
                                   skip_verify_before=position, chunk=chunk, wanted=wanted):
        cursor = (h.position, h.offset, at)
        if h.end_position <= position:
            continue
        lens = batch_lengths(buf, h)
        first = position + count - h.position if h.position < position + count else 0
        last = min(h.count, stop_position - h.position, first + (budget_records - count))
        if last <= first:
            break
        if first == 0 and last == h.count and h.data_len <= max_bytes - total:
            # the whole batch fits: no per-record work at all
            parts.append((lens, memoryview(buf)[h.data_start:h.data_start + h.data_len]))
            total += h.data_len
            count += h.count
            # a next read starts at the next batch, without reading this one
            cursor = (h.end_position, h.end_offset, at + h.size)
            if count >= budget_records or h.end_position >= stop_position:
                break
            continue
        offs = array("Q", [0])
        offs.extend(accumulate(lens))
        # whole records within the byte budget, but at least one record in all
        allowed = max_bytes - total
        cut = bisect.bisect_right(offs, offs[first] + allowed, first, last + 1) - 1
        if cut <= first:
            cut = first + 1 if count == 0 else first
        if cut > first:
            base = h.data_start
            parts.append((lens[first:cut], memoryview(buf)[base + offs[first]:base + offs[cut]]))
            total += offs[cut] - offs[first]
            count += cut - first
        if cut < last or count >= budget_records or h.end_position >= stop_position:
            break
    if count == 0:
        return empty_batch(position), cursor
    # the stored batches' payloads stay where they were read: a consumer
    # sends each as it lies, only a caller of .data joins them
    return RecordBatch.from_parts(position, parts), cursor


def read_payload(io: FileIO, seg: Segment, offset: int, stop_offset: int,
                 max_bytes: int) -> bytes:
    """Blocking: payload bytes from C{offset} up to C{stop_offset}/C{max_bytes}."""
    start_pos, start_off, file_pos = seg.seek_offset(offset)
    parts: list[memoryview] = []
    want = min(max_bytes, stop_offset - offset)
    got = 0
    for buf, h, _ in iter_batches(io, seg.fd, file_pos, start_pos, start_off, seg.size):
        if h.end_offset <= offset:
            continue
        begin = h.data_start + max(0, offset + got - h.offset)
        end = h.data_start + h.data_len
        piece = memoryview(buf)[begin:min(end, begin + want - got)]
        parts.append(piece)
        got += len(piece)
        if got >= want:
            break
    return b"".join(parts)


def position_in_segment(io: FileIO, seg: Segment, offset: int) -> int:
    """Blocking: the position of the record holding payload byte C{offset}."""
    found = _batch_reaching(io, seg, seg.seek_offset(offset), lambda h: h.end_offset > offset)
    if found is None:
        return seg.end_position
    h, lens = found
    return h.position + bisect.bisect_right(list(accumulate(lens, initial=h.offset)), offset) - 1


def offset_in_segment(io: FileIO, seg: Segment, position: int) -> int:
    """Blocking: the payload offset at which record C{position} starts."""
    found = _batch_reaching(io, seg, seg.seek_position(position),
                            lambda h: h.end_position > position)
    if found is None:
        return seg.end_offset
    h, lens = found
    return h.offset + sum(lens[:position - h.position])


def _batch_reaching(io: FileIO, seg: Segment, start: Cursor,
                    reaches: Callable[[BatchHeader], bool],
                    ) -> tuple[BatchHeader, array[int]] | None:
    """
    Blocking: the first batch of C{seg} from C{start} (a seek's cursor)
    that C{reaches} past the record or byte looked for, with its record
    lengths; None when none does (it is past the segment's end).
    """
    start_pos, start_off, file_pos = start
    for buf, h, _ in iter_batches(io, seg.fd, file_pos, start_pos, start_off, seg.size,
                                  verify=False):
        if reaches(h):
            return h, batch_lengths(buf, h)
    return None


def recover_segment(
    io: FileIO, seg: Segment, verify: bool, attributes: dict[str, int], resume: bool = False,
) -> tuple[int, str] | None:
    """
    Blocking: scan a segment's batches, rebuilding its index and folding
    their attributes into C{attributes}.

    @param resume: continue after what C{seg} already accounts for (its
        C{size}, C{end_position}, C{end_offset}) instead of from the start.
    @return: None if the whole file is valid, else (good_size, reason): the
        caller decides whether to cut the file there (the tail) or call the
        log corrupt.
    """
    end_file = io.fstat_size(seg.fd)
    if resume:
        pos, position, offset = seg.size, seg.end_position, seg.end_offset
    else:
        pos, position, offset = SEGMENT_HEADER_SIZE, seg.position, seg.offset
    try:
        for buf, h, at in iter_batches(io, seg.fd, pos, position, offset, end_file,
                                       verify=verify):
            pos = at + h.size
            seg.note_batch(at, h.position, h.offset, h.count, h.data_len, h.size)
            attrs = batch_attributes(buf, h)
            if attrs:
                attributes.update(attrs)
            position, offset = h.end_position, h.end_offset
    except (CorruptLog, FormatError) as e:
        return pos, str(e)
    return None
