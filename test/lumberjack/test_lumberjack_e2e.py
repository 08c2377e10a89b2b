"""End to end over real sockets: our client, pylogbeat, TLS, many connections, the file store."""

import io
import json
import os
import tempfile

from twisted.internet import defer, protocol, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, serverFromString
from twisted.internet.threads import deferToThread
from twisted.python import usage
from twisted.trial import unittest

from streamproto.log import MemoryLogStore, open_store
from streamproto.lumberjack import cli
from streamproto.lumberjack.client import LumberjackClient
from streamproto.lumberjack.codec import encode_batch
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import LogStoreSink
from streamproto.lumberjack.tap import Options, makeService
from streamproto.core.tls import client_endpoint
from test.support.netutil import wait_until
from test.support.tlsutil import certs


def make_events(n, start=0):
    return [{"n": i, "message": f"event {i} " + "x" * 150} for i in range(start, start + n)]


class ServerCase(unittest.TestCase):
    timeout = 60

    @defer.inlineCallbacks
    def serve(self, description="tcp:0:interface=127.0.0.1", store=None, log_name="lj", **kwargs):
        self.store = store if store is not None else MemoryLogStore(reactor)
        self.factory = LumberjackServerFactory(LogStoreSink(self.store, log_name), **kwargs)
        port = yield serverFromString(reactor, description).listen(self.factory)
        self.addCleanup(self._stop, port)
        return port.getHost().port

    @defer.inlineCallbacks
    def _stop(self, port):
        yield port.stopListening()
        for proto in list(self.factory.connections):
            proto.transport.loseConnection()
        yield wait_until(lambda: not self.factory.connections)

    @defer.inlineCallbacks
    def records(self, name="lj"):
        log = yield self.store.get(name)
        batch = yield log.read(0, max_bytes=1 << 30)
        return [json.loads(r) for r in batch.records()]


class OurClientTests(ServerCase):
    @defer.inlineCallbacks
    def test_client_to_server_tcp(self):
        port = yield self.serve()
        client = LumberjackClient(TCP4ClientEndpoint(reactor, "127.0.0.1", port),
                                  bulk_max_size=500, pipelining=2)
        first = client.send(make_events(2000))
        second = client.send(make_events(1000, 2000))
        self.assertEqual((yield first), 2000)
        self.assertEqual((yield second), 1000)
        yield client.close()
        records = yield self.records()
        self.assertEqual([r["event"] for r in records], make_events(3000))
        self.assertTrue(records[0]["peer"].startswith("127.0.0.1:"))
        self.assertNotIn("tls", records[0])
        self.assertEqual(client.batch_size, 500)  # slow start reached the bulk maximum

    @defer.inlineCallbacks
    def test_client_to_server_tls_with_client_certificate(self):
        port = yield self.serve(certs().server_endpoint())
        endpoint = client_endpoint(reactor, "127.0.0.1", port, certs().client_options())
        client = LumberjackClient(endpoint, compression_level=1)
        self.assertEqual((yield client.send(make_events(300))), 300)
        yield client.close()
        records = yield self.records()
        self.assertEqual(len(records), 300)
        self.assertEqual(records[0]["tls"]["cn"], "test-client")
        self.assertEqual(len(records[0]["tls"]["sha256"].split(":")), 32)

    @defer.inlineCallbacks
    def test_client_reconnects_and_resends(self):
        # the server drops the connection; the client reconnects and carries on
        port = yield self.serve()
        client = LumberjackClient(TCP4ClientEndpoint(reactor, "127.0.0.1", port),
                                  backoff_initial=0.05, slow_start=False, bulk_max_size=50)
        self.assertEqual((yield client.send(make_events(100))), 100)
        for proto in list(self.factory.connections):
            proto.transport.abortConnection()
        self.assertEqual((yield client.send(make_events(100, 100))), 100)
        self.assertEqual(client.connections_made, 2)
        yield client.close()
        records = yield self.records()
        self.assertEqual([r["event"]["n"] for r in records], list(range(200)))


class SlowOrFailingStorageTests(ServerCase):
    @defer.inlineCallbacks
    def serve_with_sink(self, wrap, **kwargs):
        port = yield self.serve(**kwargs)
        self.factory.sink = wrap(self.factory.sink)
        return port

    @defer.inlineCallbacks
    def test_keepalive_keeps_client_from_timing_out(self):
        class SlowSink:
            def __init__(self, inner):
                self.inner = inner

            def write(self, connection, events):
                return task.deferLater(reactor, 1.0, self.inner.write, connection, events)

        port = yield self.serve_with_sink(SlowSink, keepalive_interval=0.1)
        client = LumberjackClient(TCP4ClientEndpoint(reactor, "127.0.0.1", port), timeout=0.6,
                                  slow_start=False, bulk_max_size=20)
        self.assertEqual((yield client.send(make_events(20))), 20)
        self.assertEqual(client.connections_made, 1)  # never timed out
        yield client.close()

    @defer.inlineCallbacks
    def test_unacked_batch_is_sent_again_after_storage_failure(self):
        class FailOnce:
            def __init__(self, inner):
                self.inner = inner
                self.failed = False

            def write(self, connection, events):
                if not self.failed:
                    self.failed = True
                    return defer.fail(OSError("disk full, once"))
                return self.inner.write(connection, events)

        port = yield self.serve_with_sink(FailOnce)
        client = LumberjackClient(TCP4ClientEndpoint(reactor, "127.0.0.1", port),
                                  backoff_initial=0.05)
        self.assertEqual((yield client.send(make_events(30))), 30)
        self.assertEqual(client.connections_made, 2)
        yield client.close()
        records = yield self.records()
        self.assertEqual([r["event"] for r in records], make_events(30))
        self.flushLoggedErrors(OSError)


class PyLogBeatTests(ServerCase):
    @defer.inlineCallbacks
    def test_pylogbeat_counts_across_batches(self):
        import pylogbeat
        port = yield self.serve()

        def run():
            # pylogbeat numbers events 1..n, then n+1..: the acks must follow
            with pylogbeat.PyLogBeatClient("127.0.0.1", port, timeout=10) as client:
                client.send(make_events(5))
                client.send(make_events(3, 5))
                client.send([json.dumps({"as": "string"})])
                return client._sequence

        self.assertEqual((yield deferToThread(run)), 9)
        records = yield self.records()
        self.assertEqual([r["event"] for r in records], make_events(8) + [{"as": "string"}])


    @defer.inlineCallbacks
    def test_pylogbeat_over_tls_with_client_certificate(self):
        import pylogbeat
        c = certs()
        port = yield self.serve(c.server_endpoint())

        def run():
            with pylogbeat.PyLogBeatClient("127.0.0.1", port, timeout=10, ssl_enable=True,
                                           ssl_verify=True, ca_certs=c.ca, certfile=c.client_cert,
                                           keyfile=c.client_key) as client:
                client.send(make_events(4))

        yield deferToThread(run)
        records = yield self.records()
        self.assertEqual([r["event"] for r in records], make_events(4))
        self.assertEqual({r["tls"]["cn"] for r in records}, {"test-client"})


class ManyConnectionsTests(ServerCase):
    class OneBatch(protocol.Protocol):
        def connectionMade(self):
            self.acked = defer.Deferred()
            self.received = b""
            self.transport.write(encode_batch([b'{"hello":1}'], 0))

        def dataReceived(self, data):
            self.received += data
            if len(self.received) >= 6 and not self.acked.called:
                self.acked.callback(self.received)

    @defer.inlineCallbacks
    def test_many_concurrent_connections(self):
        count = 1000
        port = yield self.serve("tcp:0:interface=127.0.0.1:backlog=1024")
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        factory = protocol.Factory.forProtocol(self.OneBatch)
        clients = []
        for _ in range(0, count, 100):
            clients += (yield defer.gatherResults([endpoint.connect(factory)
                                                   for _ in range(100)]))
        answers = yield defer.gatherResults([c.acked for c in clients])
        self.assertEqual(set(answers), {b"2A\x00\x00\x00\x01"})
        # every connection is still open, holding almost nothing
        self.assertEqual(len(self.factory.connections), count)
        self.assertTrue(all(p.decoder.buffered == 0 and not p.state.pending_events
                            for p in self.factory.connections))
        records = yield self.records()
        self.assertEqual(len(records), count)
        for c in clients:
            c.transport.loseConnection()
        yield wait_until(lambda: not self.factory.connections)


class FileStoreTests(ServerCase):
    @defer.inlineCallbacks
    def test_durable_in_file_store(self):
        path = tempfile.mkdtemp(prefix="lumberjack-e2e-")
        store = open_store(path)
        port = yield self.serve(store=store, log_name="beats")
        client = LumberjackClient(TCP4ClientEndpoint(reactor, "127.0.0.1", port))
        self.assertEqual((yield client.send(make_events(1500))), 1500)
        yield client.close()
        yield store.close()
        # acknowledged means durable: a fresh store sees every event
        reopened = open_store(path)
        self.addCleanup(reopened.close)
        log = yield reopened.get("beats")
        batch = yield log.read(0, max_bytes=1 << 30)
        self.assertEqual([json.loads(r)["event"] for r in batch.records()], make_events(1500))


class TapAndCliTests(ServerCase):
    def test_options(self):
        options = Options()
        options.parseOptions(["--log", "beats", "--max-window", "50", "--idle-timeout", "5",
                              "--max-frame", "1000", "--max-decompressed", "5000"])
        self.assertEqual(options["port"], ["tcp:5044"])
        self.assertEqual((options["max-window"], options["idle-timeout"]), (50, 5.0))
        self.assertRaises(usage.UsageError, Options().parseOptions, ["--log", "../etc"])
        self.assertRaises(usage.UsageError, Options().parseOptions, ["--max-window", "0"])

    @defer.inlineCallbacks
    def test_make_service_with_shared_store(self):
        store = MemoryLogStore(reactor)
        options = Options()
        options.parseOptions(["--port", "tcp:0:interface=127.0.0.1", "--log", "beats",
                              "--max-window", "7", "--max-buffered", "1000000"])
        service = makeService(options, store=store)
        [listener] = list(service)
        factory = listener.factory
        self.assertEqual((factory.max_window, factory.max_buffered), (7, 1000000))
        self.assertEqual(factory.sink.log_name, "beats")
        self.assertIs(factory.sink.store, store)
        service.startService()
        yield service.stopService()

    @defer.inlineCallbacks
    def test_log_records_fit_the_largest_frame(self):
        from streamproto.lumberjack.sink import ConnectionInfo
        from streamproto.lumberjack.tap import factory_for_store
        store = MemoryLogStore(reactor)
        options = Options()
        options.parseOptions(["--max-frame", str(3 * 1048576)])
        factory = factory_for_store(options, store)
        big = json.dumps({"message": "x" * (3 * 1048576 - 100)}).encode()
        yield factory.sink.write(ConnectionInfo("127.0.0.1:1", {"cn": "c" * 64, "sha256": "AB"}),
                                 [big])
        log = yield store.get("lumberjack")
        self.assertEqual(log.end_position, 1)
        self.assertGreaterEqual(log.config.max_record_size, 3 * 1048576 + 4096)

    @defer.inlineCallbacks
    def test_cli_send(self):
        port = yield self.serve()
        args = cli.parse_args(["send", "--port", str(port), "--batch", "10", "-q", "-"])
        lines = b"\n".join(json.dumps(e).encode() for e in make_events(25))
        stream = io.BytesIO(lines + b"\nnot json\n\n" + json.dumps({"last": 1}).encode() + b"\n")
        out, err = io.StringIO(), io.StringIO()
        sent, skipped = yield cli.send(reactor, args, stream, out, err)
        self.assertEqual((sent, skipped), (26, 1))
        self.assertIn("line 26", err.getvalue())
        self.assertEqual(out.getvalue(), "sent 26 events, skipped 1 bad lines\n")
        records = yield self.records()
        self.assertEqual([r["event"] for r in records], make_events(25) + [{"last": 1}])

    @defer.inlineCallbacks
    def test_cli_progress_on_a_terminal(self):
        class Terminal(io.StringIO):
            def isatty(self):
                return True

        port = yield self.serve()
        args = cli.parse_args(["send", "-s", f"127.0.0.1:{port}", "--compression", "0"])
        stream = io.BytesIO(b"".join(json.dumps(e).encode() + b"\n" for e in make_events(5)))
        err = Terminal()
        yield cli.send(reactor, args, stream, io.StringIO(), err)
        self.assertIn("lumberjack send:", err.getvalue())
        self.assertIn("5 records", err.getvalue())

    @defer.inlineCallbacks
    def test_cli_main_in_a_process(self):
        import sys
        from twisted.internet import utils
        port = yield self.serve()
        path = os.path.join(tempfile.mkdtemp(prefix="lumberjack-cli-"), "events.jsonl")
        with open(path, "wb") as f:
            f.write(b"".join(json.dumps(e).encode() + b"\n" for e in make_events(40)))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out, err, code = yield utils.getProcessOutputAndValue(
            sys.executable, ["-m", "streamproto", "lumberjack", "send", "-s", f"127.0.0.1:{port}",
                             "--batch", "16", path],
            env=dict(os.environ, PYTHONPATH=root), path=root)
        self.assertEqual((code, out), (0, b"sent 40 events\n"), err)
        records = yield self.records()
        self.assertEqual([r["event"] for r in records], make_events(40))

    def test_cli_usage_error(self):
        err = io.StringIO()
        import sys
        self.patch(sys, "stderr", err)
        self.assertEqual(cli.main(["send", "--compression", "12"]), 2)
        self.assertIn("--compression", err.getvalue())
        self.assertEqual(cli.main([]), 2)
        self.assertTrue(os.path.exists(cli.__file__))
