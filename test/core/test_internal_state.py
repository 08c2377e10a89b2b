"""
The servers' internal state is not a public resource: the reserved
namespace (Pravega's controller state and segments) is neither listed nor
touched by the Styx API, Spark or the log targets of other servers, and a
damaged controller state fail-stops instead of being served as empty.
"""

import json

import treq
from twisted.internet import defer, reactor, threads
from twisted.python import usage
from twisted.trial import unittest
from zope.interface.verify import verifyObject

from streamproto.core.ops import store_problems
from streamproto.log import ILogStore, InvalidLogName, LogConfig, LogNotFound, MemoryLogStore
from streamproto.log.public import PublicLogStore, is_internal
from streamproto.pravega.controller import STATE_LOG, ControllerService, ControllerStateDamaged
from streamproto.pravega.segments import SegmentStore, log_name
from streamproto.styx.resource import make_site

SERVICE = "/io.pravega.controller.stream.api.grpc.v1.ControllerService/"


class ReservedNamespace(unittest.SynchronousTestCase):
    def setUp(self):
        self.store = MemoryLogStore()
        for name in (STATE_LOG, log_name("scope/stream/0.#epoch.0"), "__future", "events"):
            self.successResultOf(self.store.create(name))
        self.public = PublicLogStore(self.store)

    def test_names(self):
        self.assertTrue(is_internal(STATE_LOG))
        self.assertTrue(is_internal(log_name("a/b/0")))
        self.assertTrue(is_internal("__x"))
        self.assertFalse(is_internal("events"))
        self.assertFalse(is_internal("pravega"))
        self.assertFalse(is_internal("_single"))

    def test_view(self):
        verifyObject(ILogStore, self.public)
        self.assertEqual(self.public.names(), ["events"])
        for name in (STATE_LOG, "pravega_x", "__future"):
            self.failureResultOf(self.public.get(name), LogNotFound)
            self.failureResultOf(self.public.delete(name), LogNotFound)
            f = self.failureResultOf(self.public.create(name), InvalidLogName)
            self.assertIn("reserved for the servers' internal state", str(f.value))
            self.failureResultOf(self.public.get_or_create(name), InvalidLogName)
        # untouched
        self.assertEqual(len(self.store.names()), 4)
        self.assertEqual(self.successResultOf(self.public.get("events")).name, "events")


class StyxAPI(unittest.TestCase):
    timeout = 30

    def setUp(self):
        self.store = MemoryLogStore(reactor)
        self.successResultOf(self.store.create(STATE_LOG))
        self.successResultOf(self.store.create("events"))
        self.port = reactor.listenTCP(0, make_site(self.store, default_config=LogConfig()),
                                      interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.base = f"http://127.0.0.1:{self.port.getHost().port}"

    @defer.inlineCallbacks
    def call(self, method, path, **kwargs):
        response = yield treq.request(method, self.base + path, persistent=False, **kwargs)
        body = yield response.content()
        return response.code, json.loads(body) if body else None

    @defer.inlineCallbacks
    def test_internal_logs_are_not_part_of_the_api(self):
        code, body = yield self.call("GET", "/logs")
        self.assertEqual((code, [log["name"] for log in body]), (200, ["events"]))
        for method, path in (("GET", f"/logs/{STATE_LOG}"), ("DELETE", f"/logs/{STATE_LOG}"),
                             ("POST", f"/logs/{STATE_LOG}/truncate"),
                             ("GET", f"/logs/{STATE_LOG}/records"),
                             ("GET", f"/logs/{STATE_LOG}/backup")):
            code, body = yield self.call(method, path)
            self.assertEqual((code, body["code"]), (404, "log_not_found"), (method, path))
        code, body = yield self.call("POST", f"/logs/{STATE_LOG}/records", data=b"x",
                                     headers={"Content-Type": "application/octet-stream"})
        self.assertEqual((code, body["code"]), (404, "log_not_found"))
        for name in ("pravega_x", "__x"):
            code, body = yield self.call("POST", "/logs", data={"name": name})
            self.assertEqual((code, body["code"]), (400, "log_invalid_name"), name)
        # the state is as it was
        log = yield self.store.get(STATE_LOG)
        self.assertEqual(log.end_position, 0)
        self.assertIn(STATE_LOG, self.store.names())


class LogTargets(unittest.SynchronousTestCase):
    def test_lumberjack_and_relink_refuse_internal_targets(self):
        from streamproto.lumberjack.tap import Options as Lumberjack
        from streamproto.relink.tap import Options as Relink
        for options, argv in ((Lumberjack(), ["--log", "pravega-controller"]),
                              (Relink(), ["--log", "pravega_{channel}"]),
                              (Relink(), ["--log", "__{channel}"])):
            with self.assertRaises(usage.UsageError) as caught:
                options.parseOptions(argv + ["--data", self.mktemp()])
            self.assertIn("reserved for the servers' internal state", str(caught.exception))


class DamagedControllerState(unittest.TestCase):
    """One line written into the controller's log: fail-stop, never an empty state."""

    timeout = 30

    @defer.inlineCallbacks
    def test_fail_stop(self):
        store = MemoryLogStore(reactor)
        log = yield store.create(STATE_LOG)
        yield log.append([json.dumps({"scopes": {"kept": {}}}).encode()])
        yield log.append([b"not json, written behind the controller's back"])
        service = ControllerService(store, SegmentStore(store), "127.0.0.1", 0,
                                    ("store.example", 12345))
        service.startService()
        self.addCleanup(service.stopService)
        yield service.ready
        self.assertIsInstance(service.failure, ControllerStateDamaged)
        self.assertIn("record 1", str(service.failure))
        problems = store_problems([store])
        self.assertEqual(len(problems), 1, problems)
        self.assertTrue(problems[0].startswith("pravega controller: state unavailable: "))
        # requests are refused with the cause, not answered from an empty state
        import grpc

        from streamproto.pravega import controller_pb2 as pb
        channel = grpc.insecure_channel(f"localhost:{service.port}")
        self.addCleanup(channel.close)
        rpc = channel.unary_unary(SERVICE + "listScopes",
                                  request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=pb.ScopesResponse.FromString)
        with self.assertRaises(grpc.RpcError) as caught:
            yield threads.deferToThread(rpc, pb.ScopesRequest(), timeout=10)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertIn("controller state unavailable", caught.exception.details())
        # and nothing was written over the damaged state
        self.assertEqual(log.end_position, 2)
        yield service.stopService()
        self.assertEqual(store_problems([store]), [])
