"""
TLS with required client certificates, for every server: a client without
a certificate, with one from another CA, or with an expired one is refused
before any protocol byte reaches the server's protocol; the right one works
(a round trip with our client for that protocol).
"""

import os
import shutil
import tempfile

from twisted.internet import defer, reactor
from twisted.internet.endpoints import serverFromString
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint, client_tls_options
from streamproto.log.filestore import FileLogStore
from test.support.netutil import connect, free_port, with_timeout
from test.torture.test_torture_abuse import relink_echo_handshake, relink_echo_round_trip, relink_factory
from test.support.tlsutil import certs
from test.support.torture_harness import ServerProcess, suspicious_output, wait_for_port


class CountingWrapper(ProtocolWrapper):
    """Counts the (decrypted) bytes that reach the server's protocol."""

    def dataReceived(self, data):
        self.factory.bytes_in += len(data)
        super().dataReceived(data)


class CountingFactory(WrappingFactory):
    protocol = CountingWrapper

    def __init__(self, wrapped):
        super().__init__(wrapped)
        self.bytes_in = 0


class TLSCase:
    """Mixed into a TestCase per protocol: C{make_factory}, C{first_bytes}, C{round_trip}."""

    timeout = 60
    first_bytes = b"hello"

    def make_factory(self, store):
        raise NotImplementedError

    def round_trip(self, port, tls):
        """Deferred: a successful exchange with our client over C{tls}."""
        raise NotImplementedError

    @defer.inlineCallbacks
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="streamproto-tls-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.store = FileLogStore(os.path.join(self.dir, "data"), reactor=reactor,
                                  retention_interval=None)
        self.addCleanup(self.store.close)
        self.counting = CountingFactory(self.make_factory(self.store))
        self.listening = yield serverFromString(reactor, certs().server_endpoint()).listen(
            self.counting)
        self.addCleanup(self.listening.stopListening)
        self.port = self.listening.getHost().port

    def bad_options(self, kind):
        c = certs()
        if kind == "none":
            return c.client_options(with_cert=False)
        if kind == "other-ca":
            return client_tls_options("localhost", ca_certs=c.ca, cert=c.other_client_cert,
                                      private_key=c.other_client_key)
        return client_tls_options("localhost", ca_certs=c.ca, cert=c.expired_client_cert,
                                  private_key=c.expired_client_key)

    @defer.inlineCallbacks
    def refused(self, kind):
        try:
            proto = yield connect(self.port, tls=self.bad_options(kind))
        except Exception:   # noqa: BLE001 - refused during the handshake: fine
            proto = None
        if proto is not None:
            # TLS 1.3: the client may believe the handshake is done and send
            # its first message; the server must drop it unread
            proto.transport.write(self.first_bytes)
            try:
                yield with_timeout(proto.closed, 5)
            except defer.CancelledError:
                proto.transport.abortConnection()
                self.fail(f"a client with {kind} certificate was kept connected")
            self.assertEqual(bytes(proto.received), b"", "the server answered it")
        self.assertEqual(self.counting.bytes_in, 0, "protocol bytes reached the server")
        for conn in list(self.counting.protocols):
            self.assertFalse(conn.transport.connected, "refused connection left open")
        # and the right certificate works
        yield self.round_trip(self.port, certs().client_options(with_cert=True))
        self.assertGreater(self.counting.bytes_in, 0)

    def test_no_certificate_refused(self):
        return self.refused("none")

    def test_other_ca_refused(self):
        return self.refused("other-ca")

    def test_expired_certificate_refused(self):
        return self.refused("expired")


class StyxTLS(TLSCase, unittest.TestCase):
    first_bytes = (b"POST /logs/t/records HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                   b"Upgrade: styx/0\r\n\r\n\x00\x01\x00\x00\x00\x01x")

    def make_factory(self, store):
        from streamproto.styx.resource import make_site
        return make_site(store, timeout=5)

    @defer.inlineCallbacks
    def round_trip(self, port, tls):
        from streamproto.styx.api_client import StyxClient
        from streamproto.styx.stream_client import StyxProducer
        client = StyxClient(f"https://localhost:{port}", reactor=reactor, tls_options=tls)
        try:
            yield client.create_log("t")
            producer = yield StyxProducer.connect(reactor, "localhost", port, "t", tls=tls)
            ack = yield producer.writeMany([b"a", b"b"])
            self.assertEqual(ack.count, 2)
            yield producer.close()
            records = yield client.read_records("t")
            self.assertEqual(records, [b"a", b"b"])
        finally:
            yield client.close()


class LumberjackTLS(TLSCase, unittest.TestCase):
    first_bytes = b"2W\x00\x00\x00\x01" + b"2J\x00\x00\x00\x01\x00\x00\x00\x02{}"

    def make_factory(self, store):
        from streamproto.lumberjack.server import LumberjackServerFactory
        from streamproto.lumberjack.sink import LogStoreSink
        return LumberjackServerFactory(LogStoreSink(store, "beats"), idle_timeout=5)

    @defer.inlineCallbacks
    def round_trip(self, port, tls):
        from streamproto.lumberjack.client import LumberjackClient
        client = LumberjackClient(client_endpoint(reactor, "127.0.0.1", port, tls), reactor,
                                  timeout=5)
        try:
            n = yield with_timeout(client.send([{"m": 1}, {"m": 2}]), 10)
            self.assertEqual(n, 2)
        finally:
            yield client.close()
        if self.store is not None:   # None: a child process's store
            log = yield self.store.get("beats")
            self.assertEqual(log.end_position, 2)


class PravegaTLS(TLSCase, unittest.TestCase):
    def first_bytes_():
        from streamproto.pravega import codec
        return codec.encode(codec.Hello(codec.WIRE_VERSION, codec.OLDEST_COMPATIBLE_VERSION))
    first_bytes = first_bytes_()

    def make_factory(self, store):
        from streamproto.pravega.server import PravegaServerFactory
        return PravegaServerFactory(store, idle_timeout=5)

    @defer.inlineCallbacks
    def round_trip(self, port, tls):
        from streamproto.pravega.client import SegmentWriter, connect
        endpoint = client_endpoint(reactor, "127.0.0.1", port, tls)
        proto = yield connect(endpoint)
        try:
            yield proto.create_segment("s/t/0.#epoch.0")
        finally:
            proto.transport.loseConnection()
            yield proto.closed
        writer = SegmentWriter(endpoint, "s/t/0.#epoch.0", clock=reactor, max_retries=2)
        try:
            yield with_timeout(writer.write_batch([b"a", b"b"]), 10)
        finally:
            yield writer.close()


class RelinkTLS(TLSCase, unittest.TestCase):
    first_bytes = relink_echo_handshake()

    def make_factory(self, store):
        return relink_factory(store)

    def round_trip(self, port, tls):
        return relink_echo_round_trip(self, port, tls)


class ReliableTLS(TLSCase, unittest.TestCase):
    first_bytes = b'{"count": 5}\n'

    def make_factory(self, store):
        from streamproto.reliable.server import ReliableStreamFactory
        from streamproto.reliable.session import MemorySessionStore
        sessions = MemorySessionStore(reactor)
        self.addCleanup(sessions.close)   # its expiry timers
        return ReliableStreamFactory(sessions)

    @defer.inlineCallbacks
    def round_trip(self, port, tls):
        from streamproto.reliable.client import StatefulClient
        result = yield with_timeout(StatefulClient(
            client_endpoint(reactor, "127.0.0.1", port, tls), 100, clock=reactor).run(), 10)
        self.assertEqual(len(result.values), 100)


class TwistdPluginsOverMTLS(unittest.TestCase):
    """
    The real thing: each server's twistd plugin in a child process with an
    ``mtls:`` port next to its TCP one (TrackingFactory, styx/0's take-over
    of the TLS connection...): our client with the right certificate
    completes a round trip, one without is refused.
    """

    timeout = 120
    CASES = [("styx-server", StyxTLS), ("lumberjack-server", LumberjackTLS),
             ("pravega-server", PravegaTLS), ("relink-server", RelinkTLS),
             ("reliable-stream-server", ReliableTLS)]

    @defer.inlineCallbacks
    def test_every_plugin(self):
        c = certs()
        for plugin, case_class in self.CASES:
            data = tempfile.mkdtemp(prefix="streamproto-tls-child-")
            self.addCleanup(shutil.rmtree, data, True)
            tls_port = free_port()
            server = ServerProcess(reactor, plugin, data, ports=[c.server_endpoint(tls_port)])
            yield server.start()
            try:
                yield wait_for_port(reactor, tls_port, process=server)
                case = case_class("round_trip")
                case.store = None
                yield case.round_trip(tls_port, c.client_options(with_cert=True))
                try:
                    proto = yield connect(tls_port, tls=c.client_options(with_cert=False))
                except Exception:   # noqa: BLE001 - refused during the handshake
                    proto = None
                if proto is not None:
                    proto.transport.write(case.first_bytes)
                    yield with_timeout(proto.closed, 5)
                    self.assertEqual(bytes(proto.received), b"", plugin)
            finally:
                yield server.stop()
            self.assertEqual(suspicious_output(server.output_text()), [], plugin)
