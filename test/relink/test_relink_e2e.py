"""
Relink end to end on the real reactor: TCP and TLS, reconnection after a
dropped connection, the log bridge on the file store, and the twistd plugin.
"""

from twisted.internet import defer, reactor
from twisted.internet.endpoints import serverFromString
from twisted.internet.task import deferLater
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint
from streamproto.log import MemoryLogStore, open_store
from streamproto.relink import tap
from streamproto.relink.api import Connector, ListenerFactory
from streamproto.relink.config import LinkConfig
from streamproto.relink.endpoints import server_endpoints
from test.relink.test_relink_support import Recorder
from test.support.tlsutil import certs


class Waiting(Recorder):
    """A recorder whose test can wait for a number of messages."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._waiters = []

    def messages_received(self, link, channel_id, messages):
        result = super().messages_received(link, channel_id, messages)
        for want, d in list(self._waiters):
            if sum(map(len, self.messages.values())) >= want:
                self._waiters.remove((want, d))
                d.callback(None)
        return result

    def wait_for(self, count):
        d = defer.Deferred()
        if sum(map(len, self.messages.values())) >= count:
            d.callback(None)
        else:
            self._waiters.append((count, d))
        return d


class EndToEnd(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def serve(self, description, store=None):
        self.store = store if store is not None else MemoryLogStore(reactor)
        factory = ListenerFactory(server_endpoints(self.store, id_size=4))
        port = yield serverFromString(reactor, description).listen(factory)
        self.addCleanup(port.stopListening)
        return port.getHost().port

    def connector(self, port, name, tls=None, **kw):
        handler = Waiting()
        c = Connector(client_endpoint(reactor, "127.0.0.1", port, tls), name, handler,
                      connector_id_size=4, listener_id_size=4, **kw)
        c.start()
        self.addCleanup(c.stop)
        return c, handler

    @defer.inlineCallbacks
    def echo_round_trip(self, port, tls=None):
        c, handler = self.connector(port, "echo", tls)
        link = yield c.when_linked()
        msgs = [[b"%d" % i, b"x" * (i % 100)] for i in range(500)]
        consumed = yield link.channel(9).send_many(msgs)
        self.assertEqual(consumed, 500)
        yield handler.wait_for(500)
        self.assertEqual(handler.messages[9], [tuple(m) for m in msgs])
        done = yield c.shutdown()
        self.assertIsNone(done)

    def test_tcp_echo(self):
        return self.serve("tcp:0:interface=127.0.0.1").addCallback(self.echo_round_trip)

    @defer.inlineCallbacks
    def big_echo(self, port, tls=None):
        """
        32 MiB of 1 MiB messages echoed: both transports pause and resume
        their links many times (4 MiB byte windows, 1 MiB writes); every
        echo arrives, in order, and the send Deferreds fire.
        """
        c, handler = self.connector(port, "echo", tls)
        link = yield c.when_linked()
        ch = link.channel(4)
        pauses = []
        original = link.pause_transmission

        def counting(paused):
            pauses.append(paused)
            original(paused)
        link.pause_transmission = counting
        msgs = [b"%04d" % i + b"b" * (1 << 20) for i in range(32)]
        sent = []
        for m in msgs:
            if not ch.writable:
                yield ch.when_writable()
            sent.append(ch.send([m]))
        yield defer.gatherResults(sent)
        yield handler.wait_for(32)
        self.assertEqual([m[0][:4] for m in handler.messages[4]],
                         [m[:4] for m in msgs])
        self.assertEqual(handler.messages[4], [(m,) for m in msgs])
        self.assertIn(True, pauses)           # the transport did push back

    def test_tcp_big_echo(self):
        return self.serve("tcp:0:interface=127.0.0.1").addCallback(self.big_echo)

    def test_tls_big_echo(self):
        d = self.serve(certs().server_endpoint())
        d.addCallback(self.big_echo, certs().client_options(with_cert=True))
        return d

    def test_tls_echo_with_client_certificate(self):
        d = self.serve(certs().server_endpoint())
        d.addCallback(self.echo_round_trip, certs().client_options(with_cert=True))
        return d

    def test_plain_server_tls(self):
        d = self.serve(certs().ssl_endpoint())
        d.addCallback(self.echo_round_trip, certs().client_options(with_cert=False))
        return d

    def test_tls_without_client_certificate_never_links(self):
        d = self.serve(certs().server_endpoint())

        @defer.inlineCallbacks
        def go(port):
            c, _ = self.connector(port, "echo", certs().client_options(with_cert=False))
            yield deferLater(reactor, 0.5, lambda: None)
            self.assertFalse(c.link.attached)
        return d.addCallback(go)

    @defer.inlineCallbacks
    def test_reconnects_and_resumes(self):
        port = yield self.serve("tcp:0:interface=127.0.0.1")
        c, handler = self.connector(port, "echo")
        link = yield c.when_linked()
        yield link.channel(1).send([b"before"])
        first = c.link.owner
        self.assertIs(first, c.protocol)
        # drop the TCP connection under the link
        c.protocol.transport.abortConnection()
        yield deferLater(reactor, 0.05, lambda: None)
        after = yield link.channel(1).send([b"after"])
        self.assertEqual(after, 2)
        self.assertIs(c.link, link)
        self.assertIsNot(link.owner, first)
        yield handler.wait_for(2)
        self.assertEqual(handler.messages[1], [(b"before",), (b"after",)])

    @defer.inlineCallbacks
    def test_log_bridge_on_file_store(self):
        store = open_store(self.mktemp())
        self.addCleanup(store.close)
        port = yield self.serve("tcp:0:interface=127.0.0.1", store)
        c, _ = self.connector(port, "log")
        link = yield c.when_linked()
        yield link.channel(5).send_many([[b"rec%d" % i] for i in range(100)])
        log = yield store.get("relink-5")
        batch = yield log.read(0, -1)
        self.assertEqual(list(batch.records()), [b"rec%d" % i for i in range(100)])
        c2, _ = self.connector(port, "log-tx", connector_transactions=True)
        link2 = yield c2.when_linked()
        ch = link2.channel(6)
        ch.send_many([[b"a"], [b"b", b"c"]], ack=None)
        ok = yield ch.commit()
        self.assertTrue(ok)
        log = yield store.get("relink-6")
        batch = yield log.read(0, -1)
        self.assertEqual(list(batch.records()), [b"a", b"bc"])


class CommandLine(unittest.TestCase):
    timeout = 60

    @defer.inlineCallbacks
    def test_send_and_echo(self):
        import os
        import sys

        from twisted.internet.utils import getProcessOutputAndValue
        store = MemoryLogStore(reactor)
        factory = ListenerFactory(server_endpoints(store, id_size=4))
        port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(factory)
        self.addCleanup(port.stopListening)
        address = f"127.0.0.1:{port.getHost().port}"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=root)
        out, err, code = yield getProcessOutputAndValue(
            sys.executable, ["-c", "import sys; from streamproto.relink.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", "--connect", address, "send",
                             "--channel", "8"], env=env, path=root,
            reactor=reactor, stdinBytes=b"one\ntwo\n")
        self.assertEqual((code, out), (0, b"sent 2 messages\n"), err)
        log = yield store.get("relink-8")
        batch = yield log.read(0, -1)
        self.assertEqual(list(batch.records()), [b"one", b"two"])
        out, err, code = yield getProcessOutputAndValue(
            sys.executable, ["-c", "import sys; from streamproto.relink.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", "--connect", address, "echo",
                             "--count", "100"], env=env, path=root, reactor=reactor)
        self.assertEqual(code, 0, err)
        self.assertIn(b"100 messages of 64 B echoed", out)


class Plugin(unittest.TestCase):
    def test_options(self):
        o = tap.Options()
        o.parseOptions(["--log", "x-{channel}", "--id-size", "2"])
        self.assertEqual(o["port"], [tap.DEFAULT_PORT])
        self.assertEqual((o["log"], o["id-size"]), ("x-{channel}", 2))
        from twisted.python import usage
        self.assertRaises(usage.UsageError, tap.Options().parseOptions, ["--log", "{nope}"])
        self.assertRaises(usage.UsageError, tap.Options().parseOptions, ["--id-size", "9"])
        self.assertRaises(usage.UsageError, tap.Options().parseOptions,
                          ["--window-bytes", "0"])

    def test_window_bytes_option_reaches_the_links(self):
        o = tap.Options()
        o.parseOptions(["--port", "tcp:0:interface=127.0.0.1", "--window-bytes", "65536"])
        self.assertEqual(o["window-bytes"], 65536)
        service = tap.makeService(o, store=MemoryLogStore(reactor))
        trackers = [c.factory for c in service if hasattr(c, "factory")]
        factory = trackers[0].wrappedFactory
        for endpoint in factory.endpoints.values():
            self.assertEqual(endpoint.config.window_bytes, 65536)
            self.assertEqual(endpoint.config.max_queued_bytes, 65536)

    @defer.inlineCallbacks
    def link_to_service(self, endpoint):
        """
        Start the tap's service (stopped at the end of the test if it still
        runs) and link a Connector to its C{endpoint}: (service, link).
        """
        o = tap.Options()
        o.parseOptions(["--port", "tcp:0:interface=127.0.0.1"])
        service = tap.makeService(o, store=MemoryLogStore(reactor))
        service.startService()
        self.addCleanup(lambda: service.running and service.stopService())
        # do not consume the service's own Deferred: it stops the port with it
        ready = defer.Deferred()
        list(service)[0]._waitingForPort.addCallback(lambda p: (ready.callback(p), p)[1])
        listening = yield ready
        c = Connector(client_endpoint(reactor, "127.0.0.1", listening.getHost().port, None),
                      endpoint, Waiting(), connector_id_size=4, listener_id_size=4)
        c.start()
        self.addCleanup(c.stop)
        link = yield c.when_linked()
        return service, link

    @defer.inlineCallbacks
    def test_make_service_serves_echo(self):
        _, link = yield self.link_to_service("echo")
        n = yield link.channel(3).send([b"hi"])
        self.assertEqual(n, 1)

    @defer.inlineCallbacks
    def test_stopping_the_server_drains_connections(self):
        service, link = yield self.link_to_service("log")
        n = yield link.channel(3).send([b"kept"])
        self.assertEqual(n, 1)
        yield service.stopService()
        yield deferLater(reactor, 0.05, lambda: None)
        self.assertFalse(link.attached)
        self.assertIsNone(link.lost)


#: what the reference Go connector keeps in flight per channel by default
GO_WINDOW = 65536


class LargeSendWindow(unittest.TestCase):
    """
    A connector with a send window of 65,536 messages (the Go package's
    default) against the server's endpoints with their defaults: the server
    has no receive window to enforce (the spec has none), it applies
    backpressure instead, and nothing deadlocks even on C{echo}, whose
    echoes wait for acknowledgements that arrive behind the peer's data.
    """

    timeout = 120
    count = 200000
    size = 100

    @defer.inlineCallbacks
    def serve(self, description):
        self.store = open_store(self.mktemp())
        self.addCleanup(self.store.close)
        factory = ListenerFactory(server_endpoints(self.store, id_size=2))
        port = yield serverFromString(reactor, description).listen(factory)
        self.addCleanup(port.stopListening)
        self.factory = factory
        return port.getHost().port

    @defer.inlineCallbacks
    def run_window(self, description, name, tls=None, transactions=False):
        port = yield self.serve(description)
        handler = Waiting()
        config = LinkConfig(window=GO_WINDOW, max_queued=GO_WINDOW,
                            window_bytes=1 << 30, max_queued_bytes=1 << 30)
        c = Connector(client_endpoint(reactor, "127.0.0.1", port, tls), name, handler,
                      connector_id_size=2, listener_id_size=2, config=config,
                      connector_transactions=transactions)
        c.start()
        self.addCleanup(c.stop)
        link = yield c.when_linked()
        ch = link.channel(1)
        payload = b"m" * (self.size - 6)
        sent = 0
        largest_in_flight = 0
        last = None
        commits = []
        while sent < self.count:
            room = min(ch.room, self.count - sent, 4096)
            if room <= 0:
                yield ch.when_writable()
                continue
            batch = [[b"%06d" % i + payload] for i in range(sent, sent + room)]
            sent += room
            last = ch.send_many(batch)
            if transactions:
                commits.append(ch.commit())
            largest_in_flight = max(largest_in_flight, ch.assigned - ch.consumed)
            if sent % 16384 == 0:
                # let the reactor move bytes now and then
                yield deferLater(reactor, 0, lambda: None)
        consumed = yield last
        self.assertEqual(consumed, self.count)
        if transactions:
            self.assertTrue(all((yield defer.gatherResults(commits))))
        # the connector did keep a large window in flight
        self.assertGreater(largest_in_flight, 20000)
        return c, handler, link

    @defer.inlineCallbacks
    def echo(self, description, tls=None):
        c, handler, link = yield self.run_window(description, "echo", tls)
        yield handler.wait_for(self.count)
        got = handler.messages[1]
        self.assertEqual(len(got), self.count)
        self.assertEqual([m[0][:6] for m in got[::9973]],
                         [b"%06d" % i for i in range(0, self.count, 9973)])
        yield c.shutdown()

    @defer.inlineCallbacks
    def log(self, description, tls=None, transactions=False):
        name = "log-tx" if transactions else "log"
        c, handler, link = yield self.run_window(description, name, tls, transactions)
        yield c.shutdown()
        names = self.store.names()
        self.assertEqual(len(names), 1, names)
        log = yield self.store.get(names[0])
        self.assertEqual(log.end_position, self.count)
        records = []
        position = 0
        while position < self.count:
            batch = yield log.read(position, max_bytes=8 << 20)
            records += list(batch)
            position = batch.next_position
        self.assertEqual([bytes(r[:6]) for r in records],
                         [b"%06d" % i for i in range(self.count)])

    def test_echo_tcp(self):
        return self.echo("tcp:0:interface=127.0.0.1")

    def test_echo_tls(self):
        return self.echo(certs().server_endpoint(), certs().client_options(with_cert=True))

    def test_log_tcp(self):
        return self.log("tcp:0:interface=127.0.0.1")

    def test_log_tls(self):
        return self.log(certs().server_endpoint(), certs().client_options(with_cert=True))

    def test_log_tx_tcp(self):
        return self.log("tcp:0:interface=127.0.0.1", transactions=True)

    def test_log_tx_tls(self):
        return self.log(certs().server_endpoint(), certs().client_options(with_cert=True),
                        transactions=True)
