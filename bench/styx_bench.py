"""
styx/0 benchmark, server and client in separate processes, on the file store.

    python bench/styx_bench.py                      # small default sizes
    python bench/styx_bench.py --runs 100x10000000  # the reference's 100 B run
    python bench/styx_bench.py --profile server     # cProfile the server

For each SIZExCOUNT it measures, like C{styx benchmark}:
  - produce: COUNT records of SIZE bytes over styx/0, timed until the final
    ack (every record fsynced);
  - consume: the same records read back over styx/0.
Next to them, in the same run, two baselines moving the same bytes:
  - socket: a plain blocking socket copy of the styx/0 wire bytes between
    two processes (what the network path costs without any protocol);
  - file: writing the records' payload bytes to a file and one fsync.
The ratio columns are styx/0 throughput / socket-copy throughput.

Against the Go reference (styx 0.1.4, built outside this repository), give
its two programs: the reference's own unchanged C{styx benchmark} then runs
against the Go server and against C{twistd styx-server} (file store, acks
after fsync), alternately, C{--rounds} times, and the medians are printed
side by side as ratios::

    python bench/styx_bench.py --go-styx /path/to/styx --go-server /path/to/styx-server

With C{--plain}, the reference's C{styx benchmark} is run as a user runs
it instead: one server at a time, each on a fresh data directory, stopped
after its run, no warm-up, the servers alternated round by round, and the
best of C{--rounds} runs of each printed (the figures a user reads off the
tool); C{--baseline CHECKOUT} gives another checkout's server a turn too
(before and after a change, in one run).  Its produce phases last about 0.1 s each (100 MB, timed to the last
write, before the acks): medians over servers running side by side (the
default) and a user's best-of runs can differ by more than the gap they
measure on a shared machine (doc/performance.rst).

With C{--long-read GB}, instead: GB of 1000-byte records written to each
server and read back whole by the reference CLI (C{styx logs read
--binary}), alternately, timed with each server's CPU time: a consume long
enough to measure steadily.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_RUNS = "10x500000,100x500000,1000x100000"

SERVER = r"""
import sys
sys.path.insert(0, {root!r})
if {pure!r}:
    sys.modules["streamproto._speedups"] = None   # the pure-Python paths
from twisted.internet import endpoints, reactor
from streamproto.log import open_store
from streamproto.styx.resource import make_site
store = open_store({data!r})
endpoint = endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1")
endpoint.listen(make_site(store)).addCallback(
    lambda port: print(port.getHost().port, flush=True))
if {profile!r}:
    import cProfile, pstats, signal
    signal.signal(signal.SIGTERM, lambda *a: reactor.callFromThread(reactor.stop))
    profile = cProfile.Profile()
    profile.runcall(reactor.run)
    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)
else:
    reactor.run()
"""

SINK = r"""
import socket, sys
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
buf = bytearray(1 << 20)
total = 0
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    total += n
conn.sendall(str(total).encode())
conn.close()
"""


def spawn(code):
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=None, cwd=ROOT)
    port = int(proc.stdout.readline())
    return proc, port


def socket_copy(size, count):
    """Seconds to copy the wire bytes of COUNT records to another process."""
    proc, port = spawn(SINK)
    try:
        chunk_records = max(1, (1 << 20) // (size + 6))
        chunk = (b"\x00\x01" + (size).to_bytes(4, "big") + bytes(size)) * chunk_records
        total = (size + 6) * count
        sock = socket.create_connection(("127.0.0.1", port))
        start = time.perf_counter()
        sent = 0
        while sent < total:
            piece = chunk if total - sent >= len(chunk) else chunk[:total - sent]
            sock.sendall(piece)
            sent += len(piece)
        sock.shutdown(socket.SHUT_WR)
        received = int(sock.recv(64))
        elapsed = time.perf_counter() - start
        sock.close()
        assert received == total, (received, total)
        return elapsed
    finally:
        proc.wait()


def file_write(directory, size, count):
    """Seconds to write COUNT records' payload bytes and fsync once."""
    path = os.path.join(directory, "baseline.bin")
    chunk = bytes(min(size * count, 1 << 20))
    total = size * count
    start = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < total:
            piece = chunk if total - written >= len(chunk) else chunk[:total - written]
            f.write(piece)
            written += len(piece)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    os.unlink(path)
    return elapsed


def styx_runs(port, runs, mixed=False, consume_port=None):
    """
    Produce then consume each run in this process (consume through
    C{consume_port}, another front-end, when given); return the timings.
    """
    from twisted.internet import defer, reactor

    from streamproto.styx import benchmark
    from streamproto.styx.api_client import StyxClient

    results = {}

    async def go(reactor):
        url = f"http://127.0.0.1:{port}"
        consume_url = f"http://127.0.0.1:{consume_port or port}"
        client = StyxClient(url, reactor)
        try:
            for size, count in runs:
                await benchmark._fresh_log(client, "bench")
                produce = await benchmark.produce(reactor, url, "bench", size, count,
                                                  mixed=mixed)
                records, nbytes, consume = await benchmark.consume(reactor, consume_url,
                                                                   "bench", count)
                if records != count:
                    raise RuntimeError(f"consumed {records} records of {count}")
                results[size, count] = (produce, consume)
                await client.delete_log("bench")
        finally:
            await client.close()

    outcome = []
    d = defer.ensureDeferred(go(reactor))
    d.addBoth(outcome.append)
    d.addBoth(lambda _: reactor.stop())
    reactor.run()
    if outcome and hasattr(outcome[0], "raiseException"):
        outcome[0].raiseException()
    return results


def compare_with_go(styx_cli, go_server, rounds, reference_only=False):
    from bench.gorefs import compare_styx
    table = compare_styx(styx_cli, go_server, rounds)
    print(f"styx benchmark (the reference's, unchanged), {rounds} alternated runs per "
          "server, medians; ours: twistd styx-server, file store, acks after fsync")
    print(f"{'phase':<8} {'size':>5} | {'Go rec/s':>12} | {'ours rec/s':>12} | {'ours/Go':>7}")
    for phase in ("produce", "consume"):
        for size in (10, 100, 1000):
            if (phase, size) in table:
                g, o, gs, os_ = table[phase, size]
                failed = ""
                if len(gs) < rounds or len(os_) < rounds:
                    failed = (f"  (runs that failed this phase: Go {rounds - len(gs)}, "
                              f"ours {rounds - len(os_)})")
                print(f"{phase:<8} {size:>5} | {g:>12,.0f} | {o:>12,.0f} | {o / g:>7.2f}"
                      + failed)
    if reference_only:
        return 0
    from bench.gorefs import compare_raw
    runs = [(10, 10_000_000), (100, 3_000_000), (1000, 1_000_000)]
    table = compare_raw(go_server, runs, rounds)
    print()
    print("the same bytes from one Python socket client (bench/gorefs.py) to each server, "
          f"{rounds} alternated runs, medians; produce timed to the last ack (styx/0) or "
          "the response (HTTP): every record durable")
    print(f"{'path':<7} {'phase':<8} {'size':>5} | {'Go rec/s':>12} | {'ours rec/s':>12} | "
          f"{'ours/Go':>7}")
    for (path, phase, size), (g, o) in table.items():
        print(f"{path:<7} {phase:<8} {size:>5} | {g:>12,.0f} | {o:>12,.0f} | {o / g:>7.2f}")
    return 0


def plain_with_go(styx_cli, go_server, rounds, baseline=None):
    import statistics
    from bench.gorefs import plain_styx
    runs = plain_styx(styx_cli, go_server, rounds, baseline)
    print(f"styx benchmark (the reference's, unchanged) as a user runs it: one server at a "
          f"time, fresh data directory, {rounds} alternated runs per server, best of each; "
          "ours: twistd styx-server, file store, acks after fsync"
          + (f"; baseline: the checkout at {baseline}" if baseline else ""))
    others = [side for side in runs if side != "go"]
    print(f"{'phase':<8} {'size':>5} | {'Go rec/s':>12} | "
          + " | ".join(f"{side + '/Go best; median':>22}" for side in others)
          + " | runs, rec/s (failed runs left out)")
    for phase in ("produce", "consume"):
        for size in (10, 100, 1000):
            got = {side: [r[phase, size] for r in side_runs if (phase, size) in r]
                   for side, side_runs in runs.items()}
            if not all(got.values()):
                continue
            go = got["go"]
            ratios = " | ".join(
                f"{max(got[s]) / max(go):>10.2f}; {statistics.median(got[s]) / statistics.median(go):>9.2f}"
                for s in others)
            listed = "; ".join(f"{side} " + " ".join(f"{x:,.0f}" for x in values)
                               for side, values in got.items())
            print(f"{phase:<8} {size:>5} | {max(go):>12,.0f} | {ratios} | {listed}")
    return 0


def long_read(styx_cli, go_server, gigabytes, rounds):
    from bench.gorefs import compare_long_read
    import statistics
    runs = compare_long_read(styx_cli, go_server, gigabytes, rounds)
    print(f"styx logs read --binary of {gigabytes:g} GB of 1000 B records from each server, "
          f"{rounds} alternated runs (kept: Go {len(runs['go'])}, ours {len(runs['ours'])}), "
          "medians; ours: twistd styx-server, file store")
    print(f"{'server':<6} | {'seconds':>8} | {'MB/s':>7} | {'server CPU s/GB':>15}")
    med = {}
    for side, values in runs.items():
        if not values:
            print(f"{side:<6} | every run failed")
            continue
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values) / gigabytes
        med[side] = (wall, cpu)
        print(f"{side:<6} | {wall:>8.3f} | {gigabytes * 1000 / wall:>7,.0f} | {cpu:>15.3f}")
    if len(med) == 2:
        print(f"ours/Go: throughput {med['go'][0] / med['ours'][0]:.2f}, "
              f"server CPU per GB {med['ours'][1] / med['go'][1]:.2f}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"SIZExCOUNT,... ({DEFAULT_RUNS})")
    parser.add_argument("--data", help="directory for the store (default: a temporary one)")
    parser.add_argument("--profile", choices=("server",), help="cProfile the server process")
    parser.add_argument("--pure", action="store_true",
                        help="without the C accelerator (streamproto._speedups)")
    parser.add_argument("--mixed", action="store_true",
                        help="records of varied sizes (SIZE/2 to 3 SIZE/2, average SIZE)")
    parser.add_argument("--go-styx", metavar="PATH",
                        help="the reference's styx CLI: compare with the Go server")
    parser.add_argument("--go-server", metavar="PATH", help="the reference's styx-server")
    parser.add_argument("--reference-only", action="store_true",
                        help="with --go-styx: only the reference's own benchmark")
    parser.add_argument("--plain", action="store_true",
                        help="with --go-styx: the reference's benchmark as a user runs it "
                             "(one server at a time, fresh data, best of --rounds)")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="with --plain: another checkout of streamproto (C accelerator "
                             "built) whose server takes a turn too, for before/after")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternated runs per server with --go-styx (3)")
    parser.add_argument("--long-read", type=float, metavar="GB",
                        help="with --go-styx: instead, GB of 1000 B records read back whole "
                             "by the reference CLI from each server, with each server's CPU")
    args = parser.parse_args(argv)
    from bench.benchenv import measured
    measured(pure=args.pure)    # which streamproto and path (bench/benchenv.py)
    if args.go_styx or args.go_server:
        if not (args.go_styx and args.go_server):
            parser.error("--go-styx and --go-server go together")
        if args.baseline and not args.plain:
            parser.error("--baseline goes with --plain")
        if args.plain:
            return plain_with_go(args.go_styx, args.go_server, args.rounds, args.baseline)
        if args.long_read is not None:
            if args.long_read <= 0:
                parser.error("--long-read takes a positive number of GB")
            return long_read(args.go_styx, args.go_server, args.long_read, args.rounds)
        return compare_with_go(args.go_styx, args.go_server, args.rounds,
                               args.reference_only)
    if args.long_read is not None or args.plain:
        parser.error("--long-read and --plain need --go-styx and --go-server")
    runs = []
    for item in args.runs.split(","):
        size, _, count = item.partition("x")
        runs.append((int(size), int(count)))

    directory = args.data or tempfile.mkdtemp(prefix="styx-bench-")
    if args.pure:
        sys.modules["streamproto._speedups"] = None
    server, port = spawn(SERVER.format(root=ROOT, data=os.path.join(directory, "store"),
                                       profile=bool(args.profile), pure=args.pure))
    try:
        # the client in its own process too (a fresh reactor per run)
        child = os.fork()
        if child == 0:
            status = 1
            try:
                results = styx_runs(port, runs, args.mixed)
                with open(os.path.join(directory, "results"), "w") as f:
                    f.write(repr(results))
                status = 0
            finally:
                os._exit(status)
        os.waitpid(child, 0)
        with open(os.path.join(directory, "results")) as f:
            results = eval(f.read())  # noqa: S307 - our own repr of a dict of tuples
    finally:
        server.terminate()
        server.wait()

    print(f"styx/0 benchmark (file store in {directory}; 2 shared cores: figures are noisy)"
          + (" -- mixed record sizes" if args.mixed else "")
          + (" -- pure Python" if args.pure else ""))
    header = (f"{'size':>6} {'records':>9} | {'produce rec/s':>14} {'MB/s':>7} | "
              f"{'consume rec/s':>14} {'MB/s':>7} | {'socket rec/s':>13} | "
              f"{'file+fsync rec/s':>16} | {'prod/sock':>9} {'cons/sock':>9}")
    print(header)
    print("-" * len(header))
    for size, count in runs:
        produce, consume = results[size, count]
        sock = socket_copy(size, count)
        disk = file_write(directory, size, count)
        mb = size * count / (1 << 20)
        print(f"{size:>6} {count:>9} | {count / produce:>14,.0f} {mb / produce:>7.1f} | "
              f"{count / consume:>14,.0f} {mb / consume:>7.1f} | {count / sock:>13,.0f} | "
              f"{count / disk:>16,.0f} | {sock / produce:>9.2f} {sock / consume:>9.2f}")
    if not args.data:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
