"""
Storage faults under the servers: in-process servers built from the
protocol factories over ``FileLogStore(path, io=FaultyIO())``, driven by our
clients over real loopback connections.

- fsync failure: nothing is acked after it, the log fail-stops (no retry
  and pretend), clients get the protocol's error, reopening recovers;
- ENOSPC: a clear error, no partial record visible, writes work again once
  space is back (no reopen needed);
- bit flips and torn writes in segment files: detected by the checksums on
  read and on open, never served as data.
"""

import os
import time
import shutil
import tempfile
import uuid

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.protocols.policies import WrappingFactory
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint
from streamproto.log import LogConfig
from streamproto.log.errors import CorruptLog, LogFailed, WriteFailed
from streamproto.log.filestore import FileLogStore
from test.support.torture_harness import make_payload, parse_payload
from test.support.torture_harness import FaultyIO, sleep


class InProcessServer:
    """A protocol factory over a (fault-injectable) file store, listening on 127.0.0.1."""

    def __init__(self, case, path, make_factory, io=None, port=0):
        self.case = case
        self.path = path
        self.io = io or FaultyIO()
        self.make_factory = make_factory
        self.port = port
        self.listening = None
        self.store = None

    @defer.inlineCallbacks
    def start(self):
        self.store = FileLogStore(self.path, reactor=reactor, io=self.io, retention_interval=None)
        self.factory = self.make_factory(self.store)
        # wrapped so that stop() can drop every connection, as a dying process would
        self.wrapper = WrappingFactory(self.factory)
        self.listening = yield TCP4ServerEndpoint(reactor, self.port, interface="127.0.0.1") \
            .listen(self.wrapper)
        self.port = self.listening.getHost().port
        return self

    @defer.inlineCallbacks
    def stop(self):
        if self.listening is not None:
            yield self.listening.stopListening()
            self.listening = None
            for conn in list(self.wrapper.protocols):
                conn.transport.abortConnection()
            # every aborted connection's connectionLost (which cancels its
            # idle and heartbeat deadlines) has run before the store closes:
            # a fixed 10 ms left a Sweeper call behind under load
            deadline = time.monotonic() + 5.0
            yield sleep(reactor, 0.01)
            while self.wrapper.protocols and time.monotonic() < deadline:
                yield sleep(reactor, 0.01)
        if self.store is not None:
            store, self.store = self.store, None
            yield store.close()

    @defer.inlineCallbacks
    def restart(self, io=None):
        """Close the store (a clean stop) and open it again: recovery runs."""
        yield self.stop()
        self.io = io or FaultyIO()
        yield self.start()
        return self


class FaultCase(unittest.TestCase):
    timeout = 60

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="streamproto-faults-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.servers = []

    @defer.inlineCallbacks
    def tearDown(self):
        for s in self.servers:
            yield s.stop()
        # the servers log the injected storage errors, as they should
        self.flushLoggedErrors(LogFailed, WriteFailed, CorruptLog)

    @defer.inlineCallbacks
    def server(self, make_factory):
        s = InProcessServer(self, os.path.join(self.dir, "data"), make_factory)
        self.servers.append(s)
        yield s.start()
        return s

    def payloads(self, tag, first, n):
        return [make_payload(tag, s, s % 40) for s in range(first, first + n)]

    def assert_served(self, tag, served, must_have, may_have=()):
        """Served payloads: all valid, no duplicates, every acked one present."""
        seqs = [parse_payload(tag, p) for p in served]
        self.assertNotIn(None, seqs, "a corrupt record was served")
        self.assertEqual(len(seqs), len(set(seqs)), "duplicates served")
        self.assertEqual(seqs, sorted(seqs), "out of order")
        missing = set(must_have) - set(seqs)
        self.assertEqual(missing, set(), "acknowledged records lost")
        extra = set(seqs) - set(must_have) - set(may_have)
        self.assertEqual(extra, set(), "records that were never written")
        return seqs


# -- Styx ---------------------------------------------------------------------

def styx_factory(store):
    from streamproto.styx.resource import make_site
    return make_site(store, timeout=5)


class StyxFaults(FaultCase):
    name = "faulty"

    @defer.inlineCallbacks
    def setup_styx(self, config=None):
        from streamproto.styx.api_client import StyxClient
        s = yield self.server(styx_factory)
        yield s.store.create(self.name, config)
        client = StyxClient(f"http://127.0.0.1:{s.port}", reactor=reactor)
        self.addCleanup(client.close)
        return s, client

    def produce(self, s, records):
        from streamproto.styx.stream_client import StyxProducer

        @defer.inlineCallbacks
        def go():
            producer = yield StyxProducer.connect(reactor, "127.0.0.1", s.port, self.name,
                                                  timeout=5)
            try:
                ack = yield producer.writeMany(records)
                yield producer.close()
            finally:
                if producer._protocol.transport is not None:
                    producer._protocol.transport.abortConnection()
            return ack, producer
        return go()

    @defer.inlineCallbacks
    def test_fsync_failure_fail_stops_and_reopen_recovers(self):
        from streamproto.styx.api_client import StyxAPIError
        from streamproto.styx.codec import ErrorCode
        from streamproto.styx.stream_client import StyxProducer, StyxStreamError
        s, client = yield self.setup_styx()
        ack, _ = yield self.produce(s, self.payloads(b"s", 0, 500))
        self.assertEqual(ack.count, 500)

        s.io.fail_fsync = True
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", s.port, self.name, timeout=5)
        acks = []
        d = producer.writeMany(self.payloads(b"s", 500, 500))
        d.addCallback(acks.append)
        error = yield self.assertFailure(d, StyxStreamError)
        self.assertEqual(error.code, ErrorCode.LOG_NOT_AVAILABLE)
        self.assertEqual(acks, [])
        self.assertEqual(producer.acked_count, 0)  # nothing acked after the failure
        self.assertGreater(s.io.failed_fsyncs, 0)

        # fail-stop: even with a healthy disk again, nothing is retried or accepted
        s.io.fail_fsync = False
        e = yield self.assertFailure(client.write_records(self.name, [b"refused"]),
                                     StyxAPIError)
        self.assertEqual(e.code, "log_not_available")
        info = yield client.get_log(self.name)
        self.assertEqual((info["status"], info["record_count"]), ("tainted", 500))
        from streamproto.core.ops import store_problems   # what /ready answers 503 with
        self.assertEqual(store_problems([s.store]),
                         [f"log {self.name}: tainted: [Errno 5] injected fsync failure"])
        yield s.restart()
        records = yield client.read_records(self.name)
        seqs = self.assert_served(b"s", records, range(500), may_have=range(500, 1000))
        self.assertEqual(seqs[:500], list(range(500)))
        ack, _ = yield self.produce(s, self.payloads(b"s", 1000, 10))
        self.assertEqual(ack.count, 10)

    @defer.inlineCallbacks
    def test_enospc_clear_error_no_partial_record_then_recovery(self):
        from streamproto.styx.api_client import StyxAPIError
        from streamproto.styx.stream_client import StyxProducer, StyxStreamError
        s, client = yield self.setup_styx()
        yield client.write_records(self.name, self.payloads(b"s", 0, 100))
        s.io.enospc = True
        e = yield self.assertFailure(
            client.write_records(self.name, self.payloads(b"s", 100, 100)), StyxAPIError)
        self.assertEqual(e.code, "log_not_available")
        self.assertIn("No space left", e.message)
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", s.port, self.name, timeout=5)
        yield self.assertFailure(producer.writeMany(self.payloads(b"s", 100, 100)),
                                 StyxStreamError)
        self.assertGreater(s.io.failed_writes, 0)
        # the torn half-write was rolled back: nothing of it is visible
        records = yield client.read_records(self.name)
        self.assertEqual(self.assert_served(b"s", records, range(100)), list(range(100)))
        # space is back: the same log takes writes again, no reopen needed
        s.io.enospc = False
        yield client.write_records(self.name, self.payloads(b"s", 200, 50))
        expected = list(range(100)) + list(range(200, 250))
        records = yield client.read_records(self.name)
        self.assertEqual([parse_payload(b"s", r) for r in records], expected)
        yield s.restart()
        records = yield client.read_records(self.name)
        self.assertEqual([parse_payload(b"s", r) for r in records], expected)

    @defer.inlineCallbacks
    def test_bit_flip_below_the_store_never_served(self):
        from streamproto.styx.api_client import StyxAPIError
        s, client = yield self.setup_styx()
        yield client.write_records(self.name, self.payloads(b"s", 0, 100))
        s.io.flip_write_bit = True   # the disk silently garbles the next batch
        yield client.write_records(self.name, self.payloads(b"s", 100, 100))
        self.assertFalse(s.io.flip_write_bit)
        yield client.write_records(self.name, self.payloads(b"s", 200, 100))
        served = []
        try:
            served = yield client.read_records(self.name)
        except StyxAPIError as e:
            self.assertEqual(e.code, "log_not_available")
        # whatever was served is valid (the checksum caught the flip)
        seqs = [parse_payload(b"s", r) for r in served]
        self.assertNotIn(None, seqs)
        self.assertNotIn(150, seqs)
        # once caught, the log is "corrupt" and refuses every read (and /ready says so)
        self.assertEqual(s.store._logs[self.name].info()["status"], "corrupt")
        yield self.assertFailure(client.read_records(self.name, count=100), StyxAPIError)
        yield s.restart()
        # on open the last segment is verified: today the bad batch and what
        # follows are cut (logged; records 200..299, acked, go with it: see
        # doc/reliability.rst, bug 6); a store that calls the log corrupt
        # instead is fine too.  Either way nothing bad is served.
        try:
            records = yield client.read_records(self.name)
        except StyxAPIError as e:
            self.assertEqual(e.code, "log_not_available")
            records = []
        seqs = [parse_payload(b"s", r) for r in records]
        self.assertNotIn(None, seqs)
        self.assertNotIn(150, seqs)
        if seqs:
            self.assertEqual(seqs[:100], list(range(100)))

    @defer.inlineCallbacks
    def test_corrupt_sealed_segment_and_torn_tail_on_disk(self):
        from streamproto.styx.api_client import StyxAPIError
        s, client = yield self.setup_styx(LogConfig(segment_max_count=100))
        for i in range(4):
            yield client.write_records(self.name, self.payloads(b"s", i * 100, 100))
        yield s.stop()
        log_dir = os.path.join(s.path, self.name)
        segs = sorted(n for n in os.listdir(log_dir) if n.endswith(".seg"))
        self.assertEqual(len(segs), 4)
        # a flipped byte in the middle of a sealed segment's data
        with open(os.path.join(log_dir, segs[1]), "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(size - 200)
            byte = f.read(1)
            f.seek(size - 200)
            f.write(bytes([byte[0] ^ 0x01]))
        # a torn tail: the last batch loses its end
        last = os.path.join(log_dir, segs[-1])
        with open(last, "r+b") as f:
            f.truncate(os.path.getsize(last) - 37)
        yield s.start()
        # the torn tail was cut on open (a torn last batch looks unsynced)
        log = yield s.store.get(self.name)
        self.assertEqual(log.end_position, 300)
        # reading across the bad segment: the response has begun (200, chunked)
        # with segment 0 when the checksum fails, so the stream is cut: what
        # arrived is valid and nothing of the bad segment came through
        served = []
        try:
            yield client.read_records(self.name, on_records=served.extend)
        except StyxAPIError as e:
            self.assertEqual(e.code, "log_not_available")
        except Exception as e:   # noqa: BLE001 - ResponseFailed: the cut stream
            self.assertIn("ResponseFailed", type(e).__name__)
        seqs = [parse_payload(b"s", r) for r in served]
        self.assertNotIn(None, seqs)
        self.assertFalse(set(seqs) & set(range(100, 200)), "corrupt segment served")
        # and the good segment before it did arrive, whole, before the cut
        self.assertEqual(seqs, list(range(100)))
        self.assertEqual(log.info()["status"], "corrupt")
        # from inside the bad segment: an error before anything is sent
        e = yield self.assertFailure(client.read_records(self.name, position=150), StyxAPIError)
        self.assertEqual(e.code, "log_not_available")


# -- Pravega ------------------------------------------------------------------

def pravega_factory(store):
    from streamproto.pravega.server import PravegaServerFactory
    return PravegaServerFactory(store, read_wait=0.5, idle_timeout=0)


class PravegaFaults(FaultCase):
    segment = "torture/faults/0.#epoch.0"

    @defer.inlineCallbacks
    def read_all(self, s):
        from streamproto.pravega import codec
        from streamproto.pravega.client import connect
        proto = yield connect(client_endpoint(reactor, "127.0.0.1", s.port))
        try:
            info = yield proto.segment_info(self.segment)
            offset, buf, events = 0, b"", []
            while offset < info.write_offset:
                reply = yield proto.read_segment(self.segment, offset, 1 << 20)
                offset += len(reply.data)
                buf += reply.data
                got, used = codec.split_events(buf)
                buf = buf[used:]
                events += got
        finally:
            proto.transport.loseConnection()
            yield proto.closed
        return events

    @defer.inlineCallbacks
    def test_fsync_failure_then_reopen_writer_dedup_exactly_once(self):
        """
        After an fsync error the writer fails at once with the reason
        (bug 7: it used to reconnect 21 times, then fail with a bare
        ConnectionError); after a restart a writer with the same id learns
        the durable level from AppendSetup and resends the rest: exactly once.
        """
        from streamproto.pravega.client import ServerError, SegmentWriter, connect
        s = yield self.server(pravega_factory)
        proto = yield connect(client_endpoint(reactor, "127.0.0.1", s.port))
        yield proto.create_segment(self.segment)
        proto.transport.loseConnection()
        yield proto.closed
        wid = uuid.UUID(int=7)
        writer = SegmentWriter(client_endpoint(reactor, "127.0.0.1", s.port), self.segment,
                               writer_id=wid, clock=reactor, max_retries=1000,
                               retry_delay=0.02, max_retry_delay=0.1)
        self.addCleanup(writer.stop, None)
        yield writer.write_batch(self.payloads(b"p", 0, 1000))
        s.io.fail_fsync = True
        e = yield self.assertFailure(writer.write_batch(self.payloads(b"p", 1000, 1000)),
                                     ServerError)
        self.assertIn("restart the server", str(e))
        self.assertIn("injected fsync failure", str(e))
        self.assertEqual(writer.connections, 1)      # failed fast: no reconnect
        self.assertGreater(s.io.failed_fsyncs, 0)
        status = s.store._logs and [lg.info()["status"] for lg in s.store._logs.values()]
        self.assertIn("tainted", status)
        # a new writer on the tainted log is refused at SetupAppend, with the reason
        late = SegmentWriter(client_endpoint(reactor, "127.0.0.1", s.port), self.segment,
                             clock=reactor, max_retries=1000, retry_delay=0.02)
        self.addCleanup(late.stop, None)
        e = yield self.assertFailure(late.write(b"x"), ServerError)
        self.assertIn("injected fsync failure", str(e))
        self.assertEqual(late.connections, 0)
        # an operator restarts the server: the same writer id resumes after
        # what is durable, and dedup keeps the resend exact
        yield s.restart()
        resumed = SegmentWriter(client_endpoint(reactor, "127.0.0.1", s.port), self.segment,
                                writer_id=wid, clock=reactor)
        self.addCleanup(resumed.stop, None)
        last = yield resumed.when_set_up()
        self.assertGreaterEqual(last, 999)       # everything acked is there
        if last < 1999:
            yield resumed.write_batch(self.payloads(b"p", last + 1, 1999 - last))
        yield resumed.write_batch(self.payloads(b"p", 2000, 10))
        events = yield self.read_all(s)
        self.assertEqual(self.assert_served(b"p", events, range(2010)), list(range(2010)))

    @defer.inlineCallbacks
    def test_corrupt_segment_data_never_served(self):
        from streamproto.pravega.client import SegmentWriter, connect
        s = yield self.server(pravega_factory)
        proto = yield connect(client_endpoint(reactor, "127.0.0.1", s.port))
        yield proto.create_segment(self.segment)
        proto.transport.loseConnection()
        yield proto.closed
        writer = SegmentWriter(client_endpoint(reactor, "127.0.0.1", s.port), self.segment,
                               clock=reactor)
        self.addCleanup(writer.stop, None)
        yield writer.write_batch(self.payloads(b"p", 0, 300))
        s.io.flip_write_bit = True
        yield writer.write_batch(self.payloads(b"p", 300, 300))
        served = []
        try:
            served = yield self.read_all(s)
        except Exception:
            pass   # an error reply or a dropped connection: fine, as long as no bad data
        self.assertNotIn(None, [parse_payload(b"p", e) for e in served])
        self.assertLess(len(served), 600)


# -- Lumberjack -----------------------------------------------------------------

def lumberjack_factory(store):
    from streamproto.lumberjack.server import LumberjackServerFactory
    from streamproto.lumberjack.sink import LogStoreSink
    return LumberjackServerFactory(LogStoreSink(store, "beats"), idle_timeout=5)


class LumberjackFaults(FaultCase):
    @defer.inlineCallbacks
    def test_fsync_failure_no_ack_then_reopen_keeps_acked(self):
        import json

        from streamproto.lumberjack.client import LumberjackClient
        s = yield self.server(lumberjack_factory)
        client = LumberjackClient(client_endpoint(reactor, "127.0.0.1", s.port), reactor,
                                  backoff_initial=0.05, backoff_max=0.2, timeout=5)
        self.addCleanup(client.close)
        events = [{"m": p.decode()} for p in self.payloads(b"l", 0, 300)]
        yield client.send(events)
        s.io.fail_fsync = True
        acked = []
        d = client.send([{"m": p.decode()} for p in self.payloads(b"l", 300, 300)])
        d.addCallback(acked.append)
        yield sleep(reactor, 0.5)
        self.assertEqual(acked, [])
        self.assertGreater(s.io.failed_fsyncs, 0)
        yield s.restart()
        yield d   # at least once: the client resends after the restart
        log = yield s.store.get("beats")
        batch = yield log.read(0, -1, 1 << 30)
        served = [json.loads(r)["event"]["m"].encode() for r in batch.records()]
        seqs = [parse_payload(b"l", p) for p in served]
        self.assertNotIn(None, seqs)
        self.assertEqual(set(seqs), set(range(600)))


# -- Relink ---------------------------------------------------------------------

def relink_factory(store):
    from streamproto.relink.api import ListenerFactory
    from streamproto.relink.endpoints import server_endpoints
    return ListenerFactory(server_endpoints(store, id_size=4))


class RelinkFaults(FaultCase):
    @defer.inlineCallbacks
    def test_fsync_failure_never_acks_consumed(self):
        from streamproto.relink.api import Connector
        s = yield self.server(relink_factory)
        connector = Connector(client_endpoint(reactor, "127.0.0.1", s.port), "log",
                              connector_id_size=4, listener_id_size=4, clock=reactor)
        connector.start()
        self.addCleanup(connector.stop)
        link = yield connector.when_linked()
        channel = link.channel(3)
        yield channel.send_payloads(self.payloads(b"r", 0, 200))
        s.io.fail_fsync = True
        acked = []
        d = channel.send_payloads(self.payloads(b"r", 200, 200))
        d.addCallbacks(acked.append, lambda f: acked.append(f))
        yield sleep(reactor, 0.5)
        self.assertEqual([a for a in acked if not hasattr(a, "check")], [],
                         "consumed acked by a failed log")
        self.assertGreater(s.io.failed_fsyncs, 0)
        yield connector.stop()
        yield s.restart()
        log = yield s.store.get("relink-3")
        batch = yield log.read(0, -1, 1 << 30)
        self.assert_served(b"r", batch.records(), range(200), may_have=range(200, 400))


class RealDiskFull(unittest.TestCase):
    """
    "Disk full" in a real server process: styx-server runs with RLIMIT_FSIZE
    (Python ignores SIGXFSZ, so a write past it fails with EFBIG, like a full
    disk for that file).  Writes fail cleanly, nothing partial is visible,
    and once the limit is gone (the operator made room and restarted) the
    acknowledged records are all there and writes work.
    """

    timeout = 90

    @defer.inlineCallbacks
    def test_styx_with_file_size_limit(self):
        from streamproto.styx.api_client import StyxAPIError, StyxClient
        from test.support.torture_harness import ServerProcess, suspicious_output
        data = tempfile.mkdtemp(prefix="streamproto-efbig-")
        self.addCleanup(shutil.rmtree, data, True)
        server = ServerProcess(reactor, "styx-server", data, fsize_limit=1 << 20)
        yield server.start()
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor=reactor)
        acked, seq, error = [], 0, None
        try:
            yield client.create_log("full")
            for _ in range(40):   # 40 x 64 KiB: past the 1 MiB limit
                batch = [make_payload(b"f", s, 6000) for s in range(seq, seq + 10)]
                try:
                    yield client.write_records("full", batch)
                except StyxAPIError as e:
                    error = e
                    break
                acked += range(seq, seq + 10)
                seq += 10
            self.assertIsNotNone(error, "the file size limit was never hit")
            self.assertEqual(error.code, "log_not_available")
            self.assertIn("too large", error.message.lower())
            records = yield client.read_records("full")
            self.assertEqual([parse_payload(b"f", r) for r in records], acked)
            # still refused while the limit holds, and nothing partial appears
            yield self.assertFailure(client.write_records("full", [b"x" * 200000]),
                                     StyxAPIError)
            records = yield client.read_records("full")
            self.assertEqual(len(records), len(acked))
        finally:
            yield client.close()
            yield server.stop()
        server.fsize_limit = None      # room again
        yield server.start()
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor=reactor)
        try:
            records = yield client.read_records("full")
            self.assertEqual([parse_payload(b"f", r) for r in records], acked)
            yield client.write_records("full", [make_payload(b"f", seq, 6000)])
            records = yield client.read_records("full")
            self.assertEqual([parse_payload(b"f", r) for r in records], acked + [seq])
        finally:
            yield client.close()
            yield server.stop()
        self.assertEqual(suspicious_output(server.output_text()), [])


class SlowStateFileIO(FaultyIO):
    """Writing state.json takes 50 ms (a slow disk), segment I/O is fast."""

    def __init__(self):
        super().__init__()
        self.paths = {}

    def open(self, path, flags, mode=0o644):
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        return fd

    def fsync(self, fd):
        if self.paths.get(fd, "").endswith("state.json.tmp"):
            import time
            time.sleep(0.05)
        super().fsync(fd)


class RetentionUnderLoad(unittest.TestCase):
    """
    Size retention while appends keep rolling segments, with the default
    thread-pool runner (deletions run concurrently), then a clean close and
    reopen: the log must open again.
    """

    timeout = 60

    @defer.inlineCallbacks
    def test_reopen_after_concurrent_retention(self):
        path = tempfile.mkdtemp(prefix="streamproto-retention-")
        self.addCleanup(shutil.rmtree, path, True)
        # slow state-file writes: the deletions of successive retention
        # passes overlap in the thread pool, as they do under load
        store = FileLogStore(path, reactor=reactor, retention_interval=None,
                             io=SlowStateFileIO())
        log = yield store.create("r", LogConfig(segment_max_size=65536, log_max_size=262144))
        pending = []
        for i in range(2000):
            pending.append(log.append([make_payload(b"r", i * 10 + k, 60) for k in range(10)]))
            if len(pending) >= 50:
                yield defer.gatherResults(pending)
                pending = []
        yield defer.gatherResults(pending)
        yield sleep(reactor, 0.3)   # let the deletions finish
        start, end = log.start_position, log.end_position
        yield store.close()
        self.flushLoggedErrors(FileNotFoundError)
        store2 = FileLogStore(path, reactor=reactor, retention_interval=None)
        self.addCleanup(store2.close)
        log2 = yield store2.get("r")     # CorruptLog: "segment ... starts at X, expected Y"
        self.assertEqual(log2.end_position, end)
        self.assertLessEqual(log2.start_position, start)
        batch = yield log2.read(start, 10)
        self.assertEqual(parse_payload(b"r", batch.records()[0]), start)

