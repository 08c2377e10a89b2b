"""
Many followers of one log: the server's CPU per appended batch, shared
reads next to the same followers each reading for itself, in the same run.

    python bench/fanout_bench.py [--followers 500] [--rounds 200] [--records 10]
                                 [--size 100] [--repeat 5]

One file-store log and N styx/0 followers (L{streamproto.styx.follow.LogFollower},
each delivering to a sink that touches every chunk's bytes, as a send
would) in one process, on a fake clock with the blocking calls inline:
each round appends one batch of --records records of --size bytes and
lets every follower read it.  "shared": the followers ask the same read
(as the servers' followers do: same position, same read size), which the
file store answers once.  "own": each follower asks with a read size of
its own (one byte more per follower), so that each reads and decodes for
itself, as every follower did before the store shared its last read.
The two alternate, --repeat times each; the table gives CPU microseconds
per round (process time, so other load on the machine matters less) and
the ratio.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet.task import Clock  # noqa: E402

from bench.logstore_bench import result  # noqa: E402
from streamproto.log.file import synchronous  # noqa: E402
from streamproto.log.filestore import FileLogStore  # noqa: E402
from streamproto.styx.follow import DEFAULT_READ_BYTES, LogFollower  # noqa: E402


def run(mode, followers, rounds, records, size):
    """CPU seconds per round for C{rounds} rounds with C{followers} followers."""
    path = tempfile.mkdtemp(prefix="fanout-")
    try:
        store = FileLogStore(path, reactor=Clock(), run_blocking=synchronous,
                             retention_interval=None, inline_reads=True)
        log = result(store.create("fanout"))
        seen = [0]

        def sink(batch):
            for _, data in batch.chunks():
                seen[0] += len(data)

        fs = []
        for i in range(followers):
            read_bytes = DEFAULT_READ_BYTES + (i if mode == "own" else 0)
            f = LogFollower(log, 0, follow=True, read_bytes=read_bytes, deliver=sink)
            f.start()
            fs.append(f)
        batch = [b"x" * size] * records
        start = time.process_time()
        for _ in range(rounds):
            result(log.append(batch))
        elapsed = time.process_time() - start
        expected = followers * rounds * records * size
        if seen[0] != expected:
            raise SystemExit(f"{mode}: the followers got {seen[0]} bytes, not {expected}")
        for f in fs:
            f.stop()
        result(store.close())
        return elapsed / rounds
    finally:
        shutil.rmtree(path, True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--records", type=int, default=10)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    times = {"shared": [], "own": []}
    for _ in range(args.repeat):
        for mode in ("own", "shared"):
            times[mode].append(run(mode, args.followers, args.rounds, args.records, args.size))
    own, shared = statistics.median(times["own"]), statistics.median(times["shared"])
    print(f"{args.followers} followers, {args.records} records of {args.size} B a round, "
          f"median of {args.repeat} alternated runs of {args.rounds} rounds")
    print(f"{'reads':<8} {'CPU us/round':>13} {'us/follower':>12}")
    for mode, t in (("own", own), ("shared", shared)):
        print(f"{mode:<8} {t * 1e6:>13.0f} {t * 1e6 / args.followers:>12.2f}")
    print(f"shared reads: {own / shared:.2f}x less CPU per round")


if __name__ == "__main__":
    main()
