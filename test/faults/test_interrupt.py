"""
An interrupted matrix cleans up: C{python -m test.faults.run} stopped by
Ctrl-C (SIGINT) or SIGTERM in the middle of a partition run on JetStream
leaves no lazy FS mounted, no network namespace, no server, node or client
process, and prints the table of the runs it finished.  Needs what
L{test.faults.test_faults} needs, and iproute2.
"""

import os
import signal
import subprocess
import sys
import time

from twisted.trial.unittest import TestCase

from test.faults import netns
from test.faults.run import living_children
from test.support.torture_harness import ROOT


def _descendants(pid):
    """Every living descendant of C{pid}."""
    children = living_children()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _lazy_mounts():
    with open("/proc/mounts") as f:
        return {line.split()[1] for line in f if line.startswith("lazyfs ")}


class InterruptTests(TestCase):
    timeout = 180

    def interrupt(self, signum):
        why = netns.unavailable()
        self.assertIsNone(why, f"network namespaces cannot be made here: {why}")
        mounts_before = _lazy_mounts()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        child = subprocess.Popen(
            [sys.executable, "-m", "test.faults.run", "--only", "partition", "--store", "nats",
             "--minutes", "3", "--run-seconds", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
        try:
            # the run is under way once the workload client runs in the
            # front-end's namespace (the nodes and the front-end are up)
            deadline = time.monotonic() + 120
            while True:
                self.assertIsNone(child.poll(), child.stderr.read().decode()[-3000:]
                                  if child.poll() is not None else "")
                spawned = _descendants(child.pid)
                commands = []
                for pid in spawned:
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            commands.append(f.read())
                    except OSError:
                        pass
                if any(b"test.faults.workload" in c for c in commands):
                    break
                self.assertLess(time.monotonic(), deadline, "the run did not start")
                time.sleep(0.2)
            time.sleep(2.0)
            spawned = _descendants(child.pid)
            ours = [n for n in os.listdir(netns.NETNS_DIR)
                    if n.startswith(f"faults-{child.pid}-")]
            self.assertEqual(len(ours), 5, ours)   # the router, fe, n0, n1, n2
            self.assertTrue(_lazy_mounts() - mounts_before, "no lazy FS was mounted")
            self.assertTrue(any(b"nats-server" in c for c in commands))
            child.send_signal(signum)
            out, err = child.communicate(timeout=60)
        finally:
            if child.poll() is None:   # a failed check: let it clean up still
                child.send_signal(signal.SIGINT)
                try:
                    child.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
        self.assertEqual(child.returncode, 128 + signum, err.decode()[-3000:])
        self.assertIn(b"interrupted by", err)
        self.assertIn(b"partition  nats   styx", out)    # the partial table
        self.assertEqual([n for n in os.listdir(netns.NETNS_DIR)
                          if n.startswith(f"faults-{child.pid}-")], [])
        self.assertEqual(_lazy_mounts() - mounts_before, set())
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in spawned) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual([pid for pid in spawned if _alive(pid)], [],
                         "processes of the interrupted run are still alive")

    def test_ctrl_c(self):
        self.interrupt(signal.SIGINT)

    def test_sigterm(self):
        self.interrupt(signal.SIGTERM)
