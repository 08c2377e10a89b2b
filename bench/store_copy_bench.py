"""
C{streamproto store copy}: how fast a store moves, and what a cut-over costs.

    python bench/store_copy_bench.py                       # 100 B and 1000 B records
    python bench/store_copy_bench.py --runs 100x300000 --nodes 1

One run starts a real nats-server cluster on 127.0.0.1 (C{--nodes}, sync
always, as the tests' C{test/natsutil.py}) and, for each SIZExCOUNT:

  - produce / consume: the baseline, the store's own rates: COUNT records
    appended to one log through L{ILog.append} (512 KiB appends, 32 in
    flight: what the copy does) and read back whole, in a process of
    their own, on the file store and on JetStream;
  - copy file->nats and nats->file: the command as users run it (a new
    process, connecting, verifying every log at the end), wall time;
    C{--no-verify} figures beside them, and what a copy of nothing
    costs (the process starting, connecting, writing its journal).

Then the cut-over, with a writer running: a writer appends 100-byte
records (100 an append, each awaited) to a data directory; the copy
follows it to JetStream; the writer is stopped (the old front-end going
down), the copy told to stop (SIGINT) and, once it says it caught up, a
writer starts on JetStream (the new front-end).  Unavailability: from the
old writer's last acknowledgement to the new one's first.  The new
writer's first position must be the old one's end.

Figures are noisy (cluster, copy and client share the machine's cores):
compare the ratios copy / baseline of one run.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_RUNS = "100x2000000,1000x300000"

STORE = r"""
import sys, time
sys.path.insert(0, {root!r})
from twisted.internet import defer, reactor
if {url!r}.startswith("nats://"):
    from streamproto.core.stores import check_store_options, open_log_store
    options = {{"store": {url!r}, "data": None}}
    check_store_options(options)
    store = open_log_store(options, reactor)
else:
    from streamproto.log import open_store
    store = open_store({url!r})
"""

BASELINE = STORE + r"""
from streamproto.log.batch import RecordBatch, lengths_array
@defer.inlineCallbacks
def go():
    if hasattr(store, "start"):
        yield store.start()
    log = yield store.get_or_create("events")
    size, count = {size!r}, {count!r}
    per = max(1, (512 * 1024) // size)
    batch = RecordBatch(0, lengths_array([size] * per), bytes(size * per))
    started = time.perf_counter()
    if {mode!r} == "produce":
        inflight, done = [], 0
        while done < count:
            n = min(per, count - done)
            inflight.append(log.append(batch if n == per else batch.slice(0, n)))
            done += n
            if len(inflight) >= 32:
                yield inflight.pop(0)
        for d in inflight:
            yield d
    else:
        position = log.start_position
        while position < log.end_position:
            got = yield log.read(position, max_bytes=1 << 20)
            position = got.next_position
    print(time.perf_counter() - started, flush=True)
    yield store.close()
def run():
    go().addErrback(lambda f: print(f.getTraceback(), file=sys.stderr)).addBoth(
        lambda _: reactor.stop())
reactor.callWhenRunning(run)
reactor.run()
"""

WRITER = STORE + r"""
import signal
stopping = []
@defer.inlineCallbacks
def go():
    if hasattr(store, "start"):
        yield store.start()
    log = yield store.get_or_create("events")
    records = [b"w" * 100] * 100
    last = None
    while not stopping:
        try:
            r = yield log.append(records)
        except Exception as e:
            print("error", e, file=sys.stderr, flush=True)
            continue
        if last is None:
            print("first", time.time(), r.first_position, flush=True)
        last = (time.time(), r.end_position)
    print("last", last[0], last[1], flush=True)
    yield store.close()
def run():
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
    go().addErrback(lambda f: print(f.getTraceback(), file=sys.stderr)).addBoth(
        lambda _: reactor.stop())
reactor.callWhenRunning(run)
reactor.run()
"""


def python(code, **kwargs):
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            **kwargs)


def baseline(url, mode, size, count):
    p = python(BASELINE.format(root=ROOT, url=url, mode=mode, size=size, count=count))
    out, _ = p.communicate()
    if p.returncode:
        raise SystemExit(f"baseline {mode} on {url} failed")
    return float(out.split()[-1])


def copy(src, dst, *more):
    env = dict(os.environ, PYTHONPATH=ROOT)
    started = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "streamproto", "store", "copy", src, dst, "-q",
                        *more], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"copy {src} -> {dst} failed: {p.stderr.strip()}")
    return time.perf_counter() - started


def row(label, size, count, seconds, base=None):
    rate = count / seconds
    mb = size * count / seconds / 1e6
    ratio = f"  {seconds and base / seconds:5.2f}x baseline" if base else ""
    print(f"  {label:<28} {rate:>12,.0f} rec/s {mb:>8.1f} MB/s {seconds:>7.2f} s{ratio}",
          flush=True)


def speeds(directory, cluster_url, size, count, tag):
    print(f"{size} B x {count}:")
    data = os.path.join(directory, f"src-{tag}")
    nats_src = f"{cluster_url}?prefix=b{tag}"
    produce_file = baseline(data, "produce", size, count)
    consume_file = baseline(data, "consume", size, count)
    produce_nats = baseline(nats_src, "produce", size, count)
    consume_nats = baseline(nats_src, "consume", size, count)
    row("produce file (baseline)", size, count, produce_file)
    row("consume file (baseline)", size, count, consume_file)
    row("produce nats (baseline)", size, count, produce_nats)
    row("consume nats (baseline)", size, count, consume_nats)
    fixed = copy(data, f"{cluster_url}?prefix=e{tag}", "--log", "none-such")
    print(f"  {'copy of nothing (start-up)':<28} {fixed:>37.2f} s", flush=True)
    slowest = max(consume_file, produce_nats)
    row("copy file->nats", size, count, copy(data, f"{cluster_url}?prefix=c{tag}"), slowest)
    row("copy file->nats --no-verify", size, count,
        copy(data, f"{cluster_url}?prefix=d{tag}", "--no-verify"), slowest)
    slowest = max(consume_nats, produce_file)
    row("copy nats->file", size, count, copy(nats_src, os.path.join(directory, f"c{tag}")),
        slowest)
    row("copy nats->file --no-verify", size, count,
        copy(nats_src, os.path.join(directory, f"d{tag}"), "--no-verify"), slowest)


def cutover(directory, cluster_url, mirror_seconds):
    data = os.path.join(directory, "cutover")
    dst = f"{cluster_url}?prefix=cutover"
    old = python(WRITER.format(root=ROOT, url=data))
    first = old.stdout.readline().split()
    env = dict(os.environ, PYTHONPATH=ROOT)
    mirror = subprocess.Popen([sys.executable, "-m", "streamproto", "store", "copy", data, dst,
                               "--follow"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    time.sleep(mirror_seconds)
    old.send_signal(signal.SIGTERM)            # the old front-end goes down
    last = old.stdout.readline().split()
    old.wait()
    stop_sent = time.time()
    mirror.send_signal(signal.SIGINT)          # the last catch-up
    caught_up = None
    for line in mirror.stderr:
        if "caught up" in line:
            caught_up = time.time()
            break
    new = python(WRITER.format(root=ROOT, url=dst))  # the new front-end
    first_new = new.stdout.readline().split()
    out, err = mirror.communicate()
    verified = time.time()
    new.send_signal(signal.SIGTERM)
    new.communicate()
    if mirror.returncode:
        raise SystemExit(f"the follow copy failed: {err.strip()}")
    t_last, end = float(last[1]), int(last[2])
    t_first, position = float(first_new[1]), int(first_new[2])
    print(f"cut-over with a writer running ({end:,} records written to the old store, "
          f"{int(first[2])} first):")
    print(f"  old writer's last ack -> copy caught up   {caught_up - t_last:7.2f} s")
    print(f"  old writer's last ack -> new writer's first ack (unavailability) "
          f"{t_first - t_last:7.2f} s")
    print(f"  ... of which the new writer's start     {t_first - caught_up:7.2f} s")
    print(f"  SIGINT -> verification done             {verified - stop_sent:7.2f} s")
    print(f"  new writer's first position {position:,} "
          f"{'= the old end' if position == end else f'!= the old end {end:,}'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--runs", default=DEFAULT_RUNS, help="SIZExCOUNT,... (default %(default)s)")
    p.add_argument("--nodes", type=int, default=3, help="nats-server nodes (default 3)")
    p.add_argument("--mirror", type=float, default=5.0,
                   help="seconds the follow copy mirrors the writer before the cut-over")
    args = p.parse_args(argv)
    from test.natsutil import NatsCluster
    directory = tempfile.mkdtemp(prefix="streamproto-copy-bench-")
    cluster = NatsCluster(size=args.nodes).start()
    try:
        print(f"nats-server x{args.nodes} (sync always, R{min(args.nodes, 3)}), "
              f"{os.cpu_count()} cores")
        for i, run in enumerate(args.runs.split(",")):
            size, count = (int(x) for x in run.split("x"))
            speeds(directory, cluster.url, size, count, str(i))
        cutover(directory, cluster.url, args.mirror)
    finally:
        cluster.stop()
        shutil.rmtree(directory, True)


if __name__ == "__main__":
    main()
