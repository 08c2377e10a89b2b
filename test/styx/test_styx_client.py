"""streamproto.styx.api_client.StyxClient against a real Styx HTTP server."""

import io
import tarfile

from twisted.internet import defer, reactor, task
from twisted.trial import unittest
from twisted.web.client import HTTPConnectionPool

from streamproto.log import MemoryLogStore
from streamproto.styx import formats
from streamproto.styx.api_client import StyxAPIError, StyxClient, base_url
from streamproto.styx.resource import make_site


class ClientTestBase(unittest.TestCase):
    timeout = 30

    def setUp(self):
        self.clock = task.Clock()
        self.store = MemoryLogStore(self.clock)
        self.port = reactor.listenTCP(0, make_site(self.store), interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(self.pool.closeCachedConnections)
        self.client = StyxClient(f"http://127.0.0.1:{self.port.getHost().port}", reactor,
                                 pool=self.pool)


class LogsTests(ClientTestBase):
    @defer.inlineCallbacks
    def test_lifecycle(self):
        self.assertEqual((yield self.client.list_logs()), [])
        info = yield self.client.create_log("events", max_record_size=100, log_max_count=50)
        self.assertEqual(info["name"], "events")
        log = yield self.store.get("events")
        self.assertEqual((log.config.max_record_size, log.config.log_max_count), (100, 50))
        yield log.append([b"a", b"b"])
        info = yield self.client.get_log("events")
        self.assertEqual((info["record_count"], info["end_position"]), (2, 2))
        self.assertEqual([i["name"] for i in (yield self.client.list_logs())], ["events"])
        yield self.client.truncate_log("events")
        info = yield self.client.get_log("events")  # emptied, positions from 0 again
        self.assertEqual((info["start_position"], info["end_position"]), (0, 0))
        yield self.client.delete_log("events")
        self.assertEqual(self.store.names(), [])

    @defer.inlineCallbacks
    def test_typed_errors(self):
        e = yield self.assertFailure(self.client.get_log("nope"), StyxAPIError)
        self.assertEqual((e.code, e.status), ("log_not_found", 404))
        self.assertEqual(e.message, "api: log 'nope' not found")
        yield self.client.create_log("events")
        e = yield self.assertFailure(self.client.create_log("events"), StyxAPIError)
        self.assertEqual((e.code, e.status), ("log_exist", 400))
        e = yield self.assertFailure(self.client.create_log("bad name"), StyxAPIError)
        self.assertEqual(e.code, "log_invalid_name")
        e = yield self.assertFailure(self.client.delete_log("nope"), StyxAPIError)
        self.assertEqual(e.code, "log_not_found")
        e = yield self.assertFailure(self.client.truncate_log("nope"), StyxAPIError)
        self.assertEqual(e.code, "log_not_found")
        e = yield self.assertFailure(self.client.backup_log("events"), StyxAPIError)
        self.assertEqual((e.code, e.status), ("not_supported", 501))
        e = yield self.assertFailure(
            self.client.read_records("events", position=5), StyxAPIError)
        self.assertEqual(e.code, "invalid_params")

    @defer.inlineCallbacks
    def test_metrics(self):
        yield self.client.create_log("events")
        yield self.client.write_records("events", [b"abc"])
        text = yield self.client.metrics()
        self.assertIn('log_record_count{log="events"} 1.0', text)

    def test_package_exports(self):
        import streamproto.styx as styx
        self.assertIs(styx.StyxClient, StyxClient)
        self.assertIs(styx.make_site, make_site)
        self.assertRaises(AttributeError, getattr, styx, "nothing_here")

    def test_base_url(self):
        self.assertEqual(base_url("localhost:7123"), "http://localhost:7123")
        self.assertEqual(base_url("https://h:1/"), "https://h:1")


class RecordsTests(ClientTestBase):
    @defer.inlineCallbacks
    def setUp(self):
        super().setUp()
        yield self.client.create_log("events")

    @defer.inlineCallbacks
    def test_single_record_both_ways(self):
        result = yield self.client.write_record("events", b"\x00one\n")
        self.assertEqual(result, {"position": 1, "count": 1})
        yield self.client.write_record("events", b"two")
        self.assertEqual((yield self.client.read_record("events")), b"\x00one\n")
        self.assertEqual((yield self.client.read_record("events", "end", -1)), b"two")
        self.assertIsNone((yield self.client.read_record("events", "end")))

    @defer.inlineCallbacks
    def test_every_format_both_ways(self):
        records = [b"alpha", b"beta", b"", b"gamma"]
        cases = [formats.BINARY, formats.lines("lf"), formats.lines("cr"),
                 formats.lines("crlf")]
        for fmt in cases:
            payload = records if fmt.kind == "binary" else [r for r in records if r]
            before = (yield self.store.get("events")).end_position
            result = yield self.client.write_records("events", payload, fmt)
            self.assertEqual(result, {"position": before + len(payload),
                                      "count": len(payload)})
            for read_fmt in cases:
                if read_fmt.kind == "lines" and fmt.kind == "binary":
                    continue  # empty records vanish in lines
                got = yield self.client.read_records("events", position=before,
                                                     fmt=read_fmt)
                self.assertEqual(got, payload, (fmt, read_fmt))

    @defer.inlineCallbacks
    def test_streamed_batches(self):
        records = [b"%06d" % i for i in range(50000)]
        yield self.client.write_records("events", records)
        batches = []
        count = yield self.client.read_records("events", on_records=batches.append)
        self.assertEqual(count, 50000)
        self.assertGreater(len(batches), 1)
        self.assertEqual([r for b in batches for r in b], records)

    @defer.inlineCallbacks
    def test_count_whence_follow(self):
        yield self.client.write_records("events", [b"a", b"b", b"c"])
        self.assertEqual((yield self.client.read_records("events", "start", 1, count=1)),
                         [b"b"])
        d = self.client.read_records("events", "end", follow=True, timeout=10)
        for _ in range(100):
            log = yield self.store.get("events")
            if len(log._waiters):
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        yield log.append([b"d"])
        self.assertEqual((yield d), [b"d"])
        d = self.client.read_records("events", "end", follow=True, timeout=10)
        for _ in range(100):
            if len(log._waiters):
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.clock.advance(10)
        self.assertEqual((yield d), [])

    @defer.inlineCallbacks
    def test_record_too_large(self):
        yield self.client.create_log("small", max_record_size=4)
        e = yield self.assertFailure(self.client.write_records("small", [b"12345"]),
                                     StyxAPIError)
        self.assertEqual((e.code, e.status), ("record_too_large", 400))
        e = yield self.assertFailure(self.client.write_record("small", b"12345"),
                                     StyxAPIError)
        self.assertEqual(e.code, "record_too_large")

    def test_octet_stream_needs_one_record(self):
        self.assertRaises(ValueError, self.client.write_records, "events", [b"a", b"b"],
                          formats.RECORD)


class BackupTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_backup_to_sink_and_restore(self):
        import shutil
        import tempfile

        from streamproto.log import open_store
        path = tempfile.mkdtemp(prefix="styx-client-")
        self.addCleanup(shutil.rmtree, path, True)
        store = open_store(path, reactor=reactor, retention_interval=0)
        port = reactor.listenTCP(0, make_site(store), interface="127.0.0.1")
        pool = HTTPConnectionPool(reactor, persistent=False)
        client = StyxClient(f"http://127.0.0.1:{port.getHost().port}", reactor, pool=pool)
        try:
            yield client.create_log("events")
            yield client.write_records("events", [b"x" * 100] * 100)
            sink = io.BytesIO()
            yield client.backup_log("events", sink.write)
            with tarfile.open(fileobj=io.BytesIO(sink.getvalue()), mode="r:gz") as tar:
                self.assertGreater(sum(m.size for m in tar), 10000)
            yield client.restore_log("again", io.BytesIO(sink.getvalue()))
            self.assertEqual((yield client.read_records("again")), [b"x" * 100] * 100)
        finally:
            yield port.stopListening()
            yield pool.closeCachedConnections()
            yield store.close()


class FailoverTests(unittest.TestCase):
    """
    Several front-ends of one store: a request that cannot reach the
    current one goes to the next, and the client stays there.
    """
    timeout = 30

    def setUp(self):
        from test.support.netutil import free_port
        self.store = MemoryLogStore(task.Clock())
        self.ports = []
        for _ in range(2):
            port = reactor.listenTCP(0, make_site(self.store), interface="127.0.0.1")
            self.addCleanup(port.stopListening)
            self.ports.append(port)
        self.dead = f"http://127.0.0.1:{free_port()}"
        self.urls = [f"http://127.0.0.1:{p.getHost().port}" for p in self.ports]
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(self.pool.closeCachedConnections)

    @defer.inlineCallbacks
    def test_dead_front_end_passed_over(self):
        """A front-end that refuses connections: writes and reads go to the next one."""
        client = StyxClient(",".join([self.dead] + self.urls), reactor, pool=self.pool)
        yield client.create_log("events")
        self.assertEqual(client.base_url, self.urls[0])
        yield client.write_records("events", [b"a", b"b"])
        self.assertEqual((yield client.read_records("events")), [b"a", b"b"])

    @defer.inlineCallbacks
    def test_front_end_dies(self):
        """The current front-end goes away between requests: the next one answers."""
        client = StyxClient(self.urls, reactor, pool=self.pool)
        yield client.create_log("events")
        yield client.write_record("events", b"one")
        yield self.ports[0].stopListening()
        yield client.write_record("events", b"two")
        self.assertEqual(client.base_url, self.urls[1])
        self.assertEqual((yield client.read_records("events")), [b"one", b"two"])

    @defer.inlineCallbacks
    def test_all_dead(self):
        """Every front-end unreachable: the connection error, after trying each once."""
        from twisted.internet.error import ConnectError
        for port in self.ports:
            yield port.stopListening()
        client = StyxClient([self.dead] + self.urls, reactor, pool=self.pool)
        yield self.assertFailure(client.list_logs(), ConnectError)

    @defer.inlineCallbacks
    def test_lost_write_not_sent_again(self):
        """
        A write whose answer was lost may be stored: it is not sent to the
        next front-end (the caller decides), while a read is.
        """
        from twisted.internet.protocol import Factory, Protocol
        from twisted.web.client import ResponseFailed

        class Hangup(Protocol):
            def dataReceived(self, data):
                self.transport.loseConnection()
        hangup = reactor.listenTCP(0, Factory.forProtocol(Hangup), interface="127.0.0.1")
        self.addCleanup(hangup.stopListening)
        client = StyxClient([f"http://127.0.0.1:{hangup.getHost().port}", self.urls[0]],
                            reactor, pool=self.pool)
        yield self.store.create("events")
        yield self.assertFailure(client.write_record("events", b"x"), ResponseFailed)
        # not sent again; the next request goes to the next front-end
        self.assertEqual(client.base_url, self.urls[0])
        self.assertEqual((yield client.read_records("events")), [])
        client.base_urls.reverse()     # the hang-up first again: a read moves on
        self.assertEqual((yield client.read_records("events")), [])
        self.assertEqual(client.base_url, self.urls[0])

    def test_tls_options_per_host(self):
        """A callable gives each front-end's TLS options by its own name."""
        from streamproto.styx.api_client import _FixedTLSPolicy
        asked = []
        policy = _FixedTLSPolicy(lambda host: asked.append(host) or host.upper())
        self.assertEqual(policy.creatorForNetloc(b"a.example", 443), "A.EXAMPLE")
        self.assertEqual(_FixedTLSPolicy("same").creatorForNetloc(b"b", 1), "same")
        self.assertEqual(asked, ["a.example"])
