"""
The gRPC handlers of the controller (L{ControllerServicer}).

grpcio runs handlers on its own thread pool.  L{ControllerState} lives on
the reactor thread (it uses the log store); each handler hands its request
to it with C{blockingCallFromThread} and waits, so the reactor never blocks
and all store access stays on the reactor thread.
"""

import json

from twisted.logger import Logger

from streamproto.pravega.controller.layout import Layout

SERVICE_NAME = "io.pravega.controller.stream.api.grpc.v1.ControllerService"
#: the C{server} label of the controller's denials in the metrics
SERVER_LABEL = "pravega-controller"


def _grpc():
    import grpc

    from streamproto.pravega import controller_pb2
    return grpc, controller_pb2


class _RpcError(Exception):
    """A gRPC status to answer with (C{context.abort(code, details)})."""

    def __init__(self, code, details):
        super().__init__(details)
        self.code = code
        self.details = details


def _txn_hex(txn_id):
    """The 32 hex digits of a C{TxnId} message (two signed 64-bit halves)."""
    mask = (1 << 64) - 1
    return f"{txn_id.highBits & mask:016x}{txn_id.lowBits & mask:016x}"


def _txn_bits(txn_hex):
    """The C{(highBits, lowBits)} of a C{TxnId} message for 32 hex digits."""
    def signed(v):
        return v - (1 << 64) if v >= 1 << 63 else v
    return signed(int(txn_hex[:16], 16)), signed(int(txn_hex[16:], 16))


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
