"""
A single-node Pravega Controller: the gRPC C{ControllerService} clients ask
for scopes, streams, segments and segment-store addresses before they talk
to the segment store.

Streams have a fixed number of segments (epoch 0, never scaled): creating
one creates the segments C{scope/stream/N.#epoch.0} on our segment store.
A segment id is C{epoch << 32 | number}, as the clients compute it.
C{getURI} answers every segment (also reader-group table segments) with this
server's segment-store address.  Transactions, scaling, reader-group and
key-value-table RPCs are not implemented: gRPC answers them UNIMPLEMENTED.

grpcio runs handlers on its own thread pool.  L{ControllerState} lives on
the reactor thread (it uses the log store); each handler hands its request
to it with C{blockingCallFromThread} and waits, so the reactor never blocks
and all store access stays on the reactor thread.

The state (scopes and streams) is one JSON document; every change appends
the whole document to the log C{pravega-controller} and is answered only
once that append is durable.  Opening replays the last record.
"""

import json
import uuid
from concurrent import futures

from twisted.application import service
from twisted.internet import defer, threads
from twisted.logger import Logger

from streamproto.pravega.segments import SegmentExists, SegmentNotFound, SegmentSealed

SERVICE_NAME = "io.pravega.controller.stream.api.grpc.v1.ControllerService"
STATE_LOG = "pravega-controller"
#: Transaction leases (milliseconds): used when a client asks for 0, and the most it may ask.
DEFAULT_LEASE_MS = 120_000
MAX_LEASE_MS = 24 * 3600 * 1000
#: Completed transactions remembered (for checkTransactionState).
MAX_COMPLETED_TXNS = 1000


def segment_name(scope, stream, number, epoch=0):
    return f"{scope}/{stream}/{number}.#epoch.{epoch}"


def _valid_name(name):
    # Pravega names: letters, digits, '-' and '.'; '_' leads internal names
    return bool(name) and len(name) <= 255 and all(c.isalnum() or c in "-._" for c in name)


class ControllerState:
    """Scopes and streams, on the reactor thread; every method returns a Deferred."""

    log = Logger()

    def __init__(self, store, segments, clock=None):
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        self.store = store
        self.segments = segments
        self.scopes = {}     # scope -> {stream: {"segments": n, "sealed": bool}}
        # transaction id (32 hex digits) -> {"scope", "stream", "state", "deadline"}
        self.txns = {}
        self._log = None
        self._lock = defer.DeferredLock()

    @defer.inlineCallbacks
    def open(self):
        self._log = log = yield self.store.get_or_create(STATE_LOG)
        if log.end_position > log.start_position:
            batch = yield log.read(log.end_position - 1, 1)
            state = json.loads(bytes(batch.records()[0]))
            self.scopes = state["scopes"]
            self.txns = state.get("txns", {})
        self.log.info("controller state: {n} scopes, {t} transactions", n=len(self.scopes),
                      t=len(self.txns))
        # finish what a crash interrupted (merges are idempotent)
        for txn_id, txn in list(self.txns.items()):
            if txn["state"] == "COMMITTING":
                yield self.commit_txn(txn["scope"], txn["stream"], txn_id)
            elif txn["state"] == "ABORTING":
                yield self.abort_txn(txn["scope"], txn["stream"], txn_id)

    def _save(self):
        record = json.dumps({"scopes": self.scopes, "txns": self.txns}, sort_keys=True).encode()
        d = self._log.append([record])
        # keep only the newest document
        return d.addCallback(lambda r: self._log.truncate(r.first_position))

    def _mutate(self, fn, *args):
        return self._lock.run(fn, *args)

    def stream(self, scope, stream):
        return self.scopes.get(scope, {}).get(stream)

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
    def create_stream(self, scope, stream, count):
        @defer.inlineCallbacks
        def create():
            if scope not in self.scopes:
                return "SCOPE_NOT_FOUND"
            if not _valid_name(stream) or count < 1 or count > 1024:
                return "INVALID_STREAM_NAME"
            if stream in self.scopes[scope]:
                return "STREAM_EXISTS"
            for n in range(count):
                try:
                    yield self.segments.create(segment_name(scope, stream, n))
                except SegmentExists:
                    pass   # left by an earlier attempt that failed half-way
            self.scopes[scope][stream] = {"segments": count, "sealed": False}
            yield self._save()
            self.log.info("created stream {scope}/{stream} with {n} segments",
                          scope=scope, stream=stream, n=count)
            return "SUCCESS"
        return self._mutate(create)

    def seal_stream(self, scope, stream):
        @defer.inlineCallbacks
        def seal():
            if scope not in self.scopes:
                return "SCOPE_NOT_FOUND"
            info = self.stream(scope, stream)
            if info is None:
                return "STREAM_NOT_FOUND"
            for n in range(info["segments"]):
                try:
                    seg = yield self.segments.get(segment_name(scope, stream, n))
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
            for n in range(info["segments"]):
                try:
                    yield self.segments.delete(segment_name(scope, stream, n))
                except SegmentNotFound:
                    pass
            del self.scopes[scope][stream]
            yield self._save()
            return "SUCCESS"
        return self._mutate(delete)


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
            # The top 32 bits of a transaction id are its epoch (always 0
            # here): clients derive the transaction segments' names from them.
            # The Rust client also sign-extends the low 64 bits when it joins
            # the halves, so their top bit must be 0 too.
            rand = uuid.uuid4().int
            txn_id = f"{(rand >> 64) & 0xFFFFFFFF:016x}{rand & ((1 << 63) - 1):016x}"
            for n in range(info["segments"]):
                yield self.segments.create(txn_segment_name(scope, stream, n, txn_id))
            self.txns[txn_id] = {"scope": scope, "stream": stream, "state": "OPEN",
                                 "segments": info["segments"],
                                 "deadline": self._now_ms() + (lease_ms or DEFAULT_LEASE_MS)}
            yield self._save()
            self.log.info("opened transaction {txn} on {scope}/{stream}", txn=txn_id,
                          scope=scope, stream=stream)
            return "SUCCESS", txn_id, info["segments"]
        return self._mutate(create)

    def _txn(self, scope, stream, txn_id):
        txn = self.txns.get(txn_id)
        if txn is None or (txn["scope"], txn["stream"]) != (scope, stream):
            return None
        return txn

    def commit_txn(self, scope, stream, txn_id):
        """@return: Deferred firing with "SUCCESS", "TRANSACTION_NOT_FOUND" or "FAILURE"."""
        @defer.inlineCallbacks
        def commit():
            txn = self._txn(scope, stream, txn_id)
            if txn is None:
                return "TRANSACTION_NOT_FOUND"
            if txn["state"] == "COMMITTED":
                return "SUCCESS"
            if txn["state"] not in ("OPEN", "COMMITTING"):
                return "FAILURE"
            if txn["state"] == "OPEN":
                txn["state"] = "COMMITTING"
                yield self._save()
            for n in range(txn["segments"]):
                yield self.segments.merge(segment_name(scope, stream, n),
                                          txn_segment_name(scope, stream, n, txn_id))
            txn["state"] = "COMMITTED"
            self._prune()
            yield self._save()
            self.log.info("committed transaction {txn}", txn=txn_id)
            return "SUCCESS"
        return self._mutate(commit)

    def abort_txn(self, scope, stream, txn_id):
        @defer.inlineCallbacks
        def abort():
            txn = self._txn(scope, stream, txn_id)
            if txn is None:
                return "TRANSACTION_NOT_FOUND"
            if txn["state"] == "ABORTED":
                return "SUCCESS"
            if txn["state"] not in ("OPEN", "ABORTING"):
                return "FAILURE"
            if txn["state"] == "OPEN":
                txn["state"] = "ABORTING"
                yield self._save()
            for n in range(txn["segments"]):
                try:
                    yield self.segments.delete(txn_segment_name(scope, stream, n, txn_id))
                except SegmentNotFound:
                    pass
            txn["state"] = "ABORTED"
            self._prune()
            yield self._save()
            self.log.info("aborted transaction {txn}", txn=txn_id)
            return "SUCCESS"
        return self._mutate(abort)

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

    def __init__(self, state, call, segment_store_address):
        self.state = state
        self.call = call
        self.host, self.port = segment_store_address
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
        def handle(request, context):
            try:
                return fn(request)
            except _RpcError as e:
                context.abort(e.code, e.details)
            except Exception as e:
                self.log.failure("controller {method} failed", method=name)
                context.abort(self.grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        return handle

    # -- helpers ---------------------------------------------------------
    def _ranges(self, scope, stream, count):
        pb = self.pb
        return [pb.SegmentRange(
            segmentId=pb.SegmentId(streamInfo=pb.StreamInfo(scope=scope, stream=stream),
                                   segmentId=n),
            minKey=n / count, maxKey=(n + 1) / count) for n in range(count)]

    def _stream(self, info):
        return self.call(lambda: self.state.stream(info.scope, info.stream))

    # -- handlers --------------------------------------------------------
    def get_controller_server_list(self, request):
        return self.pb.ServerResponse()

    def create_scope(self, request):
        status = self.call(self.state.create_scope, request.scope)
        return self.pb.CreateScopeStatus(status=status)

    def check_scope_exists(self, request):
        return self.pb.ExistsResponse(
            exists=self.call(lambda: request.scope in self.state.scopes))

    def list_scopes(self, request):
        # everything in one page; the next call (with our token) gets the end
        if request.continuationToken.token:
            return self.pb.ScopesResponse(continuationToken=request.continuationToken)
        scopes = self.call(lambda: sorted(self.state.scopes))
        return self.pb.ScopesResponse(scopes=scopes,
                                      continuationToken=self.pb.ContinuationToken(token="end"))

    def delete_scope(self, request):
        return self.pb.DeleteScopeStatus(status=self.call(self.state.delete_scope, request.scope))

    def create_stream(self, request):
        info = request.streamInfo
        policy = request.scalingPolicy
        if policy.scaleType != self.pb.ScalingPolicy.FIXED_NUM_SEGMENTS:
            self.log.info("stream {scope}/{stream}: only fixed scaling, {n} segments",
                          scope=info.scope, stream=info.stream, n=policy.minNumSegments)
        status = self.call(self.state.create_stream, info.scope, info.stream,
                           max(1, policy.minNumSegments))
        return self.pb.CreateStreamStatus(status=status)

    def update_stream(self, request):
        info = self._stream(request.streamInfo)
        pb = self.pb
        if info is None:
            return pb.UpdateStreamStatus(status=pb.UpdateStreamStatus.STREAM_NOT_FOUND)
        if info["sealed"]:
            return pb.UpdateStreamStatus(status=pb.UpdateStreamStatus.STREAM_SEALED)
        if max(1, request.scalingPolicy.minNumSegments) != info["segments"]:
            # streams never scale here
            return pb.UpdateStreamStatus(status=pb.UpdateStreamStatus.FAILURE)
        return pb.UpdateStreamStatus(status=pb.UpdateStreamStatus.SUCCESS)

    def get_stream_configuration(self, request):
        info = self._stream(request)
        pb = self.pb
        count = info["segments"] if info else 0
        return pb.StreamConfig(
            streamInfo=pb.StreamInfo(scope=request.scope, stream=request.stream),
            scalingPolicy=pb.ScalingPolicy(minNumSegments=count, scaleFactor=1))

    def check_stream_exists(self, request):
        return self.pb.ExistsResponse(exists=self._stream(request) is not None)

    def list_streams(self, request):
        pb = self.pb
        scope = request.scope.scope
        streams = self.call(lambda: None if scope not in self.state.scopes
                            else sorted(self.state.scopes[scope]))
        if streams is None:
            return pb.StreamsInScopeResponse(status=pb.StreamsInScopeResponse.SCOPE_NOT_FOUND)
        if request.continuationToken.token:
            streams = []
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
        return self.pb.SegmentRanges(
            segmentRanges=self._ranges(request.scope, request.stream, info["segments"]))

    def get_epoch_segments(self, request):
        info = self._stream(request.streamInfo)
        if info is None or request.epoch != 0:
            return self.pb.SegmentRanges()
        s = request.streamInfo
        return self.pb.SegmentRanges(
            segmentRanges=self._ranges(s.scope, s.stream, info["segments"]))

    def get_segments(self, request):
        pb = self.pb
        s = request.streamInfo
        info = self._stream(s)
        count = info["segments"] if info else 0
        # no retention or truncation: every segment's head is offset 0
        return pb.SegmentsAtTime(segments=[pb.SegmentsAtTime.SegmentLocation(
            segmentId=pb.SegmentId(streamInfo=pb.StreamInfo(scope=s.scope, stream=s.stream),
                                   segmentId=n), offset=0) for n in range(count)])

    def get_successors(self, request):
        # fixed segments: a sealed segment has no successor (end of stream)
        return self.pb.SuccessorResponse()

    def get_uri(self, request):
        return self.pb.NodeUri(endpoint=self.host, port=self.port)

    def is_segment_valid(self, request):
        info = self._stream(request.streamInfo)
        return self.pb.SegmentValidityResponse(
            response=bool(info) and not info["sealed"]
            and 0 <= request.segmentId < info["segments"])

    def get_delegation_token(self, request):
        return self.pb.DelegationToken(delegationToken="")

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
        return pb.CreateTxnResponse(txnId=pb.TxnId(highBits=high, lowBits=low),
                                    activeSegments=self._ranges(s.scope, s.stream, count))

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


def parse_controller_endpoint(description):
    """
    C{tcp:PORT[:interface=HOST]} -> (host, port).  gRPC needs its own
    listener, so only plain TCP endpoint strings are accepted.

    @raise ValueError: on anything else.
    """
    parts = description.split(":")
    if parts[0] != "tcp" or len(parts) < 2:
        raise ValueError(f"controller endpoint must be tcp:PORT[:interface=HOST]: {description}")
    port = int(parts[1])
    host = "0.0.0.0"
    for p in parts[2:]:
        key, _, value = p.partition("=")
        if key != "interface" or not value:
            raise ValueError(f"unsupported controller endpoint option {p!r}")
        host = value
    if not 0 <= port <= 65535:
        raise ValueError(f"bad port {port}")
    return host, port


class ControllerService(service.Service):
    """
    Runs the gRPC server: opens the state on the reactor, serves on
    C{host:port} (port 0: any; see C{self.port} once started).
    """

    log = Logger()

    def __init__(self, store, segments, host, port, segment_store_address, reactor=None,
                 max_workers=8, expiry_interval=1.0):
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.expiry_interval = expiry_interval
        self._expiry = None
        self.state = ControllerState(store, segments, reactor)
        self.host = host
        self.port = port
        self.segment_store_address = segment_store_address
        self.max_workers = max_workers
        self._server = None
        self.ready = None

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

        self.ready = self.state.open().addBoth(ready)
        self.ready.addErrback(lambda f: self.log.failure("opening controller state", f))

        def run(fn, args):
            # requests that arrive before the state is read wait for it
            if opened:
                return defer.maybeDeferred(fn, *args)
            d = defer.Deferred()
            waiting.append(d)
            return d.addCallback(lambda _: fn(*args))

        def call(fn, *args):
            return blockingCallFromThread(self.reactor, run, fn, args)

        from twisted.internet.task import LoopingCall
        self._expiry = LoopingCall(self._expire)
        self._expiry.clock = self.reactor
        self._expiry.start(self.expiry_interval, now=False)

        servicer = ControllerServicer(self.state, call, self.segment_store_address)
        self._server = server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=self.max_workers, thread_name_prefix="pravega-controller"))
        server.add_generic_rpc_handlers((servicer.handler(),))
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.port:
            raise OSError(f"controller cannot listen on {self.host}")
        server.start()
        self.log.info("pravega controller listening on {host}:{port}",
                      host=self.host, port=self.port)

    def _expire(self):
        if self.state._log is None:
            return None
        d = self.state.expire_txns()
        d.addErrback(lambda f: self.log.failure("expiring transactions", f))
        return d

    def stopService(self):
        super().stopService()
        if self._expiry is not None and self._expiry.running:
            self._expiry.stop()
        server, self._server = self._server, None
        if server is None:
            return None
        # stop() returns a threading.Event: wait for it off the reactor
        return threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(),
                                         server.stop(1.0).wait)
