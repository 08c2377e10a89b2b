"""
Offsets and partition planning, as pure functions.

An offset is a JSON object C{{log name: position}}: the position of the next
record to read in each log.  A micro-batch is the half-open range
C{[start[log], end[log])} of every log.  Everything here depends only on its
arguments, so a restarted query that replays a batch from the offset log
plans exactly the same partitions and reads exactly the same records.
"""

from dataclasses import dataclass


class OffsetError(ValueError):
    """An offset that is not a C{{log: position}} mapping of non-negative integers."""


@dataclass(frozen=True)
class LogRange:
    """The records C{[start, end)} of one log."""

    log: str
    start: int
    end: int

    def __len__(self):
        return self.end - self.start


def check_offset(offset):
    """
    @return: C{offset} as a plain dict str -> int.
    @raise OffsetError: if it is not one.
    """
    if not isinstance(offset, dict):
        raise OffsetError(f"an offset must be a JSON object log -> position, not {offset!r}")
    checked = {}
    for log, position in offset.items():
        if not isinstance(log, str) or isinstance(position, bool) or not isinstance(position, int) \
                or position < 0:
            raise OffsetError(f"bad offset entry {log!r}: {position!r}")
        checked[log] = position
    return checked


def ranges_between(start, end):
    """
    The non-empty per-log ranges of a micro-batch, sorted by log name.

    A log missing from C{start} (it appeared after the previous batch was
    planned) starts at position 0: positions are never reused, so 0 means
    "from its beginning" whatever happened since.
    """
    start = check_offset(start)
    end = check_offset(end)
    ranges = []
    for log in sorted(end):
        first = start.get(log, 0)
        last = end[log]
        if last < first:
            raise OffsetError(f"log {log!r}: end position {last} is before start {first}")
        if last > first:
            ranges.append(LogRange(log, first, last))
    return ranges


def split_ranges(ranges, max_records_per_partition, min_partitions=1):
    """
    Cut ranges into pieces of at most C{max_records_per_partition} records,
    and into at least C{min_partitions} pieces in all (when there are that
    many records), so that every executor core gets work.

    Pieces of one range have sizes that differ by at most one record, and the
    result only depends on the arguments (no clocks, no sizes on disk).
    """
    if max_records_per_partition < 1:
        raise ValueError("max_records_per_partition must be >= 1")
    ranges = [r for r in ranges if len(r)]
    total = sum(len(r) for r in ranges)
    if not total:
        return []
    # Largest piece that still gives min_partitions pieces overall.
    target = min(max_records_per_partition, max(1, -(-total // max(1, min_partitions))))
    pieces = []
    for r in ranges:
        count = -(-len(r) // target)
        base, extra = divmod(len(r), count)
        position = r.start
        for i in range(count):
            size = base + (1 if i < extra else 0)
            pieces.append(LogRange(r.log, position, position + size))
            position += size
        assert position == r.end
    return pieces


def limit_offset(start, available, max_records):
    """
    The end offset of the next micro-batch when at most C{max_records} may be
    read: each log gets a fair share of the budget (water filling: logs with
    less new data than their share leave the rest to the others).

    @param start: the batch's start offset.
    @param available: the latest offset (what is readable now).
    @param max_records: the budget, or None for no limit.
    """
    start = check_offset(start)
    available = check_offset(available)
    end = dict(start)
    pending = {}
    for log, last in available.items():
        first = start.get(log, 0)
        end[log] = max(first, end.get(log, first))
        if last > first:
            pending[log] = last - first
    if max_records is None:
        for log in pending:
            end[log] = available[log]
        return end
    budget = max_records
    # Smallest backlog first, ties by name: deterministic, and what a small log
    # cannot use flows to the big ones.
    order = sorted(pending, key=lambda log: (pending[log], log))
    for i, log in enumerate(order):
        share = budget // (len(order) - i)
        if share == 0 and budget > 0:
            share = 1  # a budget smaller than the number of logs still moves
        take = min(pending[log], share)
        end[log] = start.get(log, 0) + take
        budget -= take
    return end


def cap_offset(available, target):
    """
    C{available} with no log beyond C{target} (Trigger.AvailableNow's end);
    logs that appeared after the target was fixed are left out, so they are
    not read in this run (L{limit_offset} keeps every log of the start).
    """
    return {log: min(position, target[log]) for log, position in available.items()
            if log in target}


#: Kafka's position codes in C{startingOffsets} / C{endingOffsets} (also in
#: L{streamproto.spark.options}).
_EARLIEST, _LATEST = -2, -1


def starting_offset(spec, bounds):
    """
    Where a read starts in each log.

    @param spec: C{"earliest"}, C{"latest"} or C{{log: position | -2 | -1}}
        (the C{startingOffsets} option); a log it does not name starts at its
        earliest record.
    @param bounds: C{{log: (start_position, end_position)}} of the logs read.
    @raise OffsetError: for a position past the end of its log, or a log
        named by position that does not exist.
    """
    if spec in ("earliest", "latest"):
        index = 0 if spec == "earliest" else 1
        return {log: b[index] for log, b in sorted(bounds.items())}
    offset = {log: b[0] for log, b in sorted(bounds.items())}
    for log, position in spec.items():
        if log not in bounds:
            if position > 0:
                raise OffsetError(f"startingOffsets: log {log!r} does not exist")
            continue
        first, last = bounds[log]
        if position == _EARLIEST:
            position = first
        elif position == _LATEST:
            position = last
        elif position > last:
            raise OffsetError(f"startingOffsets: log {log!r} ends at {last}, before {position}")
        # Below the log's start (retention): read_range reports the data loss.
        offset[log] = position
    return offset


def ending_offset(spec, bounds, start):
    """
    Where a batch read ends (exclusive) in each log.

    @param spec: C{"latest"} or C{{log: position | -1}} (the C{endingOffsets}
        option); a log it does not name ends at its latest record.
    @param start: the L{starting_offset} of the same read.
    @raise OffsetError: for a position past the end of its log or before
        the read's start in that log.
    """
    end = {log: b[1] for log, b in sorted(bounds.items())}
    if spec == "latest":
        return end
    for log, position in spec.items():
        if log not in bounds:
            if position > 0:
                raise OffsetError(f"endingOffsets: log {log!r} does not exist")
            continue
        if position == _LATEST:
            continue
        if position > end[log]:
            raise OffsetError(f"endingOffsets: log {log!r} ends at {end[log]}, before {position}")
        if position < start.get(log, 0):
            raise OffsetError(f"endingOffsets: log {log!r} would end at {position}, before "
                              f"its start {start[log]}")
        end[log] = position
    return end
