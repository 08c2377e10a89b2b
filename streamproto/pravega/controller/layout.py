"""
The pure segment layout of a Pravega stream: segment names and ids, the
L{Layout} of a stream's segments through its epochs (scaling, truncation
and stream-cut arithmetic, with no I/O), and the choice of a retention cut.

Creating a stream with I{n} segments creates C{scope/stream/K.#epoch.0}
(K < n, equal key ranges).  A segment id is C{creation epoch << 32 |
number}, as the clients compute it.
"""

import json

#: Most segments a stream may have at once, and most epochs (scales) it may go through.
MAX_SEGMENTS = 1024
MAX_EPOCHS = 100_000
#: Key ranges closer than this are the same boundary (they travel as doubles).
KEY_EPSILON = 1e-9


def retention_policy(config):
    """
    C{("SIZE" or "TIME", retentionParam)} from a stream configuration dict
    (as createStream/updateStream recorded it), or None without a policy.
    """
    policy = (config or {}).get("retentionPolicy") or {}
    kind = policy.get("retentionType")
    try:
        param = int(policy.get("retentionParam", 0))
    except (TypeError, ValueError):
        return None
    if kind not in ("SIZE", "TIME") or param < 0:
        return None
    return kind, param


def choose_retention_cut(kind, param, records, now_ms, retained):
    """
    The retention record to truncate at, as Pravega's controller picks it
    when no subscriber bounds truncation: of the recorded stream cuts that
    keep at least C{param} (bytes after the cut for SIZE, milliseconds
    since it was recorded for TIME), the one keeping least; None if none
    does.

    @param records: [{"t": recording time ms, "epoch": e, "cut": {..}}],
        oldest first.
    @param retained: callable(record) -> bytes of the stream after it.
    """
    best = best_kept = None
    for record in records:
        kept = now_ms - record["t"] if kind == "TIME" else retained(record)
        if kept >= param and (best_kept is None or kept < best_kept):
            best, best_kept = record, kept
    return best


def segment_name(scope, stream, number, epoch=0):
    return f"{scope}/{stream}/{number}.#epoch.{epoch}"


def segment_id(number, epoch):
    return (epoch << 32) | number


def name_of(scope, stream, seg_id):
    """The segment-store name of segment id C{seg_id}."""
    return segment_name(scope, stream, seg_id & 0xFFFFFFFF, seg_id >> 32)


def txn_segment_name(scope, stream, number, txn_id, epoch=0):
    return segment_name(scope, stream, number, epoch) + "#transaction." + txn_id


def txn_name_of(scope, stream, seg_id, txn_id):
    return name_of(scope, stream, seg_id) + "#transaction." + txn_id


def valid_name(name):
    # Pravega names: letters, digits, '-' and '.'; '_' leads internal names
    return bool(name) and len(name) <= 255 and all(c.isalnum() or c in "-._" for c in name)


class Layout:
    """
    The segments of one stream through its epochs, as a JSON-able dict:
    C{epoch} (current), C{next} (next segment number), C{segments} (id ->
    [min key, max key, creation epoch, sealing epoch or -1]), C{epochs}
    (active ids of every epoch), C{head} (the truncation cut, id -> offset),
    C{deleted} (ids truncated away), C{config} (the stream configuration as
    the client gave it) and, while one is under way, C{scaling} or
    C{truncating}.
    """

    def __init__(self, doc):
        self.doc = doc

    @classmethod
    def new(cls, count):
        segments = {str(n): [n / count, 1.0 if n == count - 1 else (n + 1) / count, 0, -1]
                    for n in range(count)}
        return cls({"epoch": 0, "next": count, "segments": segments,
                    "epochs": [list(range(count))], "deleted": []})

    @property
    def epoch(self):
        return self.doc["epoch"]

    def active(self, epoch=None):
        """[(id, min, max)] of the active segments of C{epoch} (default: current)."""
        epoch = self.epoch if epoch is None else epoch
        if not 0 <= epoch < len(self.doc["epochs"]):
            return []
        return [self.segment(i) for i in self.doc["epochs"][epoch]]

    def segment(self, seg_id):
        lo, hi, _, _ = self.doc["segments"][str(seg_id)]
        return seg_id, lo, hi

    def known(self, seg_id):
        return str(seg_id) in self.doc["segments"] and seg_id not in self.doc["deleted"]

    def created(self, seg_id):
        return self.doc["segments"][str(seg_id)][2]

    def sealed_at(self, seg_id):
        """The epoch whose scale sealed C{seg_id}, or None while it is active."""
        e = self.doc["segments"][str(seg_id)][3]
        return None if e < 0 else e

    def all_ids(self):
        return [int(i) for i in self.doc["segments"]]

    def successors(self, seg_id):
        """[(id, min, max, [predecessor ids])] of the segments that replaced C{seg_id}."""
        sealed = self.sealed_at(seg_id)
        if sealed is None:
            return []
        _, lo, hi = self.segment(seg_id)
        out = []
        for i in self.doc["epochs"][sealed]:
            _, a, b = self.segment(i)
            if self.created(i) == sealed and _overlap(lo, hi, a, b):
                preds = [p for p in self.all_ids() if self.sealed_at(p) == sealed
                         and _overlap(a, b, *self.segment(p)[1:])]
                out.append((i, a, b, sorted(preds)))
        return out

    def head(self):
        """{id: offset} where the stream starts (its truncation cut, or epoch 0)."""
        if "head" in self.doc:
            return {int(k): v for k, v in self.doc["head"].items()}
        return {i: 0 for i in self.doc["epochs"][0]}

    # -- changes (pure: they return what to do, or an error status) -------
    def plan_scale(self, sealed, ranges):
        """
        @return: (None, new layout doc) or (reason, None): C{sealed} must be
            active, C{ranges} must cover their key ranges exactly.
        """
        active = {i for i, _, _ in self.active()}
        if not sealed or not set(sealed) <= active or len(set(sealed)) != len(sealed):
            return "segments to seal must be active segments of the stream", None
        if not ranges or any(not (0.0 <= a < b <= 1.0) for a, b in ranges):
            return "key ranges must satisfy 0 <= start < end <= 1", None
        if len(active) - len(sealed) + len(ranges) > MAX_SEGMENTS:
            return f"a stream has at most {MAX_SEGMENTS} segments", None
        if len(self.doc["epochs"]) >= MAX_EPOCHS:
            return f"a stream goes through at most {MAX_EPOCHS} epochs", None
        old = _merge_intervals([self.segment(i)[1:] for i in sealed])
        new = sorted(ranges)
        if any(nxt[0] < prev[1] - KEY_EPSILON for prev, nxt in zip(new, new[1:])):
            return "new key ranges overlap", None
        # no overlaps: equal unions mean no gaps and nothing outside
        if _merge_intervals(new) != old:
            return "new key ranges must cover the sealed segments' ranges exactly", None
        doc = json.loads(json.dumps(self.doc))
        epoch = doc["epoch"] + 1
        ids = []
        for a, b in new:
            i = segment_id(doc["next"], epoch)
            doc["next"] += 1
            doc["segments"][str(i)] = [a, b, epoch, -1]
            ids.append(i)
        for i in sealed:
            doc["segments"][str(i)][3] = epoch
        survivors = [i for i in doc["epochs"][-1] if i not in sealed]
        doc["epochs"].append(sorted(survivors + ids, key=lambda i: doc["segments"][str(i)][0]))
        doc["epoch"] = epoch
        return None, doc

    def cut_problem(self, cut, include_deleted=False):
        """
        Why C{cut} ({id: offset}) is not a consistent stream cut, or None:
        its segments must exist (C{include_deleted}: or have been truncated
        away), tile the key space once, and every other segment must lie
        wholly before or wholly after it, as at some point in the stream's
        history.  Offsets must be 0 or more.
        """
        def exists(i):
            return str(i) in self.doc["segments"] and (include_deleted or self.known(i))
        if not cut or any(not exists(i) for i in cut) or any(o < 0 for o in cut.values()):
            return "the cut names unknown or deleted segments, or negative offsets"
        if _merge_intervals([self.segment(i)[1:] for i in cut]) != [(0.0, 1.0)] or \
                _total_length([self.segment(i)[1:] for i in cut]) > 1.0 + KEY_EPSILON:
            return "the cut's segments must cover the key space once"
        for s in self.all_ids():
            if s in cut or not exists(s):
                continue
            sides = {self.side(s, c) for c in cut if _overlap(*self.segment(s)[1:],
                                                               *self.segment(c)[1:])}
            if "across" in sides or len(sides) > 1:
                return f"segment {s} is neither before nor after the cut"
        return None

    def side(self, s, c):
        """Where segment C{s} lies from segment C{c} (overlapping keys): "before", "after", "across"."""
        s_sealed, c_sealed = self.sealed_at(s), self.sealed_at(c)
        if s_sealed is not None and s_sealed <= self.created(c):
            return "before"
        if c_sealed is not None and c_sealed <= self.created(s):
            return "after"
        return "across"

    def _overlapping(self, s, cut):
        _, lo, hi = self.segment(s)
        return [c for c in cut if _overlap(lo, hi, *self.segment(c)[1:])]

    def plan_truncation(self, cut):
        """
        @param cut: {id: offset}.
        @return: (None, [ids before the cut]) or (reason, None).  The cut
            must be a consistent stream cut (L{cut_problem}) of segments
            not yet truncated away, and not behind the stream's head.
        """
        reason = self.cut_problem(cut)
        if reason:
            return reason, None
        before = [s for s in self.all_ids() if s not in cut and self.known(s)
                  and self.side(s, self._overlapping(s, cut)[0]) == "before"]
        head = self.head()
        for c, offset in cut.items():
            if c in head and offset < head[c]:
                return f"the cut is before the stream's head in segment {c}", None
        for h in head:
            if h in before:
                continue
            if any(self.sealed_at(c) is not None and self.sealed_at(c) <= self.created(h)
                   and _overlap(*self.segment(c)[1:], *self.segment(h)[1:]) for c in cut):
                return "the cut is before the stream's head", None
        return None, sorted(before)

    def between(self, start, end):
        """
        The segments from stream cut C{start} to stream cut C{end} (both
        included), not counting those truncated away.

        @param start: {id: offset}, or None for the stream's head.
        @param end: {id: offset}, or None for the current (tail) segments.
        @return: (None, [ids]) or (reason, None): both must be consistent
            cuts, C{start} not after C{end}.
        """
        start = self.head() if not start else start
        end = {i: 0 for i, _, _ in self.active()} if not end else end
        for name, cut in (("from", start), ("to", end)):
            reason = self.cut_problem(cut, include_deleted=True)
            if reason:
                return f"{name}: {reason}", None
        for t, offset in end.items():
            for f in self._overlapping(t, start):
                if (f == t and offset < start[f]) or (f != t and self.side(t, f) == "before"):
                    return "the 'from' cut is after the 'to' cut", None
        out = []
        for s in self.all_ids():
            if not self.known(s):
                continue
            after_start = all(f == s or self.side(s, f) == "after"
                              for f in self._overlapping(s, start))
            before_end = all(t == s or self.side(s, t) == "before"
                             for t in self._overlapping(s, end))
            if after_start and before_end:
                out.append(s)
        return None, sorted(out)

    def retained_bytes(self, cut_epoch, cut, lengths):
        """
        Bytes of the stream after C{cut}, the active segments of epoch
        C{cut_epoch} at offsets {id: offset}: the rest of those segments and
        every segment created after that epoch.

        @param lengths: {id: current length} of those segments.
        """
        total = 0
        for s in self.all_ids():
            if not self.known(s):
                continue
            if s in cut:
                total += max(0, lengths.get(s, 0) - cut[s])
            elif self.created(s) > cut_epoch:
                total += lengths.get(s, 0)
        return total


def _overlap(a, b, c, d):
    return a < d - KEY_EPSILON and c < b - KEY_EPSILON


def _merge_intervals(ranges):
    """Sorted, joined intervals (boundaries within KEY_EPSILON meet)."""
    out = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + KEY_EPSILON:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return [(round(a, 9), round(b, 9)) for a, b in out]


def _total_length(ranges):
    return sum(b - a for a, b in ranges)

