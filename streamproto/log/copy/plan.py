"""
What a copy of a store does, as pure functions and values (no I/O, no
Twisted): which logs it copies, where the copy of one log starts, and the
digest that verifies it.

A copy keeps every record's position and offset, so resuming is finding
where the destination's log ends: the record after it is the next to copy.
What this module decides is whether a destination log can be the copy of
a source log at all (L{resume_point}); the reads that back the decision are
the engine's.
"""

from __future__ import annotations

import fnmatch
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c

from streamproto.log.batch import RecordBatch

#: the destination's journal of copies (an internal log: the public APIs
#: neither list nor touch names starting with C{__}); never copied itself
JOURNAL_LOG = "__store-copy"

_LITTLE = array("I", [1]).tobytes() == b"\x01\x00\x00\x00"


class CopyRefused(Exception):
    """The copy cannot go on for a reason the user must act on (one line)."""


def select(names: Iterable[str], include: Sequence[str] = (),
           exclude: Sequence[str] = ()) -> list[str]:
    """
    The logs to copy: those matching one of C{include} (shell patterns, or
    exact names; every log when empty) and none of C{exclude}, sorted.  The
    copy's own journal is never one of them.
    """
    chosen = []
    for name in names:
        if name == JOURNAL_LOG:
            continue
        if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        chosen.append(name)
    return sorted(chosen)


@dataclass(frozen=True)
class Bounds:
    """Where a log starts and ends (positions and payload offsets)."""

    start_position: int
    end_position: int
    start_offset: int
    end_offset: int

    @classmethod
    def of(cls, log: Any) -> Bounds:
        """The bounds of an L{ILog} now."""
        return cls(log.start_position, log.end_position, log.start_offset, log.end_offset)

    @property
    def empty(self) -> bool:
        return self.start_position == self.end_position


@dataclass(frozen=True)
class Start:
    """
    Where the copy of one log starts.

    @ivar position: the first position to read from the source.
    @ivar skip: (position, offset) the destination must first skip to (it
        is empty), or None.
    @ivar check: a position whose record both logs must hold alike before
        the copy goes on (the destination's last), or None.
    @ivar offset: the payload offset the source's record C{position} must
        start at (the destination's end), or None when not to be checked.
    """

    position: int
    skip: tuple[int, int] | None = None
    check: int | None = None
    offset: int | None = None


def resume_point(name: str, src: Bounds, first_offset: int, dst: Bounds | None) -> Start:
    """
    Where to start copying log C{name}.

    @param src: the source log's bounds.
    @param first_offset: where the source's first readable record starts
        (below C{src.start_offset} when its start was cut inside it).
    @param dst: the destination log's bounds, None when it does not exist.
    @raise CopyRefused: the destination holds a log that cannot be this
        one's copy (or a copy of it that went further than the source).
    """
    first = (src.start_position, first_offset)
    if dst is None or (dst.empty and (dst.end_position, dst.end_offset) == (0, 0)):
        return Start(src.start_position, skip=None if first == (0, 0) else first)
    if dst.end_position > src.end_position or dst.end_offset > src.end_offset:
        raise CopyRefused(
            f"log {name}: the destination's log ends at {dst.end_position} "
            f"(offset {dst.end_offset}), past the source's end {src.end_position} "
            f"(offset {src.end_offset}): a different log of the same name")
    if dst.empty:
        if (dst.end_position, dst.end_offset) == first:
            return Start(src.start_position)
        raise CopyRefused(
            f"log {name}: the destination's empty log stands at {dst.end_position} "
            f"(offset {dst.end_offset}), not where the source's records start "
            f"({first[0]}, offset {first[1]}): a different log of the same name")
    if dst.end_position < src.start_position:
        raise CopyRefused(
            f"log {name}: the source's records up to {src.start_position} were truncated "
            f"since the destination's copy ended at {dst.end_position}: delete the "
            "destination's log and copy it again")
    # the destination's last record must be the source's at that position
    return Start(dst.end_position, check=dst.end_position - 1, offset=dst.end_offset)


class Digest:
    """
    Count, bytes and CRC-32C of a run of records, the same however the run
    is cut into batches: one CRC over the records' lengths (their
    boundaries), one over their payloads.
    """

    __slots__ = ("count", "nbytes", "lengths_crc", "data_crc")

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self.lengths_crc = 0
        self.data_crc = 0

    def feed(self, batch: RecordBatch) -> None:
        lengths = batch.lengths
        if not _LITTLE:
            lengths = array("I", lengths)
            lengths.byteswap()
        self.lengths_crc = crc32c(lengths.tobytes(), self.lengths_crc)
        for _, part in batch.chunks():
            self.data_crc = crc32c(part, self.data_crc)
            self.nbytes += len(part)
        self.count += len(batch)

    def as_dict(self) -> dict[str, int]:
        return {"records": self.count, "bytes": self.nbytes,
                "crc_lengths": self.lengths_crc, "crc_data": self.data_crc}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Digest) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"<Digest {self.as_dict()}>"


def attributes_to_copy(src: Mapping[str, int], dst: Mapping[str, int]) -> dict[str, int] | None:
    """
    The attributes an append must set so that the destination's equal the
    source's (None: they already do).  A key only the destination has
    cannot be removed (attributes are never deleted): it is refused.
    """
    extra = sorted(set(dst) - set(src))
    if extra:
        raise CopyRefused(f"the destination's log has attributes the source's has not: "
                          f"{', '.join(extra)}")
    changed = {k: v for k, v in src.items() if dst.get(k) != v}
    return changed or None
