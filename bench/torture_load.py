"""
Load: 1,000 concurrent connections to each server (a real ``twist`` child
process), each doing a few acknowledged rounds at a modest rate, then held
idle; prints acks and the server's RSS per idle connection.

    python bench/torture_load.py                     # 1000 connections, every server
    python bench/torture_load.py --connections 2000 --only styx,pravega

The soft RLIMIT_NOFILE is raised to the hard limit first (the client side
of every connection lives in this process: 1,000 connections need about
1,000 descriptors here and as many in the server).
"""

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet import defer, task  # noqa: E402

from test.support.torture_harness import raise_nofile_limit  # noqa: E402
from test.support.torture_harness import ALL_LOAD, run_load  # noqa: E402


@defer.inlineCallbacks
def main(reactor, argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="")
    args = p.parse_args(argv)
    limit = raise_nofile_limit()
    if limit < 2 * args.connections + 100:
        print(f"warning: RLIMIT_NOFILE is {limit}; {args.connections} connections may fail")
    only = set(filter(None, args.only.split(",")))
    workdir = tempfile.mkdtemp(prefix="torture-load-")
    rows = []
    try:
        for target in ALL_LOAD:
            if only and target.name not in only:
                continue
            r = yield run_load(reactor, target, workdir, args.connections, args.rounds)
            rows.append(r)
            print(r.describe(), flush=True)
    finally:
        shutil.rmtree(workdir, True)
    head = ("server", "connections", "acks", "RSS before MiB", "RSS idle MiB", "peak MiB",
            "KiB/conn", "seconds")
    print("  ".join(f"{h:>14}" for h in head))
    for r in rows:
        print("  ".join(f"{v:>14}" for v in (
            r.target, r.connections, f"{r.acked}/{r.expected}", f"{r.rss_before_kib / 1024:.1f}",
            f"{r.rss_idle_kib / 1024:.1f}", f"{r.rss_peak_kib / 1024:.1f}",
            f"{r.kib_per_connection:.1f}", f"{r.seconds:.1f}")))
    if any(r.acked != r.expected for r in rows):
        raise RuntimeError("acks missing")


if __name__ == "__main__":
    task.react(main, [sys.argv[1:]])
