"""
The authorization policy on Lumberjack, reliable streams and Relink, over
mTLS: an allowed (C{cn:alice}) and a denied (C{cn:bob}) certificate
identity; each protocol's own way of saying no, before the store.
"""

import json

from twisted.internet import defer, reactor
from twisted.internet.endpoints import serverFromString
from twisted.trial import unittest

from streamproto.core.auth import PolicyHolder
from streamproto.core.tls import client_endpoint
from streamproto.log import MemoryLogStore
from streamproto.lumberjack.codec import encode_batch
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import LogStoreSink
from streamproto.reliable.server import ReliableStreamFactory
from streamproto.reliable.session import MemorySessionStore
from streamproto.relink.api import Connector, ListenerFactory
from streamproto.relink.endpoints import server_endpoints
from test.support import authutil
from test.support.authutil import POLICY, denied_count, tls_as, write_policy
from test.support.netutil import wait_until
from test.relink.test_relink_e2e import Waiting
from test.support.tlsutil import certs

ACK_1 = b"2A\x00\x00\x00\x01"


def error_line(received):
    """The reliable server's error line arrived (it closes after it; TLS waits for us)."""
    return received.endswith(b"\n") and b'"error"' in received


class Base(unittest.TestCase):
    timeout = 30

    def setUp(self):
        self.path = write_policy(self, POLICY)
        self.holder = PolicyHolder(self.path)
        self.store = MemoryLogStore(reactor)

    @defer.inlineCallbacks
    def listen(self, factory):
        port = yield serverFromString(reactor, certs().server_endpoint()).listen(factory)
        self.addCleanup(port.stopListening)
        return port.getHost().port


class LumberjackTests(Base):
    @defer.inlineCallbacks
    def setUp(self):
        super().setUp()
        self.factory = LumberjackServerFactory(LogStoreSink(self.store, "beats"),
                                               authorizer=self.holder)
        self.port = yield self.listen(self.factory)

    @defer.inlineCallbacks
    def test_allowed(self):
        got = yield authutil.exchange(self.port, "alice", encode_batch([b'{"a":1}'], 0),
                             until=lambda r: len(r) >= 6)
        self.assertEqual(got, ACK_1)
        records = list((yield (yield self.store.get("beats")).read(0)).records())
        self.assertEqual(len(records), 1)
        yield wait_until(lambda: not self.factory.connections)

    @defer.inlineCallbacks
    def test_denied_closes_before_any_ack(self):
        before = denied_count("lumberjack-server", "write")
        got = yield authutil.exchange(self.port, "bob", encode_batch([b'{"a":1}'], 0)
                             + encode_batch([b'{"a":2}'], 0, first_seq=2))
        self.assertEqual(got, b"")
        self.assertNotIn("beats", self.store.names())
        self.assertEqual(denied_count("lumberjack-server", "write") - before, 1)
        # an empty window is not answered either
        got = yield authutil.exchange(self.port, "bob", b"2W\x00\x00\x00\x00")
        self.assertEqual(got, b"")

    @defer.inlineCallbacks
    def test_reload_applies_to_the_next_batch(self):
        """An open connection is not dropped by a reload; its next batch is judged anew."""
        received = []
        done = defer.Deferred()
        from twisted.internet import protocol

        class Writer(protocol.Protocol):
            def connectionMade(self):
                self.transport.write(encode_batch([b'{"a":1}'], 0))

            def dataReceived(self, data):
                received.append(data)
                if len(received) == 1:
                    with open(test.path, "w") as f:
                        f.write("")  # a valid policy allowing nothing
                    test.assertTrue(test.holder.reload())
                    self.transport.write(encode_batch([b'{"a":2}'], 0, first_seq=2))

            def connectionLost(self, reason):
                done.callback(None)
        test = self
        yield client_endpoint(reactor, "127.0.0.1", self.port, tls_as("alice")).connect(
            protocol.Factory.forProtocol(Writer))
        yield done
        self.assertEqual(b"".join(received), ACK_1)
        self.assertEqual(len(list((yield (yield self.store.get("beats")).read(0)).records())),
                         1)


class ReliableTests(Base):
    @defer.inlineCallbacks
    def setUp(self):
        super().setUp()
        with open(self.path, "a") as f:
            f.write('[[allow]]\nprincipal = "cn:carol"\nlogs = ["reliable:session:c-*"]\n'
                    'ops = ["read"]\n')
        self.holder.reload()
        self.sessions = MemorySessionStore(reactor)
        self.addCleanup(self.sessions.close)
        self.port = yield self.listen(ReliableStreamFactory(self.sessions,
                                                            authorizer=self.holder))

    def lines(self, data):
        return [json.loads(line) for line in data.splitlines() if line.strip()]

    @defer.inlineCallbacks
    def test_stateless(self):
        got = yield authutil.exchange(self.port, "alice", b"{}\n", until=lambda r: r.count(b"\n") >= 3)
        self.assertIn("data", self.lines(got)[0])
        before = denied_count("reliable-stream-server", "read")
        got = yield authutil.exchange(self.port, "bob", b"{}\n", until=error_line)
        self.assertEqual(self.lines(got), [{"error": "forbidden: read on reliable:stateless"}])
        self.assertEqual(denied_count("reliable-stream-server", "read") - before, 1)

    @defer.inlineCallbacks
    def test_stateful(self):
        opening = b'{"uuid": "c-1", "params": {"count": 2}}\n'
        got = yield authutil.exchange(self.port, "carol", opening, until=lambda r: r.count(b"\n") >= 2)
        self.assertEqual([m["id"] for m in self.lines(got)], [1, 2])
        got = yield authutil.exchange(self.port, "bob", opening.replace(b"c-1", b"c-2"),
                                      until=error_line)
        self.assertEqual(self.lines(got), [{"error": "forbidden: read on reliable:session:c-2"}])
        # carol may not open sessions outside c-*; nothing was stored for them
        got = yield authutil.exchange(self.port, "carol",
                                      b'{"uuid": "d-1", "params": {"count": 2}}\n',
                                      until=error_line)
        self.assertEqual(self.lines(got), [{"error": "forbidden: read on reliable:session:d-1"}])
        from streamproto.reliable.errors import UnknownSession
        with self.assertRaises(UnknownSession):
            yield self.sessions.after("d-1", 0)
        got = yield authutil.exchange(self.port, "bob", b'{"uuid": "c-1", "state": 0}\n',
                                      until=error_line)
        self.assertEqual(self.lines(got), [{"error": "forbidden: read on reliable:session:c-1"}])


class RelinkTests(Base):
    @defer.inlineCallbacks
    def setUp(self):
        super().setUp()
        with open(self.path, "a") as f:
            f.write('[[allow]]\nprincipal = "cn:carol"\nlogs = ["relink:log", "relink-1"]\n'
                    'ops = ["write"]\n')
        self.holder.reload()
        self.factory = ListenerFactory(
            server_endpoints(self.store, id_size=4, authorizer=self.holder),
            authorizer=self.holder)
        self.port = yield self.listen(self.factory)

    def connector(self, cn, name):
        handler = Waiting()
        c = Connector(client_endpoint(reactor, "127.0.0.1", self.port, tls_as(cn)), name,
                      handler, connector_id_size=4, listener_id_size=4)
        c.start()
        self.addCleanup(c.stop)
        return c, handler

    @defer.inlineCallbacks
    def test_echo(self):
        c, handler = self.connector("alice", "echo")
        link = yield c.when_linked()
        yield link.channel(1).send([b"hi"])
        yield handler.wait_for(1)
        before = denied_count("relink-server", "write")
        c, _ = self.connector("bob", "echo")
        yield wait_until(lambda: denied_count("relink-server", "write") > before)
        self.assertFalse(c.link.attached)

    @defer.inlineCallbacks
    def test_log_bridge_per_log(self):
        c, _ = self.connector("carol", "log")
        link = yield c.when_linked()
        yield link.channel(1).send_many([[b"a"], [b"b"]])
        log = yield self.store.get("relink-1")
        self.assertEqual(list((yield log.read(0)).records()), [b"a", b"b"])
        # channel 2 goes to relink-2, which carol may not write: the link ends
        before = denied_count("relink-server", "write")
        link.channel(2).send([b"never"]).addErrback(lambda _: None)
        yield wait_until(lambda: denied_count("relink-server", "write") > before)
        self.assertNotIn("relink-2", self.store.names())
        # carol may not link to echo at all
        c, _ = self.connector("carol", "echo")
        yield wait_until(lambda: denied_count("relink-server", "write") > before + 1)
        self.assertFalse(c.link.attached)


class RelinkOneLogTests(Base):
    """A log bridge writing every channel to one log: the handshake decides."""

    @defer.inlineCallbacks
    def setUp(self):
        super().setUp()
        with open(self.path, "a") as f:
            f.write('[[allow]]\nprincipal = "cn:carol"\nlogs = ["relink:log"]\n'
                    'ops = ["write"]\n')
        self.holder.reload()
        self.port = yield self.listen(ListenerFactory(
            server_endpoints(self.store, "everything", id_size=4, authorizer=self.holder),
            authorizer=self.holder))

    @defer.inlineCallbacks
    def test_handshake_ends(self):
        handler = Waiting()
        before = denied_count("relink-server", "write")
        c = Connector(client_endpoint(reactor, "127.0.0.1", self.port, tls_as("carol")), "log",
                      handler, connector_id_size=4, listener_id_size=4)
        c.start()
        self.addCleanup(c.stop)
        yield wait_until(lambda: denied_count("relink-server", "write") > before)
        self.assertFalse(c.link.attached)
        c = Connector(client_endpoint(reactor, "127.0.0.1", self.port, tls_as("alice")), "log",
                      handler, connector_id_size=4, listener_id_size=4)
        c.start()
        self.addCleanup(c.stop)
        link = yield c.when_linked()
        yield link.channel(3).send([b"in"])
        log = yield self.store.get("everything")
        self.assertEqual(list((yield log.read(0)).records()), [b"in"])


class UmbrellaTests(unittest.TestCase):
    """
    C{twistd streamproto --auth-policy}: every server gets the policy
    through the plugin wiring (behind the connection tracker), and SIGHUP
    reloads it in all of them.
    """

    timeout = 60

    @defer.inlineCallbacks
    def test_every_server_and_sighup(self):
        import os
        import signal
        import tempfile

        from streamproto import tap
        from streamproto.styx.api_client import StyxAPIError, StyxClient
        from test.support.netutil import free_port
        if not hasattr(signal, "SIGHUP"):
            raise unittest.SkipTest("no SIGHUP on this platform")
        path = write_policy(self, POLICY)
        ports = {name: free_port() for name in ("styx-server", "lumberjack-server",
                                                 "reliable-stream-server", "relink-server")}
        args = ["--data", tempfile.mkdtemp(), "--metrics", "none", "--auth-policy", path,
                "--shutdown-timeout", "0.5",
                "--only", ",".join(ports)]
        for name, port in ports.items():
            args += ["--listen", f"{name}={certs().server_endpoint(port)}"]
        options = tap.Options()
        options.parseOptions(args)
        top = tap.makeService(options)
        before = signal.getsignal(signal.SIGHUP)
        top.startService()
        self.addCleanup(lambda: top.stopService() if top.running else None)
        url = f"https://localhost:{ports['styx-server']}"
        alice = StyxClient(url, reactor, tls_options=tls_as("alice"))
        bob = StyxClient(url, reactor, tls_options=tls_as("bob"))
        self.addCleanup(alice.close)
        self.addCleanup(bob.close)
        yield alice.create_log("events")
        with self.assertRaises(StyxAPIError) as e:
            yield bob.get_log("events")
        self.assertEqual(e.exception.status, 403)
        got = yield authutil.exchange(ports["lumberjack-server"], "bob",
                                      encode_batch([b'{"a":1}'], 0))
        self.assertEqual(got, b"")
        got = yield authutil.exchange(ports["reliable-stream-server"], "bob", b"{}\n",
                                      until=error_line)
        self.assertIn(b"forbidden", got)
        got = yield authutil.exchange(ports["lumberjack-server"], "alice",
                                      encode_batch([b'{"a":1}'], 0), until=lambda r: len(r) >= 6)
        self.assertEqual(got, ACK_1)
        # SIGHUP: bob may now read events, everywhere the policy is used
        with open(path, "a") as f:
            f.write('[[allow]]\nprincipal = "cn:bob"\nlogs = ["events"]\nops = ["read"]\n')
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(200):
            try:
                info = yield bob.get_log("events")
                break
            except StyxAPIError:
                yield task_sleep(0.05)
        self.assertEqual(info["name"], "events")
        yield top.stopService()
        self.assertEqual(signal.getsignal(signal.SIGHUP), before)


def task_sleep(seconds):
    from twisted.internet import task
    return task.deferLater(reactor, seconds, lambda: None)
