"""
Log store throughput next to plain file I/O of the same bytes, in the same run.

    python bench/logstore_bench.py [--records 2000000] [--batch 1000] [--sizes 100,1000]

Append: the store appends batches of --batch records and fsyncs each append
before the next (its Deferred fires only then), on one core (the blocking
calls run inline).  The baseline writes the same payload bytes with one
os.write per batch and fsyncs the same number of times.  "cpu" rows replace
fsync by a no-op in both, to show the store's own overhead.

Read: read every record back through ILog.read (1 MiB per call, batches not
unpacked into Python objects) next to os.pread of the payload file in 1 MiB
chunks.  A third row also materialises every record as bytes (records()).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet.task import Clock  # noqa: E402

from streamproto.log.config import LogConfig  # noqa: E402
from streamproto.log.file import synchronous  # noqa: E402
from streamproto.log.filestore import FileLogStore  # noqa: E402
from streamproto.log.segments import FileIO  # noqa: E402


class NoSyncIO(FileIO):
    def fsync(self, fd):
        pass


def result(d):
    out = []
    d.addBoth(out.append)
    if hasattr(out[0], "raiseException"):
        out[0].raiseException()
    return out[0]


def bench_append(path, records, batch, io):
    store = FileLogStore(path, reactor=Clock(), run_blocking=synchronous, io=io,
                         retention_interval=None)
    log = result(store.create("bench", LogConfig()))
    t = time.perf_counter()
    for i in range(0, len(records), batch):
        result(log.append(records[i:i + batch]))
    elapsed = time.perf_counter() - t
    result(store.close())
    return elapsed


def bench_pipelined(path, records, batch, in_flight):
    """
    The real thing: the reactor, fsync in a thread, C{in_flight} appends
    outstanding, so new writes overlap the running fsync (group commit).
    """
    from twisted.internet import defer, reactor

    store = FileLogStore(path, reactor=reactor, retention_interval=None)
    log = result(store.create("bench", LogConfig()))
    chunks = [records[i:i + batch] for i in range(0, len(records), batch)]
    timing = {}

    @defer.inlineCallbacks
    def run():
        it = iter(chunks)
        timing["t"] = time.perf_counter()

        @defer.inlineCallbacks
        def worker():
            for chunk in it:
                yield log.append(chunk)
        yield defer.gatherResults([worker() for _ in range(in_flight)])
        timing["elapsed"] = time.perf_counter() - timing["t"]
        yield store.close()

    d = run()
    d.addBoth(lambda r: reactor.stop())
    reactor.run()
    return timing["elapsed"]


def bench_plain_write(path, records, batch, do_fsync):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    t = time.perf_counter()
    for i in range(0, len(records), batch):
        os.write(fd, b"".join(records[i:i + batch]))
        if do_fsync:
            os.fsync(fd)
    elapsed = time.perf_counter() - t
    os.close(fd)
    return elapsed


def bench_read(path, materialise):
    store = FileLogStore(path, reactor=Clock(), run_blocking=synchronous,
                         retention_interval=None)
    log = result(store.get("bench"))
    n = 0
    position = log.start_position
    t = time.perf_counter()
    while position < log.end_position:
        batch = result(log.read(position, -1, 1 << 20))
        if materialise:
            n += len(batch.records())
        else:
            n += len(batch)
        position = batch.next_position
    elapsed = time.perf_counter() - t
    result(store.close())
    return elapsed, n


def bench_plain_read(path):
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    t = time.perf_counter()
    pos = 0
    while pos < size:
        pos += len(os.pread(fd, 1 << 20, pos))
    elapsed = time.perf_counter() - t
    os.close(fd)
    return elapsed


def row(label, n, store_s, base_s, nbytes):
    store_rate, base_rate = n / store_s, n / base_s
    print(f"{label:<28} store {store_rate:>13,.0f} rec/s {nbytes / store_s / 1e6:>8.1f} MB/s"
          f"   plain {base_rate:>13,.0f} rec/s   ratio {store_rate / base_rate:5.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--sizes", default="100,1000")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--in-flight", type=int, default=8,
                   help="appends outstanding in the pipelined (reactor) run")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="logbench-", dir=args.dir)
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            n = args.records if size <= 100 else max(args.records // 10, args.batch)
            records = [os.urandom(size) for _ in range(min(n, 10000))]
            records = (records * (n // len(records) + 1))[:n]
            nbytes = n * size
            print(f"--- {n:,} records of {size} B, {args.batch} per append")
            for label, io, do_fsync in (("append+fsync", None, True),
                                        ("append cpu (no fsync)", NoSyncIO(), False)):
                d1, d2 = tempfile.mkdtemp(dir=root), tempfile.mkdtemp(dir=root)
                s = bench_append(d1, records, args.batch, io)
                b = bench_plain_write(os.path.join(d2, "plain"), records, args.batch, do_fsync)
                row(label, n, s, b, nbytes)
                if io is None:
                    read_dir, plain_file = d1, os.path.join(d2, "plain")
            if size <= 100:
                pipelined = (root, records, args.batch, args.in_flight)
            for label, materialise in (("read (batches)", False), ("read + records()", True)):
                s, count = bench_read(read_dir, materialise)
                assert count == n, (count, n)
                b = bench_plain_read(plain_file)
                row(label, n, s, b, nbytes)
        # last: the reactor cannot be restarted
        root_, recs, batch, in_flight = pipelined
        d1, d2 = tempfile.mkdtemp(dir=root), tempfile.mkdtemp(dir=root)
        n = len(recs)
        print(f"--- pipelined: reactor + fsync thread, {in_flight} appends of {batch} in flight")
        s = bench_pipelined(d1, recs, batch, in_flight)
        b = bench_plain_write(os.path.join(d2, "plain"), recs, batch, True)
        row("append, group commit", n, s, b, n * len(recs[0]))
    finally:
        shutil.rmtree(root, True)


if __name__ == "__main__":
    main()
