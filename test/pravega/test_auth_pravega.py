"""
The authorization policy on Pravega: delegation tokens (format, expiry,
forgery), the segment store over mTLS (an allowed and a denied certificate
identity, tokens valid, expired and forged, at the wire level), and the
gRPC controller (Basic credentials, UNAUTHENTICATED / PERMISSION_DENIED,
tokens it issues accepted by the segment store).  The official client runs
in test_auth_pravega_interop.
"""

import base64
import json
import re
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, protocol, reactor
from twisted.internet.task import Clock
from twisted.trial import unittest

from streamproto.core.auth import Policy, PolicyHolder, hash_token
from streamproto.core.tls import client_endpoint
from streamproto.log import MemoryLogStore
from streamproto.pravega import codec
from streamproto.pravega.auth import (
    TOKEN_CHECK_FAILED, TOKEN_EXPIRED, DelegationTokens, TokenError, TokenExpired,
    segment_resource,
)
from streamproto.pravega.client import AuthTokenCheckFailedError
from streamproto.pravega.server import PravegaServerFactory
from test.support.authutil import denied_count, tls_as, write_policy
from test.pravega.test_pravega_server import RecordingClient
from test.support.tlsutil import certs

SEG = "sc/st/0.#epoch.0"
OTHER = "sc/other/0.#epoch.0"

POLICY = """
[users]
alice = "%s"
bob = "%s"

[pravega]
token-secret = "a secret of at least sixteen characters"
token-lifetime = 60

[[allow]]
principal = "cn:alice"
logs = ["pravega:sc/*"]
ops = ["read", "write", "admin"]

[[allow]]
principal = "user:alice"
logs = ["pravega:sc", "pravega:sc/*"]
ops = ["read", "write", "admin"]

[[allow]]
principal = "user:bob"
logs = ["pravega:sc/st"]
ops = ["read"]
""" % (hash_token("alice-pw"), hash_token("bob-pw"))


class TokenTests(unittest.SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.tokens = DelegationTokens(Policy.from_toml(POLICY), clock=self.clock)

    def test_round_trip(self):
        token = self.tokens.issue(["user:alice", "cn:x"], "pravega:sc/st")
        self.assertEqual(self.tokens.verify(token), ("user:alice", "cn:x"))

    def test_expired(self):
        token = self.tokens.issue(["user:alice"], "pravega:sc/st")
        self.clock.advance(59)
        self.tokens.verify(token)
        self.clock.advance(1)
        with self.assertRaises(TokenExpired) as e:
            self.tokens.verify(token)
        self.assertEqual(e.exception.code, TOKEN_EXPIRED)

    def test_forged(self):
        token = self.tokens.issue(["user:bob"], "pravega:sc/st")
        head, body, sig = token.split(".")
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        claims["prn"] = ["user:alice"]
        claims["exp"] += 10 ** 6
        forged_body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=")
        for forged in (f"{head}.{forged_body.decode()}.{sig}", token[:-2] + "AA", "x.y",
                       "", "a.b.c", token + "x"):
            with self.assertRaises(TokenError) as e:
                self.tokens.verify(forged)
            self.assertEqual(e.exception.code, TOKEN_CHECK_FAILED)
        other = DelegationTokens(Policy.from_toml(""), clock=self.clock)
        with self.assertRaises(TokenError):
            other.verify(token)

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=3),
           st.text(max_size=40))
    def test_readable_by_the_rust_client(self, principals, resource):
        """
        The payload decodes with the standard alphabet and padding (as the
        Rust client's base64::decode does) and its "exp" matches the
        client's regular expression.
        """
        token = self.tokens.issue(principals, resource)
        head, body, sig = token.split(".")
        self.assertEqual(len(body) % 4, 0)
        raw = base64.b64decode(body, validate=True)
        match = re.search(rb'"exp":\s?(\d+)', raw)
        self.assertEqual(int(match.group(1)), 1_700_000_060)
        self.assertEqual(json.loads(raw)["prn"], principals)
        self.assertEqual(self.tokens.verify(token), tuple(principals))

    @settings(max_examples=300, deadline=None)
    @given(st.one_of(st.text(max_size=200),
                     st.lists(st.text(alphabet="AZaz09-_=.+/", max_size=60), min_size=3,
                              max_size=3).map(".".join)))
    def test_garbage_is_a_token_error(self, garbage):
        with self.assertRaises(TokenError):
            self.tokens.verify(garbage)

    def test_remembered_tokens_still_expire(self):
        token = self.tokens.issue(["user:alice"], "r")
        self.assertEqual(self.tokens.verify(token), ("user:alice",))
        self.assertEqual(self.tokens.verify(token), ("user:alice",))
        self.clock.advance(60)
        with self.assertRaises(TokenExpired):
            self.tokens.verify(token)

    def test_random_secret_without_policy_secret(self):
        a = DelegationTokens(Policy.from_toml(""))
        b = DelegationTokens(Policy.from_toml(""))
        token = a.issue(["cn:x"], "r")
        a.verify(token)
        with self.assertRaises(TokenError):
            b.verify(token)

    def test_segment_resource(self):
        self.assertEqual(segment_resource("sc/st/0.#epoch.0"), "pravega:sc/st")
        self.assertEqual(segment_resource("sc/st/1.#epoch.2#transaction.00ff"),
                         "pravega:sc/st")
        self.assertEqual(segment_resource("sc/_RGgroup/0.#epoch.0"), "pravega:sc/_RGgroup")
        self.assertEqual(segment_resource("lonely"), "pravega:lonely")


class SegmentStoreTests(unittest.TestCase):
    """The segment store over mTLS, with and without tokens."""

    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        self.path = write_policy(self, POLICY)
        self.holder = PolicyHolder(self.path)
        self.tokens = DelegationTokens(self.holder)
        self.store = MemoryLogStore(reactor)
        self.factory = PravegaServerFactory(self.store, read_wait=0.3, authorizer=self.holder,
                                            tokens=self.tokens)
        description = certs().server_endpoint() + ":requireClientCert=no"
        from twisted.internet.endpoints import serverFromString
        self.port = yield serverFromString(reactor, description).listen(self.factory)
        self.addCleanup(self.stop)

    @defer.inlineCallbacks
    def stop(self):
        yield self.port.stopListening()
        for p in list(self.factory.connections):
            p.transport.loseConnection()

    @defer.inlineCallbacks
    def connect(self, cn):
        endpoint = client_endpoint(reactor, "127.0.0.1", self.port.getHost().port, tls_as(cn))
        proto = yield endpoint.connect(protocol.Factory.forProtocol(RecordingClient))
        self.addCleanup(self.disconnect, proto)
        yield proto.ready
        return proto

    def disconnect(self, proto):
        if not proto.closed.called:
            proto.transport.loseConnection()
        return proto.closed

    @defer.inlineCallbacks
    def assertRefused(self, d, code=TOKEN_CHECK_FAILED):
        e = yield self.assertFailure(d, AuthTokenCheckFailedError)
        self.assertEqual(e.reply.error_code, code)
        return e

    @defer.inlineCallbacks
    def test_certificate_identities(self):
        alice = yield self.connect("alice")
        yield alice.create_segment(SEG)
        setup = yield alice.setup_append(uuid.uuid4(), SEG)
        self.assertIsInstance(setup, codec.AppendSetup)
        yield alice.read_segment(SEG, 0)
        before = {op: denied_count("pravega-server", op) for op in ("read", "write", "admin")}
        bob = yield self.connect("bob")
        yield self.assertRefused(bob.create_segment(OTHER))
        yield self.assertRefused(bob.setup_append(uuid.uuid4(), SEG))
        yield self.assertRefused(bob.read_segment(SEG, 0))
        yield self.assertRefused(bob.segment_info(SEG))
        yield self.assertRefused(bob.seal_segment(SEG))
        yield self.assertRefused(bob.truncate_segment(SEG, 0))
        yield self.assertRefused(bob.delete_segment(SEG))
        after = {op: denied_count("pravega-server", op) for op in ("read", "write", "admin")}
        self.assertEqual((after["read"] - before["read"], after["write"] - before["write"],
                          after["admin"] - before["admin"]), (2, 1, 4))
        self.assertEqual(len(self.store.names()), 1)     # OTHER was not created
        info = yield alice.segment_info(SEG)
        self.assertFalse(info.is_sealed)
        # the connection that was refused still works for what it may do
        anonymous = yield self.connect(None)
        yield self.assertRefused(anonymous.read_segment(SEG, 0))
        token = self.tokens.issue(["user:bob"], "pravega:sc/st")
        yield bob.read_segment(SEG, 0, token=token)

    @defer.inlineCallbacks
    def test_tokens(self):
        alice = yield self.connect("alice")
        yield alice.create_segment(SEG)
        anonymous = yield self.connect(None)
        yield self.assertRefused(anonymous.setup_append(uuid.uuid4(), SEG))
        good = self.tokens.issue(["user:alice"], "pravega:sc/st")
        setup = yield anonymous.setup_append(uuid.uuid4(), SEG, token=good)
        self.assertIsInstance(setup, codec.AppendSetup)
        yield anonymous.read_segment(SEG, 0, token=good)
        # read-only bob: reads, no writes, no admin
        bob = self.tokens.issue(["user:bob"], "pravega:sc/st")
        yield anonymous.read_segment(SEG, 0, token=bob)
        yield self.assertRefused(anonymous.setup_append(uuid.uuid4(), SEG, token=bob))
        yield self.assertRefused(anonymous.seal_segment(SEG, token=bob))
        # expired: code 1, the client fetches a new one
        clock = Clock()
        clock.advance(1)
        old = DelegationTokens(self.holder, clock=clock).issue(["user:alice"], "pravega:sc/st")
        yield self.assertRefused(anonymous.read_segment(SEG, 0, token=old), TOKEN_EXPIRED)
        # forged: a token signed with another secret, a payload altered
        forged = DelegationTokens(PolicyHolder(write_policy(self, ""))).issue(
            ["user:alice"], "pravega:sc/st")
        yield self.assertRefused(anonymous.read_segment(SEG, 0, token=forged))
        head, body, sig = bob.split(".")
        raw = json.loads(base64.b64decode(body)).copy()
        raw["prn"] = ["user:alice"]
        altered = base64.urlsafe_b64encode(json.dumps(raw).encode()).rstrip(b"=").decode()
        yield self.assertRefused(anonymous.seal_segment(SEG, token=f"{head}.{altered}.{sig}"))
        yield self.assertRefused(anonymous.read_segment(SEG, 0, token="garbage"))
        info = yield alice.segment_info(SEG)
        self.assertFalse(info.is_sealed)

    @defer.inlineCallbacks
    def test_reload_revokes(self):
        """A reload applies to the next command of a connection that stays open."""
        alice = yield self.connect("alice")
        yield alice.create_segment(SEG)
        token = self.tokens.issue(["user:bob"], "pravega:sc/st")
        anonymous = yield self.connect(None)
        yield anonymous.read_segment(SEG, 0, token=token)
        with open(self.path, "w") as f:
            f.write(POLICY.replace('logs = ["pravega:sc/st"]', 'logs = ["pravega:sc/x"]'))
        self.assertTrue(self.holder.reload())
        yield self.assertRefused(anonymous.read_segment(SEG, 0, token=token))
        yield alice.read_segment(SEG, 0)


class ControllerTests(unittest.TestCase):
    """The gRPC controller's checks, called as the official client calls them."""

    timeout = 60

    def setUp(self):
        import grpc

        from streamproto.pravega.controller import ControllerService
        self.grpc = grpc
        self.path = write_policy(self, POLICY)
        self.holder = PolicyHolder(self.path)
        self.tokens = DelegationTokens(self.holder)
        self.store = MemoryLogStore(reactor)
        self.factory = PravegaServerFactory(self.store, authorizer=self.holder,
                                            tokens=self.tokens)
        self.service = ControllerService(self.store, self.factory.segments, "127.0.0.1", 0,
                                         ("127.0.0.1", 1), authorizer=self.holder,
                                         tokens=self.tokens)
        self.service.startService()
        self.addCleanup(self.service.stopService)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.addCleanup(self.channel.close)
        return self.service.ready

    def call(self, method, request, response, user=None, password=None):
        from twisted.internet.threads import deferToThread
        metadata = []
        if user is not None:
            credentials = base64.b64encode(f"{user}:{password}".encode()).decode()
            metadata.append(("authorization", f"Basic {credentials}"))
        stub = self.channel.unary_unary(
            "/io.pravega.controller.stream.api.grpc.v1.ControllerService/" + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response.FromString)
        return deferToThread(stub, request, metadata=metadata, timeout=20)

    @defer.inlineCallbacks
    def assertStatus(self, d, code):
        try:
            yield d
        except self.grpc.RpcError as e:
            self.assertEqual(e.code(), code)
            return e
        self.fail(f"expected {code}")

    @defer.inlineCallbacks
    def test_credentials(self):
        from streamproto.pravega import controller_pb2 as pb
        codes = self.grpc.StatusCode
        scope = pb.ScopeInfo(scope="sc")
        before = denied_count("pravega-controller", "admin")
        yield self.assertStatus(self.call("createScope", scope, pb.CreateScopeStatus),
                                codes.UNAUTHENTICATED)
        # empty credentials (the Rust client's default) are anonymous
        yield self.assertStatus(self.call("createScope", scope, pb.CreateScopeStatus, "", ""),
                                codes.UNAUTHENTICATED)
        yield self.assertStatus(self.call("createScope", scope, pb.CreateScopeStatus,
                                          "alice", "wrong"), codes.UNAUTHENTICATED)
        yield self.assertStatus(self.call("createScope", scope, pb.CreateScopeStatus,
                                          "mallory", "x"), codes.UNAUTHENTICATED)
        yield self.assertStatus(self.call("createScope", scope, pb.CreateScopeStatus,
                                          "bob", "bob-pw"), codes.PERMISSION_DENIED)
        # two anonymous, two with wrong credentials, bob: each counted as admin
        self.assertEqual(denied_count("pravega-controller", "admin") - before, 5)
        status = yield self.call("createScope", scope, pb.CreateScopeStatus, "alice", "alice-pw")
        self.assertEqual(status.status, pb.CreateScopeStatus.SUCCESS)
        config = pb.StreamConfig(streamInfo=pb.StreamInfo(scope="sc", stream="st"),
                                 scalingPolicy=pb.ScalingPolicy(minNumSegments=1))
        yield self.assertStatus(self.call("createStream", config, pb.CreateStreamStatus,
                                          "bob", "bob-pw"), codes.PERMISSION_DENIED)
        status = yield self.call("createStream", config, pb.CreateStreamStatus,
                                 "alice", "alice-pw")
        self.assertEqual(status.status, pb.CreateStreamStatus.SUCCESS)
        config.streamInfo.stream = "hidden"
        yield self.call("createStream", config, pb.CreateStreamStatus, "alice", "alice-pw")
        # bob may read st: its segments, a token; not the other stream
        info = pb.StreamInfo(scope="sc", stream="st")
        yield self.call("getCurrentSegments", info, pb.SegmentRanges, "bob", "bob-pw")
        yield self.assertStatus(self.call("getCurrentSegments",
                                          pb.StreamInfo(scope="sc", stream="hidden"),
                                          pb.SegmentRanges, "bob", "bob-pw"),
                                codes.PERMISSION_DENIED)
        listed = yield self.call("listStreamsInScope", pb.StreamsInScopeRequest(scope=scope),
                                 pb.StreamsInScopeResponse, "bob", "bob-pw")
        self.assertEqual([s.stream for s in listed.streams], ["st"])
        listed = yield self.call("listStreamsInScope", pb.StreamsInScopeRequest(scope=scope),
                                 pb.StreamsInScopeResponse, "alice", "alice-pw")
        self.assertEqual([s.stream for s in listed.streams], ["hidden", "st"])
        yield self.assertStatus(self.call("getDelegationToken", info, pb.DelegationToken),
                                codes.UNAUTHENTICATED)
        token = yield self.call("getDelegationToken", info, pb.DelegationToken, "bob", "bob-pw")
        self.assertEqual(self.tokens.verify(token.delegationToken), ("user:bob",))
        yield self.assertStatus(self.call("getDelegationToken",
                                          pb.StreamInfo(scope="sc", stream="hidden"),
                                          pb.DelegationToken, "bob", "bob-pw"),
                                codes.PERMISSION_DENIED)


class ControllerCertificateTests(unittest.TestCase):
    """The controller over mTLS: the gRPC peer's certificate is a principal."""

    timeout = 60

    def setUp(self):
        import grpc

        from streamproto.pravega.controller import ControllerService, parse_controller_endpoint
        self.grpc = grpc
        self.holder = PolicyHolder(write_policy(self, POLICY))
        self.store = MemoryLogStore(reactor)
        factory = PravegaServerFactory(self.store, authorizer=self.holder)
        tls = parse_controller_endpoint(certs().server_endpoint())[2]
        self.service = ControllerService(self.store, factory.segments, "127.0.0.1", 0,
                                         ("localhost", 1), tls=tls, authorizer=self.holder,
                                         tokens=factory.tokens)
        self.service.startService()
        self.addCleanup(self.service.stopService)
        return self.service.ready

    def call(self, cn, method, request, response):
        from twisted.internet.threads import deferToThread
        key, cert = certs().client(cn)
        with open(certs().ca, "rb") as ca, open(key, "rb") as k, open(cert, "rb") as c:
            credentials = self.grpc.ssl_channel_credentials(ca.read(), k.read(), c.read())
        channel = self.grpc.secure_channel(f"localhost:{self.service.port}", credentials)
        self.addCleanup(channel.close)
        stub = channel.unary_unary(
            "/io.pravega.controller.stream.api.grpc.v1.ControllerService/" + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response.FromString)
        return deferToThread(stub, request, timeout=20)

    @defer.inlineCallbacks
    def test_two_identities(self):
        from streamproto.pravega import controller_pb2 as pb
        # cn:alice may administer streams of scope sc (not the scope itself)
        yield self.service.state.create_scope("sc")
        config = pb.StreamConfig(streamInfo=pb.StreamInfo(scope="sc", stream="st"),
                                 scalingPolicy=pb.ScalingPolicy(minNumSegments=1))
        status = yield self.call("alice", "createStream", config, pb.CreateStreamStatus)
        self.assertEqual(status.status, pb.CreateStreamStatus.SUCCESS)
        info = pb.StreamInfo(scope="sc", stream="st")
        token = yield self.call("alice", "getDelegationToken", info, pb.DelegationToken)
        self.assertEqual(self.service.tokens.verify(token.delegationToken), ("cn:alice",))
        for method, request, response in (
                ("createStream", config, pb.CreateStreamStatus),
                ("getCurrentSegments", info, pb.SegmentRanges),
                ("sealStream", info, pb.UpdateStreamStatus)):
            try:
                yield self.call("bob", method, request, response)
            except self.grpc.RpcError as e:
                self.assertEqual(e.code(), self.grpc.StatusCode.PERMISSION_DENIED)
            else:
                self.fail(f"{method} allowed to cn:bob")
