"""
A Pravega writer's events as the segment store takes them, sans I/O:
events framed (L{event_frames}), queued as chunks the acknowledgements
shorten from the front (L{EventChunk}), and packed into AppendBlock /
AppendBlockEnd pairs or ConditionalAppends (L{pack_blocks}).  The writer
(L{streamproto.pravega.client.SegmentWriter}) does the I/O.
"""

import bisect
import operator
import struct
from itertools import accumulate, repeat

from streamproto.pravega import codec

__all__ = ["MAX_EVENT_SIZE", "EventChunk", "event_frames", "pack_blocks"]

_EVENT_HEADER = struct.Struct(">ii").pack
_LENGTH_AS_HEADER = struct.Struct(">q").pack
#: The reference's largest event.
MAX_EVENT_SIZE = 8 * 1024 * 1024


def event_frames(events):
    """
    C{events} (bytes-like) as Event frames back to back.

    @return: C{(data, ends)}: the frames, and the end offset of each in
        C{data} (a C{range} when every event has the same size).
    @raise ValueError: for an event larger than L{MAX_EVENT_SIZE}.
    """
    lens = list(map(len, events))
    if max(lens) > MAX_EVENT_SIZE:
        raise ValueError(f"event of {max(lens)} bytes exceeds {MAX_EVENT_SIZE}")
    if len(events) == 1:
        data = _EVENT_HEADER(0, lens[0]) + events[0]
        return data, [len(data)]
    # Event header = int32 0 + int32 length = one int64 equal to the
    # length: build headers and frames with C-level map/join only
    n = len(events)
    parts = [None] * (2 * n)
    parts[1::2] = events
    size = lens[0]
    if lens.count(size) == n:
        # all events the same size (the common case): one header, and the
        # frame ends are a range (indexable, bisectable)
        parts[::2] = [_LENGTH_AS_HEADER(size)] * n
        step = size + codec.HEADER_SIZE
        ends = range(step, step * n + 1, step)
    else:
        parts[::2] = map(_LENGTH_AS_HEADER, lens)
        ends = list(accumulate(map(operator.add, lens, repeat(codec.HEADER_SIZE))))
    return b"".join(parts), ends


class EventChunk:
    """
    Events queued together (one write or one write_batch): C{data} is their
    Event frames back to back, C{ends} the end offset of each frame in
    C{data}.  Acknowledged events at the front are skipped by moving
    C{start} (the index of the first unacknowledged event) and C{base} (its
    offset), never by copying.
    """

    __slots__ = ("data", "ends", "start", "base", "last", "deferred", "expected_offset")

    def __init__(self, data, ends, deferred, expected_offset=None):
        self.data = data
        self.ends = ends
        self.start = 0
        self.base = 0
        self.last = None
        self.deferred = deferred
        self.expected_offset = expected_offset

    @property
    def count(self):
        return len(self.ends) - self.start

    @property
    def size(self):
        return len(self.data) - self.base

    @property
    def first(self):
        return self.last - self.count + 1

    def drop_first(self, k):
        """Forget the first C{k} events (acknowledged)."""
        self.start += k
        self.base = self.ends[self.start - 1]


def pack_blocks(chunks, writer_id, request_id, block_size):
    """
    Sans-IO: the frames that send numbered C{chunks} (a list of L{EventChunk})
    as AppendBlock / AppendBlockEnd pairs of C{block_size} bytes of events,
    and conditional chunks as ConditionalAppend.

    An event crossing a block end is split as the reference does: its head
    fills the block as a PartialEvent frame, its tail is the AppendBlockEnd's
    data.  The last block is cut to what it holds.

    @return: a list of bytes-like parts to concatenate.
    """
    out = []
    wid = writer_id
    B = block_size
    parts, whole, events, last = [], 0, 0, None

    def end_block(partial=None, tail=b""):
        block_len = whole + (codec.HEADER_SIZE + len(partial) if partial is not None else 0)
        out.append(codec.encode_append_block_header(wid, block_len))
        out.extend(parts)
        if partial is not None:
            out.append(codec.pack_header(codec.PARTIAL_EVENT, len(partial)))
            out.append(partial)
        out.append(codec.encode(codec.AppendBlockEnd(wid, whole, bytes(tail), events, last,
                                                     request_id)))

    for chunk in chunks:
        if chunk.expected_offset is not None:
            if parts:
                end_block()
                parts, whole, events = [], 0, 0
            payload = memoryview(chunk.data)[chunk.base + codec.HEADER_SIZE:]
            out.append(codec.encode(codec.ConditionalAppend(
                wid, chunk.last, chunk.expected_offset, bytes(payload), request_id)))
            continue
        data = memoryview(chunk.data)
        ends = chunk.ends
        first = chunk.last - len(ends) + 1      # number of the event at index 0
        off, index, n = chunk.base, chunk.start, len(data)
        while off < n:
            room = B - whole
            if n - off <= room:
                parts.append(data[off:])
                whole += n - off
                events += len(ends) - index
                last = chunk.last
                off = n
                if whole == B:
                    end_block()
                    parts, whole, events = [], 0, 0
                break
            cut = off + room
            k = bisect.bisect_right(ends, cut, index)
            boundary = ends[k - 1] if k > index else off
            if boundary > off:
                parts.append(data[off:boundary])
                whole += boundary - off
            events += k - index
            if boundary == cut:
                last = first + k - 1
                end_block()
                off, index = cut, k
            else:
                # event k crosses the block end: head in the block, tail after it
                events += 1
                last = first + k
                end_block(data[boundary:cut], data[cut:ends[k]])
                off, index = ends[k], k + 1
            parts, whole, events = [], 0, 0
    if parts:
        end_block()
    return out
