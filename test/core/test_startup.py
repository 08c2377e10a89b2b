"""
Start-up that fails cleanly: options checked before start-up are usage
errors naming the option; a server that cannot start (a port in use) logs
one clear line and exits non-zero at once, never half-started; a read-only
data directory is named as such in Styx's error and in /ready; JSON logs
are one object per line.
"""

import errno
import io
import json
import os
import socket
import subprocess
import sys
import time

import treq
from twisted.internet import defer, reactor
from twisted.logger import LogLevel
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.trial import unittest

from streamproto import tap as umbrella
from streamproto.core.ops import format_json_line, metrics_site, store_problems
from streamproto.log import LogConfig
from streamproto.log.filestore import FileLogStore
from streamproto.log.segments import FileIO
from streamproto.styx.errors import from_exception
from streamproto.styx.resource import make_site
from test.support.netutil import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]

PLUGINS = ["styx", "pravega", "lumberjack", "reliable", "relink"]


def plugin_options(package):
    module = __import__(f"streamproto.{package}.tap", fromlist=["Options"])
    return module.Options()


class UsageErrors(unittest.SynchronousTestCase):
    """Every server option that can be checked before start-up is, naming the option."""

    def usage_error(self, options, argv):
        with self.assertRaises(usage.UsageError) as caught:
            options.parseOptions(argv)
        return str(caught.exception)

    def test_bad_endpoint(self):
        for package in PLUGINS:
            message = self.usage_error(plugin_options(package),
                                       ["--port", "nonsense", "--data", self.mktemp()])
            self.assertEqual(message, "--port 'nonsense': Unknown endpoint type: 'nonsense'",
                             package)

    def test_tls_endpoint_with_a_missing_key(self):
        message = self.usage_error(plugin_options("styx"), [
            "--port", "ssl:0:privateKey=/nonexistent/key.pem", "--data", self.mktemp()])
        self.assertTrue(message.startswith("--port 'ssl:0:privateKey=/nonexistent/key.pem': "),
                        message)
        self.assertIn("No such file", message)

    def test_data_directory_that_cannot_be_created(self):
        for package in PLUGINS:
            message = self.usage_error(plugin_options(package), ["--data", "/proc/nope"])
            self.assertEqual(message, "--data '/proc/nope': cannot create it: No such file or "
                             "directory", package)

    def test_data_directory_that_is_a_file(self):
        path = self.mktemp()
        open(path, "w").close()
        message = self.usage_error(plugin_options("styx"), ["--data", path])
        self.assertIn("cannot create it", message)

    def test_bad_metrics_endpoint(self):
        message = self.usage_error(plugin_options("styx"),
                                   ["--metrics", "bogus:1", "--data", self.mktemp()])
        self.assertEqual(message, "--metrics 'bogus:1': Unknown endpoint type: 'bogus'")

    def test_relink_log_template_checked_at_start_up(self):
        message = self.usage_error(plugin_options("relink"),
                                   ["--log", "../{channel}", "--data", self.mktemp()])
        self.assertIn("--log '../{channel}': channel 0 would go to '../0', not a valid log name",
                      message)

    def test_umbrella(self):
        message = self.usage_error(umbrella.Options(),
                                   ["--listen", "styx-server=bogus:1", "--data", self.mktemp()])
        self.assertEqual(message, "--listen 'bogus:1': Unknown endpoint type: 'bogus'")
        message = self.usage_error(umbrella.Options(), ["--data", "/proc/nope"])
        self.assertIn("--data '/proc/nope': cannot create it", message)
        message = self.usage_error(umbrella.Options(),
                                   ["--metrics", "nonsense", "--data", self.mktemp()])
        self.assertIn("--metrics 'nonsense'", message)

    def test_twistd_prints_the_usage_error_and_exits_1(self):
        done = subprocess.run(TWISTD + ["-n", "--pidfile=", "styx-server", "--port", "nonsense"],
                              capture_output=True, text=True, cwd=self.mktemp_dir(),
                              env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
        self.assertEqual(done.returncode, 1)
        self.assertIn("--port 'nonsense': Unknown endpoint type: 'nonsense'", done.stdout)
        self.assertNotIn("Traceback", done.stdout + done.stderr)

    def mktemp_dir(self):
        path = self.mktemp()
        os.makedirs(path)
        return path


class PortInUse(unittest.TestCase):
    """A listener that cannot start: one clear line, exit status 1, at once."""

    timeout = 90

    def setUp(self):
        self.taken = socket.socket()
        self.taken.bind(("127.0.0.1", 0))
        self.taken.listen(1)
        self.addCleanup(self.taken.close)
        self.port = self.taken.getsockname()[1]

    def run_twistd(self, argv):
        cwd = self.mktemp()
        os.makedirs(cwd)
        started = time.monotonic()
        done = subprocess.run(TWISTD + ["-n", "--pidfile="] + argv, capture_output=True,
                              text=True, cwd=cwd, env=dict(os.environ, PYTHONPATH=ROOT),
                              timeout=60)
        return done, time.monotonic() - started

    def assertCleanFailure(self, done, seconds, expected):
        output = done.stdout + done.stderr
        self.assertEqual(done.returncode, 1, output[-3000:])
        self.assertLess(seconds, 30)
        critical = [line for line in output.splitlines() if "#critical]" in line]
        self.assertEqual(len(critical), 1, output[-3000:])
        self.assertIn("cannot start, stopping: ", critical[0])
        self.assertIn(expected, critical[0])
        self.assertNotIn("Traceback", output)

    def test_single_server(self):
        done, seconds = self.run_twistd(["styx-server", "--port",
                                         f"tcp:{self.port}:interface=127.0.0.1"])
        self.assertCleanFailure(done, seconds, f"Couldn't listen on 127.0.0.1:{self.port}")

    def test_umbrella_with_the_controller_port_taken(self):
        ports = {name: free_port() for name in ("styx-server", "lumberjack-server",
                                                 "reliable-stream-server", "relink-server",
                                                 "pravega-server")}
        argv = ["streamproto", "--metrics", f"tcp:{free_port()}:interface=127.0.0.1",
                "--pravega-controller", f"tcp:{self.port}:interface=127.0.0.1"]
        for name, port in ports.items():
            argv += ["--listen", f"{name}=tcp:{port}:interface=127.0.0.1"]
        done, seconds = self.run_twistd(argv)
        self.assertCleanFailure(done, seconds,
                                f"pravega controller cannot listen on 127.0.0.1:{self.port}")
        # nothing is left holding the other ports
        for port in ports.values():
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            finally:
                s.close()


class ReadOnlyIO(FileIO):
    """The file layer of a data directory on a read-only mount."""

    def open(self, path, flags, mode=0o644):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return super().open(path, flags, mode)


class ReadOnlyDataDirectory(unittest.TestCase):
    timeout = 30

    def setUp(self):
        self.store = FileLogStore(self.mktemp(), io=ReadOnlyIO())
        self.addCleanup(self.store.close)

    def test_ready_says_why(self):
        problems = self.store.problems()
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("cannot be written: Read-only file system (EROFS)", problems[0])
        self.assertEqual(store_problems([self.store]), problems)

    def test_styx_error_says_why(self):
        error = from_exception(OSError(errno.EROFS, os.strerror(errno.EROFS)))
        self.assertEqual((error.status, error.code, error.message),
                         (500, "unknown_error", "api: storage error: Read-only file system "
                          "(EROFS)"))

    @defer.inlineCallbacks
    def test_over_http(self):
        site = make_site(self.store, default_config=LogConfig())
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        health = reactor.listenTCP(0, metrics_site([self.store]), interface="127.0.0.1")
        self.addCleanup(health.stopListening)
        response = yield treq.post(f"http://127.0.0.1:{port.getHost().port}/logs",
                                   data={"name": "events"}, persistent=False)
        body = json.loads((yield response.content()))
        self.assertEqual(response.code, 500)
        self.assertEqual(body["message"], "api: storage error: Read-only file system (EROFS)")
        response = yield treq.get(f"http://127.0.0.1:{health.getHost().port}/ready",
                                  persistent=False)
        body = json.loads((yield response.content()))
        self.assertEqual(response.code, 503)
        self.assertFalse(body["ready"])
        self.assertIn("Read-only file system (EROFS)", body["problems"][0])


class JSONLines(unittest.SynchronousTestCase):
    def test_one_object_per_line(self):
        failure = Failure(ZeroDivisionError("division by zero"))
        event = {"log_format": "connection from {peer} failed: {n} bytes",
                 "log_level": LogLevel.error, "log_namespace": "streamproto.test",
                 "log_time": 1764028800.25, "log_failure": failure, "peer": "127.0.0.1:1",
                 "n": 7, "obj": object(), "tls": None}
        line = format_json_line(event)
        self.assertTrue(line.endswith("\n"))
        self.assertEqual(line.count("\n"), 1)
        self.assertNotIn("\x1e", line)
        record = json.loads(line)
        self.assertEqual(record["timestamp"], "2025-11-25T00:00:00.250Z")
        self.assertEqual(record["level"], "error")
        self.assertEqual(record["namespace"], "streamproto.test")
        self.assertEqual(record["message"], "connection from 127.0.0.1:1 failed: 7 bytes")
        self.assertIn("ZeroDivisionError: division by zero", record["failure"])
        self.assertEqual((record["peer"], record["n"], record["tls"]), ("127.0.0.1:1", 7, None))
        self.assertTrue(record["obj"].startswith("<object object"))
        self.assertFalse([k for k in record if k.startswith("log_")])

    def test_observer_writes_lines(self):
        from streamproto.core.ops import json_log_observer
        stream = io.StringIO()
        observer = json_log_observer(stream)
        observer({"log_format": "hello {who}", "who": "you", "log_level": LogLevel.info,
                  "log_namespace": "x", "log_time": 0.0})
        self.assertEqual(json.loads(stream.getvalue())["message"], "hello you")


class Version(unittest.SynchronousTestCase):
    def test_version(self):
        from streamproto import __version__, cli
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        self.assertEqual(cli.main(["--version"]), 0)
        self.assertTrue(out.getvalue().startswith(f"streamproto {__version__} (Twisted "),
                        out.getvalue())
        done = subprocess.run([sys.executable, "-m", "streamproto", "--version"],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        self.assertEqual((done.returncode, done.stdout.split()[:2]),
                         (0, ["streamproto", __version__]))


class ClientErrors(unittest.SynchronousTestCase):
    """Client errors as one readable line, never a Python repr."""

    def test_nested_reasons_and_openssl(self):
        from OpenSSL import SSL
        from twisted.web._newclient import ResponseNeverReceived

        from streamproto.core.errors import describe
        tls = SSL.Error([("SSL routines", "", "certificate verify failed")])
        text = describe(Failure(ResponseNeverReceived([Failure(tls)])))
        self.assertEqual(text, "TLS error: certificate verify failed (the server's certificate "
                               "is not signed by a CA this command trusts: give its CA bundle "
                               "with --ca)")
        self.assertNotIn("<", text)
        self.assertEqual(describe(ValueError("plain")), "plain")
        self.assertEqual(describe(KeyError()), "KeyError")


class StatusErrors(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_status_on_something_else(self):
        from twisted.web.resource import Resource
        from twisted.web.server import Site
        from twisted.web.static import Data

        from streamproto import status
        root = Resource()
        root.putChild(b"metrics", Data(b"<html>not metrics {</html>", "text/html"))
        port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        url = f"http://127.0.0.1:{port.getHost().port}/metrics"
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        from twisted.internet.threads import deferToThread
        code = yield deferToThread(status.main, ["--once", "--metrics", url], io.StringIO())
        self.assertEqual(code, 1)
        self.assertIn(f"streamproto status: error: {url} did not answer Prometheus metrics text",
                      err.getvalue())
