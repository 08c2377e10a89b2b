"""
Finding records in a JetStream log without scanning it: which message
(stream sequence) holds a position or a payload offset, and the bodies of
recently used messages.

Every message says where it is in the log (L{streamproto.log.natsformat}),
and both its end position and end offset never decrease with its sequence.
So the message holding position C{p} is the first message whose end
position is above C{p}: a binary search over stream sequences.  The
L{MessageIndex} remembers the messages the store has seen (its own acks,
the follower's headers, earlier searches), densely for the newest ones and
sparsely (every C{stride}-th) for older ones, so a lookup is a bisect in
memory, or a short search of a few message fetches between two known
neighbours; never a scan from the start.
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from typing import Any, TypeAlias

from streamproto.log.batch import BytesLike
from streamproto.log.natsformat import BatchInfo

#: a cached body: [lengths, data, payload offsets or None until computed]
BodyEntry: TypeAlias = list[Any]


class MessageIndex:
    """
    Known messages of one log, ordered by stream sequence.

    @param max_entries: beyond this many, the older half is thinned to one
        entry in C{stride}.
    """

    def __init__(self, max_entries: int = 65536, stride: int = 16) -> None:
        self.max_entries = max_entries
        self.stride = stride
        self._seqs: list[int] = []
        self._infos: list[BatchInfo] = []

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, info: BatchInfo) -> None:
        seqs = self._seqs
        if not seqs or info.seq > seqs[-1]:
            seqs.append(info.seq)
            self._infos.append(info)
        else:
            i = bisect.bisect_left(seqs, info.seq)
            if i < len(seqs) and seqs[i] == info.seq:
                return
            seqs.insert(i, info.seq)
            self._infos.insert(i, info)
        if len(seqs) > self.max_entries:
            self._thin()

    def _thin(self) -> None:
        half = len(self._seqs) // 2
        keep = [info for i, info in enumerate(self._infos[:half]) if i % self.stride == 0]
        self._infos = keep + self._infos[half:]
        self._seqs = [info.seq for info in self._infos]

    def forget_before(self, seq: int) -> None:
        """Drop what is known of messages below C{seq} (purged)."""
        i = bisect.bisect_left(self._seqs, seq)
        del self._seqs[:i]
        del self._infos[:i]

    def get(self, seq: int) -> BatchInfo | None:
        i = bisect.bisect_left(self._seqs, seq)
        if i < len(self._seqs) and self._seqs[i] == seq:
            return self._infos[i]
        return None

    def after(self, info: BatchInfo) -> BatchInfo | None:
        """The known message right after C{info} (C{seq + 1}), or None."""
        i = bisect.bisect_right(self._seqs, info.seq)
        if i < len(self._seqs) and self._seqs[i] == info.seq + 1:
            return self._infos[i]
        return None

    def bounds(self, key: str, target: int) -> tuple[BatchInfo | None, BatchInfo | None]:
        """
        Where the first message whose C{key} end is above C{target} is.

        @param key: C{"position"} or C{"offset"}.
        @return: (below, above): the last known message whose end is at or
            below C{target} and the first known one whose end is above it
            (each None when unknown).  When C{above.seq == below.seq + 1},
            or C{above} holds C{target} itself, C{above} is the answer.
        """
        infos = self._infos
        attr = "end_position" if key == "position" else "end_offset"
        lo, hi = 0, len(infos)
        while lo < hi:  # first index whose end is above the target
            mid = (lo + hi) // 2
            end: int = getattr(infos[mid], attr)
            if end > target:
                hi = mid
            else:
                lo = mid + 1
        below = infos[lo - 1] if lo > 0 else None
        above = infos[lo] if lo < len(infos) else None
        return below, above


def holds(info: BatchInfo, key: str, target: int) -> bool:
    """Whether message C{info} holds position (or payload byte) C{target}."""
    if key == "position":
        return info.count > 0 and info.position <= target < info.end_position
    return info.nbytes > 0 and info.offset <= target < info.end_offset


class BodyCache:
    """
    Decoded message bodies (lengths and payloads) of every log of a store,
    least recently used first out, bounded in bytes.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        # (log id, seq) -> [lengths, data, offsets or None]
        self._entries: OrderedDict[tuple[int, int], BodyEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[int, int]) -> BodyEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple[int, int], lengths: array[int], data: BytesLike) -> BodyEntry:
        if key in self._entries:
            return self._entries[key]
        size = len(data) + 4 * len(lengths) + 64
        if size > self.max_bytes:
            return [lengths, data, None]
        entry = [lengths, data, None]
        self._entries[key] = entry
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, (lens, d, _offs) = self._entries.popitem(last=False)
            self.nbytes -= len(d) + 4 * len(lens) + 64
        return entry

    def drop_log(self, log_id: int) -> None:
        for key in [k for k in self._entries if k[0] == log_id]:
            lens, d, _offs = self._entries.pop(key)
            self.nbytes -= len(d) + 4 * len(lens) + 64
