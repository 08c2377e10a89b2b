"""
Interop: the official Pravega client (PyPI C{pravega}, the Python bindings of
the Rust client) against C{twistd -n pravega-server} started as a child
process: controller (gRPC), segment store, reader-group table segments,
byte streams and transactions, and state across a restart.

The client runs in a child Python process too, with a timeout, so a client
that hangs fails the test instead of blocking the suite.  (The client
sometimes stalls 30 s inside reader_offline, with every request answered:
the timeout leaves room for two such stalls.)
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from twisted.trial.unittest import SkipTest, SynchronousTestCase

try:
    import pravega_client  # noqa: F401
except ImportError:  # pragma: no cover - the dependency is in the dev venv
    pravega_client = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The client side: "python -c CLIENT command json-args" prints one JSON line.
CLIENT = r'''
import asyncio, json, os, sys
import pravega_client


def manager(controller):
    return pravega_client.StreamManager(controller)


def create(controller, scope, streams):
    m = manager(controller)
    out = {"scope": m.create_scope(scope)}
    for name, count in streams.items():
        out[name] = m.create_stream(scope, name, count)
    return out


def write(controller, scope, stream, events=(), count=0, prefix="", routing_key=None):
    m = manager(controller)
    w = m.create_writer(scope, stream)
    for e in events:
        w.write_event(e, routing_key=routing_key)

    async def batch():
        # queued together, so the writer packs them into blocks
        await asyncio.gather(*[w.write_event_async("%s%06d" % (prefix, i))
                               for i in range(count)])
    if count:
        asyncio.run(batch())
    w.flush()
    return len(events) + count


def read(controller, scope, stream, group, expect, timeout=40.0, sentinels=0):
    """
    Read C{expect} events with a reader group.  With C{sentinels}, then write
    that many END-n events (distinct routing keys, so every segment gets
    some) and read up to them: anything else read meanwhile is an event that
    should not exist.  (Cancelling a pending read instead makes the
    client's reader_offline wait 30 s.)
    """
    m = manager(controller)
    rg = m.create_reader_group(group, scope, stream)
    # a new reader id each time: the group resumes from where the last
    # reader went offline, whoever reads next
    r = rg.create_reader("reader-" + os.urandom(6).hex())
    got = []

    async def until(done):
        while not done():
            sl = await r.get_segment_slice_async()
            got.extend(e.data().decode() for e in sl)
            r.release_segment(sl)

    async def main():
        try:
            await asyncio.wait_for(until(lambda: len(got) >= expect), timeout)
            if sentinels:
                w = m.create_writer(scope, stream)
                for k in range(sentinels):
                    w.write_event("END-%d" % k, routing_key="key-%d" % k)
                w.flush()
                ends = lambda: sum(e.startswith("END-") for e in got) == sentinels
                await asyncio.wait_for(until(ends), timeout)
        finally:
            # offline while the event loop still runs, off its thread
            await asyncio.get_running_loop().run_in_executor(None, r.reader_offline)
    asyncio.run(main())
    return [e for e in got if not e.startswith("END-")]


def bytestream(controller, scope, stream):
    m = manager(controller)
    bs = m.create_byte_stream(scope, stream)
    written = bs.write(b"hello, ") + bs.write(b"byte stream")
    bs.flush()
    tail = bs.current_tail_offset()
    bs.seek(7, 0)
    buf = bytearray(11)
    n = bs.readinto(buf)
    bs.seek(0, 0)
    head = bytearray(5)
    bs.readinto(head)
    return {"written": written, "tail": tail, "read": bytes(buf[:n]).decode(),
            "head": bytes(head).decode()}


def transactions(controller, scope, stream):
    m = manager(controller)
    tw = m.create_transaction_writer(scope, stream, 1)
    committed = tw.begin_txn()
    for i in range(10):
        committed.write_event("committed-%d" % i)
    committed.commit()
    aborted = tw.begin_txn()
    aborted.write_event("aborted")
    aborted.abort()
    return {"committed_open": committed.is_open(), "aborted_open": aborted.is_open()}


def seal_delete(controller, scope, stream):
    m = manager(controller)
    return {"seal": m.seal_stream(scope, stream), "delete": m.delete_stream(scope, stream),
            "streams": list(m.list_stream(scope))}


cmd, args = sys.argv[1], json.loads(sys.argv[2])
print(json.dumps(globals()[cmd](**args)), flush=True)
# The client's runtime threads can crash the interpreter's own shutdown
# (SIGABRT/SIGSEGV after the work is done): leave without it.
os._exit(0)
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """C{twistd -n pravega-server} with its controller, on 127.0.0.1."""

    def __init__(self, data):
        self.data = data
        self.store_port = free_port()
        self.controller_port = free_port()
        self.process = None
        self.log = os.path.join(data, "twistd.log")

    @property
    def controller(self):
        return f"tcp://127.0.0.1:{self.controller_port}"

    def start(self):
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
             "-n", "--pidfile=", "-l", self.log,
             "pravega-server", "--data", os.path.join(self.data, "store"),
             "--port", f"tcp:{self.store_port}:interface=127.0.0.1",
             "--controller", f"tcp:{self.controller_port}:interface=127.0.0.1"],
            env=env, cwd=self.data, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited: {self.tail()}")
            if self._listening(self.controller_port) and self._listening(self.store_port):
                return
            time.sleep(0.1)
        raise AssertionError(f"server did not start: {self.tail()}")

    def _listening(self, port):
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            return False

    def tail(self):
        try:
            with open(self.log) as f:
                return "".join(f.readlines()[-30:])
        except OSError:
            return "(no log)"

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class InteropTests(SynchronousTestCase):
    def setUp(self):
        if pravega_client is None:
            raise SkipTest("the pravega package (Pravega's Python client) is not installed")
        self.data = tempfile.mkdtemp(prefix="pravega-interop-")
        self.addCleanup(shutil.rmtree, self.data, True)
        self.server = ServerProcess(self.data)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.scope = "sc" + uuid.uuid4().hex[:8]

    def client(self, command, timeout=75, **args):
        args.setdefault("controller", self.server.controller)
        try:
            done = subprocess.run([sys.executable, "-c", CLIENT, command, json.dumps(args)],
                                  capture_output=True, text=True, timeout=timeout,
                                  env=dict(os.environ, RUST_LOG="error"))
        except subprocess.TimeoutExpired:
            self.fail(f"pravega client {command} hung; server log:\n{self.server.tail()}")
        if done.returncode:
            self.fail(f"pravega client {command} exited {done.returncode}:\n"
                      f"{done.stdout[-500:]}\n{done.stderr[-3000:]}\n"
                      f"server log:\n{self.server.tail()}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def group(self):
        return "rg" + uuid.uuid4().hex[:12]

    def test_write_and_read_events(self):
        """Single events and a 10k batch go in; a reader group reads each once."""
        created = self.client("create", scope=self.scope, streams={"events": 3})
        self.assertEqual(created, {"scope": True, "events": True})
        # creating again reports that it exists
        self.assertEqual(self.client("create", scope=self.scope, streams={"events": 3}),
                         {"scope": False, "events": False})
        singles = [f"single-{i}" for i in range(20)]
        self.client("write", scope=self.scope, stream="events", events=singles,
                    routing_key="one-key")
        self.client("write", scope=self.scope, stream="events", count=10000, prefix="b")
        got = self.client("read", scope=self.scope, stream="events", group=self.group(),
                          expect=10020, sentinels=12)
        self.assertEqual(len(got), 10020)
        self.assertEqual(sorted(got), sorted(singles + ["b%06d" % i for i in range(10000)]))
        # one routing key, one segment: its events keep their order
        self.assertEqual([e for e in got if e.startswith("single-")], singles)

    def test_reader_group_resumes_after_restart(self):
        self.client("create", scope=self.scope, streams={"s": 2})
        first = [f"first-{i}" for i in range(30)]
        self.client("write", scope=self.scope, stream="s", events=first, routing_key="k")
        group = self.group()
        self.assertEqual(self.client("read", scope=self.scope, stream="s", group=group,
                                     expect=30, sentinels=1), first)
        self.server.stop()
        self.server.start()
        later = [f"later-{i}" for i in range(5)]
        # the stream (controller state) and its data survived
        self.assertEqual(self.client("create", scope=self.scope, streams={"s": 2}),
                         {"scope": False, "s": False})
        self.client("write", scope=self.scope, stream="s", events=later, routing_key="k")
        # the group carries on where its reader went offline (and only there:
        # the sentinels show nothing else follows)
        self.assertEqual(self.client("read", scope=self.scope, stream="s", group=group,
                                     expect=5, sentinels=1), later)

    def test_byte_stream(self):
        self.client("create", scope=self.scope, streams={"bytes": 1})
        self.assertEqual(self.client("bytestream", scope=self.scope, stream="bytes"),
                         {"written": 18, "tail": 18, "read": "byte stream", "head": "hello"})

    def test_transactions(self):
        self.client("create", scope=self.scope, streams={"tx": 2})
        self.assertEqual(self.client("transactions", scope=self.scope, stream="tx"),
                         {"committed_open": False, "aborted_open": False})
        got = self.client("read", scope=self.scope, stream="tx", group=self.group(),
                          expect=10, sentinels=12)
        self.assertEqual(sorted(got), sorted(f"committed-{i}" for i in range(10)))

    def test_seal_and_delete_stream(self):
        self.client("create", scope=self.scope, streams={"a": 1, "b": 2})
        self.client("write", scope=self.scope, stream="b", events=["x"])
        self.assertEqual(self.client("seal_delete", scope=self.scope, stream="b"),
                         {"seal": True, "delete": True, "streams": ["a"]})
