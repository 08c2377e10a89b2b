"""
C{--config FILE}: one TOML table per server, every option available, the
command line winning; the complete example of doc/operations.rst loads.
"""

import os
import re
import subprocess
import sys
import time
import urllib.request

from twisted.python import usage
from twisted.trial import unittest

from streamproto import tap as umbrella
from streamproto.lumberjack.tap import Options as Lumberjack
from streamproto.styx.tap import Options as Styx
from test.support.netutil import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]


def doc_example():
    """The complete file shown in doc/operations.rst (the literal block after 'A complete file')."""
    with open(os.path.join(ROOT, "doc", "operations.rst")) as f:
        text = f.read()
    start = text.index("A complete file")
    block = text[text.index("::\n\n", start) + 4:]
    lines = []
    for line in block.split("\n"):
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    return "\n".join(lines)


class ConfigTestBase(unittest.SynchronousTestCase):
    def write(self, text):
        path = self.mktemp()
        with open(path, "w") as f:
            f.write(text)
        return path

    def usage_error(self, options, argv):
        with self.assertRaises(usage.UsageError) as caught:
            options.parseOptions(argv)
        return str(caught.exception)


class PluginConfig(ConfigTestBase):
    def test_table_and_command_line(self):
        path = self.write('[lumberjack-server]\nmax_frame = 2097152\nlog = "beats"\n'
                          'port = ["tcp:0", "tcp:1"]\n[styx-server]\ntimeout = 9\n')
        o = Lumberjack()
        o.parseOptions(["--config", path, "--data", self.mktemp(), "--log", "cli"])
        self.assertEqual(o["max-frame"], 2097152)
        self.assertEqual(o["log"], "cli")               # the command line wins
        self.assertEqual(o["port"], ["tcp:0", "tcp:1"])
        o = Lumberjack()
        o.parseOptions(["--config", path, "--data", self.mktemp(), "--port", "tcp:2"])
        self.assertEqual(o["port"], ["tcp:2"])          # all of the file's ports ignored

    def test_flags_and_lists(self):
        path = self.write('[styx-server]\ncors-origin = ["https://a.example", "https://b.example"]\n')
        o = Styx()
        o.parseOptions(["--config", path, "--data", self.mktemp()])
        self.assertEqual(o["cors_origins"], ["https://a.example", "https://b.example"])

    def test_errors(self):
        data = self.mktemp()
        path = self.write("[styx-server]\nmax-bodysize = 5\n")
        self.assertEqual(self.usage_error(Styx(), ["--config", path, "--data", data]),
                         f"--config {path!r} [styx-server]: unknown option 'max-bodysize'")
        path = self.write("[styx-server]\nmax-body-size = -5\n")
        self.assertIn("max-body-size must be positive",
                      self.usage_error(Styx(), ["--config", path, "--data", data]))
        path = self.write("[styx-server\n")
        self.assertIn("not valid TOML", self.usage_error(Styx(), ["--config", path]))
        self.assertIn("cannot read it", self.usage_error(Styx(), ["--config", "/nonexistent"]))
        path = self.write("timeout = 5\n")
        self.assertIn("must be a table", self.usage_error(Styx(), ["--config", path]))


class UmbrellaConfig(ConfigTestBase):
    def test_per_server_options_reach_the_servers(self):
        path = self.write('[streamproto]\nmetrics = "none"\n'
                          '[lumberjack-server]\nmax-frame = 4194304\nport = ["tcp:0"]\n'
                          '[styx-server]\nmax-body-size = 1000\n'
                          '[relink-server]\nlog = "links-{channel}"\n'
                          '[reliable-stream-server]\nrate = 100\n'
                          '[pravega-server]\nread-wait = 5\ncontroller = "none"\n')
        o = umbrella.Options()
        o.parseOptions(["--config", path, "--data", self.mktemp()])
        self.assertEqual(o["metrics"], "none")
        servers = o.server_options
        self.assertEqual(servers["lumberjack-server"]["max-frame"], 4194304)
        self.assertEqual(servers["lumberjack-server"]["port"], ["tcp:0"])
        self.assertEqual(servers["styx-server"]["max-body-size"], 1000)
        self.assertEqual(servers["relink-server"]["log"], "links-{channel}")
        self.assertEqual(servers["reliable-stream-server"]["rate"], 100)
        self.assertEqual(servers["pravega-server"]["read-wait"], 5.0)
        self.assertEqual(servers["pravega-server"]["controller"], "none")
        # --listen wins over a table's port; --pravega-controller over its controller
        o = umbrella.Options()
        o.parseOptions(["--config", path, "--data", self.mktemp(), "--listen",
                        "lumberjack-server=tcp:5", "--pravega-controller", "tcp:0"])
        self.assertEqual(o.server_options["lumberjack-server"]["port"], ["tcp:5"])
        self.assertEqual(o.server_options["pravega-server"]["controller"], "tcp:0")

    def test_errors(self):
        data = self.mktemp()
        path = self.write("[styx-server]\ndata = '/elsewhere'\n")
        self.assertIn("'data' is shared by every server: set it in [streamproto]",
                      self.usage_error(umbrella.Options(), ["--config", path, "--data", data]))
        path = self.write("[styx]\ntimeout = 5\n")
        self.assertIn("unknown table [styx]",
                      self.usage_error(umbrella.Options(), ["--config", path, "--data", data]))
        path = self.write("[relink-server]\nlog = '../{channel}'\n")
        message = self.usage_error(umbrella.Options(), ["--config", path, "--data", data])
        self.assertTrue(message.startswith("relink-server: --log '../{channel}'"), message)

    def test_the_complete_example_of_the_doc(self):
        text = doc_example()
        self.assertIn("[relink-server]", text)
        path = self.write(text.replace('"/var/lib/streamproto"', repr(self.mktemp())))
        o = umbrella.Options()
        o.parseOptions(["--config", path])
        self.assertEqual(o["log-format"], "json")
        self.assertEqual(o.server_options["lumberjack-server"]["max-frame"], 4194304)
        self.assertEqual(o.server_options["styx-server"]["cors_origins"], ["*"])
        # and each table alone, for its own plugin
        for name, module in umbrella.available_servers():
            sub = module.Options()
            sub.parseOptions(["--config", path, "--data", self.mktemp()])
            self.assertTrue(sub["port"], name)


class TwistdWithConfig(unittest.TestCase):
    """The real twistd, every port from the file: the servers serve there."""

    timeout = 60

    def test_serves_where_the_file_says(self):
        ports = {name: free_port() for name in ("styx-server", "lumberjack-server",
                                                 "reliable-stream-server", "relink-server",
                                                 "pravega-server", "metrics", "controller")}
        text = doc_example()
        for name in ("styx-server", "lumberjack-server", "reliable-stream-server",
                     "relink-server", "pravega-server"):
            text = re.sub(rf'(\[{name}\]\nport = )\["tcp:\d+"\]',
                          rf'\1["tcp:{ports[name]}:interface=127.0.0.1"]', text)
        text = text.replace('"tcp:9180:interface=127.0.0.1"',
                            f'"tcp:{ports["metrics"]}:interface=127.0.0.1"')
        text = text.replace('pravega-controller = "tcp:9090"',
                            f'pravega-controller = "tcp:{ports["controller"]}:interface=127.0.0.1"')
        data = os.path.abspath(self.mktemp())
        text = text.replace('"/var/lib/streamproto"', repr(data))
        path = os.path.abspath(self.mktemp())
        with open(path, "w") as f:
            f.write(text)
        cwd = self.mktemp()
        os.makedirs(cwd)
        log = open(os.path.join(cwd, "output"), "w+")
        self.addCleanup(log.close)
        process = subprocess.Popen(TWISTD + ["-n", "--pidfile=", "streamproto", "--config", path],
                                   cwd=cwd, env=dict(os.environ, PYTHONPATH=ROOT),
                                   stdout=log, stderr=subprocess.STDOUT)

        def output():
            log.seek(0)
            return log.read()
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(
                            f"http://127.0.0.1:{ports['styx-server']}/logs", timeout=2) as r:
                        self.assertEqual(r.status, 200)
                        break
                except OSError:
                    self.assertIsNone(process.poll(), output()[-3000:])
                    self.assertLess(time.monotonic(), deadline)
                    time.sleep(0.1)
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/ready",
                                        timeout=5) as r:
                self.assertEqual(r.status, 200)
        finally:
            process.terminate()
            process.wait(timeout=30)
        # log-format = "json" from [streamproto]: every line is an object
        text = output()
        lines = [line for line in text.splitlines() if line.strip()]
        self.assertTrue(lines and all(line.startswith("{") for line in lines), text[-2000:])
