"""
A small synchronous client of a Pravega controller's gRPC API (ours or
Pravega's own): scopes and streams, for C{streamproto pravega scope|stream}
and for programs and tests.  Blocking (grpcio's channel): call it from a
thread (C{deferToThread}) in a Twisted program.
"""

from dataclasses import dataclass, field

SERVICE = "/io.pravega.controller.stream.api.grpc.v1.ControllerService/"


class ControllerError(Exception):
    """The controller refused a request, or could not be reached; one readable line."""


@dataclass
class SegmentRange:
    number: int
    epoch: int
    segment_id: int
    min_key: float
    max_key: float
    name: str


@dataclass
class StreamDescription:
    scope: str
    stream: str
    min_segments: int
    scaling: str
    retention: str
    tags: list = field(default_factory=list)
    segments: list = field(default_factory=list)


def segment_name(scope, stream, segment_id):
    """The qualified name of a segment id (segment number in the low 32 bits, epoch above)."""
    return f"{scope}/{stream}/{segment_id & 0xFFFFFFFF}.#epoch.{segment_id >> 32}"


class ControllerClient:
    """
    @param target: C{HOST:PORT} of the controller.
    @param tls: None, or C{(ca_pem_bytes or None, cert_pem_bytes or None,
        key_pem_bytes or None)}: verify the controller (and show a client
        certificate).
    @param server_name: the name to verify in the controller's certificate
        (default: the host of C{target}).
    @param timeout: seconds per call.
    """

    def __init__(self, target, tls=None, server_name=None, timeout=30.0):
        import grpc

        from streamproto.pravega import controller_pb2
        self.grpc, self.pb = grpc, controller_pb2
        self.target = target
        self.timeout = timeout
        if tls is None:
            self.channel = grpc.insecure_channel(target)
        else:
            ca, cert, key = tls
            credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert)
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            self.channel = grpc.secure_channel(target, credentials, options=options)

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, response_type):
        rpc = self.channel.unary_unary(SERVICE + method,
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=response_type.FromString)
        try:
            return rpc(request, timeout=self.timeout or None)
        except self.grpc.RpcError as e:
            code = e.code().name if hasattr(e, "code") and e.code() else "ERROR"
            details = e.details() if hasattr(e, "details") else str(e)
            raise ControllerError(f"controller {self.target}: {code}: {details}") from None

    @staticmethod
    def _status(response, enum, ok=("SUCCESS",)):
        name = enum.Name(response.status)
        if name not in ok:
            raise ControllerError(name)
        return name

    # -- scopes ----------------------------------------------------------
    def create_scope(self, scope):
        pb = self.pb
        r = self._call("createScope", pb.ScopeInfo(scope=scope), pb.CreateScopeStatus)
        return self._status(r, pb.CreateScopeStatus.Status)

    def delete_scope(self, scope):
        pb = self.pb
        r = self._call("deleteScope", pb.ScopeInfo(scope=scope), pb.DeleteScopeStatus)
        return self._status(r, pb.DeleteScopeStatus.Status)

    def list_scopes(self):
        pb = self.pb
        scopes, token = [], ""
        while True:
            r = self._call("listScopes", pb.ScopesRequest(
                continuationToken=pb.ContinuationToken(token=token)), pb.ScopesResponse)
            scopes.extend(r.scopes)
            if not r.scopes or r.continuationToken.token in ("", token):
                return scopes
            token = r.continuationToken.token

    # -- streams ---------------------------------------------------------
    def _info(self, scope, stream):
        return self.pb.StreamInfo(scope=scope, stream=stream)

    def create_stream(self, scope, stream, segments=1):
        pb = self.pb
        config = pb.StreamConfig(streamInfo=self._info(scope, stream),
                                 scalingPolicy=pb.ScalingPolicy(minNumSegments=segments))
        r = self._call("createStream", config, pb.CreateStreamStatus)
        return self._status(r, pb.CreateStreamStatus.Status)

    def seal_stream(self, scope, stream):
        pb = self.pb
        r = self._call("sealStream", self._info(scope, stream), pb.UpdateStreamStatus)
        return self._status(r, pb.UpdateStreamStatus.Status)

    def delete_stream(self, scope, stream):
        pb = self.pb
        r = self._call("deleteStream", self._info(scope, stream), pb.DeleteStreamStatus)
        return self._status(r, pb.DeleteStreamStatus.Status)

    def list_streams(self, scope):
        pb = self.pb
        streams, token = [], ""
        while True:
            r = self._call("listStreamsInScope", pb.StreamsInScopeRequest(
                scope=pb.ScopeInfo(scope=scope),
                continuationToken=pb.ContinuationToken(token=token)),
                pb.StreamsInScopeResponse)
            self._status(r, pb.StreamsInScopeResponse.Status)
            streams.extend(s.stream for s in r.streams)
            if not r.streams or r.continuationToken.token in ("", token):
                return streams
            token = r.continuationToken.token

    def describe_stream(self, scope, stream):
        """@return: a L{StreamDescription} with the current segments."""
        pb = self.pb
        config = self._call("getStreamConfiguration", self._info(scope, stream), pb.StreamConfig)
        ranges = self._call("getCurrentSegments", self._info(scope, stream), pb.SegmentRanges)
        policy = config.scalingPolicy
        retention = config.retentionPolicy
        description = StreamDescription(
            scope, stream, policy.minNumSegments,
            pb.ScalingPolicy.ScalingPolicyType.Name(policy.scaleType),
            "none" if retention.retentionType == 0 else
            f"{pb.RetentionPolicy.RetentionPolicyType.Name(retention.retentionType)} "
            f"{retention.retentionParam}",
            list(config.tags.tag))
        for r in ranges.segmentRanges:
            segment_id = r.segmentId.segmentId
            description.segments.append(SegmentRange(
                segment_id & 0xFFFFFFFF, segment_id >> 32, segment_id, r.minKey, r.maxKey,
                segment_name(scope, stream, segment_id)))
        return description
