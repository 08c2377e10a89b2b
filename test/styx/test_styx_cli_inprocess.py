"""
C{streamproto styx} commands run in process (C{cli.run} on the test's
reactor, stdin/stdout patched) against a server on 127.0.0.1, so that
coverage measures them; test_styx_cli runs the same as subprocesses.
"""

import io
import json
import sys

from twisted.internet import defer, reactor
from twisted.python.failure import Failure
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.styx import cli
from streamproto.styx.resource import make_site
from test.support.tlsutil import certs


class Stdout(io.TextIOWrapper):
    """A text stdout with a binary C{.buffer}, like C{sys.stdout}."""

    def __init__(self):
        super().__init__(io.BytesIO(), encoding="utf-8", write_through=True)

    def bytes(self):
        self.flush()
        return self.buffer.getvalue()


class InProcessCommandTests(unittest.TestCase):
    timeout = 20

    def setUp(self):
        self.store = MemoryLogStore(reactor)
        port = reactor.listenTCP(0, make_site(self.store), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.host = f"127.0.0.1:{port.getHost().port}"

    @defer.inlineCallbacks
    def styx(self, *argv, stdin=b""):
        """Run a command in process: (exit status, stdout bytes)."""
        args = cli.parse_args(["-s", self.host] + list(argv))
        out = Stdout()
        self.patch(sys, "stdout", out)
        self.patch(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        self.patch(sys, "stderr", io.StringIO())
        status = yield defer.ensureDeferred(cli.run(reactor, args))
        return status, out.bytes()

    @defer.inlineCallbacks
    def test_logs_commands(self):
        status, out = yield self.styx("logs", "create", "events", "--log-max-count", "10")
        self.assertEqual(status, 0)
        self.assertEqual(out.decode().splitlines()[0].split(), ["name:", "events"])
        log = yield self.store.get("events")
        self.assertEqual(log.config.log_max_count, 10)
        yield log.append([b"abc", b"de"])
        status, out = yield self.styx("logs", "list")
        lines = out.decode().splitlines()
        self.assertEqual(lines[0].split("\t")[0], "NAME")
        self.assertEqual(lines[1].split(), ["events", "ok", "2", "5", "0", "2"])
        status, out = yield self.styx("-f", "json", "logs", "list")
        self.assertEqual([i["name"] for i in json.loads(out)], ["events"])
        status, out = yield self.styx("logs", "get", "events", "-f", "json")
        self.assertEqual(json.loads(out)["end_position"], 2)
        status, out = yield self.styx("logs", "truncate", "events")
        self.assertEqual((status, out), (0, b""))
        log = yield self.store.get("events")
        self.assertEqual(log.start_position, log.end_position)
        status, out = yield self.styx("logs", "delete", "events")
        self.assertEqual((status, out), (0, b""))
        self.assertEqual(self.store.names(), [])

    @defer.inlineCallbacks
    def test_errors_are_cli_errors(self):
        failure = yield self.assertFailure(
            defer.ensureDeferred(self.styx("logs", "get", "nope")), cli.CLIError)
        self.assertEqual(str(failure), "api: log 'nope' not found")
        yield self.assertFailure(
            defer.ensureDeferred(self.styx("logs", "create", "x", "--log-max-count", "0")),
            cli.CLIError)
        self.assertEqual(self.store.names(), [])

    @defer.inlineCallbacks
    def produce_and_consume(self, *mode):
        yield self.store.create("events")
        status, out = yield self.styx("produce", "events", *mode, stdin=b"one\ntwo\nthree\n")
        self.assertEqual(status, 0)
        status, out = yield self.styx("logs", "write", "events", "-l", "crlf", *mode,
                                      stdin=b"four\r\n")
        log = yield self.store.get("events")
        batch = yield log.read(0)
        self.assertEqual(batch.records(), [b"one", b"two", b"three", b"four"])
        status, out = yield self.styx("consume", "events", *mode)
        self.assertEqual((status, out), (0, b"one\ntwo\nthree\nfour\n"))
        status, out = yield self.styx("logs", "read", "events", "-w", "end", "-P", "-1",
                                      *mode)
        self.assertEqual((status, out), (0, b"four\n"))
        status, out = yield self.styx("consume", "events", "-w", "start", "-P", "1",
                                      "-n", "1", "-b", *mode)
        self.assertEqual((status, out), (0, b"\x00\x00\x00\x03two"))

    def test_produce_consume_styx0(self):
        return self.produce_and_consume()

    def test_produce_consume_http(self):
        return self.produce_and_consume("--http")


class TLSCommandTests(InProcessCommandTests):
    """The same over https with a client certificate (--ca/--cert/--key)."""

    @defer.inlineCallbacks
    def setUp(self):
        from test.styx.test_styx_cli import serve_styx_mtls
        self.store = MemoryLogStore(reactor)
        port = yield serve_styx_mtls(self, self.store)
        self.host = f"https://localhost:{port}"

    def styx(self, *argv, stdin=b""):
        c = certs()
        return super().styx("--ca", c.ca, "--cert", c.client_cert, "--key", c.client_key,
                            *argv, stdin=stdin)


class ReportTests(unittest.SynchronousTestCase):
    def report(self, exception):
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        try:
            raise exception
        except BaseException:
            status = cli._report(Failure())
        return status, err.getvalue()

    def test_exit_statuses(self):
        self.assertEqual(self.report(cli.CLIError("no such log")),
                         (1, "streamproto styx: error: no such log\n"))
        self.assertEqual(self.report(ValueError("bad")), (1, "streamproto styx: error: bad\n"))
        self.assertEqual(self.report(BrokenPipeError()), (0, ""))
        self.assertEqual(self.report(KeyboardInterrupt()), (130, ""))
