"""
Interop: the official Pravega client (PyPI C{pravega}, the Python bindings of
the Rust client) against C{twistd -n pravega-server} started as a child
process: controller (gRPC, plain and TLS), segment store, reader-group table
segments, byte streams, transactions, stream configurations, manual scaling
(a writer and readers carrying on across it), and state across a restart.

The client runs in a child Python process too, with a timeout, so a client
that hangs fails the test instead of blocking the suite.

The client's Python binding has a stall of its own, which the client code
below avoids: it completes an awaited future (C{get_segment_slice_async},
C{write_event_async}) on a tokio worker thread that calls the event loop's
C{call_soon_threadsafe}, which drops the GIL around its wake-up write and
needs it back afterwards.  The woken event loop may by then have resumed the
coroutine, which calls a blocking method (C{reader_offline}, C{flush},
C{write_event}): those run C{block_on} holding the GIL.  The worker waits
for the GIL, and the tasks it would run (among them the reads of a pooled
connection that the blocking call now waits on) wait for it, until the
client's 30 s request timeout breaks the deadlock.  The replies sit unread
in the client's socket meanwhile (C{ss} shows them in Recv-Q; gdb shows the
worker in C{take_gil} under C{pyo3_asyncio::generic::set_result}).  So
after each await, before a blocking call, the client waits in the event loop
until no thread is inside C{call_soon_threadsafe} (C{settle}), and the
timeouts here are shorter than that 30 s: a stall fails the test.
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

from twisted.trial.unittest import SynchronousTestCase

from test.support.ciutil import missing
# settle() as source, for every client program below
from test.support.pravega_binding import SETTLE

try:
    import pravega_client  # noqa: F401
except ImportError:  # pragma: no cover - the dependency is in the dev venv
    pravega_client = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The client side: "python -c CLIENT command json-args" prints one JSON line.
CLIENT = SETTLE + r'''
import json, os
import pravega_client


async def read_until(reader, got, done):
    """Append the events C{reader} reads (as text) to C{got} until C{done()}."""
    while not done():
        sl = await reader.get_segment_slice_async()
        await settle()
        got.extend(e.data().decode() for e in sl)
        reader.release_segment(sl)


def manager(controller):
    # tls:// also needs tls_enabled; the CA comes from $pravega_client_tls_cert_path
    return pravega_client.StreamManager(controller, False, controller.startswith("tls://"))


def create(controller, scope, streams):
    m = manager(controller)
    out = {"scope": m.create_scope(scope)}
    for name, count in streams.items():
        out[name] = m.create_stream(scope, name, count)
    return out


def write(controller, scope, stream, events=(), count=0, prefix="", routing_key=None,
          keyed=()):
    m = manager(controller)
    w = m.create_writer(scope, stream)
    for e in events:
        w.write_event(e, routing_key=routing_key)
    for key, e in keyed:
        w.write_event(e, routing_key=key)

    async def batch():
        # queued together, so the writer packs them into blocks
        await asyncio.gather(*[w.write_event_async("%s%06d" % (prefix, i))
                               for i in range(count)])
        await settle()
    if count:
        asyncio.run(batch())
    w.flush()
    return len(events) + count


def read(controller, scope, stream, group, expect, timeout=15.0, sentinels=0):
    """
    Read C{expect} events with a reader group.  With C{sentinels}, then write
    that many END-n events (distinct routing keys, so every segment gets
    some) and read up to them: anything else read meanwhile is an event that
    should not exist.  (Cancelling a pending read instead leaves its
    future holding the reader's lock, which reader_offline waits for.)
    """
    m = manager(controller)
    rg = m.create_reader_group(group, scope, stream)
    # a new reader id each time: the group resumes from where the last
    # reader went offline, whoever reads next
    r = rg.create_reader("reader-" + os.urandom(6).hex())
    got = []

    def until(done):
        return read_until(r, got, done)

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
            await settle()
            # offline while the event loop still runs, off its thread
            await asyncio.get_running_loop().run_in_executor(None, r.reader_offline)
    asyncio.run(main())
    return [e for e in got if not e.startswith("END-")]


def configure(controller, scope, stream):
    """Create a stream with a policy and tags, update them, read the tags back."""
    m = manager(controller)
    m.create_scope(scope)
    P, R = pravega_client.StreamScalingPolicy, pravega_client.StreamRetentionPolicy
    created = m.create_stream_with_policy(scope, stream, P.fixed_scaling_policy(2),
                                          R.none(), ["one", "two"])
    tags = m.get_stream_tags(scope, stream)
    updated = m.update_stream_with_policy(scope, stream, P.fixed_scaling_policy(2),
                                          R.by_size(1 << 20), ["three"])
    return {"created": created, "tags": tags, "updated": updated,
            "now": m.get_stream_tags(scope, stream)}


def retention(controller, scope, stream, size, old, new, pause):
    """
    A stream with a size retention policy (created by the client): C{old}
    is written, the server records a stream cut after it (C{pause} s), then
    C{new}; returns the head the controller answers once it moved.
    """
    from streamproto.pravega import controller_pb2 as pb
    m = manager(controller)
    m.create_scope(scope)
    P, R = pravega_client.StreamScalingPolicy, pravega_client.StreamRetentionPolicy
    created = m.create_stream_with_policy(scope, stream, P.fixed_scaling_policy(1),
                                          R.by_size(size), [])
    w = m.create_writer(scope, stream)
    for e in old:
        w.write_event(e)
    w.flush()
    time.sleep(pause)
    for e in new:
        w.write_event(e)
    w.flush()
    info = pb.StreamInfo(scope=scope, stream=stream)
    target = controller.split("://")[1]
    deadline = time.monotonic() + 10
    while True:
        head = controller_call(target, "getSegments", pb.GetSegmentsRequest(streamInfo=info),
                               pb.SegmentsAtTime)
        offsets = {s.segmentId.segmentId: s.offset for s in head.segments}
        if offsets.get(0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {"created": created, "head": offsets.get(0)}


def controller_call(target, method, request, response):
    # a plain gRPC call to our controller, as an operator's tool would make
    import grpc
    with grpc.insecure_channel(target) as channel:
        rpc = channel.unary_unary(
            "/io.pravega.controller.stream.api.grpc.v1.ControllerService/" + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response.FromString)
        return rpc(request, timeout=10)


def scale_midway(controller, scope, stream, before, after, sealed, ranges):
    """One writer writes C{before}, the stream scales, the same writer writes C{after}."""
    from streamproto.pravega import controller_pb2 as pb
    target = controller.split("://")[1]
    m = manager(controller)
    w = m.create_writer(scope, stream)
    for key, e in before:
        w.write_event(e, routing_key=key)
    w.flush()
    info = pb.StreamInfo(scope=scope, stream=stream)
    r = controller_call(target, "scale", pb.ScaleRequest(
        streamInfo=info, sealedSegments=sealed,
        newKeyRanges=[pb.ScaleRequest.KeyRangeEntry(start=a, end=b) for a, b in ranges]),
        pb.ScaleResponse)
    for key, e in after:
        w.write_event(e, routing_key=key)
    w.flush()
    current = controller_call(target, "getCurrentSegments", info, pb.SegmentRanges)
    return {"scale": pb.ScaleResponse.ScaleStreamStatus.Name(r.status),
            "segments": [s.segmentId.segmentId for s in current.segmentRanges]}


def read_across_scale(controller, scope, stream, before, after, sealed, ranges):
    """
    A reader reads C{before} and waits at the tail; the stream scales under
    it; one writer wrote C{before} and writes C{after}; the same reader
    reads on through the successors.
    """
    from streamproto.pravega import controller_pb2 as pb
    target = controller.split("://")[1]
    m = manager(controller)
    w = m.create_writer(scope, stream)
    r = m.create_reader_group("across", scope, stream).create_reader("r")
    got = []

    def until(n):
        return read_until(r, got, lambda: len(got) >= n)

    async def main():
        try:
            for key, e in before:
                w.write_event(e, routing_key=key)
            w.flush()
            await asyncio.wait_for(until(len(before)), 15)
            controller_call(target, "scale", pb.ScaleRequest(
                streamInfo=pb.StreamInfo(scope=scope, stream=stream), sealedSegments=sealed,
                newKeyRanges=[pb.ScaleRequest.KeyRangeEntry(start=a, end=b)
                              for a, b in ranges]), pb.ScaleResponse)
            for key, e in after:
                w.write_event(e, routing_key=key)
            w.flush()
            await asyncio.wait_for(until(len(before) + len(after)), 15)
        finally:
            await settle()
            await asyncio.get_running_loop().run_in_executor(None, r.reader_offline)
    asyncio.run(main())
    return got


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
    """
    C{twistd -n pravega-server} with its controller, on 127.0.0.1; with
    C{tls}, both over TLS, the segment store advertised as "localhost" (the
    Rust client checks certificates against DNS names only).
    """

    def __init__(self, data, tls=False, extra=()):
        self.data = data
        self.tls = tls
        self.extra = list(extra)
        self.store_port = free_port()
        self.controller_port = free_port()
        self.process = None
        self.log = os.path.join(data, "twistd.log")

    @property
    def controller(self):
        if self.tls:
            return f"tls://localhost:{self.controller_port}"
        return f"tcp://127.0.0.1:{self.controller_port}"

    def endpoints(self):
        if not self.tls:
            return ["--port", f"tcp:{self.store_port}:interface=127.0.0.1",
                    "--controller", f"tcp:{self.controller_port}:interface=127.0.0.1"]
        from test.support.tlsutil import certs
        return ["--port", certs().ssl_endpoint(self.store_port),
                "--controller", certs().ssl_endpoint(self.controller_port),
                "--advertise", f"localhost:{self.store_port}"]

    def start(self):
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
             "-n", "--pidfile=", "-l", self.log,
             "pravega-server", "--data", os.path.join(self.data, "store"),
             *self.endpoints(), *self.extra],
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


class InteropBase(SynchronousTestCase):
    tls = False
    server_args = ()

    def setUp(self):
        if pravega_client is None:
            missing("the pravega package (Pravega's Python client, the test extra) is not "
                    "installed")
        self.data = tempfile.mkdtemp(prefix="pravega-interop-")
        self.addCleanup(shutil.rmtree, self.data, True)
        self.server = ServerProcess(self.data, self.tls, self.server_args)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.scope = "sc" + uuid.uuid4().hex[:8]

    def client(self, command, timeout=25, **args):
        args.setdefault("controller", self.server.controller)
        env = dict(os.environ, RUST_LOG="error", PYTHONPATH=ROOT)
        if self.tls:
            from test.support.tlsutil import certs
            env["pravega_client_tls_cert_path"] = certs().ca
        try:
            done = subprocess.run([sys.executable, "-c", CLIENT, command, json.dumps(args)],
                                  capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            self.fail(f"pravega client {command} hung; server log:\n{self.server.tail()}")
        if done.returncode:
            self.fail(f"pravega client {command} exited {done.returncode}:\n"
                      f"{done.stdout[-500:]}\n{done.stderr[-3000:]}\n"
                      f"server log:\n{self.server.tail()}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def group(self):
        return "rg" + uuid.uuid4().hex[:12]


class InteropTests(InteropBase):

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

    def test_stream_configuration(self):
        self.assertEqual(self.client("configure", scope=self.scope, stream="c"),
                         {"created": True, "tags": ["one", "two"], "updated": True,
                          "now": ["three"]})

    def test_live_reader_follows_a_scale(self):
        """A reader online during the scale, a writer writing before and after it."""
        self.client("create", scope=self.scope, streams={"s": 2})
        keys = [f"key{k}" for k in range(8)]
        before = [[k, f"{k}-before{n}"] for n in range(3) for k in keys]
        after = [[k, f"{k}-after{n}"] for n in range(3) for k in keys]
        # merge the two segments into one, then the reader must follow both
        got = self.client("read_across_scale", scope=self.scope, stream="s", before=before,
                          after=after, sealed=[0, 1], ranges=[[0.0, 1.0]])
        self.assertEqual(sorted(got), sorted(e for _, e in before + after))
        for k in keys:
            self.assertEqual([e for e in got if e.startswith(k + "-")],
                             [e for key, e in before + after if key == k])

    def test_writer_and_reader_carry_on_across_a_scale(self):
        """
        A writer writes, the stream scales (one segment split in two), the
        same writer writes on; a reader group that read before the scale
        reads the rest, each routing key's events in order.
        """
        self.client("create", scope=self.scope, streams={"s": 1})
        keys = [f"key{k}" for k in range(6)]

        def events(tag):
            return [[k, f"{k}-{tag}{n}"] for n in range(3) for k in keys]
        first, before, after = events("first"), events("before"), events("after")
        self.client("write", scope=self.scope, stream="s", keyed=first)
        group = self.group()
        got = self.client("read", scope=self.scope, stream="s", group=group,
                          expect=len(first), sentinels=1)
        self.assertEqual(got, [e for _, e in first])
        self.assertEqual(
            self.client("scale_midway", scope=self.scope, stream="s", before=before,
                        after=after, sealed=[0], ranges=[[0.0, 0.5], [0.5, 1.0]]),
            {"scale": "STARTED", "segments": [1 << 32 | 1, 1 << 32 | 2]})
        # the new epoch is durable: the reader finds it after a restart
        self.server.stop()
        self.server.start()
        got = self.client("read", scope=self.scope, stream="s", group=group,
                          expect=len(before) + len(after), sentinels=2)
        self.assertEqual(sorted(got), sorted(e for _, e in before + after))
        for k in keys:
            self.assertEqual([e for e in got if e.startswith(k + "-")],
                             [e for key, e in before + after if key == k])


class RetentionInteropTests(InteropBase):
    """A size retention policy set through the client, enforced by the controller."""

    server_args = ("--retention-interval", "0.1")

    def test_size_retention(self):
        old = ["old-%096d" % i for i in range(20)]
        new = ["new-%096d" % i for i in range(20)]
        # an event is stored as its 8-byte header and data: keep exactly "new"
        kept = sum(8 + len(e) for e in new)
        r = self.client("retention", scope=self.scope, stream="r", size=kept, old=old,
                        new=new, pause=0.4)
        self.assertEqual(r, {"created": True, "head": sum(8 + len(e) for e in old)})
        # a new reader group starts at the head: the old events are gone
        self.assertEqual(self.client("read", scope=self.scope, stream="r", group=self.group(),
                                     expect=len(new), sentinels=1), new)


class TLSInteropTests(InteropBase):
    """The same client with TLS to the controller and to the segment store."""

    tls = True

    def test_events_over_tls(self):
        self.assertEqual(self.client("create", scope=self.scope, streams={"s": 2}),
                         {"scope": True, "s": True})
        events = [f"secret-{i}" for i in range(50)]
        self.client("write", scope=self.scope, stream="s", events=events, routing_key="k")
        self.assertEqual(self.client("read", scope=self.scope, stream="s", group=self.group(),
                                     expect=50, sentinels=2), events)
