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
from twisted.python import usage
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.lumberjack import cli
from streamproto.lumberjack.client import ClientClosed, LumberjackClient
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import LogStoreSink
from test.netutil import wait_until
from test.tlsutil import certs


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
        options = cli.Options()
        options.parseOptions(["send"] + argv + ["-"])
        err = io.StringIO()
        sending = cli.send(reactor, options.subOptions, io.BytesIO(b'{"a": 1}\n'),
                           io.StringIO(), err)
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
    """The command gives up when nothing is acknowledged for --give-up seconds."""

    timeout = 30

    @defer.inlineCallbacks
    def give_up(self, argv):
        options = cli.Options()
        options.parseOptions(["send", "--give-up", "1.5"] + argv + ["-"])
        err = io.StringIO()
        started = reactor.seconds()
        failure = yield self.assertFailure(
            cli.send(reactor, options.subOptions, io.BytesIO(b'{"a": 1}\n'), io.StringIO(),
                     err), cli.GaveUp)
        self.assertLess(reactor.seconds() - started, 10)
        return str(failure)

    @defer.inlineCallbacks
    def test_refused_port(self):
        port = _closed_port()
        text = yield self.give_up(["--port", str(port)])
        self.assertTrue(text.startswith(f"nothing acknowledged by 127.0.0.1:{port} in 1.5 s; "
                                        "giving up (last: cannot connect: "), text)

    @defer.inlineCallbacks
    def test_permanent_tls_failure(self):
        factory = LumberjackServerFactory(LogStoreSink(MemoryLogStore(reactor), "beats"))
        port = yield serverFromString(reactor, certs().server_endpoint()).listen(factory)
        self.addCleanup(port.stopListening)
        text = yield self.give_up(["--port", str(port.getHost().port), "--ca", certs().ca,
                                   "--server-name", "localhost"])
        self.assertIn("giving up (last: connection lost", text)

    def test_option(self):
        options = cli.Options()
        options.parseOptions(["send", "-"])
        self.assertEqual(options.subOptions["give-up"], 60.0)
        self.assertRaises(usage.UsageError, cli.Options().parseOptions,
                          ["send", "--give-up", "-1"])


class HelpTextTests(unittest.SynchronousTestCase):
    """--help as users see it: no stray indentation, doubled dots or words."""

    def _check(self, text):
        # the option lines, after the synopsis
        for line in text.split("Options:", 1)[1].splitlines():
            # the description column: drop the option names in front of it
            description = re.sub(r"^\s*(-\w, )?--[\w-]+=?\s+", "", line).strip()
            self.assertNotRegex(description, r"\S {3,}\S", line)
            self.assertNotRegex(description, r"[^.]\.\.(?!\.)", line)

    def test_send_synopsis_names_the_command_once(self):
        options = cli.Options()
        with self.assertRaises(SystemExit):
            self.patch(sys, "stdout", io.StringIO())
            options.parseOptions(["send", "--help"])
        first = sys.stdout.getvalue().splitlines()[0]
        self.assertTrue(first.startswith("streamproto lumberjack send [options] [FILE]"), first)
        self.assertEqual(first.count("send"), 1, first)
        self._check(sys.stdout.getvalue())

    def test_server_options_help(self):
        from streamproto.reliable import tap as reliable_tap
        from streamproto.styx import tap as styx_tap
        for options in (styx_tap.Options(), reliable_tap.Options()):
            self._check(str(options))
