"""
Pravega segment-store benchmark: one writer, durable acks, server and writer
in separate processes, on the file store.

    python bench/pravega_bench.py                        # 500k x 100 B events
    python bench/pravega_bench.py --events 5000000       # bigger
    python bench/pravega_bench.py --profile server       # cProfile the server
    python bench/pravega_bench.py --profile writer       # cProfile the writer

The writer hands events to L{SegmentWriter.write_batch} in batches
(C{--batch} events each, at most C{--inflight} batches unacknowledged) and
measures events/s until the last DataAppended, and the ack latency of each
batch (from write_batch to the DataAppended covering its last event; every
event of a batch waits at most that long).

Baseline, same run, same bytes: the Event frames of every batch written to a
file with os.write and made durable with os.fsync per batch (what the
storage alone costs when each batch waits for its own fsync).  The ratio is
Pravega events/s / baseline events/s.
"""

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

SERVER = r"""
import sys
sys.path.insert(0, {root!r})
from twisted.internet import endpoints, reactor
from streamproto.log import open_store
from streamproto.pravega.server import PravegaServerFactory
store = open_store({data!r})
endpoint = endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1")
endpoint.listen(PravegaServerFactory(store)).addCallback(
    lambda port: print(port.getHost().port, flush=True))
if {profile!r}:
    import cProfile, pstats, signal
    signal.signal(signal.SIGTERM, lambda *a: reactor.callFromThread(reactor.stop))
    profile = cProfile.Profile()
    profile.runcall(reactor.run)
    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(20)
else:
    reactor.run()
"""


def percentile(sorted_values, p):
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, int(round(p / 100.0 * (len(sorted_values) - 1))))
    return sorted_values[i]


def run_writer(port, args):
    from twisted.internet import defer, reactor
    from twisted.internet.endpoints import TCP4ClientEndpoint

    from streamproto.pravega.client import SegmentWriter, connect

    segment = "bench/stream/0.#epoch.0"
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
    payload = b"x" * args.size
    result = {}

    @defer.inlineCallbacks
    def main():
        admin = yield connect(endpoint)
        yield admin.create_segment(segment)
        writer = SegmentWriter(endpoint, segment, block_size=args.block_size,
                               window_events=args.batch * args.inflight,
                               window_bytes=1 << 30)
        yield writer.write(b"warm-up")
        latencies = []
        batch = [payload] * args.batch
        inflight = []
        sent = 0
        start = time.perf_counter()
        while sent < args.events:
            n = min(args.batch, args.events - sent)
            t0 = time.perf_counter()
            d = writer.write_batch(batch if n == args.batch else batch[:n])
            d.addCallback(lambda _, t0=t0: latencies.append(time.perf_counter() - t0))
            inflight.append(d)
            sent += n
            if len(inflight) >= args.inflight:
                yield inflight.pop(0)
        yield defer.gatherResults(inflight)
        elapsed = time.perf_counter() - start
        yield writer.close()
        info = yield admin.segment_info(segment)
        admin.transport.loseConnection()
        result.update(elapsed=elapsed, latencies=sorted(latencies),
                      bytes=info.write_offset)

    def go():
        d = main()
        d.addErrback(lambda f: (result.update(error=f), f.printTraceback()))
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(go)
    if args.profile == "writer":
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(reactor.run)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    else:
        reactor.run()
    if "error" in result:
        raise SystemExit(1)
    return result


def run_baseline(path, args):
    frame = struct.pack(">ii", 0, args.size) + b"x" * args.size
    block = frame * args.batch
    fd = os.open(os.path.join(path, "baseline"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    latencies = []
    written = 0
    start = time.perf_counter()
    try:
        while written < args.events:
            n = min(args.batch, args.events - written)
            t0 = time.perf_counter()
            os.write(fd, block if n == args.batch else frame * n)
            os.fsync(fd)
            latencies.append(time.perf_counter() - t0)
            written += n
    finally:
        os.close(fd)
    return {"elapsed": time.perf_counter() - start, "latencies": sorted(latencies)}


def report(name, events, size, r):
    lat = r["latencies"]
    ms = [1000 * percentile(lat, p) for p in (50, 90, 99, 100)]
    rate = events / r["elapsed"]
    print(f"{name:<10} {rate:>14,.0f} {events * (size + 8) / r['elapsed'] / 1e6:>8.1f}"
          f"   p50 {ms[0]:7.2f}  p90 {ms[1]:7.2f}  p99 {ms[2]:7.2f}  max {ms[3]:7.2f}")
    return rate


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=500000)
    p.add_argument("--size", type=int, default=100, help="event payload bytes")
    p.add_argument("--batch", type=int, default=10000, help="events per write_batch")
    p.add_argument("--inflight", type=int, default=8, help="unacknowledged batches")
    p.add_argument("--block-size", type=int, default=1024 * 1024)
    p.add_argument("--data", help="directory for the store (default: a temporary one)")
    p.add_argument("--profile", choices=["server", "writer"])
    args = p.parse_args(argv)

    path = args.data or tempfile.mkdtemp(prefix="pravega-bench-")
    os.makedirs(path, exist_ok=True)
    store = os.path.join(path, "store")
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER.format(root=ROOT, data=store,
                                             profile=args.profile == "server")],
        stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        r = run_writer(port, args)
    finally:
        server.terminate()
        server.wait()
    base = run_baseline(path, args)
    if not args.data:
        shutil.rmtree(path, ignore_errors=True)

    print(f"one writer, {args.events:,} events of {args.size} B, batches of {args.batch}, "
          f"{args.inflight} in flight, blocks of {args.block_size} B; ack latency per batch "
          f"in ms")
    print(f"{'':<10} {'events/s':>14} {'MB/s':>8}")
    rate = report("pravega", args.events, args.size, r)
    base_rate = report("file", args.events, args.size, base)
    print(f"ratio pravega/file: {rate / base_rate:.2f}   (segment bytes: {r['bytes']:,})")


if __name__ == "__main__":
    main()
