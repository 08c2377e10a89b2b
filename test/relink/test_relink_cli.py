"""
C{streamproto relink send|echo}: run in process on the test's reactor (its
C{run} coroutine with file objects for stdin/stdout/stderr) against a
listener on 127.0.0.1, over TCP and mutual TLS; plus the real entry point
in a subprocess.
"""

import io
import os
import re
import sys

from twisted.internet import defer, reactor
from twisted.internet.endpoints import serverFromString
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.relink import cli
from streamproto.relink.api import ListenerFactory, RelinkEndpoint
from streamproto.relink.endpoints import server_endpoints
from test.support.netutil import ProcessOutput
from test.relink.test_relink_support import Recorder
from test.support.tlsutil import certs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ECHOED = re.compile(r"^(\d+) messages of (\d+) B echoed in [0-9.]+s: [0-9,]+ msg/s\n$")


class BrokenStore(MemoryLogStore):
    """A store whose logs cannot be opened: every append (commit) fails."""

    def get_or_create(self, name, *args, **kwargs):
        return defer.fail(OSError("disk on fire"))


class RelinkCLITestBase(unittest.TestCase):
    timeout = 20
    tls = False

    @defer.inlineCallbacks
    def setUp(self):
        self.store = self.make_store()
        description = certs().server_endpoint() if self.tls else "tcp:0:interface=127.0.0.1"
        port = yield serverFromString(reactor, description).listen(
            ListenerFactory(server_endpoints(self.store, id_size=4)))
        self.addCleanup(port.stopListening)
        self.port = port.getHost().port

    def make_store(self):
        return MemoryLogStore(reactor)

    def connect_args(self):
        args = ["-s", f"127.0.0.1:{self.port}"]
        if self.tls:
            c = certs()
            args += ["--ca", c.ca, "--cert", c.client_cert, "--key", c.client_key,
                     "--server-name", "localhost"]
        return args

    @defer.inlineCallbacks
    def relink(self, *argv, stdin=b""):
        """Run the command in process: (exit status, stdout text, stderr text)."""
        out, err = io.StringIO(), io.StringIO()
        args = cli.parse_args(self.connect_args() + list(argv))
        status = yield cli.run(reactor, args, io.BytesIO(stdin), out, err)
        return status, out.getvalue(), err.getvalue()

    def assertRecords(self, stored, expected):
        # not assertEqual: difflib on thousands of records takes minutes
        if stored != expected:
            first = next((i for i, (a, b) in enumerate(zip(stored, expected)) if a != b),
                         min(len(stored), len(expected)))
            self.fail(f"{len(stored)} records stored, {len(expected)} expected; first "
                      f"difference at {first}: {stored[first:first + 3]!r} != "
                      f"{expected[first:first + 3]!r}")

    @defer.inlineCallbacks
    def stored(self, name):
        self.assertIn(name, self.store.names())
        log = yield self.store.get(name)
        batch = yield log.read(0, max_bytes=1 << 30)
        return list(batch.records())


class SendTests(RelinkCLITestBase):
    @defer.inlineCallbacks
    def test_send_lines(self):
        lines = [b"line %d" % i for i in range(300)] + [b"", b"with \r", b"last"]
        stdin = b"\n".join(lines)          # no newline after the last line
        status, out, err = yield self.relink("send", "--channel", "5", stdin=stdin)
        self.assertEqual((status, out, err), (0, "sent 303 messages\n", ""))
        self.assertRecords((yield self.stored("relink-5")), lines)

    @defer.inlineCallbacks
    def test_send_in_transactions(self):
        # 10 lines, a commit every 3: commits of 3, 3, 3 and a final 1
        lines = [b"tx %d" % i for i in range(10)]
        status, out, err = yield self.relink(
            "send", "--endpoint", "log-tx", "--transactions", "--commit-every", "3",
            "--channel", "7", stdin=b"".join(line + b"\n" for line in lines))
        self.assertEqual((status, out, err), (0, "sent 10 messages\n", ""))
        self.assertRecords((yield self.stored("relink-7")), lines)
        # an exact multiple of --commit-every commits no trailing empty transaction,
        # and a second run appends after the first, once
        more = [b"more %d" % i for i in range(4)]
        status, out, err = yield self.relink(
            "send", "--endpoint", "log-tx", "--transactions", "--commit-every", "2",
            "--channel", "7", stdin=b"".join(line + b"\n" for line in more))
        self.assertEqual((status, out, err), (0, "sent 4 messages\n", ""))
        self.assertRecords((yield self.stored("relink-7")), lines + more)

    @defer.inlineCallbacks
    def test_send_nothing(self):
        status, out, err = yield self.relink("send", "--channel", "3")
        self.assertEqual((status, out, err), (0, "sent 0 messages\n", ""))
        self.assertEqual(self.store.names(), [])
        status, out, err = yield self.relink(
            "send", "--endpoint", "log-tx", "--transactions", "--channel", "3")
        self.assertEqual((status, out, err), (0, "sent 0 messages\n", ""))

    @defer.inlineCallbacks
    def test_many_lines_wait_for_window(self):
        # more messages than the link's window: the sender waits for room
        lines = [b"%06d" % i for i in range(20000)]
        status, out, err = yield self.relink(
            "send", "--channel", "2", stdin=b"\n".join(lines) + b"\n")
        self.assertEqual((status, out), (0, "sent 20000 messages\n"), err)
        self.assertRecords((yield self.stored("relink-2")), lines)


class EchoTests(RelinkCLITestBase):
    @defer.inlineCallbacks
    def test_echo_prints_the_rate(self):
        status, out, err = yield self.relink("echo", "--count", "3000", "--size", "16")
        self.assertEqual((status, err), (0, ""))
        match = ECHOED.match(out)
        self.assertIsNotNone(match, out)
        self.assertEqual(match.groups(), ("3000", "16"))
        self.assertEqual(self.store.names(), [])     # echo stores nothing


class TLSSendTests(SendTests):
    """The same over mutual TLS (--ca/--cert/--key)."""

    tls = True


class TLSEchoTests(EchoTests):
    tls = True


class NoLinkTests(RelinkCLITestBase):
    """TCP connects, but the server closes the handshake: the command must not retry for ever."""

    @defer.inlineCallbacks
    def test_unknown_endpoint(self):
        status, out, err = yield self.relink("-t", "0.5", "send", "--endpoint",
                                             "nope", stdin=b"x\n")
        self.assertEqual((status, out), (1, ""))
        self.assertIn("no link after 0.5s", err)
        self.assertEqual(self.store.names(), [])

    @defer.inlineCallbacks
    def test_other_id_size(self):
        status, out, err = yield self.relink("-t", "0.5", "--id-size", "2",
                                             "echo", "--count", "5")
        self.assertEqual((status, out), (1, ""))
        self.assertIn("no link after 0.5s", err)


class ShutdownTimeoutTests(unittest.TestCase):
    """A listener that never answers our shutdown: the command gives up, saying so."""

    timeout = 20

    @defer.inlineCallbacks
    def test_silent_listener(self):
        handler = Recorder()      # records the peer's shutdown, never answers it
        port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            ListenerFactory([RelinkEndpoint("silent", handler, connector_id_size=4,
                                            listener_id_size=4)]))
        self.addCleanup(port.stopListening)
        out, err = io.StringIO(), io.StringIO()
        args = cli.parse_args(["-s", f"127.0.0.1:{port.getHost().port}",
                               "--shutdown-timeout", "0.5", "send", "--endpoint", "silent"])
        status = yield cli.run(reactor, args, io.BytesIO(b"a\nb\n"), out, err)
        self.assertEqual(status, 1)
        # the library's warning (shown by default), then the error
        self.assertIn("streamproto relink: relink: no shutdown from the listener in 0.5 s",
                      err.getvalue())
        self.assertEqual(err.getvalue().splitlines(True)[-1],
                         "streamproto relink: error: the listener did not complete the shutdown "
                         "within 0.5 s (messages not yet acknowledged may not have been "
                         "consumed)\n")
        self.assertEqual(handler.messages, {0: [(b"a",), (b"b",)]})
        self.assertTrue(handler.shutdowns)


class LargeWindowTests(RelinkCLITestBase):
    @defer.inlineCallbacks
    def test_echo_with_the_go_default_window(self):
        # 65,536 in flight on one channel: the server pushes back, never fails the link
        status, out, err = yield self.relink("--window", "65536", "echo", "--count",
                                             "150000", "--size", "100")
        self.assertEqual((status, err), (0, ""))
        self.assertIn("150000 messages of 100 B echoed", out)


class FailedCommitTests(RelinkCLITestBase):
    def make_store(self):
        return BrokenStore(reactor)

    @defer.inlineCallbacks
    def test_failed_commits_exit_non_zero(self):
        status, out, err = yield self.relink(
            "send", "--endpoint", "log-tx", "--transactions", "--commit-every", "2",
            stdin=b"a\nb\nc\n")
        self.assertEqual((status, out), (1, "sent 3 messages, 2 commits failed\n"), err)
        self.flushLoggedErrors(OSError)


class ErrorTests(unittest.TestCase):
    timeout = 20

    @defer.inlineCallbacks
    def free_port(self):
        port = reactor.listenTCP(0, ListenerFactory([]), interface="127.0.0.1")
        number = port.getHost().port
        yield port.stopListening()
        return number

    @defer.inlineCallbacks
    def run_cli(self, argv, stdin=b""):
        out, err = io.StringIO(), io.StringIO()
        status = yield cli.run(reactor, cli.parse_args(argv), io.BytesIO(stdin), out, err)
        return status, out.getvalue(), err.getvalue()

    @defer.inlineCallbacks
    def test_connection_refused(self):
        port = yield self.free_port()
        for command in (["send"], ["echo", "--count", "5"]):
            status, out, err = yield self.run_cli(
                ["-s", f"127.0.0.1:{port}"] + command, stdin=b"x\n")
            self.assertEqual((status, out), (1, ""))
            self.assertTrue(err.startswith(
                f"streamproto relink: error: cannot connect to 127.0.0.1:{port}: "), err)
            self.assertIn("refused", err)

    def test_bad_address(self):
        for option in ("-s", "--connect"):
            for address in ("host:", "host:http", "ftp://host:1"):
                err = io.StringIO()
                self.patch(sys, "stderr", err)
                self.assertEqual(cli.main([option, address, "send"]), 2)
                self.assertIn(f"streamproto relink: error: bad server address {address!r}",
                              err.getvalue())

    def test_usage_errors(self):
        self.patch(sys, "stderr", io.StringIO())
        for argv in ([], ["frobnicate"], ["send", "--channel", "x"],
                     ["send", "--commit-every", "0"], ["echo", "--count", "0"],
                     ["echo", "--size", "-1"], ["--link-timeout", "-1", "send"],
                     ["--shutdown-timeout", "0", "send"], ["--window", "0", "send"]):
            self.assertEqual(cli.main(argv), 2, argv)
        self.assertIn("--commit-every must be at least 1", sys.stderr.getvalue())


class EntryPointTests(RelinkCLITestBase):
    """C{python -m streamproto relink ...} as a user runs it."""

    def spawn(self, argv, stdin=b""):
        env = dict(os.environ,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proto = ProcessOutput(stdin)
        reactor.spawnProcess(proto, sys.executable,
                             [sys.executable, "-m", "streamproto", "relink"] + argv,
                             env=env, path=ROOT)
        return proto.ended

    @defer.inlineCallbacks
    def test_send_and_refused(self):
        out, err, code = yield self.spawn(self.connect_args() + ["send", "--channel", "1"],
                                          stdin=b"a\nb\n")
        self.assertEqual((code, out), (0, b"sent 2 messages\n"), err)
        self.assertRecords((yield self.stored("relink-1")), [b"a", b"b"])
        out, err, code = yield self.spawn(["-s", "127.0.0.1:1", "echo"])
        self.assertEqual(code, 1, err)
        self.assertIn(b"streamproto relink: error: cannot connect to 127.0.0.1:1: ", err)


class CommitOutcomeTests(unittest.SynchronousTestCase):
    """C{send --transactions} counts a commit of unknown outcome apart (L{cli._commit})."""

    class Channel:
        def __init__(self, outcome):
            self.outcome = outcome

        def commit(self):
            if isinstance(self.outcome, Exception):
                return defer.fail(self.outcome)
            return defer.succeed(self.outcome)

    def test_outcomes(self):
        from streamproto.relink.errors import CommitOutcomeUnknown, LinkLost
        self.assertIs(self.successResultOf(cli._commit(self.Channel(True))), True)
        self.assertIs(self.successResultOf(cli._commit(self.Channel(False))), False)
        self.assertIsNone(self.successResultOf(cli._commit(self.Channel(CommitOutcomeUnknown(3)))))
        # anything else is still an error
        self.failureResultOf(cli._commit(self.Channel(LinkLost("gone"))), LinkLost)
