"""
Many connections on one server: a C{twistd styx-server} (file store) with
10,000 concurrent styx/0 connections, 9,000 idle and 1,000 active.

    python bench/connections.py                           # 8,000 idle producers,
                                                          # 1,000 idle followers, 1,000 active
    python bench/connections.py --idle 4000 --idle-followers 500 --seconds 20
    python bench/connections.py --go-server /path/to/styx-server   # the reference instead

In order, on one server:

  1. the active connections (half producers, half followers of the same
     C{--logs} logs) at C{--rate} records/s in all, open loop (latency
     from each record's planned time, HDR histogram: bench/latency.py): their
     p99 alone;
  2. C{--idle} idle producers (styx/0 handshake done, nothing sent), then
     C{--idle-followers} idle followers (following a log nobody writes),
     with the server's RSS read before and after each: memory per idle
     connection and per idle follower;
  3. the active load again with every idle connection open: its p99 next
     to the p99 alone, and how many connections were refused.

Each active run is repeated C{--repeat} times (alone, then with the idle
connections): the ratio is of the median p99s.  Each run also says how
many full (generation 2) garbage collections the server made during it
(C{python_gc_collections_total} of its C{/metrics}): a full collection
walks every object, and with 10,000 connections open its pause was the
p99 (doc/performance.rst).

The server raises its own open-files limit at start-up (its log says to
what: doc/operations.rst); this client raises its own the same way.  All
connections go to 127.0.0.1 (one destination port: 10,000 source ports
fit in Linux's default ephemeral range).  RSS is the server's VmRSS; the
client's own load shares the machine's 2 cores with the server and with
whatever else runs: compare the two p99s of one run.
"""

import argparse
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet import defer  # noqa: E402

from bench import gorefs  # noqa: E402
from bench.latency import (  # noqa: E402
    PLANNED, histogram, open_loop, run_reactor, start_ours, summary, task_sleep,
)
from streamproto.core.fdlimit import raise_open_files_limit  # noqa: E402
from test.support.torture_harness import rss_kib  # noqa: E402
from streamproto.core.gcpolicy import tune_for_server  # noqa: E402


def full_collections(port):
    """The server's full garbage collections so far (its C{/metrics}; None: not ours)."""
    import urllib.request
    if port is None:
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('python_gc_collections_total{generation="2"}'):
                return int(float(line.split()[-1]))
    return -1


def hold_idle(reactor, port, args):
    """
    C{--hold-idle}: this process holds the idle connections (their
    heartbeats and timers must not slow the active client down): opens
    C{--idle} producers, says C{opened N REFUSED}, waits for a line on
    stdin, opens C{--idle-followers} followers, says so again, then holds
    them until stdin closes.
    """
    from twisted.internet import defer, threads

    from streamproto.styx.stream_client import StyxConsumer, StyxProducer

    @defer.inlineCallbacks
    def say_opened(n, connect):
        opened, refused = yield open_many(n, connect)
        first = refused[0].getErrorMessage().replace("\n", " ") if refused else ""
        print(f"opened {len(opened)} {len(refused)} {first}", flush=True)
        return opened

    @defer.inlineCallbacks
    def go():
        held = yield say_opened(args.idle, lambda i: StyxProducer.connect(
            reactor, "127.0.0.1", port, f"conn-{i % args.logs}"))
        yield threads.deferToThread(sys.stdin.readline)
        held += yield say_opened(args.idle_followers, lambda i: StyxConsumer.connect(
            reactor, "127.0.0.1", port, "conn-idle", lambda records: None, follow=True))
        yield threads.deferToThread(sys.stdin.read)      # until the parent is done
        yield close_all(held)
        reactor.stop()

    return go()


def close_all(connections):
    """Close producers and consumers alike, whatever they answer (the run is over)."""
    return defer.DeferredList([defer.maybeDeferred(c.close) for c in connections],
                              consumeErrors=True)


@defer.inlineCallbacks
def open_many(n, connect, batch=250):
    """Open C{n} connections, C{batch} at a time: Deferred of (opened, failures)."""
    opened, refused = [], []
    for start in range(0, n, batch):
        results = yield defer.DeferredList(
            [connect(i) for i in range(start, min(n, start + batch))], consumeErrors=True)
        for ok, value in results:
            (opened if ok else refused).append(value)
    return opened, refused


def run(reactor, port, server_pid, args, out):
    from twisted.internet import defer, threads

    metrics_port = None if args.go_server else port

    from streamproto.styx.api_client import StyxClient
    from streamproto.styx.stream_client import StyxConsumer, StyxProducer

    api = StyxClient(f"http://127.0.0.1:{port}", reactor)
    refused = []
    payload = b"x" * max(0, args.size - PLANNED.size)

    def ignore(records):
        return None

    @defer.inlineCallbacks
    def active_load(producers, label):
        turn = [0]

        def send(record):
            p = producers[turn[0] % len(producers)]
            turn[0] += 1
            return p.write(record)

        p99s = []
        for run in range(args.repeat):
            acks = histogram()
            gcs = yield threads.deferToThread(full_collections, metrics_port)
            sent, lag = yield open_loop(reactor, send, payload, args.rate, args.seconds, acks)
            after = yield threads.deferToThread(full_collections, metrics_port)
            p50, p99, p999, worst = summary(acks)
            print(f"  active {label} ({run + 1}/{args.repeat}): {sent:,} records at "
                  f"{args.rate:,.0f}/s: p50 {p50:.2f} ms, p99 {p99:.2f} ms, p99.9 {p999:.2f} "
                  f"ms, max {worst:.2f} ms (send lag {lag * 1000:.1f} ms"
                  + (f"; {after - gcs} full collections in the server)" if gcs is not None
                     else ")"), file=out, flush=True)
            p99s.append(p99)
        return statistics.median(p99s)

    @defer.inlineCallbacks
    def go():
        logs = [f"conn-{i}" for i in range(args.logs)]
        for name in logs + ["conn-idle"]:
            yield api.create_log(name)
        half = args.active // 2
        rss_start = rss_kib(server_pid)
        producers, failed = yield open_many(half, lambda i: StyxProducer.connect(
            reactor, "127.0.0.1", port, logs[i % len(logs)]))
        refused.extend(failed)
        followers, failed = yield open_many(args.active - half, lambda i: StyxConsumer.connect(
            reactor, "127.0.0.1", port, logs[i % len(logs)], ignore, follow=True))
        refused.extend(failed)
        print(f"  {len(producers)} active producers, {len(followers)} active followers on "
              f"{len(logs)} logs (server RSS {rss_start:,} -> {rss_kib(server_pid):,} KiB)",
              file=out, flush=True)
        yield task_sleep(reactor, 1.0)
        alone = yield active_load(producers, "alone")

        before = rss_kib(server_pid)
        started = time.monotonic()
        holder = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--hold-idle", str(port),
             "--idle", str(args.idle), "--idle-followers", str(args.idle_followers),
             "--logs", str(args.logs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        @defer.inlineCallbacks
        def opened():
            line = ""
            while not line.startswith("opened "):    # past the holder's own header
                line = yield threads.deferToThread(holder.stdout.readline)
                if not line:
                    raise RuntimeError("the process holding the idle connections died")
            _, n, failed, *first = line.split(" ", 3)
            if int(failed):
                refused.append(" ".join(first).strip())
            return int(n), int(failed)

        n_idle, _ = yield opened()
        took = time.monotonic() - started
        yield task_sleep(reactor, 2.0)
        after_idle = rss_kib(server_pid)
        holder.stdin.write("followers\n")
        holder.stdin.flush()
        n_followers, _ = yield opened()
        yield task_sleep(reactor, 2.0)
        after_followers = rss_kib(server_pid)
        per_idle = (after_idle - before) * 1024 / max(1, n_idle)
        per_follower = (after_followers - after_idle) * 1024 / max(1, n_followers)
        total = len(producers) + len(followers) + n_idle + n_followers
        print(f"  {n_idle:,} idle producers opened in {took:.1f} s (another process): "
              f"server RSS {before:,} -> {after_idle:,} KiB = {per_idle:,.0f} B per idle "
              "connection", file=out)
        print(f"  {n_followers:,} idle followers: RSS -> {after_followers:,} KiB = "
              f"{per_follower:,.0f} B per idle follower", file=out)
        print(f"  {total:,} connections open, {len(refused)} refused"
              + (f" (first: {refused[0]})" if refused else ""), file=out, flush=True)
        loaded = yield active_load(producers, f"with {total - args.active:,} idle")
        print(f"  active p99 (median of {args.repeat}) with the idle connections / alone: "
              f"{loaded:.2f} / {alone:.2f} ms = {loaded / alone:.2f}", file=out, flush=True)
        holder.stdin.close()
        yield threads.deferToThread(holder.wait)
        yield close_all(producers + followers)
        yield api.close()
        return len(refused)

    return go()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--idle", type=int, default=8000, help="idle producers (8000)")
    p.add_argument("--idle-followers", type=int, default=1000, help="idle followers (1000)")
    p.add_argument("--active", type=int, default=1000,
                   help="active connections, half producers, half followers (1000)")
    p.add_argument("--logs", type=int, default=100, help="logs the active ones use (100)")
    p.add_argument("--rate", type=float, default=1000.0,
                   help="records/s over all active producers (1000)")
    p.add_argument("--size", type=int, default=100, help="bytes per record (100)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per active run (10)")
    p.add_argument("--repeat", type=int, default=3,
                   help="active runs alone and with the idle connections (3 each)")
    p.add_argument("--data", help="directory for the store (default: a temporary one)")
    p.add_argument("--go-server", metavar="PATH",
                   help="the same run against the reference styx-server (built outside "
                        "this repository) instead of ours: run it after ours, one "
                        "server at a time, as a user compares them")
    p.add_argument("--hold-idle", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = sys.stdout
    before, now = raise_open_files_limit()
    from twisted.internet import reactor
    # the clients' own full garbage collections would show as latency
    tune_for_server(reactor)
    if args.hold_idle:
        reactor.callWhenRunning(hold_idle, reactor, args.hold_idle, args)
        reactor.run()
        return 0
    print(f"this client's open files limit: {now} (was {before}); the idle connections "
          "are held by another process", file=out)
    directory = args.data or tempfile.mkdtemp(prefix="connections-bench-")
    if args.go_server:
        port = gorefs.free_port()
        server = gorefs.go_styx_server(args.go_server, port, os.path.join(directory, "go"))
        print(f"  server: the Go reference ({args.go_server})", file=out)
    else:
        server, port = start_ours(directory, None)
    try:
        refused = run_reactor(lambda reactor: run(reactor, port, server.pid, args, out))
    finally:
        gorefs.stop(server)
        if not args.go_server:
            with open(os.path.join(directory, "styx-server.log"), "rb") as f:
                for line in f.read().decode("utf-8", "replace").splitlines():
                    if "open files limit" in line or "accelerator" in line:
                        print("  server:", line.split(" ", 2)[-1], file=out)
        if not args.data:
            shutil.rmtree(directory, ignore_errors=True)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
