"""
Socket activation as systemd does it (doc/operations.rst): a real C{twistd
styx-server --port systemd:domain=INET:index=0} child process inherits a
listening socket at file descriptor 3, with C{LISTEN_FDS=1} and
C{LISTEN_PID} its own pid, and serves the Styx HTTP API on it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from twisted.trial import unittest

from test.support.netutil import start_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: What systemd does between fork and exec, for one socket: put it at fd 3
#: (SD_LISTEN_FDS_START), say how many there are, their names (systemd 227
#: and later always set LISTEN_FDNAMES: the socket unit's
#: FileDescriptorName=, by default the unit's name; Twisted ignores the
#: descriptors without it) and for which process (the pid is only known in
#: the child: an exec keeps it), then exec.
ACTIVATE = """\
import os, sys
fd, name = int(sys.argv[1]), sys.argv[2]
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.set_inheritable(3, True)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_FDNAMES"] = name
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[3], sys.argv[3:])
"""

#: twistd's entry point (the console script may not sit next to sys.executable)
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]


def child_env():
    """The caller's environment without its own activation variables, with
    this work tree first on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def request(port, method, path, body=None, headers=None, timeout=10.0):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return response.status, response.read()


class SocketActivationTests(unittest.TestCase):
    """Blocking subprocess and HTTP work in the test thread: no reactor work
    is pending meanwhile."""

    timeout = 30

    def activate(self, listening, endpoint, fd_name="styx.socket"):
        """Start twistd as a socket-activated service on C{listening}."""
        data = os.path.join(tempfile.mkdtemp(), "data")
        # the unit file's ExecStart (doc/operations.rst), after the activation
        argv = TWISTD + ["-n", "--pidfile=", "styx-server", "--port", endpoint,
                         "--data", data, "--log-format", "json"]
        return start_process(
            self, [sys.executable, "-c", ACTIVATE, str(listening.fileno()), fd_name] + argv,
            pass_fds=(listening.fileno(),), cwd=tempfile.mkdtemp(), env=child_env())

    def test_serves_on_the_inherited_socket(self):
        """The endpoint of the documented unit: the first inherited socket."""
        self.serve_and_stop("systemd:domain=INET:index=0")

    def test_named_socket(self):
        """A socket unit with C{FileDescriptorName=styx}, chosen by name."""
        self.serve_and_stop("systemd:domain=INET:name=styx", fd_name="styx")

    def serve_and_stop(self, endpoint, fd_name="styx.socket"):
        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.addCleanup(listening.close)
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        port = listening.getsockname()[1]
        process = self.activate(listening, endpoint, fd_name)
        # the child owns the socket now: once it is gone, nothing listens
        listening.close()

        # the socket already listens while twistd starts: this connection
        # waits in the backlog and is served once the server adopted it
        status, body = request(port, "POST", "/logs", b"name=events",
                               {"Content-Type": "application/x-www-form-urlencoded"},
                               timeout=20.0)
        self.assertEqual(status, 200, body)
        self.assertEqual(json.loads(body)["name"], "events")
        status, body = request(port, "POST", "/logs/events/records", b"one\ntwo\n",
                               {"Content-Type": "application/vnd.styx.line-delimited"})
        self.assertEqual((status, json.loads(body)), (200, {"position": 2, "count": 2}))
        status, body = request(port, "GET", "/logs/events/records", None,
                               {"Accept": "application/vnd.styx.line-delimited"})
        self.assertEqual((status, body), (200, b"one\ntwo\n"))

        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=15)
        output = process.stdout.read().decode("utf-8", "replace")
        self.assertLess(time.monotonic() - started, 10.0)
        # twistd re-raises the SIGTERM that stopped it on itself
        self.assertIn(code, (0, -signal.SIGTERM), output)
        self.assertNotIn("Traceback", output)
        events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        formats = [e["message"] for e in events]
        self.assertTrue(any("closing log store" in f for f in formats), output)
        # the connections were the inherited socket's
        opened = [e for e in events if "closed after" in e["message"]]
        self.assertEqual(len(opened), 3, formats)
        self.assertTrue(all(e["server"] == "styx-server" for e in opened))

        # stopped: the listening socket died with the child
        probe = socket.socket()
        self.addCleanup(probe.close)
        with self.assertRaises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))

    def test_without_activation_the_endpoint_refuses(self):
        """Not socket-activated (LISTEN_PID another process's): twistd
        fails at startup rather than listening somewhere else."""
        data = os.path.join(tempfile.mkdtemp(), "data")
        env = child_env()
        env.update(LISTEN_FDS="1", LISTEN_PID="1")
        result = subprocess.run(
            TWISTD + ["-n", "--pidfile=", "styx-server", "--port",
                      "systemd:domain=INET:index=0", "--data", data],
            cwd=tempfile.mkdtemp(), env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, timeout=20)
        output = result.stdout.decode("utf-8", "replace")
        self.assertNotEqual(result.returncode, 0, output)
        # no descriptor at index 0: a usage error, before anything starts
        self.assertIn("--port 'systemd:domain=INET:index=0': no socket passed by systemd "
                      "matches it (IndexError", output)
        self.assertNotIn("starting on", output)
