"""
C{streamproto styx ...} run as a subprocess against a server started in the
test, plus the twistd plugin's options and service.
"""

import io
import json
import os
import shutil
import struct
import sys
import tempfile
import types

from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import serverFromString
from twisted.trial import unittest

from streamproto.log import LogConfig, MemoryLogStore, open_store
from streamproto.styx import cli, tap
from streamproto.styx.resource import make_site
from test.support.netutil import ProcessOutput
from test.support.tlsutil import certs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn(args, stdin=b""):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proto = ProcessOutput(stdin)
    reactor.spawnProcess(proto, sys.executable,
                         [sys.executable, "-m", "streamproto", "styx"] + args,
                         env=env, path=ROOT)
    return proto


class CLITestBase(unittest.TestCase):
    timeout = 60

    def serve(self, store, timeout=30):
        self.store = store
        self.upgrades = []

        def counting_upgrade(request, log, params, **kwargs):
            from streamproto.styx import stream
            self.upgrades.append(request.method)
            return stream.upgrade(request, log, params, **kwargs)

        site = make_site(store, upgrade=counting_upgrade, timeout=timeout)
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.host = f"127.0.0.1:{port.getHost().port}"
        self.addCleanup(port.stopListening)

    def setUp(self):
        self.serve(MemoryLogStore(reactor))

    def styx(self, *args, stdin=b""):
        return spawn(["-s", self.host] + list(args), stdin).ended

    @defer.inlineCallbacks
    def ok(self, *args, stdin=b""):
        out, err, code = yield self.styx(*args, stdin=stdin)
        self.assertEqual(code, 0, err)
        return out


class LogsCommandTests(CLITestBase):
    @defer.inlineCallbacks
    def test_create_list_get(self):
        out = yield self.ok("logs", "create", "events", "--log-max-count", "10")
        self.assertEqual(out.decode().splitlines()[0].split(), ["name:", "events"])
        log = yield self.store.get("events")
        self.assertEqual(log.config.log_max_count, 10)
        yield log.append([b"abc"])
        out = yield self.ok("logs", "list")
        lines = out.decode().splitlines()
        self.assertEqual(lines[0].split("\t")[0], "NAME")
        self.assertEqual(lines[1].split(), ["events", "ok", "1", "3", "0", "1"])
        out = yield self.ok("logs", "get", "events", "-f", "json")
        self.assertEqual(json.loads(out), {"name": "events", "status": "ok",
                                           "record_count": 1, "file_size": 3,
                                           "start_position": 0, "end_position": 1})
        out = yield self.ok("-f", "json", "logs", "list")
        self.assertEqual([i["name"] for i in json.loads(out)], ["events"])

    @defer.inlineCallbacks
    def test_errors(self):
        out, err, code = yield self.styx("logs", "get", "nope")
        self.assertEqual(code, 1)
        self.assertEqual(err, b"streamproto styx: error: api: log 'nope' not found\n")
        out, err, code = yield self.styx("logs", "create", "bad.name")
        self.assertEqual(code, 1)
        self.assertIn(b"streamproto styx: error: ", err)
        out, err, code = yield self.styx("logs", "frobnicate")
        self.assertEqual(code, 2)

    @defer.inlineCallbacks
    def test_truncate_delete(self):
        log = yield self.store.create("events")
        yield log.append([b"a", b"b"])
        yield self.ok("logs", "truncate", "events")
        log = yield self.store.get("events")
        self.assertEqual((log.start_position, log.end_position), (0, 0))
        yield self.ok("logs", "delete", "events")
        self.assertEqual(self.store.names(), [])


class RecordsCommandTests(CLITestBase):
    """produce/consume over styx/0 (the default when its client is in the build)."""

    mode = ()
    @defer.inlineCallbacks
    def setUp(self):
        super().setUp()
        self.log = yield self.store.create("events")

    @defer.inlineCallbacks
    def records(self):
        batch = yield self.log.read(self.log.start_position, max_bytes=1 << 30)
        return batch.records()

    @defer.inlineCallbacks
    def test_produce_lines_and_consume(self):
        yield self.ok("produce", "events", *self.mode, stdin=b"one\ntwo\nthree\n")
        yield self.ok("logs", "write", "events", "-l", "crlf", *self.mode, stdin=b"four\r\nfive")
        self.assertEqual((yield self.records()), [b"one", b"two", b"three", b"four", b"five"])
        out = yield self.ok("consume", "events", *self.mode)
        self.assertEqual(out, b"one\ntwo\nthree\nfour\nfive\n")
        out = yield self.ok("logs", "read", "events", "-w", "end", "-P", "-2", "-l", "cr", *self.mode)
        self.assertEqual(out, b"four\rfive\r")
        out = yield self.ok("consume", "events", "-P", "1", "-n", "2", "-u", *self.mode)
        self.assertEqual(out, b"two\nthree\n")
        # styx/0 unless --http
        expected = [] if self.mode else [b"POST"] * 2 + [b"GET"] * 3
        self.assertEqual(self.upgrades, expected)

    @defer.inlineCallbacks
    def test_binary_both_ways(self):
        records = [b"\n\x00", b"", b"x" * 3000]
        body = b"".join(struct.pack(">i", len(r)) + r for r in records)
        yield self.ok("produce", "events", "--binary", *self.mode, stdin=body)
        self.assertEqual((yield self.records()), records)
        out = yield self.ok("consume", "events", "-b", *self.mode)
        self.assertEqual(out, body)

    @defer.inlineCallbacks
    def test_many_records(self):
        lines = b"".join(b"%d\n" % i for i in range(100000))
        yield self.ok("produce", "events", *self.mode, stdin=lines)
        self.assertEqual(self.log.end_position, 100000)
        out = yield self.ok("consume", "events", *self.mode)
        self.assertEqual(out, lines)

    @defer.inlineCallbacks
    def test_follow(self):
        ended = self.styx("consume", "events", "--follow", "-n", "3", *self.mode)
        yield task.deferLater(reactor, 0.5, lambda: None)
        yield self.log.append([b"a"])
        yield task.deferLater(reactor, 0.2, lambda: None)
        yield self.log.append([b"b", b"c", b"d"])
        out, err, code = yield ended
        self.assertEqual((out, code), (b"a\nb\nc\n", 0), err)

    @defer.inlineCallbacks
    def test_produce_unknown_log(self):
        out, err, code = yield self.styx("produce", "nope", *self.mode, stdin=b"x\n")
        self.assertEqual(code, 1)
        self.assertEqual(err, b"streamproto styx: error: api: log 'nope' not found\n")


class RecordsOverHTTPTests(RecordsCommandTests):
    """The same with --http: batches over the HTTP API, long-polls for --follow."""

    mode = ("--http",)


class SlowInputTests(CLITestBase):
    """A slow stdin must not starve styx/0 heartbeats (stdin is read in a thread)."""

    def setUp(self):
        self.serve(MemoryLogStore(reactor), timeout=2)

    @defer.inlineCallbacks
    def test_pause_longer_than_the_server_timeout(self):
        yield self.store.create("events")
        proto = spawn(["-s", self.host, "produce", "events"], stdin=None)
        proto.transport.write(b"first\n")
        # the server closes styx/0 streams idle for 2 s; we pause 3 s
        yield task.deferLater(reactor, 3.0, lambda: None)
        proto.transport.write(b"second\n")
        proto.transport.closeStdin()
        out, err, code = yield proto.ended
        self.assertEqual(code, 0, err)
        log = yield self.store.get("events")
        batch = yield log.read(0)
        self.assertEqual(batch.records(), [b"first", b"second"])
        self.assertEqual(self.upgrades, [b"POST"])


class FileStoreCommandTests(CLITestBase):
    def setUp(self):
        self.path = tempfile.mkdtemp(prefix="styx-cli-")
        self.addCleanup(shutil.rmtree, self.path, True)
        store = open_store(self.path, reactor=reactor, retention_interval=0)
        self.addCleanup(store.close)
        self.serve(store)

    @defer.inlineCallbacks
    def test_backup_restore(self):
        yield self.ok("logs", "create", "events")
        yield self.ok("produce", "events", stdin=b"a\nb\n")
        archive = os.path.join(self.path, "..", os.path.basename(self.path) + ".tgz")
        self.addCleanup(lambda: os.path.exists(archive) and os.unlink(archive))
        yield self.ok("logs", "backup", "events", "-o", archive)
        with open(archive, "rb") as f:
            data = f.read()
        self.assertEqual(data[:2], b"\x1f\x8b")
        out = yield self.ok("logs", "backup", "events")
        self.assertEqual(out[:2], b"\x1f\x8b")
        yield self.ok("logs", "restore", "copy", stdin=data)
        out = yield self.ok("consume", "copy")
        self.assertEqual(out, b"a\nb\n")
        out, err, code = yield self.styx("logs", "restore", "copy", stdin=data)
        self.assertEqual(code, 1)


@defer.inlineCallbacks
def serve_styx_mtls(testcase, store):
    """The Styx API over C{store} on mtls (client certificates required): its port."""
    port = yield serverFromString(reactor, certs().server_endpoint()).listen(make_site(store))
    testcase.addCleanup(port.stopListening)
    return port.getHost().port


class TLSCommandTests(CLITestBase):
    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore(reactor)
        self.port = yield serve_styx_mtls(self, self.store)

    @defer.inlineCallbacks
    def test_client_certificate(self):
        c = certs()
        host = f"https://localhost:{self.port}"
        out, err, code = yield spawn(["-s", host, "--ca", c.ca, "--cert", c.client_cert,
                                      "--key", c.client_key, "logs", "create", "secure"]).ended
        self.assertEqual(code, 0, err)
        self.assertEqual(self.store.names(), ["secure"])
        tls = ["-s", host, "--ca", c.ca, "--cert", c.client_cert, "--key", c.client_key]
        for mode in ((), ("--http",)):
            out, err, code = yield spawn(tls + ["produce", "secure", *mode],
                                         stdin=b"a\nb\n").ended
            self.assertEqual(code, 0, err)
            out, err, code = yield spawn(tls + ["consume", "secure", "-w", "end", "-P", "-2",
                                                *mode]).ended
            self.assertEqual((code, out), (0, b"a\nb\n"), err)
        out, err, code = yield spawn(["-s", host, "--ca", c.ca, "logs", "list"]).ended
        self.assertEqual(code, 1)


class InProcessTests(unittest.SynchronousTestCase):
    def test_tabulate_like_go_tabwriter(self):
        self.assertEqual(cli.tabulate([["name:", "x"], ["start_position:", "0"]]),
                         "name:\t\t\tx\nstart_position:\t\t0\n")

    def test_usage_errors(self):
        import io
        self.patch(sys, "stderr", io.StringIO())
        self.assertEqual(cli.main(["logs"]), 2)
        self.assertEqual(cli.main(["consume"]), 2)
        self.assertEqual(cli.main(["logs", "read", "x", "-w", "middle"]), 2)

    def test_help_names_every_command(self):
        text = cli.build_parser().format_help()
        for command in ("logs", "produce", "consume", "benchmark"):
            self.assertIn(command, text)

    def test_benchmark_dispatch(self):
        calls = []
        fake = types.ModuleType("streamproto.styx.benchmark")
        fake.main = lambda argv: calls.append(argv) or 0
        saved = sys.modules.get("streamproto.styx.benchmark")
        sys.modules["streamproto.styx.benchmark"] = fake
        try:
            self.assertEqual(cli.main(["benchmark", "-n", "5"]), 0)
        finally:
            if saved is None:
                del sys.modules["streamproto.styx.benchmark"]
            else:
                sys.modules["streamproto.styx.benchmark"] = saved
        self.assertEqual(calls, [["-n", "5"]])


class _TTY(io.StringIO):
    def isatty(self):
        return True


class FakeClient:
    """Just enough of StyxClient for produce()/consume() in process."""

    base_url = "http://fake"
    tls_options = None

    def __init__(self, stored=()):
        self.written = []
        self.stored = list(stored)

    def get_log(self, name):
        return defer.succeed({"name": name, "start_position": 0,
                              "end_position": len(self.stored)})

    def write_records(self, name, records, fmt):
        self.written.append(list(records))
        return defer.succeed({"position": 0, "count": len(records)})

    def read_records(self, name, whence, position, count, follow, timeout, on_records):
        records = self.stored[position:]
        on_records(records)
        return defer.succeed(len(records))


class ProgressTests(unittest.SynchronousTestCase):
    def test_produce_progress_on_a_terminal(self):
        client = FakeClient()
        err = _TTY()
        args = cli.build_parser().parse_args(["produce", "events", "--http"])
        d = defer.ensureDeferred(cli.produce(
            None, args, client, stdin=io.BytesIO(b"a\nbb\nccc\n"), err=err,
            blocking=lambda f, *a: defer.succeed(f(*a))))
        self.assertEqual(self.successResultOf(d), 0)
        self.assertEqual(client.written, [[b"a", b"bb", b"ccc"]])
        self.assertIn("produce events: 3 records", err.getvalue())
        self.assertTrue(err.getvalue().endswith("\n"))

    def test_consume_progress_and_no_bar_off_a_terminal(self):
        client = FakeClient([b"x", b"y"])
        out = io.BytesIO()
        err = _TTY()
        args = cli.build_parser().parse_args(["consume", "events", "--http"])
        d = defer.ensureDeferred(cli.consume(None, args, client, stdout=out, err=err))
        self.assertEqual(self.successResultOf(d), 0)
        self.assertEqual(out.getvalue(), b"x\ny\n")
        self.assertIn("100.0%", err.getvalue())
        quiet = io.StringIO()
        d = defer.ensureDeferred(cli.consume(None, args, client, stdout=io.BytesIO(),
                                             err=quiet))
        self.successResultOf(d)
        self.assertEqual(quiet.getvalue(), "")


class TapTests(unittest.TestCase):
    def test_options(self):
        options = tap.Options()
        options.parseOptions(["--timeout", "5", "--log-max-count", "100", "--data",
                              "/tmp/x"])
        self.assertEqual(options["port"], ["tcp:7123"])
        self.assertEqual(options["timeout"], 5)
        self.assertEqual(options["log_config"], LogConfig(log_max_count=100))
        defaults = tap.Options()
        defaults.parseOptions([])
        self.assertEqual(defaults["timeout"], 30)
        self.assertEqual(defaults["log_config"], LogConfig())
        self.assertEqual(defaults["cors_origins"], ["*"])
        options = tap.Options()
        options.parseOptions(["--cors-origin", "https://a", "--cors-origin", "https://*.b"])
        self.assertEqual(options["cors_origins"], ["https://a", "https://*.b"])
        options = tap.Options()
        options.parseOptions(["--cors-origin", "none"])
        self.assertEqual(options["cors_origins"], [])

    def test_http_idle_timeout(self):
        from streamproto.styx.resource import make_site
        options = tap.Options()
        options.parseOptions(["--http-idle-timeout", "5"])
        self.assertEqual(options["http-idle-timeout"], 5)
        self.assertEqual(make_site(MemoryLogStore(reactor), http_idle_timeout=5).timeOut, 5)
        self.assertEqual(make_site(MemoryLogStore(reactor)).timeOut, 60)

    def test_bad_options(self):
        from twisted.python import usage
        for args in (["--timeout", "1"], ["--timeout", "x"], ["--max-record-size", "0"],
                     ["--log-max-count", "0"], ["--http-idle-timeout", "0"]):
            self.assertRaises(usage.UsageError, tap.Options().parseOptions, args)

    @defer.inlineCallbacks
    def test_make_service_serves_the_api(self):
        import treq
        store = MemoryLogStore(reactor)
        options = tap.Options()
        options.parseOptions(["--port", "tcp:0:interface=127.0.0.1", "--timeout", "7",
                              "--max-record-size", "99"])
        service = tap.makeService(options, store=store)
        service.startService()
        self.addCleanup(service.stopService)
        listener = list(service)[0]
        port = listener._waitingForPort.result.getHost().port
        root = listener.factory.resource
        self.assertEqual(root.timeout, 7)
        response = yield treq.post(f"http://127.0.0.1:{port}/logs", data={"name": "a"},
                                   persistent=False)
        self.assertEqual(response.code, 200)
        yield response.content()
        log = yield store.get("a")
        self.assertEqual(log.config.max_record_size, 99)
