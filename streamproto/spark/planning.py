"""
Offsets and partition planning, as pure functions.

An offset is a JSON object C{{log name: position}}: the position of the next
record to read in each log (reading several styx-servers, the keys are
C{"host:port/log"}: one log name on several servers is one stream per node).  A micro-batch is the half-open range
C{[start[log], end[log])} of every log.  Everything here depends only on its
arguments, so a restarted query that replays a batch from the offset log
plans exactly the same partitions and reads exactly the same records.
"""

from dataclasses import dataclass


def node_key(node, log):
    """The offset key of log C{log} on node C{node} (several styx-servers)."""
    return f"{node}/{log}"


def split_key(key):
    """C{(node, log)} of an offset key; node None for a plain log name."""
    node, _, log = key.rpartition("/")
    return (node or None), log


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


def select_logs(bounds, pattern):
    """The logs of C{bounds} whose name matches C{pattern} (whole name), all without one."""
    if pattern is None:
        return bounds
    import re
    compiled = re.compile(pattern)
    return {key: b for key, b in bounds.items() if compiled.fullmatch(split_key(key)[1])}


def _named(spec, bounds, option):
    unknown = sorted(set(spec) - set(bounds))
    if unknown:
        raise OffsetError(f"option {option!r} names {', '.join(map(repr, unknown))}, not among "
                          f"the logs read ({', '.join(sorted(bounds)) or 'none'})")


def _positions(spec, bounds, option, unnamed):
    """
    The position in each log that C{spec} (C{{key: position | -2 | -1}},
    for the C{option} named) names: -2 its first, -1 its last; a log not
    named gets C{unnamed}.
    """
    _named(spec, bounds, option)
    positions = {}
    for key, (first, last) in bounds.items():
        position = spec.get(key, unnamed)
        if position == -2:
            position = first
        elif position == -1:
            position = last
        elif position > last:
            raise OffsetError(f"{option}: log {key!r} ends at {last}, before {position}")
        positions[key] = position
    return positions


def resolve_start(spec, bounds, batch):
    """
    Where a query starts in each log, from C{startingOffsets}.

    @param spec: C{"earliest"}, C{"latest"} or C{{key: position | -2 | -1}}
        (logs not named start at their beginning).
    @param bounds: C{{key: (start, end)}} of the logs read.
    @param batch: a batch query (where, as in Kafka, "latest" is refused: it
        would read nothing).
    """
    if spec == "latest" or (isinstance(spec, dict) and -1 in spec.values()):
        if batch:
            raise OffsetError("startingOffsets: latest (or -1) is not allowed in a batch "
                              "query: it would read nothing")
    if spec in ("earliest", None):
        return {key: b[0] for key, b in bounds.items()}
    if spec == "latest":
        return {key: b[1] for key, b in bounds.items()}
    return _positions(spec, bounds, "startingOffsets", -2)


def resolve_end(spec, bounds):
    """Where a batch query ends in each log, from C{endingOffsets} (exclusive)."""
    if spec in ("latest", None):
        return {key: b[1] for key, b in bounds.items()}
    if spec == "earliest" or (isinstance(spec, dict) and -2 in spec.values()):
        raise OffsetError("endingOffsets: earliest (or -2) is not allowed: it would read "
                          "nothing")
    return _positions(spec, bounds, "endingOffsets", -1)
