"""
The authorization policy on the Styx HTTP API, styx/0 and WebSocket, over
mTLS: an allowed and a denied certificate identity for read, write and
admin; bearer tokens on HTTP and WebSocket; 401 without credentials; a
reload while clients run.
"""

import json
import os

import treq
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, serverFromString, wrapClientTLS
from twisted.trial import unittest
from twisted.web.client import Agent, HTTPConnectionPool

from streamproto.core.auth import PolicyHolder, hash_token
from streamproto.log import LogConfig, MemoryLogStore
from streamproto.styx.api_client import StyxAPIError, StyxClient, _FixedTLSPolicy
from streamproto.styx.codec import ErrorCode
from streamproto.styx.resource import make_site
from streamproto.styx.stream_client import StyxConsumer, StyxProducer, StyxStreamError
from test.support import authutil
from test.support.authutil import denied_count
from test.support.tlsutil import certs
from test.support.wsclient import connect as websocket_connect

POLICY = """
[tokens]
dashboards = "%s"
ingest = "%s"

[[allow]]
principal = "cn:alice"
logs = ["*"]
ops = ["read", "write", "admin"]

[[allow]]
principal = "token:dashboards"
logs = ["events"]
ops = ["read"]

[[allow]]
principal = "token:ingest"
logs = ["events"]
ops = ["write"]
""" % (hash_token("dash-token"), hash_token("ingest-token"))


def write_policy(case, text=POLICY):
    """This module's policy (with the ingest token) by default."""
    return authutil.write_policy(case, text)


class StyxAuthTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        self.policy_path = write_policy(self)
        self.holder = PolicyHolder(self.policy_path)
        self.store = MemoryLogStore()
        self.log = yield self.store.create("events", LogConfig(max_record_size=1000))
        yield self.log.append([b"one", b"two"])
        yield self.store.create("other")
        # client certificates asked for, not required: anonymous clients too
        description = certs().server_endpoint() + ":requireClientCert=no"
        self.port = yield serverFromString(reactor, description).listen(
            make_site(self.store, timeout=10, authorizer=self.holder))
        self.addCleanup(self.port.stopListening)
        self.url = f"https://localhost:{self.port.getHost().port}"
        self.clients = []

    @defer.inlineCallbacks
    def tearDown(self):
        for client in self.clients:
            close = getattr(client, "close", None) or client.closeCachedConnections
            yield close()

    def client(self, cn=None):
        """A StyxClient presenting certificate C{cn} (None: no certificate)."""
        tls = certs().client_options_for(cn) if cn else certs().client_options(with_cert=False)
        client = StyxClient(self.url, reactor, tls_options=tls)
        self.clients.append(client)
        return client

    @defer.inlineCallbacks
    def assertDenied(self, d, status, code):
        try:
            yield d
        except StyxAPIError as e:
            self.assertEqual((e.status, e.code), (status, code))
            return e
        self.fail(f"not denied: expected {status}")

    # -- certificates ---------------------------------------------------------
    @defer.inlineCallbacks
    def test_allowed_identity(self):
        alice = self.client("alice")
        info = yield alice.create_log("new")
        self.assertEqual(info["name"], "new")
        yield alice.write_records("new", [b"a", b"b"])
        records = yield alice.read_records("new", whence="start")
        self.assertEqual(list(records), [b"a", b"b"])
        yield alice.truncate_log("new")
        yield alice.delete_log("new")
        names = [i["name"] for i in (yield alice.list_logs())]
        self.assertEqual(sorted(names), ["events", "other"])

    @defer.inlineCallbacks
    def test_denied_identity(self):
        bob = self.client("bob")
        before = {op: denied_count("styx-server", op) for op in ("read", "write", "admin")}
        yield self.assertDenied(bob.create_log("new"), 403, "forbidden")
        self.assertNotIn("new", self.store.names())
        yield self.assertDenied(bob.write_records("events", [b"x"]), 403, "forbidden")
        yield self.assertDenied(bob.write_record("events", b"x"), 403, "forbidden")
        self.assertEqual(self.log.end_position, (yield self._end()))
        yield self.assertDenied(bob.read_records("events", whence="start"), 403, "forbidden")
        yield self.assertDenied(bob.get_log("events"), 403, "forbidden")
        yield self.assertDenied(bob.truncate_log("events"), 403, "forbidden")
        yield self.assertDenied(bob.delete_log("events"), 403, "forbidden")
        yield self.assertDenied(bob.backup_log("events"), 403, "forbidden")
        yield self.assertDenied(bob.restore_log("restored", b"\0" * 100000), 403, "forbidden")
        self.assertEqual(sorted(self.store.names()), ["events", "other"])
        self.assertEqual((yield bob.list_logs()), [])
        after = {op: denied_count("styx-server", op) for op in ("read", "write", "admin")}
        self.assertEqual(after["write"] - before["write"], 2)
        self.assertEqual(after["read"] - before["read"], 2)
        self.assertEqual(after["admin"] - before["admin"], 5)

    @defer.inlineCallbacks
    def _end(self):
        the_log = yield self.store.get("events")
        self.assertEqual([bytes(r) for r in (yield the_log.read(0)).records()],
                         [b"one", b"two"])
        return the_log.end_position

    # -- tokens and anonymous ----------------------------------------------------
    def request(self, method, path, token=None, data=None, headers=None):
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.clients.append(pool)
        agent = Agent(reactor, contextFactory=_FixedTLSPolicy(
            certs().client_options(with_cert=False)), pool=pool)
        headers = dict(headers or {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return treq.request(method, self.url + path, headers=headers, data=data, agent=agent)

    @defer.inlineCallbacks
    def answer(self, *args, **kwargs):
        response = yield self.request(*args, **kwargs)
        body = yield response.content()
        return response, body

    @defer.inlineCallbacks
    def test_anonymous_gets_401(self):
        response, body = yield self.answer("GET", "/logs/events/records")
        self.assertEqual(response.code, 401)
        self.assertEqual(json.loads(body)["code"], "unauthorized")
        self.assertEqual(response.headers.getRawHeaders("www-authenticate"),
                         ['Bearer realm="streamproto"'])
        response, body = yield self.answer("POST", "/logs/events/records", data=b"x\n",
                                           headers={"Content-Type": "application/vnd.styx.line-delimited"})
        self.assertEqual(response.code, 401)
        self.assertEqual(json.loads(body)["code"], "unauthorized")
        response, body = yield self.answer("GET", "/logs")
        self.assertEqual((response.code, json.loads(body)), (200, []))

    @defer.inlineCallbacks
    def test_bearer_token(self):
        response, body = yield self.answer("GET", "/logs/events/records?whence=start",
                                           token="dash-token",
                                           headers={"Accept": "application/vnd.styx.line-delimited"})
        self.assertEqual((response.code, body), (200, b"one\ntwo\n"))
        response, body = yield self.answer("GET", "/logs", token="dash-token")
        self.assertEqual([i["name"] for i in json.loads(body)], ["events"])
        # the token may read events only, and not write it: 403
        response, body = yield self.answer("GET", "/logs/other/records", token="dash-token")
        self.assertEqual((response.code, json.loads(body)["code"]), (403, "forbidden"))
        response, body = yield self.answer("POST", "/logs/events/records", token="dash-token",
                                           data=b"x\n",
                                           headers={"Content-Type": "application/vnd.styx.line-delimited"})
        self.assertEqual((response.code, json.loads(body)["code"]), (403, "forbidden"))
        response, body = yield self.answer("POST", "/logs/events/records", token="ingest-token",
                                           data=b"three\n",
                                           headers={"Content-Type": "application/vnd.styx.line-delimited"})
        self.assertEqual(response.code, 200, body)
        self.assertEqual(self.log.end_position, json.loads(body)["position"])

    @defer.inlineCallbacks
    def test_styx_client_token(self):
        """StyxClient(token=...) sends it with every request."""
        client = StyxClient(self.url, reactor, tls_options=certs().client_options(
            with_cert=False), token="dash-token")
        self.clients.append(client)
        records = yield client.read_records("events", whence="start")
        self.assertEqual(list(records), [b"one", b"two"])
        yield self.assertDenied(client.write_records("events", [b"x"]), 403, "forbidden")
        yield self.assertDenied(self.client().read_records("events"), 401, "unauthorized")

    @defer.inlineCallbacks
    def test_unknown_token_401_and_never_logged(self):
        from twisted.logger import globalLogPublisher
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        response, body = yield self.answer("GET", "/logs/events/records",
                                           token="guess-token-123")
        self.assertEqual((response.code, json.loads(body)["code"]), (401, "unauthorized"))
        from twisted.logger import formatEvent
        text = "\n".join(formatEvent(e) + repr(e) for e in events)
        self.assertIn("unknown bearer token", text)
        self.assertNotIn("guess-token-123", text)

    # -- styx/0 -----------------------------------------------------------------
    @defer.inlineCallbacks
    def test_styx0_streams(self):
        port = self.port.getHost().port
        got = []
        consumer = yield StyxConsumer.connect(reactor, "localhost", port, "events", got.extend,
                                              whence="start",
                                              tls=certs().client_options_for("alice"))
        yield consumer.done
        self.assertEqual(got, [b"one", b"two"])
        producer = yield StyxProducer.connect(reactor, "localhost", port, "events",
                                              tls=certs().client_options_for("alice"))
        yield producer.write(b"three")
        yield producer.close()
        self.assertEqual(self.log.end_position, (yield self.store.get("events")).end_position)
        for cn, code in (("bob", ErrorCode.FORBIDDEN), (None, ErrorCode.UNAUTHORIZED)):
            tls = (certs().client_options_for(cn) if cn
                   else certs().client_options(with_cert=False))
            end = self.log.end_position
            producer = yield StyxProducer.connect(reactor, "localhost", port, "events", tls=tls)
            producer.write(b"never").addErrback(lambda _: None)
            with self.assertRaises(StyxStreamError) as e:
                yield producer.close()
            self.assertEqual(e.exception.code, code)
            self.assertEqual(self.log.end_position, end)
            got = []
            consumer = yield StyxConsumer.connect(reactor, "localhost", port, "events",
                                                  got.extend, whence="start", tls=tls)
            with self.assertRaises(StyxStreamError) as e:
                yield consumer.done
            self.assertEqual(e.exception.code, code)
            self.assertEqual(got, [])

    # -- WebSocket --------------------------------------------------------------
    def websocket(self, cn=None, token=None, produce=False):
        port = self.port.getHost().port
        headers = {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if produce:
            headers["X-HTTP-Method-Override"] = "POST"
        tls = certs().client_options_for(cn) if cn else certs().client_options(with_cert=False)
        endpoint = wrapClientTLS(tls, TCP4ClientEndpoint(reactor, "127.0.0.1", port))
        return websocket_connect(
            endpoint, f"wss://localhost:{port}/logs/events/records?whence=start", headers)

    @defer.inlineCallbacks
    def assertWebSocketRefused(self, status, **kwargs):
        client = yield self.websocket(**kwargs)
        with self.assertRaises(Exception) as e:
            yield client.opened
        yield client.closed
        self.assertIn(str(status), str(e.exception) + repr(getattr(client, "close_reason", "")))

    @defer.inlineCallbacks
    def test_websocket(self):
        client = yield self.websocket(token="dash-token")
        yield client.opened
        client.close()
        yield client.closed
        client = yield self.websocket(cn="alice")
        yield client.opened
        client.close()
        yield client.closed
        yield self.assertWebSocketRefused(401)
        yield self.assertWebSocketRefused(403, cn="bob")
        yield self.assertWebSocketRefused(403, token="dash-token", produce=True)
        self.assertEqual([bytes(r) for r in (yield self.log.read(0)).records()],
                         [b"one", b"two"])

    # -- reload -------------------------------------------------------------------
    @defer.inlineCallbacks
    def test_reload_under_load(self):
        """
        While clients write, the policy is reloaded (what SIGHUP does): a
        bad file keeps the old policy; a new one takes effect at the next
        request; no connection is dropped.
        """
        port = self.port.getHost().port
        producer = yield StyxProducer.connect(reactor, "localhost", port, "events",
                                              tls=certs().client_options_for("alice"))
        alice = self.client("alice")
        bob = self.client("bob")
        writes = []
        for i in range(50):
            writes.append(producer.write(b"r%d" % i))
            writes.append(alice.write_records("events", [b"h%d" % i]))
            if i == 10:
                with open(self.policy_path, "w") as f:
                    f.write("[[allow]]\nnot valid")
                self.assertFalse(self.holder.reload())
            if i == 20:
                with open(self.policy_path, "w") as f:
                    f.write(POLICY + '\n[[allow]]\nprincipal = "cn:bob"\nlogs = ["events"]\n'
                                     'ops = ["read"]\n')
                self.assertTrue(self.holder.reload())
                records = yield bob.read_records("events", whence="start", count=1)
                self.assertEqual(list(records), [b"one"])
        yield defer.gatherResults(writes)
        yield producer.close()
        the_log = yield self.store.get("events")
        self.assertEqual(the_log.end_position - 2, 100)


class CLITokenTests(unittest.TestCase):
    """streamproto styx takes the token from $STREAMPROTO_TOKEN, over HTTP and styx/0."""

    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore()
        yield self.store.create("events")
        policy = POLICY + '[[allow]]\nprincipal = "token:ingest"\nlogs = ["events"]\nops = ["read"]\n'
        port = reactor.listenTCP(0, make_site(self.store, authorizer=PolicyHolder(
            write_policy(self, policy))), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.host = f"127.0.0.1:{port.getHost().port}"

    @defer.inlineCallbacks
    def styx(self, *argv, stdin=b""):
        import io
        import sys

        from streamproto.styx import cli
        from test.styx.test_styx_cli_inprocess import Stdout
        args = cli.parse_args(["-s", self.host] + list(argv))
        out = Stdout()
        self.patch(sys, "stdout", out)
        self.patch(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        self.patch(sys, "stderr", io.StringIO())
        try:
            status = yield defer.ensureDeferred(cli.run(reactor, args))
        except cli.CLIError as e:      # main() prints it and exits 1
            return 1, str(e).encode()
        return status, out.bytes()

    @defer.inlineCallbacks
    def test_token_from_the_environment(self):
        self.patch(os, "environ", dict(os.environ))
        os.environ.pop("STREAMPROTO_TOKEN", None)
        status, out = yield self.styx("produce", "events", stdin=b"a\nb\n")
        self.assertEqual(status, 1)
        self.assertIn(b"unauthorized", out)
        os.environ["STREAMPROTO_TOKEN"] = "ingest-token"
        for transport in ((), ("--http",)):
            status, _ = yield self.styx("produce", "events", *transport, stdin=b"a\nb\n")
            self.assertEqual(status, 0)
            status, out = yield self.styx("consume", "events", "-n", "2", *transport)
            self.assertEqual((status, out), (0, b"a\nb\n"))
        the_log = yield self.store.get("events")
        self.assertEqual(the_log.end_position, 4)
        status, out = yield self.styx("logs", "delete", "events")
        self.assertEqual(status, 1)
        self.assertIn(b"forbidden", out)
        self.assertIn("events", self.store.names())
