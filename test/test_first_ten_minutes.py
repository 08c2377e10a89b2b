"""
doc/first-ten-minutes.rst, run as written: every block marked
C{.. checked: NAME} is taken from the page and run in a shell, in order,
against the main job started by the page's own first block.

What the test changes, and only that:
  - C{.venv/bin/X} is this interpreter's environment (C{python -m
    streamproto}, twistd's C{run()}, this C{python}); C{pip install}
    lines are checked by importing what they install (the test
    environment has installed it already);
  - C{twistd} gets C{--pidfile=} (trial runs in parallel directories).
The ports are the page's defaults (7123, 5044, 9090, 12345, 7341, 7350,
9180): below the ephemeral range, so no other test's server holds them;
one that is busy fails the test with its name.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "doc", "first-ten-minutes.rst")
PORTS = {"styx": 7123, "lumberjack": 5044, "pravega controller": 9090,
         "pravega segment store": 12345, "reliable": 7341, "relink": 7350, "metrics": 9180}
STEPS = ["start", "ready", "styx", "lumberjack", "pravega", "spark"]


def checked_blocks(text):
    """{name: the literal block after C{.. checked: name}}, in page order."""
    blocks = {}
    pattern = re.compile(r"^\.\. checked: (\S+)\n\n::\n\n((?:    .*\n|\n)+)", re.M)
    for m in pattern.finditer(text):
        blocks[m.group(1)] = textwrap.dedent(m.group(2)).strip("\n") + "\n"
    return blocks


def localise(script):
    """The page's commands in this test environment (see the module docstring)."""
    python = sys.executable
    lines = []
    for line in script.splitlines():
        pip = re.match(r"\.venv/bin/pip install (.*)$", line.strip())
        if pip:
            what = pip.group(1)
            module = {"pravega": "pravega_client", "'.[spark]'": "pyspark"}.get(
                what.split("==")[0], None)
            if module is None:
                raise AssertionError(f"the page installs {what!r}: teach the test")
            lines.append(f"{python} -c 'import {module}'")
            continue
        twistd = f"{python} -c 'from twisted.scripts.twistd import run; run()'"
        line = line.replace(".venv/bin/twistd -n ", f"{twistd} -n --pidfile= ")
        line = line.replace(".venv/bin/streamproto ", f"{python} -m streamproto ")
        line = line.replace(".venv/bin/python", python)
        line = line.replace("PYSPARK_PYTHON=.venv/bin/python", f"PYSPARK_PYTHON={python}")
        lines.append(line)
    return "\n".join(lines) + "\n"


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


class FirstTenMinutesTests(SynchronousTestCase):

    def setUp(self):
        with open(PAGE) as f:
            self.blocks = checked_blocks(f.read())
        self.work = tempfile.mkdtemp(prefix="first-ten-minutes-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.env.pop("PYSPARK_DRIVER_PYTHON", None)

    def shell(self, name, timeout=300):
        script = localise(self.blocks[name])
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=self.work,
                                env=self.env, capture_output=True, text=True, timeout=timeout)
        self.assertEqual(result.returncode, 0,
                         f"step {name!r} failed:\n{script}\n--- stdout\n{result.stdout}\n"
                         f"--- stderr\n{result.stderr[-3000:]}")
        return result.stdout

    def start(self):
        busy = [f"{what} ({port})" for what, port in PORTS.items() if not port_free(port)]
        self.assertEqual(busy, [], "the page's default ports must be free for this test")
        script = localise(self.blocks["start"])
        # the part after the installs: the server itself, in the foreground
        command = script.strip().split("&&")[-1].strip()
        log = open(os.path.join(self.work, "server.log"), "wb")
        self.addCleanup(log.close)
        server = subprocess.Popen(command, shell=True, cwd=self.work, env=self.env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def stop():
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
        self.addCleanup(stop)
        deadline = time.monotonic() + 60
        while True:
            self.assertIsNone(server.poll(), "the main job exited: " + self.server_log())
            try:
                with urllib.request.urlopen("http://127.0.0.1:9180/ready", timeout=2) as r:
                    if r.status == 200:
                        return server
            except OSError:
                pass
            self.assertLess(time.monotonic(), deadline,
                            "the main job not ready in 60 s: " + self.server_log())
            time.sleep(0.2)

    def server_log(self):
        with open(os.path.join(self.work, "server.log"), "rb") as f:
            return f.read()[-3000:].decode(errors="replace")

    def test_the_page_runs(self):
        self.assertEqual(list(self.blocks), STEPS, "the page's checked steps changed")
        self.assertIn("twistd -n streamproto", self.blocks["start"])
        self.start()
        self.assertIn('"ready"', self.shell("ready").replace(" ", ""))
        out = self.shell("styx")
        self.assertEqual(out.splitlines()[-2:], ["first record", "second record"])
        self.assertIn("sent 1 event", self.shell("lumberjack"))
        self.assertIn("wrote 3 events to demo/clicks", self.shell("pravega"))
        out = self.shell("spark", timeout=600)
        rows = [line for line in out.splitlines() if line.startswith(("events ", "lumberjack "))]
        self.assertEqual(rows[:2], ["events 0 first record", "events 1 second record"])
        self.assertEqual(len(rows), 3, out)
        self.assertTrue(rows[2].startswith('lumberjack 0 {"peer":"127.0.0.1:'), rows[2])
        # Pravega's segments are internal: not among the logs Spark reads
        self.assertFalse([line for line in out.splitlines() if "click" in line], out)
