"""Packaging: twistd plugins, the umbrella service, the core options, the CLI."""

import io
import os
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout

from twisted.application import service
from twisted.internet import defer
from twisted.python import usage
from twisted.trial import unittest

from streamproto import cli, tap
from streamproto.core.tap import (
    ServerOptions, StoreService, non_negative_float, positive_float, positive_int, server_service,
)

PLUGINS = ["streamproto", "styx-server", "pravega-server", "lumberjack-server",
           "reliable-stream-server", "relink-server"]


class InstalledPluginTests(unittest.TestCase):
    timeout = 120

    def test_twistd_lists_every_server(self):
        """
        After a normal install, twistd finds our plugins from any directory
        (not only from the source tree, which the current directory would
        otherwise put on sys.path).
        """
        cwd = tempfile.mkdtemp()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-m", "twisted", "--help"], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=100)
        for name in PLUGINS:
            self.assertIn(name, out.stdout, f"{name} missing from twistd --help:\n{out.stdout}"
                          f"\n{out.stderr}")


class Options(ServerOptions):
    defaultPort = "tcp:9999"


class CoreOptionsTests(unittest.SynchronousTestCase):
    def test_default_port_and_data(self):
        o = Options()
        o.parseOptions([])
        self.assertEqual(o["port"], ["tcp:9999"])
        self.assertTrue(os.path.isabs(o["data"]))

    def test_repeated_ports(self):
        from test.support.tlsutil import certs
        tls = f"ssl:2:privateKey={certs().server_key}:certKey={certs().server_cert}"
        o = Options()
        o.parseOptions(["--port", "tcp:1", "-p", tls, "--data", "x"])
        self.assertEqual(o["port"], ["tcp:1", tls])
        self.assertEqual(o["data"], os.path.abspath("x"))

    def test_positive_int(self):
        coerce = positive_int("--window")
        self.assertEqual(coerce("5"), 5)
        self.assertRaises(ValueError, coerce, "0")
        self.assertRaises(ValueError, coerce, "x")
        self.assertRaises(ValueError, coerce, "1.5")

    def test_float_options(self):
        self.assertEqual(positive_float("--rate")("0.5"), 0.5)
        self.assertRaises(ValueError, positive_float("--rate"), "0")
        self.assertEqual(non_negative_float("--idle")("0"), 0.0)
        with self.assertRaises(ValueError) as e:
            non_negative_float("--idle")("-1")
        self.assertIn("--idle must not be negative", str(e.exception))


class ServiceTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_server_service_listens_and_closes_store(self):
        from twisted.internet.protocol import Factory, Protocol
        data = tempfile.mkdtemp()
        o = Options()
        o.parseOptions(["--port", "tcp:0:interface=127.0.0.1", "--data", data])
        stores = []

        def factory(store):
            stores.append(store)
            return Factory.forProtocol(Protocol)
        top = server_service(o, factory)
        top.startService()
        log = yield stores[0].create("x")
        yield log.append([b"r"])
        yield top.stopService()
        self.assertTrue(any(isinstance(s, StoreService) for s in top))
        self.assertEqual(stores[0]._logs, {})  # closed
        self.assertTrue(os.path.isdir(os.path.join(data, "x")))

    def test_umbrella_rejects_unknown_server(self):
        o = tap.Options()
        self.assertRaises(usage.UsageError, o.parseOptions, ["--listen", "nope=tcp:1"])
        self.assertRaises(usage.UsageError, o.parseOptions, ["--listen", "no-equals-sign"])

    @defer.inlineCallbacks
    def test_umbrella_runs_every_available_server_on_one_store(self):
        data = tempfile.mkdtemp()
        args = ["--data", data, "--metrics", "tcp:0:interface=127.0.0.1"]
        for name, _ in tap.available_servers():
            args += ["--listen", f"{name}=tcp:0:interface=127.0.0.1"]
        o = tap.Options()
        o.parseOptions(args)
        top = tap.makeService(o)
        self.assertIsInstance(top, service.MultiService)
        stores = [s for s in top if isinstance(s, StoreService)]
        self.assertEqual(len(stores), 1)
        top.startService()
        try:
            # the store, the metrics listener, and one service per server
            self.assertEqual(len(list(top)), 2 + len(tap.available_servers()))
        finally:
            yield top.stopService()


class CLITests(unittest.SynchronousTestCase):
    def run_cli(self, argv):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(argv)
        return code, out.getvalue(), err.getvalue()

    def test_help(self):
        code, out, _ = self.run_cli(["--help"])
        self.assertEqual(code, 0)
        self.assertIn("usage: streamproto", out)

    def test_unknown_command(self):
        code, _, err = self.run_cli(["frobnicate"])
        self.assertEqual(code, 2)
        self.assertIn("unknown command", err)

