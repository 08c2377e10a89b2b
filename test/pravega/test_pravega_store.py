"""
The Pravega server on the file-backed log store (dedup and seals survive a
restart), the CLI and the twistd plugin.
"""

import io
import uuid

from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.trial import unittest

from streamproto.log import MemoryLogStore, open_store
from streamproto.pravega import cli, codec, tap
from streamproto.pravega.blocks import pack_blocks
from streamproto.pravega.client import SegmentSealedError, SegmentWriter, connect
from streamproto.pravega.segments import log_name
from streamproto.pravega.server import PravegaServerFactory
from test.pravega.test_pravega_server import RecordingClient, chunk

SEG = "scope/stream/0.#epoch.0"


class RestartTests(unittest.TestCase):
    timeout = 30

    def setUp(self):
        self.path = self.mktemp()
        self.servers = []

    @defer.inlineCallbacks
    def start(self, port_number=0):
        store = open_store(self.path)
        factory = PravegaServerFactory(store, read_wait=0.2)
        port = yield TCP4ServerEndpoint(reactor, port_number, interface="127.0.0.1").listen(
            factory)
        self.servers.append((store, factory, port))
        return TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)

    @defer.inlineCallbacks
    def stop(self, abort=False):
        store, factory, port = self.servers.pop()
        yield port.stopListening()
        for p in list(factory.connections):
            if abort:
                p.transport.abortConnection()
            else:
                p.transport.loseConnection()
        yield store.close()

    @defer.inlineCallbacks
    def tearDown(self):
        while self.servers:
            yield self.stop()

    @defer.inlineCallbacks
    def test_dedup_and_seal_survive_restart(self):
        ep = yield self.start()
        c = yield connect(ep)
        yield c.create_segment(SEG)
        wid = uuid.uuid4()
        w = SegmentWriter(ep, SEG, writer_id=wid, block_size=1000)
        yield w.write_batch([b"before %d" % i for i in range(300)])
        yield w.close()
        c.transport.loseConnection()
        yield c.closed
        yield self.stop()

        ep = yield self.start()
        raw = yield ep.connect(_factory())
        yield raw.ready
        setup = yield raw.setup_append(wid, SEG)
        self.assertEqual(setup.last_event_number, 299)
        # a resend of old events plus new ones: only the new ones are kept
        raw.send_raw(b"".join(pack_blocks([chunk([b"before 298", b"before 299", b"after"], 300)],
                                          wid, setup.request_id, 1000)))
        ack = yield raw.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.previous_event_number), (300, 299))
        yield raw.seal_segment(SEG)
        info = yield raw.segment_info(SEG)
        raw.transport.loseConnection()
        yield raw.closed
        yield self.stop()

        ep = yield self.start()
        c = yield connect(ep)
        info2 = yield c.segment_info(SEG)
        self.assertEqual((info2.is_sealed, info2.write_offset), (True, info.write_offset))
        w = SegmentWriter(ep, SEG, writer_id=wid)
        yield self.assertFailure(w.write(b"late"), SegmentSealedError)
        w.stop(None)
        out = io.BytesIO()
        status = yield cli.run(reactor, ["-s", f"127.0.0.1:{ep._port}", "read", SEG], stdout=out)
        self.assertEqual(status, 0)
        self.assertEqual(out.getvalue().splitlines(),
                         [b"before %d" % i for i in range(300)] + [b"after"])
        c.transport.loseConnection()
        yield c.closed

    @defer.inlineCallbacks
    def test_writer_survives_server_restart(self):
        ep = yield self.start()
        port_number = self.servers[-1][2].getHost().port
        c = yield connect(ep)
        yield c.create_segment(SEG)
        c.transport.loseConnection()
        yield c.closed
        w = SegmentWriter(ep, SEG, block_size=2000, retry_delay=0.02, max_retries=100)
        first = [b"first %d" % i for i in range(500)]
        yield w.write_batch(first)
        # large enough that it is still on its way when the server stops
        # (2,000 records were all acknowledged first once Nagle was off)
        second = [b"second %d" % i for i in range(20000)]
        pending = w.write_batch(second)
        # stop the server once part of the second batch is durable: its acks
        # are lost with the connection
        store = self.servers[-1][0]
        log = yield store.get(log_name(SEG))
        size_first = log.end_offset
        while log.end_offset == size_first:
            yield task.deferLater(reactor, 0.001, lambda: None)
        self.assertNoResult(pending)     # what this test is about: acks lost
        yield self.stop(abort=True)
        ep = yield self.start(port_number)
        self.assertEqual((yield pending), 20499)
        yield w.close()
        self.assertGreaterEqual(w.connections, 2)
        out = io.BytesIO()
        status = yield cli.run(reactor, ["-s", f"127.0.0.1:{port_number}", "read", SEG], stdout=out)
        self.assertEqual(status, 0)
        self.assertEqual(out.getvalue().splitlines(), first + second)


def _factory():
    from twisted.internet.protocol import Factory
    return Factory.forProtocol(RecordingClient)


class CLITests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        self.factory = PravegaServerFactory(MemoryLogStore(reactor), read_wait=0.2)
        self.port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            self.factory)
        self.addCleanup(self.port.stopListening)

    @defer.inlineCallbacks
    def run_cli(self, *argv, stdin=b""):
        out, err = io.BytesIO(), io.StringIO()
        status = yield cli.run(reactor, ["-s", f"127.0.0.1:{self.port.getHost().port}", *argv],
                               stdin=io.BytesIO(stdin), stdout=out, stderr=err)
        return status, out.getvalue().decode(), err.getvalue()

    @defer.inlineCallbacks
    def test_commands(self):
        self.assertEqual((yield self.run_cli("create", SEG)), (0, f"created {SEG}\n", ""))
        status, _, err = yield self.run_cli("create", SEG)
        self.assertEqual(status, 1)
        self.assertIn("SegmentAlreadyExists", err)
        status, out, _ = yield self.run_cli("write", SEG, "--batch", "2",
                                            stdin=b"one\ntwo\nthree\n")
        self.assertEqual((status, out), (0, f"wrote 3 events to {SEG}\n"))
        status, out, _ = yield self.run_cli("read", SEG)
        self.assertEqual((status, out), (0, "one\ntwo\nthree\n"))
        status, out, _ = yield self.run_cli("info", SEG)
        self.assertIn("write_offset: 35\n", out)
        self.assertEqual((yield self.run_cli("truncate", SEG, "11"))[0], 0)
        status, out, _ = yield self.run_cli("read", SEG, "--offset", "11")
        self.assertEqual(out, "two\nthree\n")
        self.assertEqual((yield self.run_cli("seal", SEG))[0], 0)
        status, out, _ = yield self.run_cli("read", SEG, "--offset", "11", "--follow")
        self.assertEqual((status, out), (0, "two\nthree\n"))
        self.assertEqual((yield self.run_cli("delete", SEG))[0], 0)
        status, _, err = yield self.run_cli("info", SEG)
        self.assertEqual(status, 1)
        self.assertIn("NoSuchSegment", err)

    @defer.inlineCallbacks
    def test_bad_usage(self):
        status, _, _ = yield self.run_cli("frobnicate")
        self.assertEqual(status, 2)


class TapTests(unittest.TestCase):
    def test_options(self):
        o = tap.Options()
        o.parseOptions([])
        self.assertEqual(o["port"], ["tcp:12345"])
        self.assertEqual(o["read-wait"], 60.0)
        o = tap.Options()
        o.parseOptions(["--port", "tcp:0", "--read-wait", "5", "--idle-timeout", "0"])
        self.assertEqual((o["port"], o["read-wait"], o["idle-timeout"]), (["tcp:0"], 5.0, 0.0))
        from twisted.python import usage
        self.assertRaises(usage.UsageError, tap.Options().parseOptions,
                          ["--max-frame-size", str(0x01000000)])

    @defer.inlineCallbacks
    def test_make_service_listens(self):
        o = tap.Options()
        o.parseOptions(["--port", "tcp:0:interface=127.0.0.1", "--controller", "none"])
        svc = tap.makeService(o, store=MemoryLogStore(reactor))
        svc.startService()
        try:
            [listener] = list(svc)
            port = listener._waitingForPort.result
            ep = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
            c = yield connect(ep)
            self.assertEqual(c.server_versions, (17, 5))
            c.transport.loseConnection()
            yield c.closed
        finally:
            yield svc.stopService()
