"""
Events/s of the official Pravega client (PyPI ``pravega``) against
``twistd pravega-server``: its writer (100-byte events by default) and a
reader group reading them back.  The baseline, in the same run and against
the same server, is streamproto's own ``SegmentWriter``/``SegmentReader``
writing and reading the same events on a one-segment stream.

    python bench/pravega_client_bench.py [--events 100000] [--size 100] [--segments 1]

Starts the server (a child ``twistd -n pravega-server`` on 127.0.0.1, data in
a temporary directory); the Pravega client runs in a child process too.  To
tell who limits the writers, it reports the CPU time the server process and
the client process used during each write phase, as a share of one core
(from ``/proc/PID/stat``; 100% is one core busy all along).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet import defer, task  # noqa: E402
from twisted.internet.endpoints import TCP4ClientEndpoint  # noqa: E402

from streamproto.pravega.client import SegmentReader, SegmentWriter, connect  # noqa: E402
from test.pravega.test_pravega_interop import SETTLE, ServerProcess  # noqa: E402

# SETTLE: see test/pravega/test_pravega_interop.py (the binding's 30 s stall)
CLIENT = SETTLE + r'''
import json, os
import pravega_client

controller, scope, stream, segments, count, size = sys.argv[1:7]
count, size, segments = int(count), int(size), int(segments)
m = pravega_client.StreamManager(controller)
m.create_scope(scope)
m.create_stream(scope, stream, segments)
w = m.create_writer(scope, stream)
payload = "x" * size
# markers: the parent samples both processes' CPU time at each
print(json.dumps({"phase": "write"}), flush=True)
started = time.perf_counter()


async def write():
    # bounded batches keep the client's memory flat
    for first in range(0, count, 5000):
        await asyncio.gather(*[w.write_event_async(payload)
                               for _ in range(min(5000, count - first))])
    await settle()
asyncio.run(write())
w.flush()
written = time.perf_counter() - started
print(json.dumps({"phase": "written"}), flush=True)

rg = m.create_reader_group("bench", scope, stream)
r = rg.create_reader("r")
got = 0
started = time.perf_counter()


async def read():
    global got
    try:
        while got < count:
            sl = await r.get_segment_slice_async()
            await settle()
            got += sum(1 for _ in sl)
            r.release_segment(sl)
    finally:
        await settle()
        await asyncio.get_running_loop().run_in_executor(None, r.reader_offline)
asyncio.run(read())
read_s = time.perf_counter() - started
print(json.dumps({"write_s": written, "read_s": read_s, "read": got}), flush=True)
os._exit(0)
'''


def cpu_seconds(pid):
    """User + system CPU seconds of process C{pid} so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    # after the command: state is field 3, utime and stime fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU time of some processes between two instants, as a share of one core."""

    def __init__(self, **pids):
        self.pids = pids
        self.marks = []

    def mark(self):
        self.marks.append((time.perf_counter(),
                           {name: cpu_seconds(pid) for name, pid in self.pids.items()}))

    def shares(self):
        (t0, c0), (t1, c1) = self.marks[-2:]
        return {name: (c1[name] - c0[name]) / (t1 - t0) for name in self.pids}


def pravega_client_run(server, events, size, segments):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.controller, "bench",
                             "events", str(segments), str(events), str(size)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RUST_LOG="error"))
    meter = CpuMeter(server=server.process.pid, client=proc.pid)
    result = None
    try:
        for line in proc.stdout:
            msg = json.loads(line)
            if "phase" in msg:
                meter.mark()
            else:
                result = msg
        err = proc.stderr.read()
        if proc.wait(600) or result is None:
            raise SystemExit(f"pravega client failed:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result["write_cpu"] = meter.shares()
    return result


@defer.inlineCallbacks
def baseline_run(reactor, server, events, size):
    """streamproto's SegmentWriter/SegmentReader on the same server."""
    ep = TCP4ClientEndpoint(reactor, "127.0.0.1", server.store_port)
    proto = yield connect(ep)
    name = "bench/baseline/0.#epoch.0"
    yield proto.create_segment(name)
    proto.transport.loseConnection()
    writer = SegmentWriter(ep, name)
    payload = b"x" * size
    result = {}
    meter = CpuMeter(server=server.process.pid, client=os.getpid())
    meter.mark()
    started = time.perf_counter()
    for first in range(0, events, 5000):
        yield writer.write_batch([payload] * min(5000, events - first))
    yield writer.close()
    result["write_s"] = time.perf_counter() - started
    meter.mark()
    result["write_cpu"] = meter.shares()
    reader = SegmentReader(ep, name)
    got = 0
    started = time.perf_counter()
    while got < events:
        got += len((yield reader.read()))
    result["read_s"] = time.perf_counter() - started
    yield reader.close()
    return result


def report(name, events, r):
    cpu = r["write_cpu"]
    print(f"{name:34s} write {events / r['write_s']:9.0f} events/s   "
          f"read {events / r['read_s']:9.0f} events/s   "
          f"CPU while writing: server {cpu['server']:4.0%}  client {cpu['client']:4.0%}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--segments", type=int, default=1)
    args = p.parse_args()
    data = tempfile.mkdtemp(prefix="pravega-bench-")
    server = ServerProcess(data)
    server.start()

    @defer.inlineCallbacks
    def run(reactor):
        try:
            client = pravega_client_run(server, args.events, args.size, args.segments)
            base = yield baseline_run(reactor, server, args.events, args.size)
        finally:
            server.stop()
            shutil.rmtree(data, True)
        print(f"{args.events} events of {args.size} bytes, twistd pravega-server on the "
              f"file store (shared machine: figures vary)")
        report(f"pravega client, {args.segments} segment(s)", args.events, client)
        report("baseline: streamproto client", args.events, base)
        print(f"ratio pravega/baseline: write {base['write_s'] / client['write_s']:.2f}  "
              f"read {base['read_s'] / client['read_s']:.2f}")

    task.react(run)


if __name__ == "__main__":
    main()
