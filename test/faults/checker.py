"""
The independent checker of the fault harness: histories in, a verdict out.

Sans-IO on purpose: it never talks to a server.  A workload records one
L{Op} per operation a client invoked (who, which unique payload, when it
was invoked and completed, and whether the outcome was C{ok}, C{failed} or
C{unknown}); after the faults, the harness reads the final state by another
path (a fresh process, or the store's files directly) and hands the records
it found, in log order, to L{check}.  The checker judges the pair against
the protocol's L{Promise} and counts every anomaly by kind, with a few
examples of each, so that a run's table row and a planted-anomaly test read
the same numbers.

Payloads are self-identifying (L{encode}: C{producer:seq:crc32:padding}),
so a record read back names the operation that wrote it, and a record that
no operation wrote (a torn tail, a zeroed page, bytes from another record)
is caught by its checksum or by the absence of its operation.
"""

import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

OK = "ok"
FAILED = "failed"
UNKNOWN = "unknown"

#: Anomaly kinds: each is a broken promise, counted in L{Verdict.anomalies}.
LOST = "lost"                      # acknowledged, absent from the final state
DUPLICATE = "duplicate"            # present more often than the promise allows
REORDERED = "reordered"            # out of its producer's order
CORRUPT = "corrupt"                # bytes that do not decode or fail their checksum
PHANTOM = "phantom"                # well-formed, but no operation ever wrote it
FAILED_PRESENT = "failed-present"  # a definite refusal whose record is there anyway
PARTIAL = "partial"                # a transaction's records not all there the same number of times
KINDS = (LOST, DUPLICATE, REORDERED, CORRUPT, PHANTOM, FAILED_PRESENT, PARTIAL)

#: separates a producer's name from a record's part number in a transaction
PART = "~"

#: How many examples of each kind a verdict keeps.
EXAMPLES = 5


def encode(producer, seq, size=64):
    """
    The payload of operation C{seq} of C{producer}: C{producer:seq:crc:pad},
    padded with a seq-derived filler to C{size} bytes, where the crc32
    covers everything else, so that any changed byte is detected.
    """
    head = f"{producer}:{seq}:".encode()
    fill = max(0, size - len(head) - 9)
    pad = (b"%08x" % (seq * 2654435761 & 0xFFFFFFFF) * (fill // 8 + 1))[:fill]
    crc = zlib.crc32(head + pad)
    return head + b"%08x:" % crc + pad


def decode(record):
    """
    C{(producer, seq)} of a payload made by L{encode}, or C{None} when the
    bytes are not such a payload (wrong shape or checksum).
    """
    try:
        producer, seq, crc, pad = bytes(record).split(b":", 3)
        seq_n = int(seq)
        if (len(crc) != 8 or zlib.crc32(producer + b":" + seq + b":" + pad)
                != int(crc, 16)):
            return None
        return producer.decode(), seq_n
    except ValueError:
        return None


def encode_part(producer, seq, part, size=64):
    """
    Record C{part} of transaction C{seq} of C{producer} (an operation of
    several records: L{Promise.parts}); decoded as C{(producer~part, seq)}.
    """
    return encode(f"{producer}{PART}{part}", seq, size)


def split_part(key):
    """C{(producer, seq), part} of a decoded key (part 0 for a one-record operation)."""
    producer, seq = key
    name, sep, part = producer.rpartition(PART)
    if sep and part.isdigit():
        return (name, seq), int(part)
    return key, 0


@dataclass(frozen=True)
class Op:
    """
    One operation of a history: producer C{process} wrote its C{seq}-th
    payload (unique per producer; a retry of the same payload reuses the
    seq), invoked at C{invoke} and completed at C{complete} (seconds, any
    monotonic clock; C{None} while it never completed) with C{outcome}
    C{ok} (acknowledged), C{failed} (a definite refusal: the server said it
    did not write it) or C{unknown} (timeout, reset, crash: it may or may
    not have been written).
    """

    process: str
    seq: int
    invoke: float
    complete: float | None
    outcome: str

    def key(self):
        return (self.process, self.seq)


@dataclass(frozen=True)
class Promise:
    """
    What a protocol promises about one history.

    @ivar at_most_once: a payload invoked once is stored at most once (the
        protocol deduplicates, or the client never resends); without it
        duplicates are allowed (at least once) and only counted apart.
    @ivar order: C{"realtime"}: a producer's record acknowledged before
        another of its records was invoked comes first in the log;
        C{"invocation"}: a producer's records are in the order it invoked
        them (one ordered connection, pipelined); C{None}: no order promise.
    @ivar parts: records per operation (a transaction of L{encode_part}
        records, atomic): every copy of it is whole, or it is I{partial}.
    """

    at_most_once: bool = True
    order: str | None = "realtime"
    parts: int = 1


@dataclass
class Verdict:
    """The checker's judgement: counts, anomalies by kind, examples of each."""

    ops: int = 0
    acknowledged: int = 0
    failed: int = 0
    unknown: int = 0
    unknown_present: int = 0
    unknown_absent: int = 0
    records_read: int = 0
    allowed_duplicates: int = 0
    longest_unavailability: float = 0.0
    anomalies: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=lambda: defaultdict(list))

    @property
    def valid(self):
        return not any(self.anomalies[k] for k in KINDS)

    def note(self, kind, example):
        self.anomalies[kind] += 1
        if len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append(example)

    def summary(self):
        """One line: the counts a table row shows."""
        bad = ", ".join(f"{k} {self.anomalies[k]}" for k in KINDS if self.anomalies[k])
        return (f"{'VALID' if self.valid else 'INVALID'}: {self.ops} ops, "
                f"{self.acknowledged} acknowledged, {self.failed} failed, "
                f"{self.unknown} unknown ({self.unknown_present} present), "
                f"{self.records_read} records read, "
                f"{self.allowed_duplicates} allowed duplicates, longest "
                f"unavailability {self.longest_unavailability:.2f} s"
                + (f"; {bad}" if bad else ""))

    def describe(self):
        """The summary and the examples of each anomaly, for a failure message."""
        lines = [self.summary()]
        for kind in KINDS:
            for example in self.examples.get(kind, ()):
                lines.append(f"  {kind}: {example}")
        return "\n".join(lines)


def longest_gap(history, start=None, end=None):
    """
    The longest stretch of the run in which no operation was acknowledged:
    between the start of the history, each acknowledgement and its end.
    """
    times = [op.invoke for op in history] + [op.complete for op in history
                                             if op.complete is not None]
    if not times:
        return 0.0
    start = min(times) if start is None else start
    end = max(times) if end is None else end
    acks = sorted(op.complete for op in history if op.outcome == OK)
    edges = [start] + [t for t in acks if start <= t <= end] + [end]
    return max(b - a for a, b in zip(edges, edges[1:]))


def check(history, records, promise=Promise(), decoder=decode, start=None, end=None):
    """
    Judge C{history} (L{Op}s) against C{records}, the final state read back
    in log order (bytes each), under C{promise}; return a L{Verdict}.

    A payload invoked more than once (a retry) may be present once per
    invocation even under at-most-once: the client wrote it that often.
    """
    verdict = Verdict(ops=len(history))
    ops = {}
    invocations = Counter()
    for op in history:
        invocations[op.key()] += 1
        # the op that counts for a payload: an acknowledged one over an
        # unknown one over a failed one (a retry may succeed after a timeout)
        best = ops.get(op.key())
        if best is None or _rank(op) > _rank(best):
            ops[op.key()] = op
        if op.outcome == OK:
            verdict.acknowledged += 1
        elif op.outcome == FAILED:
            verdict.failed += 1
        else:
            verdict.unknown += 1

    seen = Counter()
    parts = defaultdict(Counter)   # transactions: copies of each part, per operation
    last_invoke = {}   # realtime order: latest invocation seen, per producer
    last_seq = {}      # invocation order: highest seq seen, per producer
    for position, record in enumerate(records):
        verdict.records_read += 1
        key = decoder(record)
        if key is None:
            verdict.note(CORRUPT, f"position {position}: {bytes(record)[:80]!r}")
            continue
        part = 0
        if promise.parts > 1:
            key, part = split_part(key)
            if part >= promise.parts:
                verdict.note(PHANTOM, f"position {position}: part {part} of {key}")
                continue
        op = ops.get(key)
        if op is None:
            verdict.note(PHANTOM, f"position {position}: {key} was never written")
            continue
        if promise.parts > 1:
            parts[key][part] += 1
            if part:
                continue        # copies, order: judged on each transaction's first record
        seen[key] += 1
        if seen[key] > 1:
            if promise.at_most_once and seen[key] > invocations[key]:
                verdict.note(DUPLICATE, f"position {position}: {key} copy #{seen[key]}, "
                                        f"invoked {invocations[key]}x")
            else:
                verdict.allowed_duplicates += 1
            continue   # order is judged on first copies
        producer = op.process
        if promise.order == "realtime":
            if op.complete is not None and op.outcome == OK \
                    and op.complete < last_invoke.get(producer, float("-inf")):
                verdict.note(REORDERED, f"position {position}: {key} acknowledged at "
                                        f"{op.complete:.3f}, after a record of "
                                        f"{producer} invoked at {last_invoke[producer]:.3f}")
            last_invoke[producer] = max(op.invoke, last_invoke.get(producer, op.invoke))
        elif promise.order == "invocation":
            if op.seq < last_seq.get(producer, -1):
                verdict.note(REORDERED, f"position {position}: {key} after seq "
                                        f"{last_seq[producer]} of {producer}")
            last_seq[producer] = max(op.seq, last_seq.get(producer, op.seq))

    for key, copies in sorted(parts.items()):
        counts = [copies[i] for i in range(promise.parts)]
        if len(set(counts)) > 1:
            verdict.note(PARTIAL, f"{key}: copies of each of its {promise.parts} records "
                                  f"{counts}")
    for key, op in sorted(ops.items()):
        present = seen[key] > 0
        if promise.parts > 1:
            present = min(parts[key][i] for i in range(promise.parts)) > 0
        if op.outcome == OK and not present:
            verdict.note(LOST, f"{key} acknowledged at {op.complete:.3f}, absent")
        elif op.outcome == UNKNOWN:
            if present:
                verdict.unknown_present += 1
            else:
                verdict.unknown_absent += 1
        elif op.outcome == FAILED and present:
            verdict.note(FAILED_PRESENT, f"{key} refused at {op.complete}, present")
    verdict.longest_unavailability = longest_gap(history, start, end)
    return verdict


def _rank(op):
    return {OK: 2, UNKNOWN: 1, FAILED: 0}[op.outcome]
