"""
The one command-line convention of the client commands
(L{streamproto.core.cli}, doc/cli.rst): the address and TLS options, the
previous release's spellings as hidden aliases (with a note), the usage
errors, and the exit statuses of every command run as users run it
(C{python -m streamproto ...}): 0 done, 1 failure (one line, no Python
repr), 2 usage.
"""

import argparse
import contextlib
import io
import json
import os
import sys

from twisted.internet import defer, reactor
from twisted.trial import unittest

from streamproto import status
from streamproto.core import cli as common
from streamproto.log import MemoryLogStore
from streamproto.lumberjack import cli as lumberjack_cli
from streamproto.lumberjack import tap as lumberjack_tap
from streamproto.pravega import cli as pravega_cli
from streamproto.pravega import tap as pravega_tap
from streamproto.reliable import cli as reliable_cli
from streamproto.reliable import tap as reliable_tap
from streamproto.relink import cli as relink_cli
from streamproto.relink import tap as relink_tap
from streamproto.styx import cli as styx_cli
from streamproto.styx import tap as styx_tap
from test.support.netutil import ProcessOutput, free_port
from test.support.test_ops_support import RunningService
from test.support.tlsutil import certs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEGMENT = "scope/stream/0.#epoch.0"


class AddressTests(unittest.SynchronousTestCase):
    def test_forms(self):
        parse = common.parse_address
        self.assertEqual(parse("host"), (None, "host", None, ""))
        self.assertEqual(parse("host:7"), (None, "host", 7, ""))
        self.assertEqual(parse("HTTPS://Host:7/"), ("https", "host", 7, ""))
        self.assertEqual(parse("http://h:9180/metrics"), ("http", "h", 9180, "/metrics"))
        self.assertEqual(parse("tls://[::1]:5044"), ("tls", "::1", 5044, ""))
        for bad in ("", "host:", "host:http", "host:70000", "ftp://host", "h:1?x=1",
                    "user@h:1"):
            self.assertRaises(ValueError, parse, bad)

    def test_server(self):
        server = common.Server("::1", 7, True)
        self.assertEqual((server.address, server.url("/m")), ("[::1]:7", "https://[::1]:7/m"))


class ResolveTests(unittest.SynchronousTestCase):
    """One convention, many spellings: the same L{common.Server} whichever is used."""

    def setUp(self):
        self.convention = common.Convention("streamproto test", "127.0.0.1:5044",
                                            timeout=60.0, aliases=("--metrics",))

    def resolve(self, *argv):
        err = io.StringIO()
        parser = self.convention.parser("test")
        with contextlib.redirect_stderr(err):
            args = self.convention.parse(parser, list(argv), err)
        return args, err.getvalue()

    def usage_error(self, *argv):
        err = io.StringIO()
        parser = self.convention.parser("test")
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as raised:
            self.convention.parse(parser, list(argv), err)
        self.assertEqual(raised.exception.code, common.EXIT_USAGE)
        self.assertIn("streamproto test: error: ", err.getvalue())
        return err.getvalue()

    def test_default(self):
        args, err = self.resolve()
        self.assertEqual(args.server, common.Server("127.0.0.1", 5044, False, None, ""))
        self.assertEqual((args.tls_options, args.timeout, args.format, args.verbosity, err),
                         (None, 60.0, "text", 1, ""))

    def test_old_spellings_are_aliases(self):
        new, _ = self.resolve("-s", "logs.example:6000")
        for old in (["-H", "logs.example", "-p", "6000"],
                    ["--host", "logs.example", "--port", "6000"],
                    ["--connect", "logs.example:6000"],
                    ["-H", "http://logs.example:6000"],
                    ["--metrics", "logs.example:6000"]):
            args, err = self.resolve(*old)
            self.assertEqual((args.server.host, args.server.port, args.server.tls),
                             (new.server.host, new.server.port, False), old)
            self.assertIn("is the previous release's spelling, kept for this release only: "
                          "use -s/--server", err)
        # quiet: no note
        self.assertEqual(self.resolve("-q", "--connect", "h:1")[1], "")

    def test_ca_certs_alias(self):
        ca = certs().ca
        args, err = self.resolve("--ca-certs", ca, "--server-name", "localhost")
        self.assertEqual((args.ca, args.server.tls), (ca, True))
        self.assertIsNotNone(args.tls_options)
        self.assertIn("--ca-certs is the previous release's spelling", err)
        self.assertIn("use --ca", err)

    def test_tls(self):
        for argv in (["--tls"], ["-s", "tls://h:1"], ["-s", "https://h:1"],
                     ["--ca", certs().ca], ["--cert", certs().client_cert,
                                             "--key", certs().client_key]):
            args, _ = self.resolve(*argv)
            self.assertTrue(args.server.tls, argv)
            self.assertIsNotNone(args.tls_options, argv)

    def test_usage_errors(self):
        ca = certs().ca
        self.assertIn("the server is given twice", self.usage_error("-s", "a:1", "-H", "b:2"))
        self.assertIn("the port is given twice", self.usage_error("-s", "a:1", "-p", "2"))
        self.assertIn("plain TCP", self.usage_error("-s", "http://a:1", "--ca", ca))
        self.assertIn("--key needs --cert", self.usage_error("--key", ca))
        self.assertIn("--ca /nope/ca.pem: no such file", self.usage_error("--ca", "/nope/ca.pem"))
        self.assertIn("cannot use the TLS files", self.usage_error("--ca", __file__))
        self.assertIn("unknown scheme", self.usage_error("-s", "ftp://a"))
        self.assertIn("seconds must be 0 or more", self.usage_error("-t", "-1"))
        self.assertIn("not a number of seconds", self.usage_error("-t", "soon"))
        self.assertIn("the CA bundle is given twice",
                      self.usage_error("--ca", ca, "--ca-certs", certs().client_cert))

    def test_verbosity(self):
        self.assertEqual(self.resolve("-vv")[0].verbosity, 3)
        self.assertEqual(self.resolve("-q", "-v")[0].verbosity, 0)

    def test_report(self):
        err = io.StringIO()
        self.assertEqual(common.report("p", ValueError("bad thing"), err), common.EXIT_FAILURE)
        self.assertEqual(common.report("p", KeyboardInterrupt(), err), common.EXIT_INTERRUPTED)
        self.assertEqual(common.report("p", BrokenPipeError(), err), common.EXIT_OK)
        self.assertEqual(err.getvalue(), "p: error: bad thing\n")

    def test_emit(self):
        out = io.StringIO()
        common.emit(argparse.Namespace(format="text"), out, "sent 3", {"sent": 3})
        common.emit(argparse.Namespace(format="json"), out, "sent 3", {"sent": 3})
        self.assertEqual(out.getvalue(), 'sent 3\n{"sent": 3}\n')


#: every command: (name, its parser's builder, an in-process main or None)
PARSERS = {
    "styx": styx_cli.build_parser,
    "lumberjack": lumberjack_cli.build_parser,
    "reliable": reliable_cli.build_parser,
    "pravega": pravega_cli.parser,
    "relink": relink_cli._parser,
    "status": status.build_parser,
}


class EveryCommandTests(unittest.TestCase):
    """The same options, help and usage errors in every command."""

    def subcommand_helps(self, parser):
        yield parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in dict.fromkeys(action.choices.values()):
                    yield from self.subcommand_helps(sub)

    def test_help_shows_one_convention(self):
        for name, build in PARSERS.items():
            for text in self.subcommand_helps(build()):
                for option in ("-s ADDRESS, --server ADDRESS", "--tls", "--ca FILE",
                               "--cert FILE", "--key FILE", "-v, --verbose", "-q, --quiet",
                               "-t SECONDS, --timeout SECONDS"):
                    self.assertIn(option, text, (name, text))
                for old in ("--host", "--port", "--connect", "--ca-certs", "--metrics",
                            "--give-up", "--link-timeout"):
                    self.assertNotIn(old, text, name)
                if name != "status":
                    self.assertNotIn("--once", text)

    def test_common_options_after_the_command(self):
        args = styx_cli.parse_args(["logs", "list", "-s", "h:1", "-f", "json"])
        self.assertEqual((args.server.address, args.format), ("h:1", "json"))
        args = lumberjack_cli.parse_args(["send", "-s", "h:2", "-q"])
        self.assertEqual((args.server.address, args.verbosity), ("h:2", 0))
        args = relink_cli.parse_args(["echo", "-s", "h:3", "-t", "4"])
        self.assertEqual((args.server.address, args.timeout), ("h:3", 4.0))
        args = pravega_cli.CONVENTION.parse(pravega_cli.parser(), ["info", "x", "-s", "h:4"])
        self.assertEqual(args.server.address, "h:4")
        # before the command, not overridden by the subcommand's defaults
        args = styx_cli.parse_args(["-f", "json", "-t", "5", "logs", "list"])
        self.assertEqual((args.format, args.timeout), ("json", 5.0))

    def main_status(self, main, argv):
        err, out = io.StringIO(), io.StringIO()
        self.patch(sys, "stderr", err)
        self.patch(sys, "stdout", out)
        return main(argv), err.getvalue()

    @defer.inlineCallbacks
    def test_usage_errors_exit_2(self):
        mains = {"styx": styx_cli.main, "lumberjack": lumberjack_cli.main,
                 "reliable": reliable_cli.main, "relink": relink_cli.main,
                 "status": status.main}
        for name, main in mains.items():
            for argv in (["--frobnicate"], ["-s", "host:"], ["-t", "-1"]):
                code, err = self.main_status(main, argv)
                self.assertEqual(code, 2, (name, argv, err))
                self.assertIn(f"streamproto {name}: error: ", err)
            code, _ = self.main_status(main, ["--help"])
            self.assertEqual(code, 0, name)
        # pravega parses in its reactor function
        err = io.StringIO()
        for argv in (["--frobnicate"], ["-s", "host:", "info", "x"], ["info"]):
            code = yield pravega_cli.run(reactor, argv, stdin=io.BytesIO(),
                                         stdout=io.BytesIO(), stderr=err)
            self.assertEqual(code, 2, argv)
        self.assertIn("streamproto pravega: error: ", err.getvalue())
        from streamproto import cli
        code, err = self.main_status(cli.main, ["nope"])
        self.assertEqual(code, 2)


def spawn(argv, stdin=b""):
    """C{python -m streamproto ARGV}: Deferred (stdout, stderr, exit status)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proto = ProcessOutput(stdin)
    reactor.spawnProcess(proto, sys.executable, [sys.executable, "-m", "streamproto"] + argv,
                         env=env, path=ROOT)
    return proto.ended


class ExitStatusTests(unittest.TestCase):
    """
    Each command against its server with the new spellings and the old ones
    (0), and against a closed port (1, one line, no Python repr).
    """

    timeout = 180

    @defer.inlineCallbacks
    def serve(self, tap, args=()):
        server = RunningService(tap, list(args))
        ports = yield server.start(self)
        return ports

    def assertDone(self, result, argv):
        out, err, code = result
        self.assertEqual(code, 0, (argv, err))
        return out

    def assertOldSpellingNoted(self, result, argv, old):
        out = self.assertDone(result, argv)
        self.assertIn(f"{old} is the previous release's spelling".encode(), result[1])
        return out

    def assertFailed(self, result, argv, name):
        out, err, code = result
        self.assertEqual(code, 1, (argv, err))
        lines = err.decode().splitlines()
        errors = [line for line in lines if line.startswith(f"streamproto {name}: error: ")]
        self.assertEqual(len(errors), 1, err)
        for line in lines:
            self.assertNotIn("Traceback", line)
            self.assertNotRegex(line, r"<[\w.]+ |\[<|Failure", line)
        return errors[0]

    @defer.inlineCallbacks
    def run_all(self, *commands):
        results = yield defer.gatherResults([spawn(argv, stdin) for argv, stdin in commands])
        return results

    @defer.inlineCallbacks
    def test_styx(self):
        api, _ = yield self.serve(styx_tap, ["--metrics", "tcp:0:interface=127.0.0.1"])
        new = ["styx", "-s", f"127.0.0.1:{api}", "logs", "create", "events", "-f", "json"]
        old = ["styx", "-H", f"http://127.0.0.1:{api}", "logs", "list"]
        fail = ["styx", "-s", f"127.0.0.1:{free_port()}", "logs", "list"]
        done = yield spawn(new)
        self.assertEqual(json.loads(self.assertDone(done, new))["name"], "events")
        r_old, r_fail = yield self.run_all((old, b""), (fail, b""))
        self.assertIn(b"events", self.assertOldSpellingNoted(r_old, old, "-H/--host"))
        self.assertIn("refused", self.assertFailed(r_fail, fail, "styx"))

    @defer.inlineCallbacks
    def test_interrupted(self):
        """Ctrl-C (SIGINT) ends a follower with status 130."""
        from streamproto.styx.api_client import StyxClient
        from test.support.netutil import wait_until
        api, _ = yield self.serve(styx_tap, ["--metrics", "tcp:0:interface=127.0.0.1"])
        client = StyxClient(f"http://127.0.0.1:{api}", reactor)
        self.addCleanup(client.close)
        yield client.create_log("events")
        yield client.write_records("events", [b"first"])
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proto = ProcessOutput()
        process = reactor.spawnProcess(
            proto, sys.executable, [sys.executable, "-m", "streamproto", "styx", "-s",
                                    f"127.0.0.1:{api}", "consume", "events", "-F", "-u"],
            env=env, path=ROOT)
        yield wait_until(lambda: bytes(proto.out) == b"first\n", timeout=60)
        process.signalProcess("INT")
        out, err, code = yield proto.ended
        self.assertEqual((out, code), (b"first\n", 130), err)

    @defer.inlineCallbacks
    def test_styx_https_without_the_ca(self):
        """The TLS failure as a sentence with a hint, not a list of Failure reprs."""
        from streamproto.styx.resource import make_site
        from twisted.internet.endpoints import serverFromString
        port = yield serverFromString(reactor, certs().server_endpoint(client_ca=False)).listen(
            make_site(MemoryLogStore(reactor)))
        self.addCleanup(port.stopListening)
        argv = ["styx", "-s", f"https://localhost:{port.getHost().port}", "logs", "list"]
        line = self.assertFailed((yield spawn(argv)), argv, "styx")
        self.assertIn("certificate verify failed", line)
        self.assertIn("give its CA bundle with --ca", line)

    @defer.inlineCallbacks
    def test_lumberjack(self):
        (port,) = yield self.serve(lumberjack_tap)
        events = b'{"a": 1}\n{"b": 2}\n{"c": 3}\n'
        new = ["lumberjack", "send", "-s", f"127.0.0.1:{port}", "-f", "json", "-"]
        old = ["lumberjack", "send", "-H", "127.0.0.1", "-p", str(port), "--give-up", "30"]
        fail = ["lumberjack", "send", "-s", f"127.0.0.1:{free_port()}", "-t", "1"]
        r_new, r_old, r_fail = yield self.run_all((new, events), (old, events), (fail, events))
        self.assertEqual(json.loads(self.assertDone(r_new, new)), {"sent": 3, "skipped": 0})
        self.assertEqual(self.assertOldSpellingNoted(r_old, old, "--give-up"), b"sent 3 events\n")
        self.assertIn(b"-H/--host is the previous release's spelling", r_old[1])
        self.assertIn("giving up", self.assertFailed(r_fail, fail, "lumberjack"))

    @defer.inlineCallbacks
    def test_reliable(self):
        (port,) = yield self.serve(reliable_tap)
        new = ["reliable", "client", "-s", f"127.0.0.1:{port}", "-n", "5", "-f", "json"]
        old = ["reliable", "client", "--host", "127.0.0.1", "--port", str(port), "--count", "5",
               "--give-up-after", "30"]
        fail = ["reliable", "client", "-s", f"127.0.0.1:{free_port()}", "-t", "1"]
        r_new, r_old, r_fail = yield self.run_all((new, b""), (old, b""), (fail, b""))
        self.assertEqual(json.loads(self.assertDone(r_new, new))["received"], 5)
        self.assertIn(b"received 5 messages", self.assertOldSpellingNoted(
            r_old, old, "--give-up-after"))
        self.assertIn("no connection for 1 s", self.assertFailed(r_fail, fail, "reliable"))

    @defer.inlineCallbacks
    def test_relink(self):
        ports = yield self.serve(relink_tap)
        port = ports[0]
        new = ["relink", "-s", f"127.0.0.1:{port}", "echo", "-n", "10", "-f", "json"]
        old = ["relink", "--connect", f"127.0.0.1:{port}", "--link-timeout", "10", "echo",
               "--count", "10"]
        fail = ["relink", "-s", f"127.0.0.1:{free_port()}", "send"]
        r_new, r_old, r_fail = yield self.run_all((new, b""), (old, b""), (fail, b"x\n"))
        self.assertEqual(json.loads(self.assertDone(r_new, new))["messages"], 10)
        self.assertIn(b"10 messages of 64 B echoed", self.assertOldSpellingNoted(
            r_old, old, "--connect"))
        self.assertIn("cannot connect", self.assertFailed(r_fail, fail, "relink"))

    @defer.inlineCallbacks
    def test_pravega(self):
        (port,) = yield self.serve(pravega_tap, ["--controller", "none"])
        old = ["pravega", "--host", "127.0.0.1", "--port", str(port), "create", SEGMENT]
        new = ["pravega", "-s", f"127.0.0.1:{port}", "info", SEGMENT, "-f", "json"]
        fail = ["pravega", "-s", f"127.0.0.1:{free_port()}", "info", SEGMENT]
        r_old = yield spawn(old)
        self.assertOldSpellingNoted(r_old, old, "-H/--host")
        r_new, r_fail = yield self.run_all((new, b""), (fail, b""))
        info = json.loads(self.assertDone(r_new, new))
        self.assertEqual((info["segment"], info["write_offset"]), (SEGMENT, 0))
        self.assertIn("info: ", self.assertFailed(r_fail, fail, "pravega"))

    @defer.inlineCallbacks
    def test_status(self):
        _, metrics = yield self.serve(styx_tap, ["--metrics", "tcp:0:interface=127.0.0.1"])
        new = ["status", "-s", f"127.0.0.1:{metrics}", "--once", "-f", "json"]
        old = ["status", "--metrics", f"http://127.0.0.1:{metrics}/metrics", "--once"]
        fail = ["status", "-s", f"127.0.0.1:{free_port()}", "--once"]
        r_new, r_old, r_fail = yield self.run_all((new, b""), (old, b""), (fail, b""))
        self.assertIn("styx-server", json.loads(self.assertDone(r_new, new))["servers"])
        self.assertIn(b"styx-server", self.assertOldSpellingNoted(r_old, old, "--metrics"))
        self.assertIn("cannot read", self.assertFailed(r_fail, fail, "status"))
