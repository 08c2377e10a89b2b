"""
A single-node Pravega Controller: the gRPC C{ControllerService} clients ask
for scopes, streams, segments and segment-store addresses before they talk
to the segment store.

Streams and their segments
==========================
Creating a stream with I{n} segments creates C{scope/stream/K.#epoch.0}
(K < n, equal key ranges) on our segment store.  A segment id is
C{creation epoch << 32 | number}, as the clients compute it.  A manual
C{scale} seals some active segments and creates successors covering exactly
their key ranges, with the next segment numbers, in a new epoch; the
clients find them through C{getSegmentsImmediatelyFollowing}.
C{truncateStream} truncates the segments of a stream cut at its offsets and
deletes every segment before the cut; C{getSegments} then answers the cut as
the stream's head.  C{getSegmentsBetween} lists the segments between two
cuts and C{isStreamCutValid} checks one.  C{updateStream} records the
configuration (it does not scale: use C{scale}).  Retention policies (SIZE,
TIME) are enforced by periodic rounds (L{ControllerState.apply_retention})
that record stream cuts at the segments' tails and truncate at the newest
one the policy lets go, through the same durable path as C{truncateStream}.
C{getURI} answers every segment (also reader-group table segments) with
this server's segment-store address.  Auto-scaling, consumption-based
retention, reader-group and key-value-table RPCs are not implemented: gRPC
answers the RPCs UNIMPLEMENTED.

grpcio runs handlers on its own thread pool.  L{ControllerState} lives on
the reactor thread (it uses the log store); each handler hands its request
to it with C{blockingCallFromThread} and waits, so the reactor never blocks
and all store access stays on the reactor thread.

The state (scopes, stream layouts, transactions) is one JSON document; every
change appends the whole document to the log C{pravega-controller} and is
answered only once that append is durable.  Opening replays the last record
and finishes what a crash interrupted (a scale, a truncation, a commit).
"""

import json
import os
import uuid
from concurrent import futures

from twisted.application import service
from twisted.internet import defer, threads
from twisted.logger import Logger

from streamproto.core.compat import listening_port
from streamproto.core.ops import add_readiness_check

# gRPC's fork support (on by default in grpcio's core) re-creates its
# pollers in a forked child; a Twisted process that spawns a child
# (spawnProcess forks, closes every descriptor, then execs) then sees the
# child die on "epoll_wait error: Bad file descriptor" before its exec.
# Read when grpc is first imported (lazily, below); an explicit setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from streamproto.log.errors import AppendConflict  # noqa: E402
from streamproto.pravega.segments import (  # noqa: E402
    BadOffset, SegmentExists, SegmentNotFound, SegmentSealed,
)

SERVICE_NAME = "io.pravega.controller.stream.api.grpc.v1.ControllerService"

#: a change is tried this many times against other controllers' changes
MUTATION_ATTEMPTS = 5
STATE_LOG = "pravega-controller"
#: the C{server} label of the controller's denials in the metrics
SERVER_LABEL = "pravega-controller"
#: Transaction leases (milliseconds): used when a client asks for 0, and the most it may ask.
DEFAULT_LEASE_MS = 120_000
MAX_LEASE_MS = 24 * 3600 * 1000
#: Completed transactions remembered (for checkTransactionState).
MAX_COMPLETED_TXNS = 1000
#: Most segments a stream may have at once, and most epochs (scales) it may go through.
MAX_SEGMENTS = 1024
MAX_EPOCHS = 100_000
#: Key ranges closer than this are the same boundary (they travel as doubles).
KEY_EPSILON = 1e-9
#: Stream cuts remembered per stream for its retention policy; beyond this
#: every other one of the older half is forgotten (coarser, never unsafe).
MAX_RETENTION_CUTS = 128


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


def _valid_name(name):
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


class ControllerState:
    """
    Scopes, streams and transactions, on the reactor thread; every method
    returns a Deferred.  C{scopes} is scope -> {stream: {"segments": initial
    count, "sealed": bool}}; C{layouts} is "scope/stream" -> L{Layout} doc.
    """

    log = Logger()

    def __init__(self, store, segments, clock=None):
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        self.store = store
        self.segments = segments
        self.scopes = {}
        self.layouts = {}
        # transaction id (32 hex digits) -> {"scope", "stream", "state", "deadline", "segments"}
        self.txns = {}
        # "scope/stream" -> stream cuts recorded for its retention policy,
        # oldest first: [{"t": ms, "epoch": e, "cut": {"id": offset}}]
        self.retention = {}
        self._log = None
        #: the state log's end when the document in memory was read or written
        self._position = None
        self._lock = defer.DeferredLock()

    @defer.inlineCallbacks
    def open(self):
        """
        Read the state.  @raise ControllerStateDamaged: the last document
        does not parse: the controller must not carry on with an empty
        state (it would lose every scope and stream it knew).
        """
        self._log = yield self.store.get_or_create(STATE_LOG)
        yield self._load()
        self.log.info("controller state: {n} scopes, {t} transactions", n=len(self.scopes),
                      t=len(self.txns))
        # finish what a crash interrupted (every step is idempotent)
        for key, doc in list(self.layouts.items()):
            scope, _, stream = key.partition("/")
            if "scaling" in doc:
                yield self._mutate(self._finish_scale, scope, stream)
            if "truncating" in doc:
                yield self._mutate(self._finish_truncation, scope, stream)
        for txn_id, txn in list(self.txns.items()):
            if txn["state"] == "COMMITTING":
                yield self.commit_txn(txn["scope"], txn["stream"], txn_id)
            elif txn["state"] == "ABORTING":
                yield self.abort_txn(txn["scope"], txn["stream"], txn_id)

    @defer.inlineCallbacks
    def _load(self):
        """Read the newest document of the state log into memory."""
        log = self._log
        end = log.end_position
        scopes, txns, layouts, retention = {}, {}, {}, {}
        if end > log.start_position:
            position = end - 1
            batch = yield log.read(position, 1)
            try:
                state = json.loads(bytes(batch.records()[0]))
                scopes = state["scopes"]
                if not isinstance(scopes, dict):
                    raise TypeError("scopes is not an object")
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise ControllerStateDamaged(
                    f"controller state log {STATE_LOG!r}, record {position}: "
                    f"{type(e).__name__}: {e}")
            txns = state.get("txns", {})
            layouts = state.get("layouts", {})
            retention = state.get("retention", {})
        # documents written before streams could scale have no layouts
        for scope, streams in scopes.items():
            for stream, info in streams.items():
                layouts.setdefault(f"{scope}/{stream}", Layout.new(info["segments"]).doc)
        self.scopes, self.txns, self.layouts, self.retention = scopes, txns, layouts, retention
        self._position = end

    @defer.inlineCallbacks
    def _catch_up(self, force=False):
        """
        Take the document another controller on the same store (a second
        front-end on a JetStream store) wrote since ours: C{get} of an open
        log brings its tail up to date with the store's.
        """
        log = yield self.store.get(STATE_LOG)
        if log is not self._log:
            self._log = log
            force = True
        if force or log.end_position != self._position:
            yield self._load()

    def refresh(self):
        """
        Bring the state in memory up to date (between mutations, never
        during one).  @return: Deferred.
        """
        return self._lock.run(self._catch_up)

    def _save(self):
        record = json.dumps({"scopes": self.scopes, "txns": self.txns, "layouts": self.layouts,
                             "retention": self.retention}, sort_keys=True).encode()
        # written only right after the document it was derived from: two
        # controllers on one store never overwrite each other's change
        d = self._log.append([record], expected_position=self._position)

        def saved(r):
            self._position = r.end_position
            # keep only the newest document
            return self._log.truncate(r.first_position)
        return d.addCallback(saved)

    def _mutate(self, fn, *args):
        return self._lock.run(self._attempt, fn, *args)

    @defer.inlineCallbacks
    def _attempt(self, fn, *args):
        """
        Run a change on the newest document; when another controller wrote
        first (L{AppendConflict}), read its document and run the change again.
        """
        for attempt in range(MUTATION_ATTEMPTS):
            yield self._catch_up(force=attempt > 0)
            try:
                result = yield fn(*args)
            except AppendConflict:
                self.log.info("controller state changed by another controller: retrying")
                continue
            return result
        yield self._catch_up(force=True)
        raise AppendConflict(f"controller state: {MUTATION_ATTEMPTS} conflicting writers in "
                             "a row")

    def stream(self, scope, stream):
        return self.scopes.get(scope, {}).get(stream)

    def layout(self, scope, stream):
        """The L{Layout} of an existing stream, or None."""
        if self.stream(scope, stream) is None:
            return None
        return Layout(self.layouts[f"{scope}/{stream}"])

    # -- scopes ----------------------------------------------------------
    def create_scope(self, scope):
        """@return: Deferred firing with "SUCCESS", "SCOPE_EXISTS" or "INVALID_SCOPE_NAME"."""
        @defer.inlineCallbacks
        def create():
            if not _valid_name(scope):
                return "INVALID_SCOPE_NAME"
            if scope in self.scopes:
                return "SCOPE_EXISTS"
            self.scopes[scope] = {}
            yield self._save()
            self.log.info("created scope {scope}", scope=scope)
            return "SUCCESS"
        return self._mutate(create)

    def delete_scope(self, scope):
        @defer.inlineCallbacks
        def delete():
            if scope not in self.scopes:
                return "SCOPE_NOT_FOUND"
            if self.scopes[scope]:
                return "SCOPE_NOT_EMPTY"
            del self.scopes[scope]
            yield self._save()
            return "SUCCESS"
        return self._mutate(delete)

    # -- streams ---------------------------------------------------------
    def create_stream(self, scope, stream, count, config=None):
        """
        @param config: the stream configuration to remember (a JSON-able
            dict, answered by getStreamConfiguration), or None.
        """
        @defer.inlineCallbacks
        def create():
            if scope not in self.scopes:
                return "SCOPE_NOT_FOUND"
            if not _valid_name(stream) or count < 1 or count > MAX_SEGMENTS:
                return "INVALID_STREAM_NAME"
            if stream in self.scopes[scope]:
                return "STREAM_EXISTS"
            for n in range(count):
                try:
                    yield self.segments.create(segment_name(scope, stream, n))
                except SegmentExists:
                    pass   # left by an earlier attempt that failed half-way
            self.scopes[scope][stream] = {"segments": count, "sealed": False}
            doc = Layout.new(count).doc
            if config is not None:
                doc["config"] = config
            self.layouts[f"{scope}/{stream}"] = doc
            yield self._save()
            self.log.info("created stream {scope}/{stream} with {n} segments",
                          scope=scope, stream=stream, n=count)
            return "SUCCESS"
        return self._mutate(create)

    def update_stream(self, scope, stream, config):
        """Record a new configuration: "SUCCESS", "SCOPE_NOT_FOUND", "STREAM_NOT_FOUND" or "STREAM_SEALED"."""
        @defer.inlineCallbacks
        def update():
            if scope not in self.scopes:
                return "SCOPE_NOT_FOUND"
            info = self.stream(scope, stream)
            if info is None:
                return "STREAM_NOT_FOUND"
            if info["sealed"]:
                return "STREAM_SEALED"
            self.layouts[f"{scope}/{stream}"]["config"] = config
            yield self._save()
            self.log.info("updated the configuration of {scope}/{stream}", scope=scope,
                          stream=stream)
            return "SUCCESS"
        return self._mutate(update)

    def seal_stream(self, scope, stream):
        @defer.inlineCallbacks
        def seal():
            if scope not in self.scopes:
                return "SCOPE_NOT_FOUND"
            info = self.stream(scope, stream)
            if info is None:
                return "STREAM_NOT_FOUND"
            for seg_id, _, _ in self.layout(scope, stream).active():
                try:
                    seg = yield self.segments.get(name_of(scope, stream, seg_id))
                    yield seg.seal()
                except (SegmentSealed, SegmentNotFound):
                    pass
            if not info["sealed"]:
                info["sealed"] = True
                yield self._save()
            return "SUCCESS"
        return self._mutate(seal)

    def delete_stream(self, scope, stream):
        @defer.inlineCallbacks
        def delete():
            info = self.stream(scope, stream)
            if info is None:
                return "STREAM_NOT_FOUND"
            if not info["sealed"]:
                return "STREAM_NOT_SEALED"
            layout = self.layout(scope, stream)
            for seg_id in layout.all_ids():
                if not layout.known(seg_id):
                    continue
                try:
                    yield self.segments.delete(name_of(scope, stream, seg_id))
                except SegmentNotFound:
                    pass
            del self.scopes[scope][stream]
            del self.layouts[f"{scope}/{stream}"]
            self.retention.pop(f"{scope}/{stream}", None)
            yield self._save()
            return "SUCCESS"
        return self._mutate(delete)

    # -- scaling ---------------------------------------------------------
    def scale(self, scope, stream, sealed, ranges):
        """
        Seal the active segments C{sealed} (ids) and replace them with new
        segments over C{ranges} ([(start, end)]) in a new epoch.

        @return: Deferred firing with C{(status, reason, [(id, min, max)]
            of the new segments, the epoch the scale started from)}: status
            "STARTED" (done: scaling here is synchronous), "FAILURE" or
            "PRECONDITION_FAILED".
        """
        @defer.inlineCallbacks
        def scale():
            info = self.stream(scope, stream)
            if info is None:
                return "FAILURE", "no such stream", [], 0
            if info["sealed"]:
                return "PRECONDITION_FAILED", "the stream is sealed", [], 0
            if any(t["scope"] == scope and t["stream"] == stream
                   and t["state"] in ("OPEN", "COMMITTING", "ABORTING")
                   for t in self.txns.values()):
                # their segments belong to this epoch's segments
                return "PRECONDITION_FAILED", "the stream has open transactions", [], 0
            layout = self.layout(scope, stream)
            reason, doc = layout.plan_scale(list(sealed), [tuple(r) for r in ranges])
            if reason:
                return "PRECONDITION_FAILED", reason, [], layout.epoch
            old_epoch = layout.epoch
            # record the intent first: a crash half-way is finished on open
            self.layouts[f"{scope}/{stream}"]["scaling"] = {"sealed": list(sealed), "to": doc}
            yield self._save()
            new = yield self._finish_scale(scope, stream)
            self.log.info("scaled {scope}/{stream} to epoch {epoch}: sealed {sealed}, "
                          "created {created}", scope=scope, stream=stream,
                          epoch=old_epoch + 1, sealed=list(sealed), created=[n[0] for n in new])
            return "STARTED", "", new, old_epoch
        return self._mutate(scale)

    @defer.inlineCallbacks
    def _finish_scale(self, scope, stream):
        key = f"{scope}/{stream}"
        pending = self.layouts[key]["scaling"]
        target = Layout(pending["to"])
        created = [i for i in target.doc["epochs"][-1] if target.created(i) == target.epoch]
        # successors first: a writer that finds its segment sealed asks for them
        for i in created:
            try:
                yield self.segments.create(name_of(scope, stream, i))
            except SegmentExists:
                pass
        # The new epoch is visible before the old segments are sealed: a
        # writer that finds its segment sealed must find the successors.
        # (The saved document still holds the intent until the end.)
        self.layouts[key] = target.doc
        for i in pending["sealed"]:
            try:
                seg = yield self.segments.get(name_of(scope, stream, i))
                yield seg.seal()
            except (SegmentSealed, SegmentNotFound):
                pass
        yield self._save()
        return [target.segment(i) for i in created]

    def check_scale(self, scope, stream, epoch):
        """@return: "SUCCESS" once the stream is past C{epoch}, else "INVALID_INPUT"."""
        layout = self.layout(scope, stream)
        if layout is None or epoch < 0 or epoch >= layout.epoch:
            # scales finish before scale() answers: nothing is ever in progress
            return "INVALID_INPUT"
        return "SUCCESS"

    # -- truncation ------------------------------------------------------
    def truncate_stream(self, scope, stream, cut):
        """
        Truncate the stream at the stream cut C{cut} ({segment id: offset}).

        @return: Deferred firing with C{(status, reason)}: "SUCCESS",
            "STREAM_NOT_FOUND", "STREAM_SEALED" or "FAILURE".
        """
        return self._mutate(self._truncate, scope, stream, dict(cut))

    @defer.inlineCallbacks
    def _truncate(self, scope, stream, cut):
        # under the lock: truncateStream and retention both come here
        layout = self.layout(scope, stream)
        if layout is None:
            return "STREAM_NOT_FOUND", "no such stream"
        reason, before = layout.plan_truncation(cut)
        if reason:
            return "FAILURE", reason
        for seg_id, offset in cut.items():
            try:
                seg = yield self.segments.get(name_of(scope, stream, seg_id))
            except SegmentNotFound:
                return "FAILURE", f"segment {seg_id} does not exist"
            if offset > seg.info()["write_offset"]:
                return "FAILURE", f"offset {offset} is beyond the end of segment {seg_id}"
        self.layouts[f"{scope}/{stream}"]["truncating"] = {
            "cut": {str(k): v for k, v in cut.items()}, "before": before}
        yield self._save()
        yield self._finish_truncation(scope, stream)
        self.log.info("truncated {scope}/{stream} at {cut}; deleted {before}", scope=scope,
                      stream=stream, cut=cut, before=before)
        return "SUCCESS", ""

    # -- retention -------------------------------------------------------
    @defer.inlineCallbacks
    def apply_retention(self):
        """
        One round of retention over every stream with a SIZE or TIME
        policy: record a stream cut at the tails of its current segments
        (when it moved since the last one), then truncate at the newest
        recorded cut that still keeps what the policy asks for.  Each stream
        is handled under the state lock on its own, so RPCs interleave; the
        recorded cuts are saved with the next state change (losing some in
        a crash only delays truncation).

        @return: Deferred firing with {"scope/stream": truncation cut} of
            the streams truncated.
        """
        truncated = {}
        for key in sorted(self.layouts):
            scope, _, stream = key.partition("/")
            doc = self.layouts.get(key)
            policy = retention_policy(doc.get("config")) if doc is not None else None
            if policy is None:
                self.retention.pop(key, None)
                continue
            try:
                cut = yield self._mutate(self._retain, scope, stream, policy)
            except Exception:
                self.log.failure("retention of {stream}", stream=key)
                continue
            if cut is not None:
                truncated[key] = cut
        return truncated

    @defer.inlineCallbacks
    def _retain(self, scope, stream, policy):
        key = f"{scope}/{stream}"
        layout = self.layout(scope, stream)
        if layout is None:
            return None
        kind, param = policy
        records = self.retention.setdefault(key, [])
        lengths = {}

        @defer.inlineCallbacks
        def length(seg_id):
            if seg_id not in lengths:
                try:
                    seg = yield self.segments.get(name_of(scope, stream, seg_id))
                    lengths[seg_id] = seg.info()["write_offset"]
                except SegmentNotFound:
                    lengths[seg_id] = 0
            return lengths[seg_id]

        tail = {}
        for seg_id, _, _ in layout.active():
            tail[str(seg_id)] = yield length(seg_id)
        if not records or records[-1]["cut"] != tail:
            # the earliest time the stream's tail was here: data before it
            # is at least this old
            records.append({"t": self._now_ms(), "epoch": layout.epoch, "cut": tail})
            if len(records) > MAX_RETENTION_CUTS:
                half = len(records) // 2
                records[:half] = records[:half:2]
        if kind == "SIZE":
            # the lengths of every segment that may lie after a recorded cut
            oldest = min(r["epoch"] for r in records)
            for s in layout.all_ids():
                if layout.known(s) and (layout.sealed_at(s) or layout.epoch + 1) > oldest:
                    yield length(s)

        def retained(record):
            return layout.retained_bytes(record["epoch"],
                                         {int(k): v for k, v in record["cut"].items()}, lengths)
        chosen = choose_retention_cut(kind, param, records, self._now_ms(), retained)
        if chosen is None:
            return None
        cut = {int(k): v for k, v in chosen["cut"].items()}
        # the chosen cut and the older ones are used up (or were overtaken)
        del records[:records.index(chosen) + 1]
        if cut == layout.head():
            return None
        status, reason = yield self._truncate(scope, stream, cut)
        if status != "SUCCESS":
            # e.g. a truncateStream went further meanwhile
            self.log.info("retention of {scope}/{stream}: not truncating at {cut}: {reason}",
                          scope=scope, stream=stream, cut=cut, reason=reason)
            return None
        self.log.info("retention ({kind} {param}) truncated {scope}/{stream} at {cut}",
                      kind=kind, param=param, scope=scope, stream=stream, cut=cut)
        return cut

    @defer.inlineCallbacks
    def _finish_truncation(self, scope, stream):
        doc = self.layouts[f"{scope}/{stream}"]
        pending = doc["truncating"]
        for seg_id, offset in pending["cut"].items():
            try:
                seg = yield self.segments.get(name_of(scope, stream, int(seg_id)))
                yield seg.truncate(offset)
            except (SegmentNotFound, BadOffset) as e:
                self.log.warn("truncating segment {id}: {e}", id=seg_id, e=e)
        for seg_id in pending["before"]:
            try:
                yield self.segments.delete(name_of(scope, stream, seg_id))
            except SegmentNotFound:
                pass
        doc["head"] = pending["cut"]
        doc["deleted"] = sorted(set(doc["deleted"]) | set(pending["before"]))
        del doc["truncating"]
        yield self._save()

    # -- transactions ----------------------------------------------------
    def _now_ms(self):
        return int(self.clock.seconds() * 1000)

    def create_txn(self, scope, stream, lease_ms):
        """
        @return: Deferred firing with C{(status, txn_id, segment count)}:
            status "SUCCESS", "STREAM_NOT_FOUND", "STREAM_SEALED" or
            "LEASE_TOO_LARGE".
        """
        @defer.inlineCallbacks
        def create():
            info = self.stream(scope, stream)
            if info is None:
                return "STREAM_NOT_FOUND", None, 0
            if info["sealed"]:
                return "STREAM_SEALED", None, 0
            if lease_ms > MAX_LEASE_MS:
                return "LEASE_TOO_LARGE", None, 0
            # The top 32 bits of a transaction id are its epoch: clients
            # find the transaction's segments with getEpochSegments(epoch).
            # The Rust client also sign-extends the low 64 bits when it joins
            # the halves, so their top bit must be 0 too.
            epoch = self.layout(scope, stream).epoch
            ids = [i for i, _, _ in self.layout(scope, stream).active()]
            rand = uuid.uuid4().int
            txn_id = f"{epoch:08x}{(rand >> 64) & 0xFFFFFFFF:08x}{rand & ((1 << 63) - 1):016x}"
            for i in ids:
                yield self.segments.create(txn_name_of(scope, stream, i, txn_id))
            self.txns[txn_id] = {"scope": scope, "stream": stream, "state": "OPEN",
                                 "segments": ids, "epoch": epoch,
                                 "deadline": self._now_ms() + (lease_ms or DEFAULT_LEASE_MS)}
            yield self._save()
            self.log.info("opened transaction {txn} on {scope}/{stream}", txn=txn_id,
                          scope=scope, stream=stream)
            return "SUCCESS", txn_id, len(ids)
        return self._mutate(create)

    def _txn(self, scope, stream, txn_id):
        txn = self.txns.get(txn_id)
        if txn is None or (txn["scope"], txn["stream"]) != (scope, stream):
            return None
        return txn

    def commit_txn(self, scope, stream, txn_id):
        """@return: Deferred firing with "SUCCESS", "TRANSACTION_NOT_FOUND" or "FAILURE"."""
        @defer.inlineCallbacks
        def merge_segments(txn):
            for i in _txn_segments(txn):
                yield self.segments.merge(name_of(scope, stream, i),
                                          txn_name_of(scope, stream, i, txn_id))
        return self._end_txn(scope, stream, txn_id, "COMMITTING", "COMMITTED",
                             merge_segments)

    def abort_txn(self, scope, stream, txn_id):
        """@return: Deferred firing with "SUCCESS", "TRANSACTION_NOT_FOUND" or "FAILURE"."""
        @defer.inlineCallbacks
        def delete_segments(txn):
            for i in _txn_segments(txn):
                try:
                    yield self.segments.delete(txn_name_of(scope, stream, i, txn_id))
                except SegmentNotFound:
                    pass
        return self._end_txn(scope, stream, txn_id, "ABORTING", "ABORTED", delete_segments)

    def _end_txn(self, scope, stream, txn_id, ending, ended, apply):
        """
        Commit or abort: record the C{ending} state durably first (so that a
        restart finishes the job), C{apply(txn)} to the segments, then record
        C{ended}.  Repeating a finished one succeeds; the other outcome fails.
        """
        @defer.inlineCallbacks
        def end():
            txn = self._txn(scope, stream, txn_id)
            if txn is None:
                return "TRANSACTION_NOT_FOUND"
            if txn["state"] == ended:
                return "SUCCESS"
            if txn["state"] not in ("OPEN", ending):
                return "FAILURE"
            if txn["state"] == "OPEN":
                txn["state"] = ending
                yield self._save()
            yield apply(txn)
            txn["state"] = ended
            self._prune()
            yield self._save()
            self.log.info("{outcome} transaction {txn}", outcome=ended.lower(), txn=txn_id)
            return "SUCCESS"
        return self._mutate(end)

    def ping_txn(self, scope, stream, txn_id, lease_ms):
        """@return: Deferred firing with a PingTxnStatus name."""
        @defer.inlineCallbacks
        def ping():
            txn = self._txn(scope, stream, txn_id)
            if txn is None:
                return "UNKNOWN"
            if txn["state"] in ("COMMITTING", "COMMITTED"):
                return "COMMITTED"
            if txn["state"] in ("ABORTING", "ABORTED"):
                return "ABORTED"
            if lease_ms > MAX_LEASE_MS:
                return "LEASE_TOO_LARGE"
            txn["deadline"] = self._now_ms() + (lease_ms or DEFAULT_LEASE_MS)
            yield self._save()
            return "OK"
        return self._mutate(ping)

    def txn_state(self, scope, stream, txn_id):
        txn = self._txn(scope, stream, txn_id)
        return "UNKNOWN" if txn is None else txn["state"]

    @defer.inlineCallbacks
    def expire_txns(self):
        """Abort every open transaction whose lease ran out."""
        now = self._now_ms()
        for txn_id, txn in list(self.txns.items()):
            if txn["state"] == "OPEN" and txn["deadline"] < now:
                self.log.info("transaction {txn} lease expired", txn=txn_id)
                yield self.abort_txn(txn["scope"], txn["stream"], txn_id)

    def _prune(self):
        done = [t for t, v in self.txns.items() if v["state"] in ("COMMITTED", "ABORTED")]
        for t in done[:max(0, len(done) - MAX_COMPLETED_TXNS)]:
            del self.txns[t]


def txn_segment_name(scope, stream, number, txn_id, epoch=0):
    return segment_name(scope, stream, number, epoch) + "#transaction." + txn_id


def txn_name_of(scope, stream, seg_id, txn_id):
    return name_of(scope, stream, seg_id) + "#transaction." + txn_id


def _txn_segments(txn):
    # documents from before scaling kept a count of epoch-0 segments
    segments = txn["segments"]
    return list(range(segments)) if isinstance(segments, int) else segments


def _txn_hex(txn_id):
    mask = (1 << 64) - 1
    return f"{txn_id.highBits & mask:016x}{txn_id.lowBits & mask:016x}"


def _txn_bits(txn_hex):
    def signed(v):
        return v - (1 << 64) if v >= 1 << 63 else v
    return signed(int(txn_hex[:16], 16)), signed(int(txn_hex[16:], 16))


def _grpc():
    import grpc

    from streamproto.pravega import controller_pb2
    return grpc, controller_pb2


class ControllerStateDamaged(Exception):
    """The controller's durable state does not parse: it fail-stops."""


class _RpcError(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code = code
        self.details = details


class ControllerServicer:
    """
    The gRPC handlers.  Each runs on a grpcio thread and calls into the
    reactor through C{call} (C{blockingCallFromThread} bound to a reactor).
    """

    log = Logger()

    #: handlers that are given the caller's principals too
    _WITH_PRINCIPALS = ("getDelegationToken", "listScopes", "listStreamsInScope")

    def __init__(self, state, call, segment_store_address, authorizer=None, tokens=None):
        """
        @param segment_store_address: C{(host, port)}, or a callable
            returning it (read at each getURI).
        @param authorizer: the L{streamproto.core.auth.IAuthorizer} (default:
            everyone may do everything, and delegation tokens are empty).
        @param tokens: the L{streamproto.pravega.auth.DelegationTokens}
            shared with the segment store.
        """
        from streamproto.core.auth import ALLOW_ALL
        from streamproto.pravega.auth import DelegationTokens
        self.authorizer = authorizer or ALLOW_ALL
        self.tokens = tokens or DelegationTokens(self.authorizer)
        self.state = state
        self.call = call
        if callable(segment_store_address):
            self.segment_store_address = segment_store_address
        else:
            self.segment_store_address = lambda: segment_store_address
        self.grpc, self.pb = _grpc()

    def handler(self):
        pb = self.pb
        methods = {
            "getControllerServerList": (pb.ServerRequest, self.get_controller_server_list),
            "createScope": (pb.ScopeInfo, self.create_scope),
            "checkScopeExists": (pb.ScopeInfo, self.check_scope_exists),
            "listScopes": (pb.ScopesRequest, self.list_scopes),
            "deleteScope": (pb.ScopeInfo, self.delete_scope),
            "createStream": (pb.StreamConfig, self.create_stream),
            "updateStream": (pb.StreamConfig, self.update_stream),
            "getStreamConfiguration": (pb.StreamInfo, self.get_stream_configuration),
            "checkStreamExists": (pb.StreamInfo, self.check_stream_exists),
            "listStreamsInScope": (pb.StreamsInScopeRequest, self.list_streams),
            "sealStream": (pb.StreamInfo, self.seal_stream),
            "deleteStream": (pb.StreamInfo, self.delete_stream),
            "getCurrentSegments": (pb.StreamInfo, self.get_current_segments),
            "getEpochSegments": (pb.GetEpochSegmentsRequest, self.get_epoch_segments),
            "getSegments": (pb.GetSegmentsRequest, self.get_segments),
            "getSegmentsImmediatelyFollowing": (pb.SegmentId, self.get_successors),
            "getSegmentsImmediatlyFollowing": (pb.SegmentId, self.get_successors),
            "scale": (pb.ScaleRequest, self.scale),
            "checkScale": (pb.ScaleStatusRequest, self.check_scale),
            "truncateStream": (pb.StreamCut, self.truncate_stream),
            "getSegmentsBetween": (pb.StreamCutRange, self.get_segments_between),
            "isStreamCutValid": (pb.StreamCut, self.is_stream_cut_valid),
            "getURI": (pb.SegmentId, self.get_uri),
            "isSegmentValid": (pb.SegmentId, self.is_segment_valid),
            "getDelegationToken": (pb.StreamInfo, self.get_delegation_token),
            "removeWriter": (pb.RemoveWriterRequest, self.remove_writer),
            "noteTimestampFromWriter": (pb.TimestampFromWriter, self.note_timestamp),
            "createTransaction": (pb.CreateTxnRequest, self.create_transaction),
            "commitTransaction": (pb.TxnRequest, self.commit_transaction),
            "abortTransaction": (pb.TxnRequest, self.abort_transaction),
            "pingTransaction": (pb.PingTxnRequest, self.ping_transaction),
            "checkTransactionState": (pb.TxnRequest, self.check_transaction_state),
        }
        grpc = self.grpc
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            name: grpc.unary_unary_rpc_method_handler(
                self._guarded(name, fn), request_deserializer=request.FromString,
                response_serializer=lambda m: m.SerializeToString())
            for name, (request, fn) in methods.items()})

    def _guarded(self, name, fn):
        with_principals = name in self._WITH_PRINCIPALS

        def handle(request, context):
            try:
                principals = self._authorize(name, request, context)
                if with_principals:
                    return fn(request, principals)
                return fn(request)
            except _RpcError as e:
                context.abort(e.code, e.details)
            except Exception as e:
                self.log.failure("controller {method} failed", method=name)
                context.abort(self.grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        return handle

    def _authorize(self, name, request, context):
        """
        The caller's principals, if the policy lets them call C{name} on
        the request's scope or stream (L{streamproto.pravega.auth
        .METHOD_ACCESS}).

        @raise _RpcError: C{UNAUTHENTICATED} for wrong credentials, or none
            where some are needed; C{PERMISSION_DENIED} otherwise.
        """
        from streamproto.core.auth import ANONYMOUS, denied
        from streamproto.pravega.auth import METHOD_ACCESS, Unauthenticated, grpc_principals
        if not self.authorizer.enabled:
            return (ANONYMOUS,)
        access = METHOD_ACCESS.get(name)
        try:
            principals = grpc_principals(context, self.authorizer)
        except Unauthenticated as e:
            op, resource_of = access or ("read", lambda request: name)
            denied(SERVER_LABEL, ("invalid-credentials",), op, resource_of(request), str(e))
            raise _RpcError(self.grpc.StatusCode.UNAUTHENTICATED, f"authentication failed: {e}")
        if access is not None:
            op, resource_of = access
            self._require(principals, op, resource_of(request))
        return principals

    def _require(self, principals, op, resource):
        from streamproto.core.auth import denied, is_anonymous
        if self.authorizer.allows(principals, op, resource):
            return
        denied(SERVER_LABEL, principals, op, resource)
        code = (self.grpc.StatusCode.UNAUTHENTICATED if is_anonymous(principals)
                else self.grpc.StatusCode.PERMISSION_DENIED)
        raise _RpcError(code, f"{op} on {resource} denied")

    def _readable(self, principals, resource):
        return self.authorizer.allows(principals, "read", resource)

    # -- helpers ---------------------------------------------------------
    def _ranges(self, scope, stream, segments):
        """SegmentRange messages of C{segments}, [(id, min, max)]."""
        pb = self.pb
        return [pb.SegmentRange(
            segmentId=pb.SegmentId(streamInfo=pb.StreamInfo(scope=scope, stream=stream),
                                   segmentId=i),
            minKey=lo, maxKey=hi) for i, lo, hi in segments]

    def _stream(self, info):
        return self.call(lambda: self.state.stream(info.scope, info.stream))

    def _layout(self, info):
        """A copy of the stream's L{Layout}, or None (read on the reactor thread)."""
        def copy():
            layout = self.state.layout(info.scope, info.stream)
            return None if layout is None else Layout(json.loads(json.dumps(layout.doc)))
        return self.call(copy)

    def _config_dict(self, config):
        from google.protobuf import json_format
        config = self.pb.StreamConfig.FromString(config.SerializeToString())
        config.ClearField("streamInfo")
        return json_format.MessageToDict(config)

    # -- handlers --------------------------------------------------------
    def get_controller_server_list(self, request):
        return self.pb.ServerResponse()

    def create_scope(self, request):
        status = self.call(self.state.create_scope, request.scope)
        return self.pb.CreateScopeStatus(status=status)

    def check_scope_exists(self, request):
        return self.pb.ExistsResponse(
            exists=self.call(lambda: request.scope in self.state.scopes))

    def list_scopes(self, request, principals):
        # everything in one page; the next call (with our token) gets the end
        from streamproto.pravega.auth import stream_resource
        if request.continuationToken.token:
            return self.pb.ScopesResponse(continuationToken=request.continuationToken)
        scopes = self.call(lambda: sorted(self.state.scopes))
        if self.authorizer.enabled:
            scopes = [s for s in scopes if self._readable(principals, stream_resource(s))]
        return self.pb.ScopesResponse(scopes=scopes,
                                      continuationToken=self.pb.ContinuationToken(token="end"))

    def delete_scope(self, request):
        return self.pb.DeleteScopeStatus(status=self.call(self.state.delete_scope, request.scope))

    def create_stream(self, request):
        info = request.streamInfo
        policy = request.scalingPolicy
        if policy.scaleType != self.pb.ScalingPolicy.FIXED_NUM_SEGMENTS:
            self.log.info("stream {scope}/{stream}: no auto-scaling, {n} segments",
                          scope=info.scope, stream=info.stream, n=policy.minNumSegments)
        status = self.call(self.state.create_stream, info.scope, info.stream,
                           max(1, policy.minNumSegments), self._config_dict(request))
        return self.pb.CreateStreamStatus(status=status)

    def update_stream(self, request):
        info = request.streamInfo
        status = self.call(self.state.update_stream, info.scope, info.stream,
                           self._config_dict(request))
        return self.pb.UpdateStreamStatus(status=status)

    def get_stream_configuration(self, request):
        from google.protobuf import json_format
        pb = self.pb
        layout = self._layout(request)
        config = pb.StreamConfig()
        if layout is not None and "config" in layout.doc:
            json_format.ParseDict(layout.doc["config"], config, ignore_unknown_fields=True)
        elif layout is not None:
            config.scalingPolicy.minNumSegments = len(layout.active(0))
            config.scalingPolicy.scaleFactor = 1
        config.streamInfo.scope = request.scope
        config.streamInfo.stream = request.stream
        return config

    def check_stream_exists(self, request):
        return self.pb.ExistsResponse(exists=self._stream(request) is not None)

    def list_streams(self, request, principals):
        from streamproto.pravega.auth import stream_resource
        pb = self.pb
        scope = request.scope.scope
        streams = self.call(lambda: None if scope not in self.state.scopes
                            else sorted(self.state.scopes[scope]))
        if streams is None:
            return pb.StreamsInScopeResponse(status=pb.StreamsInScopeResponse.SCOPE_NOT_FOUND)
        if request.continuationToken.token:
            streams = []
        if self.authorizer.enabled:
            streams = [s for s in streams if self._readable(principals,
                                                            stream_resource(scope, s))]
        return pb.StreamsInScopeResponse(
            streams=[pb.StreamInfo(scope=scope, stream=s) for s in streams],
            continuationToken=pb.ContinuationToken(token="end"))

    def seal_stream(self, request):
        status = self.call(self.state.seal_stream, request.scope, request.stream)
        return self.pb.UpdateStreamStatus(status=status)

    def delete_stream(self, request):
        status = self.call(self.state.delete_stream, request.scope, request.stream)
        return self.pb.DeleteStreamStatus(status=status)

    def get_current_segments(self, request):
        info = self._stream(request)
        if info is None or info["sealed"]:
            # a sealed stream has no current segments, as in Pravega
            return self.pb.SegmentRanges()
        layout = self._layout(request)
        return self.pb.SegmentRanges(
            segmentRanges=self._ranges(request.scope, request.stream, layout.active()))

    def get_epoch_segments(self, request):
        s = request.streamInfo
        layout = self._layout(s)
        if layout is None:
            return self.pb.SegmentRanges()
        return self.pb.SegmentRanges(
            segmentRanges=self._ranges(s.scope, s.stream, layout.active(request.epoch)))

    def get_segments(self, request):
        pb = self.pb
        s = request.streamInfo
        layout = self._layout(s)
        # the head: where the stream was truncated, else the first epoch at 0
        head = layout.head() if layout is not None else {}
        return pb.SegmentsAtTime(segments=[pb.SegmentsAtTime.SegmentLocation(
            segmentId=pb.SegmentId(streamInfo=pb.StreamInfo(scope=s.scope, stream=s.stream),
                                   segmentId=i), offset=offset)
            for i, offset in sorted(head.items())])

    def get_successors(self, request):
        pb = self.pb
        s = request.streamInfo
        layout = self._layout(s)
        if layout is None or str(request.segmentId) not in layout.doc["segments"]:
            return pb.SuccessorResponse()
        # an active segment, or one sealed with its stream, has none
        return pb.SuccessorResponse(segments=[
            pb.SuccessorResponse.SegmentEntry(
                segment=self._ranges(s.scope, s.stream, [(i, lo, hi)])[0], value=preds)
            for i, lo, hi, preds in layout.successors(request.segmentId)])

    def scale(self, request):
        pb = self.pb
        s = request.streamInfo
        ranges = [(r.start, r.end) for r in request.newKeyRanges]
        status, reason, created, epoch = self.call(
            self.state.scale, s.scope, s.stream, list(request.sealedSegments), ranges)
        if reason:
            self.log.info("scale of {scope}/{stream} refused: {reason}", scope=s.scope,
                          stream=s.stream, reason=reason)
        return pb.ScaleResponse(status=status, epoch=epoch,
                                segments=self._ranges(s.scope, s.stream, created))

    def check_scale(self, request):
        s = request.streamInfo
        status = self.call(self.state.check_scale, s.scope, s.stream, request.epoch)
        return self.pb.ScaleStatusResponse(status=status)

    def truncate_stream(self, request):
        s = request.streamInfo
        status, reason = self.call(self.state.truncate_stream, s.scope, s.stream,
                                   dict(request.cut))
        if reason:
            self.log.info("truncation of {scope}/{stream} refused: {reason}", scope=s.scope,
                          stream=s.stream, reason=reason)
        return self.pb.UpdateStreamStatus(status=status)

    def get_segments_between(self, request):
        s = request.streamInfo
        layout = self._layout(s)
        if layout is None:
            raise _RpcError(self.grpc.StatusCode.NOT_FOUND, "STREAM_NOT_FOUND")
        # "from" is a Python keyword: the field is reached with getattr
        reason, ids = layout.between(dict(getattr(request, "from")), dict(request.to))
        if reason:
            raise _RpcError(self.grpc.StatusCode.INVALID_ARGUMENT, reason)
        pb = self.pb
        info = pb.StreamInfo(scope=s.scope, stream=s.stream)
        return pb.StreamCutRangeResponse(
            segments=[pb.SegmentId(streamInfo=info, segmentId=i) for i in ids])

    def is_stream_cut_valid(self, request):
        layout = self._layout(request.streamInfo)
        valid = layout is not None and layout.cut_problem(
            dict(request.cut), include_deleted=True) is None
        return self.pb.StreamCutValidityResponse(response=valid)

    def get_uri(self, request):
        host, port = self.segment_store_address()
        return self.pb.NodeUri(endpoint=host, port=port)

    def is_segment_valid(self, request):
        info = self._stream(request.streamInfo)
        if not info or info["sealed"]:
            return self.pb.SegmentValidityResponse(response=False)
        layout = self._layout(request.streamInfo)
        return self.pb.SegmentValidityResponse(
            response=request.segmentId in {i for i, _, _ in layout.active()})

    def get_delegation_token(self, request, principals):
        """
        A signed token carrying the caller's principals to the segment
        store (see L{streamproto.pravega.auth}), for a caller that may
        read, write or administer the stream; empty without a policy.
        """
        from streamproto.core.auth import OPS
        from streamproto.pravega.auth import stream_resource
        if not self.authorizer.enabled:
            return self.pb.DelegationToken(delegationToken="")
        resource = stream_resource(request.scope, request.stream)
        if not any(self.authorizer.allows(principals, op, resource) for op in OPS):
            self._require(principals, "read", resource)
        return self.pb.DelegationToken(delegationToken=self.tokens.issue(principals, resource))

    def remove_writer(self, request):
        return self.pb.RemoveWriterResponse()

    def note_timestamp(self, request):
        return self.pb.TimestampResponse()

    def create_transaction(self, request):
        pb = self.pb
        s = request.streamInfo
        status, txn_id, count = self.call(self.state.create_txn, s.scope, s.stream, request.lease)
        if status != "SUCCESS":
            # the RPC has no status field: gRPC errors are how Pravega reports these
            code = {"STREAM_NOT_FOUND": self.grpc.StatusCode.NOT_FOUND,
                    "LEASE_TOO_LARGE": self.grpc.StatusCode.INVALID_ARGUMENT}.get(
                status, self.grpc.StatusCode.FAILED_PRECONDITION)
            raise _RpcError(code, status)
        high, low = _txn_bits(txn_id)
        layout = self._layout(s)
        return pb.CreateTxnResponse(
            txnId=pb.TxnId(highBits=high, lowBits=low),
            activeSegments=self._ranges(s.scope, s.stream, layout.active(int(txn_id[:8], 16))))

    def commit_transaction(self, request):
        s = request.streamInfo
        status = self.call(self.state.commit_txn, s.scope, s.stream, _txn_hex(request.txnId))
        return self.pb.TxnStatus(status=status)

    def abort_transaction(self, request):
        s = request.streamInfo
        status = self.call(self.state.abort_txn, s.scope, s.stream, _txn_hex(request.txnId))
        return self.pb.TxnStatus(status=status)

    def ping_transaction(self, request):
        s = request.streamInfo
        status = self.call(self.state.ping_txn, s.scope, s.stream, _txn_hex(request.txnId),
                           request.lease)
        return self.pb.PingTxnStatus(status=status)

    def check_transaction_state(self, request):
        s = request.streamInfo
        state = self.call(self.state.txn_state, s.scope, s.stream, _txn_hex(request.txnId))
        return self.pb.TxnState(state=state)


class ControllerTLS:
    """
    PEM bytes for the controller's TLS: its key and certificate chain, and
    (to require and verify client certificates) the CAs to trust.
    """

    def __init__(self, private_key, cert_chain, client_ca=None):
        self.private_key = private_key
        self.cert_chain = cert_chain
        self.client_ca = client_ca

    def credentials(self):
        import grpc
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


def _split_endpoint(description):
    """Split at ':' as Twisted endpoint strings do ('\\:' is a literal colon)."""
    parts, current, chars = [], [], iter(description)
    for c in chars:
        if c == "\\":
            current.append(next(chars, ""))
        elif c == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return parts


def _read_pem(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}")


def parse_controller_endpoint(description):
    """
    The controller's listening endpoint, in the words of Twisted's endpoint
    strings (gRPC needs its own listener, so only these):
    C{tcp:PORT[:interface=HOST]}, C{ssl:PORT[:interface=HOST]:privateKey=KEY
    [:certKey=CERT][:extraCertChain=CHAIN]} and C{mtls:...} (the same, plus
    C{caCerts=CA} to require client certificates signed by CA).

    @return: C{(host, port, tls)}: C{tls} a L{ControllerTLS} or None.
    @raise ValueError: on anything else.
    """
    parts = _split_endpoint(description)
    kind = parts[0]
    if kind not in ("tcp", "ssl", "mtls") or len(parts) < 2 or not parts[1].isdigit():
        raise ValueError("controller endpoint must be tcp:PORT[:interface=HOST], "
                         f"ssl:PORT:privateKey=KEY[:certKey=CERT] or mtls:...: {description}")
    port = int(parts[1])
    allowed = {"interface"} if kind == "tcp" else {
        "interface", "privateKey", "certKey", "extraCertChain"} | (
        {"caCerts", "requireClientCert"} if kind == "mtls" else set())
    options = {}
    for p in parts[2:]:
        key, sep, value = p.partition("=")
        if not sep or key not in allowed or not value:
            raise ValueError(f"unsupported controller endpoint option {p!r}")
        options[key] = value
    if not 0 <= port <= 65535:
        raise ValueError(f"bad port {port}")
    host = options.get("interface", "0.0.0.0")
    if kind == "tcp":
        return host, port, None
    if "privateKey" not in options:
        raise ValueError(f"{kind}: controller endpoint needs privateKey=")
    key = _read_pem(options["privateKey"], "private key")
    chain = _read_pem(options.get("certKey", options["privateKey"]), "certificate")
    if "extraCertChain" in options:
        chain += b"\n" + _read_pem(options["extraCertChain"], "certificate chain")
    client_ca = None
    if "caCerts" in options and options.get("requireClientCert", "yes") != "no":
        client_ca = _read_pem(options["caCerts"], "CA certificates")
    return host, port, ControllerTLS(key, chain, client_ca)


class ControllerService(service.Service):
    """
    Runs the gRPC server: opens the state on the reactor, serves on
    C{host:port} (port 0: any; see C{self.port} once started), expires
    transaction leases and applies retention policies periodically.

    @ivar segment_store_address: C{(host, port)} clients are sent to; a
        port of 0 with C{store_listener} (the segment store's listening
        service) becomes the port it listens on, once it does.
    """

    log = Logger()

    def __init__(self, store, segments, host, port, segment_store_address, reactor=None,
                 max_workers=8, expiry_interval=1.0, tls=None, retention_interval=60.0,
                 store_listener=None, authorizer=None, tokens=None):
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        #: who may do what (L{streamproto.core.auth.IAuthorizer}; None: everyone)
        self.authorizer = authorizer
        #: the delegation tokens shared with the segment store
        self.tokens = tokens
        self.expiry_interval = expiry_interval
        self.retention_interval = retention_interval
        self.store_listener = store_listener
        self._expiry = None
        self._retention = None
        self.state = ControllerState(store, segments, reactor)
        self.host = host
        self.port = port
        self.segment_store_address = segment_store_address
        self.max_workers = max_workers
        self.tls = tls
        self._server = None
        self.ready = None
        #: why the controller fail-stopped (its state could not be read), or None
        self.failure = None

    def startService(self):
        super().startService()
        import grpc
        from twisted.internet.threads import blockingCallFromThread

        opened = []
        waiting = []

        def ready(result):
            opened.append(result)
            for d in waiting:
                d.callback(None)
            return result

        self.failure = None
        self._remove_check = add_readiness_check(self._problems)
        self.ready = self._open()
        if self.segment_store_address[1] == 0 and self.store_listener is not None:
            self.ready.addCallback(lambda _: self._resolve_store_port())
        self.ready.addErrback(self._failed)
        self.ready.addBoth(ready)

        def run(fn, args):
            # requests that arrive before the state is read wait for it
            if opened:
                return self._serve(fn, args)
            d = defer.Deferred()
            waiting.append(d)
            return d.addCallback(lambda _: self._serve(fn, args))

        def call(fn, *args):
            return blockingCallFromThread(self.reactor, run, fn, args)

        servicer = ControllerServicer(self.state, call, lambda: self.segment_store_address,
                                      authorizer=self.authorizer, tokens=self.tokens)
        # grpcio binds with SO_REUSEPORT by default: a second server on the
        # same port would start "fine" and take half of the connections
        server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=self.max_workers, thread_name_prefix="pravega-controller"),
            options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((servicer.handler(),))
        address = f"{self.host}:{self.port}"
        try:
            if self.tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, self.tls.credentials())
        except RuntimeError as e:     # newer grpcio raises instead of answering 0
            port, reason = 0, e
        else:
            reason = "address in use or not available"
        if not port:
            server.stop(None)
            raise OSError(f"pravega controller cannot listen on {address}: {reason}")
        self.port = port
        self._server = server
        server.start()

        from twisted.internet.task import LoopingCall
        self._expiry = LoopingCall(self._expire)
        self._expiry.clock = self.reactor
        self._expiry.start(self.expiry_interval, now=False)
        if self.retention_interval:
            self._retention = LoopingCall(self._retain)
            self._retention.clock = self.reactor
            self._retention.start(self.retention_interval, now=False)
        self.log.info("pravega controller listening on {host}:{port} ({tls})",
                      host=self.host, port=self.port,
                      tls="plain" if self.tls is None else
                      "TLS" if self.tls.client_ca is None else "TLS, client certificates")

    @defer.inlineCallbacks
    def _open(self):
        """
        Read the state; while the store cannot answer (a cluster electing
        a leader, not reachable yet), try again with a growing pause:
        C{/ready} and every request say why meanwhile.  Damaged state is
        not retried (L{_failed}).
        """
        from twisted.internet.task import deferLater
        delay = 0.5
        while True:
            try:
                yield self.state.open()
            except ControllerStateDamaged:
                raise
            except Exception as e:  # noqa: BLE001 - the store's own transient errors
                if not self.running:
                    raise
                self.failure = e
                self.log.warn("pravega controller: cannot read its state yet ({error}); "
                              "trying again in {delay:g} s", error=e, delay=delay)
                yield deferLater(self.reactor, delay, lambda: None)
                delay = min(delay * 2, 5.0)
                continue
            self.failure = None
            return None

    def _failed(self, failure):
        """
        The state could not be read: fail-stop.  Every request answers
        UNAVAILABLE with the cause and C{/ready} says 503, until an operator
        repairs the state and restarts; never an empty state served as if
        it were the real one.
        """
        self.failure = failure.value
        if failure.check(ControllerStateDamaged):
            self.log.critical("pravega controller stopped serving: its state is damaged: "
                              "{error}; repair or remove the last record of the log, then "
                              "restart", error=failure.value)
        else:
            self.log.failure("pravega controller stopped serving: opening its state failed",
                             failure)
        return None

    def _serve(self, fn, args):
        if self.failure is not None:
            import grpc
            return defer.fail(_RpcError(grpc.StatusCode.UNAVAILABLE,
                                        f"controller state unavailable: {self.failure}"))
        # what another controller on the same store changed is seen at once
        return self.state.refresh().addCallback(lambda _: fn(*args))

    def _problems(self):
        if self.failure is None:
            return []
        return [f"pravega controller: state unavailable: {self.failure}"]

    def _resolve_store_port(self):
        """Learn the segment store's port from its listener (it was asked for port 0)."""
        waiting = listening_port(self.store_listener)
        if waiting is None:
            self.log.warn("cannot learn the segment store's port: clients are told port 0")
            return None
        learned = defer.Deferred()

        def listening(port):
            host = self.segment_store_address[0]
            self.segment_store_address = (host, port.getHost().port)
            self.log.info("advertising the segment store at {host}:{port}", host=host,
                          port=self.segment_store_address[1])
            learned.callback(None)
            return port

        def failed(f):
            learned.callback(None)   # the listener reports its own failure
            return f
        waiting.addCallbacks(listening, failed)
        return learned

    def _retain(self):
        if self.state._log is None or self.failure is not None:
            return None
        d = self.state.apply_retention()
        d.addErrback(lambda f: self.log.failure("applying retention policies", f))
        return d

    def _expire(self):
        if self.state._log is None or self.failure is not None:
            return None
        d = self.state.expire_txns()
        d.addErrback(lambda f: self.log.failure("expiring transactions", f))
        return d

    def stopService(self):
        super().stopService()
        remove = getattr(self, "_remove_check", None)
        if remove is not None:
            remove()
        for loop in (self._expiry, self._retention):
            if loop is not None and loop.running:
                loop.stop()
        server, self._server = self._server, None
        if server is None:
            return None
        # stop() returns a threading.Event: wait for it off the reactor
        return threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(),
                                         server.stop(1.0).wait)
