"""
C{streamproto store copy} run as users run it (C{python -m streamproto}):
a file store to a real JetStream cluster and back, a copy killed halfway
(SIGKILL) and run again in a fresh process, a copy following a JetStream
source that is written until SIGTERM, and the refusals (exit 1, one line).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial import unittest

from streamproto.log import LogConfig
from streamproto.log.copy import JOURNAL_LOG
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore
from streamproto.log.reader import LogDirectoryReader
from test.support.natsutil import shared_cluster, unique_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def records(n, size, tag=b""):
    return [(tag + b"%d:" % i).ljust(size, b".") for i in range(n)]


def poll_until(value, target, deadline):
    """
    Poll C{value()} until it reaches C{target} or the monotonic clock
    passes C{deadline} (a copy running in another process).

    @return: its last value.
    """
    while value() < target and time.monotonic() < deadline:
        time.sleep(0.05)
    return value()


def exited(p):
    """Why a copy running in another process stopped copying (a failure's message)."""
    # seen once in CI: a copy that never copied
    if p.poll() is None:
        return "the copy is still running"
    return f"the copy exited {p.returncode}: {p.stderr.read().decode()[-2000:]}"


def run_copy(*argv, wait=True):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "streamproto", "store", *argv], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not wait:
        return p
    out, err = p.communicate(timeout=300)
    return p.returncode, out.decode(), err.decode()


class ProcessCopyTests(unittest.SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()

    def tempdir(self):
        path = tempfile.mkdtemp(prefix="streamproto-copy-")
        self.addCleanup(shutil.rmtree, path, True)
        return path

    def file_store(self, path):
        store = FileLogStore(path, reactor=self.clock, run_blocking=synchronous,
                             retention_interval=None)
        self.addCleanup(store.close)
        return store

    def nats_store(self, prefix):
        from streamproto.log.bridge import SynchronousBridge
        from streamproto.log.jetstream import JetStreamLogStore
        cluster = shared_cluster()
        store = JetStreamLogStore(cluster.urls, prefix=prefix, clock=self.clock,
                                  bridge=SynchronousBridge(), retention_interval=None)
        self.addCleanup(store.close)
        self.successResultOf(store.start())
        return store

    def nats_url(self):
        cluster = shared_cluster()
        prefix = unique_prefix(self)
        self.addCleanup(self.delete_streams, prefix)
        hosts = ",".join(u.split("://", 1)[1] for u in cluster.urls)
        return prefix, f"nats://{hosts}?prefix={prefix}"

    def delete_streams(self, prefix):
        store = self.nats_store(prefix)
        for name in store.names():
            self.successResultOf(store.delete(name))

    def populate(self, store):
        """Logs of every kind: user, internal, truncated heads, attributes, empty."""
        events = self.successResultOf(store.create("events", LogConfig(log_max_count=100000)))
        self.successResultOf(events.append(records(3000, 100)))
        self.successResultOf(events.append(records(50, 1000), attributes={"writer": 3050}))
        self.successResultOf(events.truncate(1000))
        controller = self.successResultOf(store.create("pravega-controller"))
        self.successResultOf(controller.append([b'{"scopes": {"s": {}}}']))
        segment = self.successResultOf(store.create("pravega_s_t_0.#epoch.0"
                                                    .replace(".", "_").replace("#", "")))
        self.successResultOf(segment.append(records(200, 37)))
        self.successResultOf(segment.truncate_offset(37 * 20 + 11))
        self.successResultOf(store.create("relink-target"))

    def assertSameStores(self, a, b):
        names = [n for n in a.names() if n != JOURNAL_LOG]
        self.assertEqual(names, [n for n in b.names() if n != JOURNAL_LOG])
        for name in names:
            x = self.successResultOf(a.get(name))
            y = self.successResultOf(b.get(name))
            self.assertEqual([x.start_position, x.end_position, x.start_offset, x.end_offset],
                             [y.start_position, y.end_position, y.start_offset, y.end_offset],
                             name)
            self.assertEqual((x.attributes, x.config), (y.attributes, y.config), name)
            position = x.start_position
            while position < x.end_position:
                got_x = self.successResultOf(x.read(position))
                got_y = self.successResultOf(y.read(position, max_records=len(got_x)))
                self.assertEqual(got_x.records(), got_y.records(), (name, position))
                position = got_x.next_position

    def test_file_to_nats_and_back(self):
        """
        A file store copied to JetStream and back holds the same logs,
        positions, offsets, boundaries, attributes and configurations.
        """
        src_path = self.tempdir()
        src = self.file_store(src_path)
        self.populate(src)
        prefix, url = self.nats_url()
        code, out, err = run_copy("copy", src_path, url)
        self.assertEqual(code, 0, err)
        self.assertIn("4 logs verified", out)
        self.assertSameStores(src, self.nats_store(prefix))
        back = os.path.join(self.tempdir(), "back")
        code, out, err = run_copy("copy", url, back, "-f", "json")
        self.assertEqual(code, 0, err)
        self.assertSameStores(src, self.file_store(back))

    def test_killed_copy_resumes_in_a_fresh_process(self):
        """
        A copy killed (SIGKILL) halfway and started again finishes with
        every record once, at its position.
        """
        src_path, dst_path = self.tempdir(), os.path.join(self.tempdir(), "dst")
        src = self.file_store(src_path)
        log = self.successResultOf(src.create("events"))
        for i in range(120):
            self.successResultOf(log.append(records(5000, 100, tag=b"%d-" % i)))
        self.successResultOf(src.close())
        p = run_copy("copy", src_path, dst_path, wait=False)
        deadline = time.monotonic() + 60
        seg_dir = os.path.join(dst_path, "events")
        while time.monotonic() < deadline:
            if os.path.isdir(seg_dir) and sum(
                    os.path.getsize(os.path.join(seg_dir, f)) for f in os.listdir(seg_dir)
                    if f.endswith(".seg")) > 1_000_000:
                break
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.communicate()
        reader = LogDirectoryReader(dst_path)
        start, end = reader.bounds("events")
        self.assertTrue(0 < end < 600000, end)
        code, out, err = run_copy("copy", src_path, dst_path)
        self.assertEqual(code, 0, err)
        self.assertIn("events: 600000 end position, 600000 records", out)
        expected = [r for i in range(120) for r in records(5000, 100, tag=b"%d-" % i)]
        got = [r for batch in LogDirectoryReader(dst_path).read("events", 0, 600000)
               for r in batch.records()]
        self.assertEqual(got, expected)

    def test_follow_until_sigterm(self):
        """
        C{--follow} copies what is appended to the JetStream source while it
        runs; SIGTERM makes it catch up, verify and exit 0.
        """
        prefix, url = self.nats_url()
        src = self.nats_store(prefix)
        log = self.successResultOf(src.create("events"))
        self.successResultOf(log.append(records(100, 50)))
        dst_path = os.path.join(self.tempdir(), "dst")
        p = run_copy("copy", url, dst_path, "--follow", wait=False)
        reader = LogDirectoryReader(dst_path)

        def copied():
            try:
                return reader.bounds("events")[1]
            except Exception:
                return -1
        deadline = time.monotonic() + 60
        self.assertEqual(poll_until(copied, 100, deadline), 100, exited(p))
        for i in range(5):
            self.successResultOf(log.append(records(10, 50, tag=b"late%d" % i)))
        self.assertEqual(poll_until(copied, 150, deadline), 150, exited(p))
        self.successResultOf(log.append([b"just before the stop"], attributes={"w": 1}))
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        self.assertIn("events: 151 end position, 151 records", out.decode(), err.decode())
        self.assertSameStores(src, self.file_store(dst_path))

    def test_follow_a_live_data_directory_until_sigint(self):
        """
        C{--follow} from a data directory a server is writing (here this
        process's store) to JetStream: the appends made while it runs are
        copied; SIGINT makes it catch up, verify and exit 0.
        """
        src_path = self.tempdir()
        server = self.file_store(src_path)
        log = self.successResultOf(server.create("events"))
        self.successResultOf(log.append(records(100, 50)))
        prefix, url = self.nats_url()
        p = run_copy("copy", src_path, url, "--follow", wait=False)
        dst = self.nats_store(prefix)

        def copied():
            try:
                return self.successResultOf(dst.get("events")).end_position
            except Exception:
                return -1
        deadline = time.monotonic() + 60

        self.assertEqual(poll_until(copied, 100, deadline), 100, exited(p))
        self.successResultOf(log.append(records(20, 50, tag=b"late")))
        self.assertEqual(poll_until(copied, 120, deadline), 120, exited(p))
        self.successResultOf(log.append([b"last"], attributes={"w": 121}))
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        self.assertIn("events: 121 end position, 121 records", out.decode())
        self.assertSameStores(server, self.nats_store(prefix))

    def test_refusals(self):
        """
        A destination holding another log of the same name: exit 1, one
        line naming it, nothing written to it.
        """
        src_path, dst_path = self.tempdir(), self.tempdir()
        src, dst = self.file_store(src_path), self.file_store(dst_path)
        self.successResultOf(self.successResultOf(src.create("events")).append([b"a", b"b"]))
        self.successResultOf(self.successResultOf(dst.create("events")).append([b"z"]))
        self.successResultOf(dst.close())
        code, out, err = run_copy("copy", src_path, dst_path)
        self.assertEqual(code, 1)
        self.assertEqual(err.strip().splitlines()[-1],
                         "streamproto store: error: refused: log events: the destination's "
                         "record 0 differs from the source's (or ends at another offset): "
                         "a different log of the same name")
        self.assertEqual(LogDirectoryReader(dst_path).bounds("events"), (0, 1))
        code, out, err = run_copy("copy", src_path, "nats://127.0.0.1:1")
        self.assertEqual(code, 1)
        self.assertIn("cannot be reached", err)
        self.assertNotIn("Traceback", err)


def counting(state):
    n = state["n"] + 1
    return {"value": n}, {"n": n}


class SessionCopyTests(unittest.TestCase):
    """
    Reliable-stream sessions go along: SQLite under a data directory to a
    JetStream store's bucket and back, each read by the real session store
    of the other side (the client resumes where it was).
    """

    def tempdir(self):
        path = tempfile.mkdtemp(prefix="streamproto-copy-")
        self.addCleanup(shutil.rmtree, path, True)
        return path

    def run_copy_async(self, *argv):
        from twisted.internet import threads
        return threads.deferToThread(run_copy, *argv)

    @defer.inlineCallbacks
    def test_sessions_file_to_nats_and_back(self):
        from streamproto.reliable.natsessions import JetStreamSessionStore
        from streamproto.reliable.session import Message, SQLiteSessionStore
        from streamproto.reliable.tap import SQLITE_FILE
        src = self.tempdir()
        sessions = SQLiteSessionStore(os.path.join(src, SQLITE_FILE))
        yield sessions.register("a", {"n": 0})
        yield sessions.register("b/\u00e9", {"n": 10})
        for _ in range(4):
            yield sessions.put("a", counting)
        yield sessions.put("b/\u00e9", counting)
        yield sessions.ack("a", 2)
        yield sessions.close()
        cluster = shared_cluster()
        prefix = unique_prefix(self)
        hosts = ",".join(u.split("://", 1)[1] for u in cluster.urls)
        url = f"nats://{hosts}?prefix={prefix}"
        code, out, err = yield self.run_copy_async("copy", src, url)
        self.assertEqual(code, 0, err)
        self.assertIn("reliable-stream sessions: 2 found, 2 copied", out)
        bucket = JetStreamSessionStore(cluster.urls, prefix=prefix)
        try:
            yield bucket.start()
            self.assertEqual((yield bucket.after("a", 2)), Message(3, {"value": 3}))
            self.assertEqual((yield bucket.put("a", counting)), Message(5, {"value": 5}))
            self.assertEqual((yield bucket.after("b/\u00e9", 0)), Message(1, {"value": 11}))
        finally:
            yield bucket.close()
        back = os.path.join(self.tempdir(), "back")
        code, out, err = yield self.run_copy_async("copy", url, back)
        self.assertEqual(code, 0, err)
        self.assertIn("reliable-stream sessions: 2 found, 2 copied", out)
        restored = SQLiteSessionStore(os.path.join(back, SQLITE_FILE))
        try:
            self.assertEqual((yield restored.after("a", 4)), Message(5, {"value": 5}))
            self.assertEqual((yield restored.put("a", counting)), Message(6, {"value": 6}))
        finally:
            yield restored.close()
        # run again: the same sessions are skipped; another one of a uuid is refused
        code, out, err = yield self.run_copy_async("copy", src, url)
        self.assertEqual(code, 1)
        self.assertIn("refused: session a: the destination holds another session", err)


class TLSCopyTests(unittest.SynchronousTestCase):
    """
    C{store copy} and C{store list} to and from a C{tls://} store, as the
    servers reach it (C{--store-ca}, C{--store-cert}, C{--store-key}): the
    NATS server verified, a client certificate shown; a server the CA did
    not sign is refused with one line, nothing copied.
    """

    def setUp(self):
        from test.support.natsutil import NatsCluster
        from test.support.tlsutil import certs
        self.c = certs()
        self.cluster = NatsCluster(1, tls=(self.c.server_cert, self.c.server_key, self.c.ca))
        self.cluster.start()
        self.addCleanup(self.cluster.stop)
        self.url = f"tls://localhost:{self.cluster.ports[0]}?replicas=1"
        self.tls = ["--store-ca", self.c.ca, "--store-cert", self.c.client_cert,
                    "--store-key", self.c.client_key]

    def tempdir(self):
        path = tempfile.mkdtemp(prefix="streamproto-copy-")
        self.addCleanup(shutil.rmtree, path, True)
        return path

    def test_file_to_tls_and_back(self):
        src = self.tempdir()
        store = FileLogStore(src, reactor=Clock(), run_blocking=synchronous,
                             retention_interval=None)
        events = self.successResultOf(store.create("events"))
        self.successResultOf(events.append(records(500, 100), attributes={"writer": 500}))
        store.close()
        code, out, err = run_copy("copy", src, self.url, *self.tls)
        self.assertEqual(code, 0, err)
        self.assertIn("events: 500 end position, 500 records", out)
        code, out, err = run_copy("list", self.url, *self.tls)
        self.assertEqual(code, 0, err)
        self.assertIn("events", out)
        back = os.path.join(self.tempdir(), "back")
        code, out, err = run_copy("copy", self.url, back, *self.tls)
        self.assertEqual(code, 0, err)
        got = [r for batch in LogDirectoryReader(back).read("events", 0, 500)
               for r in batch.records()]
        self.assertEqual(got, records(500, 100))

    def test_unverified_server_refused(self):
        """
        At once: a CA that did not sign the server's certificate will not
        sign it on the next attempt either (before, the first connection
        waited out its whole deadline).
        """
        from streamproto.log.natsio import CONNECT_DEADLINE
        started = time.monotonic()
        code, out, err = run_copy("list", self.url, "--store-ca", self.c.other_ca,
                                  "--store-cert", self.c.client_cert,
                                  "--store-key", self.c.client_key)
        self.assertNotEqual(code, 0)
        self.assertLess(time.monotonic() - started, CONNECT_DEADLINE / 2)
        self.assertNotIn("Traceback", err)
        self.assertIn("CERTIFICATE_VERIFY_FAILED", err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
