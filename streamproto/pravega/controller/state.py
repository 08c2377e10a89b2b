"""
The controller's durable state: scopes, streams (their L{Layout}s),
scaling, truncation, retention and transactions, on the reactor thread.

The state is one JSON document; every change appends the whole document to
the log C{pravega-controller} and is answered only once that append is
durable.  Opening replays the last record and finishes what a crash
interrupted (a scale, a truncation, a commit).
"""

import functools
import json
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from streamproto.core.clock import default_reactor, monotonic_seconds, wall_seconds
from streamproto.log.errors import AppendConflict
from streamproto.log.interfaces import ILog, ILogStore
from streamproto.log.versions import CONTROLLER_VERSION, check_mapping
from streamproto.pravega.controller.layout import (
    MAX_SEGMENTS, Layout, choose_retention_cut, name_of, retention_policy, segment_name,
    txn_name_of, valid_name,
)
from streamproto.pravega.segments import (
    BadOffset, SegmentExists, SegmentNotFound, SegmentSealed, SegmentStore,
)

#: a change is tried this many times against other controllers' changes
MUTATION_ATTEMPTS = 5
STATE_LOG = "pravega-controller"
#: Transaction leases (milliseconds): used when a client asks for 0, and the most it may ask.
DEFAULT_LEASE_MS = 120_000
MAX_LEASE_MS = 24 * 3600 * 1000
#: Completed transactions remembered (for checkTransactionState).
MAX_COMPLETED_TXNS = 1000
#: Stream cuts remembered per stream for its retention policy; beyond this
#: every other one of the older half is forgotten (coarser, never unsafe).
MAX_RETENTION_CUTS = 128


_T = TypeVar("_T")
#: a change of the state document, as a generator run by inlineCallbacks
_Change: TypeAlias = Generator[defer.Deferred[Any], Any, _T]


def _mutation(change: Callable[..., _Change[_T]]) -> Callable[..., defer.Deferred[_T]]:
    """
    Decorate a L{ControllerState} method that changes the document: it runs
    (as under inlineCallbacks) under the state's lock on the newest document,
    and again on the newer one when another controller wrote first (see
    L{ControllerState._attempt}).  Why a decorator: every change must go
    through that lock and retry, and a change written without it would lose
    another controller's update.
    """
    run = defer.inlineCallbacks(change)

    @functools.wraps(change)
    def mutate(self: "ControllerState", *args: Any, **kwargs: Any) -> defer.Deferred[_T]:
        return self._mutate(functools.partial(run, self, *args, **kwargs))
    return mutate


class ControllerStateDamaged(Exception):
    """The controller's durable state does not parse: it fail-stops."""


class ControllerState:
    """
    Scopes, streams and transactions, on the reactor thread; every method
    returns a Deferred.  C{scopes} is scope -> {stream: {"segments": initial
    count, "sealed": bool}}; C{layouts} is "scope/stream" -> L{Layout} doc.
    """

    log = Logger()

    def __init__(self, store: ILogStore, segments: SegmentStore,
                 clock: IReactorTime | None = None) -> None:
        clock = default_reactor(clock)
        self.clock = clock
        #: leases run on this clock: a step of the wall clock must not
        #: expire (or prolong) every open transaction at once
        self.monotonic = monotonic_seconds(clock)
        #: txn id -> (its persisted wall deadline, ms; its monotonic one, s)
        self._leases: dict[str, tuple[int, float]] = {}
        self.store = store
        self.segments = segments
        self.scopes: dict[str, dict[str, dict[str, Any]]] = {}
        self.layouts: dict[str, dict[str, Any]] = {}
        # transaction id (32 hex digits) -> {"scope", "stream", "state", "deadline", "segments"}
        self.txns: dict[str, dict[str, Any]] = {}
        # "scope/stream" -> stream cuts recorded for its retention policy,
        # oldest first: [{"t": ms, "epoch": e, "cut": {"id": offset}}]
        self.retention: dict[str, list[dict[str, Any]]] = {}
        self._log: ILog | None = None
        #: the state log's end when the document in memory was read or written
        self._position: int | None = None
        self._lock = defer.DeferredLock()

    @property
    def opened(self) -> bool:
        """Whether L{open} has got the state log (its document may still be loading)."""
        return self._log is not None

    @defer.inlineCallbacks
    def open(self) -> Generator[defer.Deferred[Any], Any, None]:
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
        assert log is not None  # read after open() got it
        end = log.end_position
        scopes, txns, layouts, retention = {}, {}, {}, {}
        if end > log.start_position:
            position = end - 1
            batch = yield log.read(position, 1)
            try:
                state = json.loads(bytes(batch.records()[0]))
                if isinstance(state, dict):
                    check_mapping(f"controller state log {STATE_LOG!r}, record {position}",
                                  state, CONTROLLER_VERSION)
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

    def refresh(self) -> defer.Deferred[None]:
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
        log = self._log
        assert log is not None  # saved after open() got it
        d = log.append([record], expected_position=self._position)

        def saved(r):
            self._position = r.end_position
            # keep only the newest document
            return log.truncate(r.first_position)
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
            except Exception:
                # the change is in memory and maybe not stored (a store that
                # did not answer): read the stored document again before the
                # next answer, which must not come from what is not stored
                # (a retried create_scope answered SCOPE_EXISTS)
                self._position = None
                raise
            return result
        yield self._catch_up(force=True)
        raise AppendConflict(f"controller state: {MUTATION_ATTEMPTS} conflicting writers in "
                             "a row")

    def stream(self, scope: str, stream: str) -> dict[str, Any] | None:
        return self.scopes.get(scope, {}).get(stream)

    def _find(self, scope: str, stream: str) -> dict[str, Any] | str:
        """The stream's info, or what a request on it answers: SCOPE_NOT_FOUND, STREAM_NOT_FOUND."""
        if scope not in self.scopes:
            return "SCOPE_NOT_FOUND"
        info = self.stream(scope, stream)
        return "STREAM_NOT_FOUND" if info is None else info

    def layout(self, scope: str, stream: str) -> Layout | None:
        """The L{Layout} of an existing stream, or None."""
        if self.stream(scope, stream) is None:
            return None
        return self._layout(scope, stream)

    def _layout(self, scope: str, stream: str) -> Layout:
        """The L{Layout} of a stream the caller knows exists."""
        return Layout(self.layouts[f"{scope}/{stream}"])

    # -- scopes ----------------------------------------------------------
    @_mutation
    def create_scope(self, scope: str) -> _Change[str]:
        """@return: Deferred firing with "SUCCESS", "SCOPE_EXISTS" or "INVALID_SCOPE_NAME"."""
        if not valid_name(scope):
            return "INVALID_SCOPE_NAME"
        if scope in self.scopes:
            return "SCOPE_EXISTS"
        self.scopes[scope] = {}
        yield self._save()
        self.log.info("created scope {scope}", scope=scope)
        return "SUCCESS"

    @_mutation
    def delete_scope(self, scope: str) -> _Change[str]:
        if scope not in self.scopes:
            return "SCOPE_NOT_FOUND"
        if self.scopes[scope]:
            return "SCOPE_NOT_EMPTY"
        del self.scopes[scope]
        yield self._save()
        return "SUCCESS"

    # -- streams ---------------------------------------------------------
    @_mutation
    def create_stream(self, scope: str, stream: str, count: int,
                      config: dict[str, Any] | None = None) -> _Change[str]:
        """
        @param config: the stream configuration to remember (a JSON-able
            dict, answered by getStreamConfiguration), or None.
        """
        if scope not in self.scopes:
            return "SCOPE_NOT_FOUND"
        if not valid_name(stream) or count < 1 or count > MAX_SEGMENTS:
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

    @_mutation
    def update_stream(self, scope: str, stream: str, config: dict[str, Any]
                      ) -> _Change[str]:
        """Record a new configuration: "SUCCESS", "SCOPE_NOT_FOUND", "STREAM_NOT_FOUND" or "STREAM_SEALED"."""
        info = self._find(scope, stream)
        if isinstance(info, str):
            return info
        if info["sealed"]:
            return "STREAM_SEALED"
        self.layouts[f"{scope}/{stream}"]["config"] = config
        yield self._save()
        self.log.info("updated the configuration of {scope}/{stream}", scope=scope,
                      stream=stream)
        return "SUCCESS"

    @_mutation
    def seal_stream(self, scope: str, stream: str) -> _Change[str]:
        info = self._find(scope, stream)
        if isinstance(info, str):
            return info
        for seg_id, _, _ in self._layout(scope, stream).active():
            try:
                seg = yield self.segments.get(name_of(scope, stream, seg_id))
                yield seg.seal()
            except (SegmentSealed, SegmentNotFound):
                pass
        if not info["sealed"]:
            info["sealed"] = True
            yield self._save()
        return "SUCCESS"

    @_mutation
    def delete_stream(self, scope: str, stream: str) -> _Change[str]:
        info = self.stream(scope, stream)
        if info is None:
            return "STREAM_NOT_FOUND"
        if not info["sealed"]:
            return "STREAM_NOT_SEALED"
        layout = self._layout(scope, stream)
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

    # -- scaling ---------------------------------------------------------
    @_mutation
    def scale(self, scope: str, stream: str, sealed: Sequence[int],
              ranges: Sequence[tuple[float, float]]
              ) -> _Change[tuple[str, str, list[tuple[int, float, float]], int]]:
        """
        Seal the active segments C{sealed} (ids) and replace them with new
        segments over C{ranges} ([(start, end)]) in a new epoch.

        @return: Deferred firing with C{(status, reason, [(id, min, max)]
            of the new segments, the epoch the scale started from)}: status
            "STARTED" (done: scaling here is synchronous), "FAILURE" or
            "PRECONDITION_FAILED".
        """
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
        layout = self._layout(scope, stream)
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

    def check_scale(self, scope: str, stream: str, epoch: int) -> str:
        """@return: "SUCCESS" once the stream is past C{epoch}, else "INVALID_INPUT"."""
        layout = self.layout(scope, stream)
        if layout is None or epoch < 0 or epoch >= layout.epoch:
            # scales finish before scale() answers: nothing is ever in progress
            return "INVALID_INPUT"
        return "SUCCESS"

    # -- truncation ------------------------------------------------------
    def truncate_stream(self, scope: str, stream: str, cut: Mapping[int, int]
                        ) -> defer.Deferred[tuple[str, str]]:
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
    def apply_retention(self) -> Generator[defer.Deferred[Any], Any, dict[str, dict[int, int]]]:
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
        return int(wall_seconds(self.clock)() * 1000)

    @_mutation
    def create_txn(self, scope: str, stream: str, lease_ms: int
                   ) -> _Change[tuple[str, str | None, int]]:
        """
        @return: Deferred firing with C{(status, txn_id, segment count)}:
            status "SUCCESS", "STREAM_NOT_FOUND", "STREAM_SEALED" or
            "LEASE_TOO_LARGE".
        """
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
        epoch = self._layout(scope, stream).epoch
        ids = [i for i, _, _ in self._layout(scope, stream).active()]
        rand = uuid.uuid4().int
        txn_id = f"{epoch:08x}{(rand >> 64) & 0xFFFFFFFF:08x}{rand & ((1 << 63) - 1):016x}"
        for i in ids:
            yield self.segments.create(txn_name_of(scope, stream, i, txn_id))
        self.txns[txn_id] = {"scope": scope, "stream": stream, "state": "OPEN",
                             "segments": ids, "epoch": epoch,
                             "deadline": self._lease(txn_id, lease_ms)}
        yield self._save()
        self.log.info("opened transaction {txn} on {scope}/{stream}", txn=txn_id,
                      scope=scope, stream=stream)
        return "SUCCESS", txn_id, len(ids)

    def _txn(self, scope, stream, txn_id):
        txn = self.txns.get(txn_id)
        if txn is None or (txn["scope"], txn["stream"]) != (scope, stream):
            return None
        return txn

    def commit_txn(self, scope: str, stream: str, txn_id: str) -> defer.Deferred[str]:
        """@return: Deferred firing with "SUCCESS", "TRANSACTION_NOT_FOUND" or "FAILURE"."""
        @defer.inlineCallbacks
        def merge_segments(txn):
            for i in _txn_segments(txn):
                yield self.segments.merge(name_of(scope, stream, i),
                                          txn_name_of(scope, stream, i, txn_id))
        return self._end_txn(scope, stream, txn_id, "COMMITTING", "COMMITTED",
                             merge_segments)

    def abort_txn(self, scope: str, stream: str, txn_id: str) -> defer.Deferred[str]:
        """@return: Deferred firing with "SUCCESS", "TRANSACTION_NOT_FOUND" or "FAILURE"."""
        @defer.inlineCallbacks
        def delete_segments(txn):
            for i in _txn_segments(txn):
                try:
                    yield self.segments.delete(txn_name_of(scope, stream, i, txn_id))
                except SegmentNotFound:
                    pass
        return self._end_txn(scope, stream, txn_id, "ABORTING", "ABORTED", delete_segments)

    @_mutation
    def _end_txn(self, scope, stream, txn_id, ending, ended, apply):
        """
        Commit or abort: record the C{ending} state durably first (so that a
        restart finishes the job), C{apply(txn)} to the segments, then record
        C{ended}.  Repeating a finished one succeeds; the other outcome fails.
        """
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

    @_mutation
    def ping_txn(self, scope: str, stream: str, txn_id: str, lease_ms: int
                 ) -> _Change[str]:
        """@return: Deferred firing with a PingTxnStatus name."""
        txn = self._txn(scope, stream, txn_id)
        if txn is None:
            return "UNKNOWN"
        if txn["state"] in ("COMMITTING", "COMMITTED"):
            return "COMMITTED"
        if txn["state"] in ("ABORTING", "ABORTED"):
            return "ABORTED"
        if lease_ms > MAX_LEASE_MS:
            return "LEASE_TOO_LARGE"
        txn["deadline"] = self._lease(txn_id, lease_ms)
        yield self._save()
        return "OK"

    def _lease(self, txn_id: str, lease_ms: int) -> int:
        """Start a lease of C{lease_ms} (0: the default); return its wall deadline (ms)."""
        lease_ms = lease_ms or DEFAULT_LEASE_MS
        deadline = self._now_ms() + lease_ms
        self._leases[txn_id] = deadline, self.monotonic() + lease_ms / 1000
        return deadline

    def _lease_end(self, txn_id: str, txn: dict[str, Any]) -> float:
        """
        The monotonic end of C{txn}'s lease.  A deadline this process did
        not set (read after a restart, or set by another controller on a
        shared store) is persisted in wall time: what is left of it then
        runs on the monotonic clock.
        """
        known = self._leases.get(txn_id)
        if known is None or known[0] != txn["deadline"]:
            left = min(max(0, txn["deadline"] - self._now_ms()), MAX_LEASE_MS)
            known = txn["deadline"], self.monotonic() + left / 1000
            self._leases[txn_id] = known
        return known[1]

    def txn_state(self, scope: str, stream: str, txn_id: str) -> str:
        txn = self._txn(scope, stream, txn_id)
        return "UNKNOWN" if txn is None else txn["state"]

    @defer.inlineCallbacks
    def expire_txns(self) -> Generator[defer.Deferred[Any], Any, None]:
        """Abort every open transaction whose lease ran out."""
        for txn_id in set(self._leases) - {t for t, v in self.txns.items()
                                           if v["state"] == "OPEN"}:
            del self._leases[txn_id]
        for txn_id, txn in list(self.txns.items()):
            if txn["state"] == "OPEN" and self._lease_end(txn_id, txn) <= self.monotonic():
                self.log.info("transaction {txn} lease expired", txn=txn_id)
                yield self.abort_txn(txn["scope"], txn["stream"], txn_id)

    def _prune(self):
        done = [t for t, v in self.txns.items() if v["state"] in ("COMMITTED", "ABORTED")]
        for t in done[:max(0, len(done) - MAX_COMPLETED_TXNS)]:
            del self.txns[t]


def _txn_segments(txn):
    # documents from before scaling kept a count of epoch-0 segments
    segments = txn["segments"]
    return list(range(segments)) if isinstance(segments, int) else segments
