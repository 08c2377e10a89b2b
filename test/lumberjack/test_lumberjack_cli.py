"""
C{streamproto lumberjack send} against servers it cannot use: it retries for
ever (like Filebeat), so it must say why on stderr instead of hanging
silently.
"""

import io
import re
import socket
import sys

from twisted.internet import defer, reactor
from twisted.internet.endpoints import serverFromString
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.lumberjack import cli
from streamproto.lumberjack.client import ClientClosed, LumberjackClient
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import LogStoreSink
from test.support.netutil import wait_until
from test.support.tlsutil import certs


def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class SendWarningsTests(unittest.TestCase):

    def setUp(self):
        # keep the client the CLI builds, to stop its retries at the end
        self.clients = []
        test = self

        class KeptClient(LumberjackClient):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                test.clients.append(self)

        self.patch(cli, "LumberjackClient", KeptClient)

    @defer.inlineCallbacks
    def _send_until_warned(self, argv, expected):
        args = cli.parse_args(["send"] + argv + ["-"])
        err = io.StringIO()
        sending = cli.send(reactor, args, io.BytesIO(b'{"a": 1}\n'), io.StringIO(), err)
        try:
            yield wait_until(lambda: expected in err.getvalue())
        finally:
            yield self.clients[0].close()
            yield self.assertFailure(sending, ClientClosed)
        return err.getvalue()

    @defer.inlineCallbacks
    def test_refused_connection_is_reported(self):
        text = yield self._send_until_warned(["--port", str(_closed_port())],
                                             "cannot connect")
        self.assertIn("streamproto lumberjack:", text)

    @defer.inlineCallbacks
    def test_refused_tls_handshake_is_reported(self):
        # an mtls: server and a client without a certificate: TCP connects,
        # then the handshake fails; that too must be said
        factory = LumberjackServerFactory(LogStoreSink(MemoryLogStore(reactor), "beats"))
        port = yield serverFromString(reactor, certs().server_endpoint()).listen(factory)
        self.addCleanup(port.stopListening)
        text = yield self._send_until_warned(
            ["--port", str(port.getHost().port), "--ca", certs().ca,
             "--server-name", "localhost"], "connection lost")
        self.assertIn("reconnecting", text)


class GiveUpTests(unittest.TestCase):
    """The command gives up when nothing is acknowledged for -t/--timeout seconds."""

    timeout = 30

    @defer.inlineCallbacks
    def give_up(self, argv):
        args = cli.parse_args(["send", "-t", "1.5"] + argv + ["-"])
        err = io.StringIO()
        started = reactor.seconds()
        failure = yield self.assertFailure(
            cli.send(reactor, args, io.BytesIO(b'{"a": 1}\n'), io.StringIO(), err),
            cli.GaveUp)
        self.assertLess(reactor.seconds() - started, 10)
        return str(failure)

    @defer.inlineCallbacks
    def test_refused_port(self):
        port = _closed_port()
        text = yield self.give_up(["--port", str(port)])
        self.assertTrue(text.startswith(f"nothing acknowledged by 127.0.0.1:{port} in 1.5 s; "
                                        "giving up (last: cannot connect: "), text)

    @defer.inlineCallbacks
    def test_refused_ports_loadbalance(self):
        ports = [_closed_port(), _closed_port()]
        servers = ",".join(f"127.0.0.1:{p}" for p in ports)
        text = yield self.give_up(["-s", servers, "--loadbalance"])
        self.assertTrue(text.startswith(f"nothing acknowledged by {servers} in 1.5 s; giving up "
                                        "(last: 127.0.0.1:"), text)
        self.assertIn(": cannot connect: ", text)

    @defer.inlineCallbacks
    def test_permanent_tls_failure(self):
        factory = LumberjackServerFactory(LogStoreSink(MemoryLogStore(reactor), "beats"))
        port = yield serverFromString(reactor, certs().server_endpoint()).listen(factory)
        self.addCleanup(port.stopListening)
        text = yield self.give_up(["--port", str(port.getHost().port), "--ca", certs().ca,
                                   "--server-name", "localhost"])
        self.assertIn("giving up (last: connection lost", text)

    def test_option(self):
        self.assertEqual(cli.parse_args(["send", "-"]).timeout, 60.0)
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        # the previous release's spelling, with a note naming the new one
        self.assertEqual(cli.parse_args(["send", "--give-up", "5"], err).timeout, 5.0)
        self.assertIn("--give-up is the previous release's spelling", err.getvalue())
        self.assertIn("use -t/--timeout", err.getvalue())
        for bad in (["--give-up", "-1"], ["-t", "-1"], ["-t", "soon"]):
            with self.assertRaises(SystemExit) as raised:
                cli.parse_args(["send"] + bad)
            self.assertEqual(raised.exception.code, 2)


class HelpTextTests(unittest.SynchronousTestCase):
    """--help as users see it: no stray indentation, doubled dots or words."""

    def _check_twisted_options(self, text):
        # the option lines, after the synopsis
        for line in text.split("Options:", 1)[1].splitlines():
            # the description column: drop the option names in front of it
            description = re.sub(r"^\s*(-\w, )?--[\w-]+=?\s+", "", line).strip()
            self.assertNotRegex(description, r"\S {3,}\S", line)
            self.assertNotRegex(description, r"[^.]\.\.(?!\.)", line)

    def test_send_usage_names_the_command_once(self):
        self.patch(sys, "stdout", io.StringIO())
        with self.assertRaises(SystemExit) as raised:
            cli.parse_args(["send", "--help"])
        self.assertEqual(raised.exception.code, 0)
        text = sys.stdout.getvalue()
        first = text.splitlines()[0]
        self.assertTrue(first.startswith("usage: streamproto lumberjack send "), first)
        self.assertEqual(first.count("send"), 1, first)
        self.assertIn("-s ADDRESS, --server ADDRESS", text)
        # the previous release's spellings work but are not shown
        for old in ("--host", "--port", "--give-up", "--ca-certs", "--connect"):
            self.assertNotIn(old, text)

    def test_server_options_help(self):
        from streamproto.reliable import tap as reliable_tap
        from streamproto.styx import tap as styx_tap
        for options in (styx_tap.Options(), reliable_tap.Options()):
            self._check_twisted_options(str(options))


class LoadBalanceOptionTests(unittest.SynchronousTestCase):
    """--loadbalance and --worker: Filebeat's loadbalance and worker."""

    def test_default_is_one_connection_at_a_time(self):
        args = cli.parse_args(["send", "-s", "h1:1,h2:2", "-"])
        self.assertFalse(args.loadbalance)
        client = cli.make_client(reactor, args)
        self.assertIsInstance(client, LumberjackClient)
        self.assertEqual(len(client.senders), 1)

    def test_loadbalance(self):
        from streamproto.lumberjack.client import LoadBalancingLumberjackClient
        args = cli.parse_args(["send", "-s", "h1:1,h2:2", "--loadbalance", "--worker", "2",
                               "--pipelining", "3", "-"])
        client = cli.make_client(reactor, args)
        self.assertIsInstance(client, LoadBalancingLumberjackClient)
        self.assertEqual(client.names, ["h1:1", "h2:2"])
        self.assertEqual([s.name for s in client.senders], ["h1:1", "h2:2"] * 2)
        self.assertEqual({s.pipelining for s in client.senders}, {3})
        self.assertEqual(cli.parse_args(["send", "--loadbalance", "-"]).worker, 1)

    def test_bad_options_are_usage_errors(self):
        for bad in (["--worker", "2"], ["--loadbalance=yes"], ["--loadbalance", "--worker", "0"],
                    ["--loadbalance", "--worker", "many"]):
            err = io.StringIO()
            self.patch(sys, "stderr", err)
            with self.assertRaises(SystemExit) as raised:
                cli.parse_args(["send", "-s", "h1,h2"] + bad + ["-"])
            self.assertEqual(raised.exception.code, 2, bad)
            self.assertIn("streamproto lumberjack send: error:", err.getvalue())
            if bad == ["--worker", "2"]:
                self.assertIn("--worker needs --loadbalance", err.getvalue())

    def test_help(self):
        self.patch(sys, "stdout", io.StringIO())
        with self.assertRaises(SystemExit):
            cli.parse_args(["send", "--help"])
        self.assertIn("--loadbalance", sys.stdout.getvalue())

