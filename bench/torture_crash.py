"""
Crash consistency (kill -9) trials, many per protocol, with a table.

    python bench/torture_crash.py                      # 100 trials per protocol
    python bench/torture_crash.py --trials 20 --only styx,pravega --seed 5000

Each trial starts the server as a real ``twist`` process on a fresh data
directory, drives it at full speed with our client, SIGKILLs it at a
random moment (drawn from the trial's seed), restarts it and reads
everything back (see test/torture_crash.py).  A failing trial prints its
seed and keeps its data directory; replay it with ``--seed SEED --trials 1``.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet import defer, task  # noqa: E402

from test.support.torture_harness import ALL_TARGETS, run_trial  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=100, help="trials per protocol (100)")
    p.add_argument("--only", default="", help="comma-separated protocols (default: all)")
    p.add_argument("--seed", type=int, default=1, help="first seed (1)")
    p.add_argument("--traffic", type=float, nargs=2, default=(0.3, 1.5),
                   metavar=("MIN", "MAX"), help="seconds of traffic before the kill")
    p.add_argument("--signal", default="KILL", choices=["KILL", "TERM"],
                   help="KILL (crash, default) or TERM (graceful shutdown under load)")
    p.add_argument("--workdir", default=None, help="where data directories go")
    return p.parse_args(argv)


@defer.inlineCallbacks
def main(reactor, argv):
    args = parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    workdir = args.workdir or tempfile.mkdtemp(prefix="torture-crash-")
    rows = []
    failed = False
    for target in ALL_TARGETS:
        if only and target.name not in only:
            continue
        why = target.available()
        if why:
            print(f"{target.name}: not available ({why})", flush=True)
            continue
        acked = lost = dups = corrupt = 0
        recovery = []
        bad = []
        for seed in range(args.seed, args.seed + args.trials):
            try:
                r = yield run_trial(reactor, target, seed, workdir, tuple(args.traffic),
                                    stop_signal=args.signal)
            except Exception as e:   # noqa: BLE001 - e.g. the restarted server refuses reads
                print(f"  FAILED {target.name} seed={seed}: {e!r}", flush=True)
                bad.append(seed)
                continue
            problems = r.check(target.duplicates_forbidden, target.in_order)
            acked += len(r.acked)
            lost += len(r.lost)
            dups += len(r.duplicates)
            corrupt += r.corrupt
            if r.recovery_seconds is not None:
                recovery.append(r.recovery_seconds)
            if problems:
                bad.append(seed)
                print(f"  FAILED {r.describe()}: {problems}", flush=True)
            else:
                shutil.rmtree(os.path.join(workdir, f"{target.name}-{seed}"), True)
            print(f"\r{target.name}: {seed - args.seed + 1}/{args.trials} trials", end="",
                  file=sys.stderr, flush=True)
        print(file=sys.stderr)
        rows.append((target.name, args.trials, acked, lost,
                     dups if target.duplicates_forbidden else f"{dups} (allowed)", corrupt,
                     statistics.median(recovery) if recovery else float("nan"),
                     max(recovery) if recovery else float("nan"), bad))
        failed = failed or bool(bad)
    head = ("protocol", "trials", "acked", "lost", "duplicates", "corrupt",
            "recovery median s", "recovery max s", "failed seeds")
    print("  ".join(f"{h:>12}" for h in head))
    for row in rows:
        name, trials, acked, lost, dups, corrupt, med, mx, bad = row
        print("  ".join(f"{v:>12}" for v in (name, trials, acked, lost, str(dups), corrupt,
                                             f"{med:.2f}", f"{mx:.2f}",
                                             ",".join(map(str, bad)) or "-")))
    if failed:
        raise RuntimeError(f"some trials failed; data kept in {workdir}")
    shutil.rmtree(workdir, True)


if __name__ == "__main__":
    task.react(main, [sys.argv[1:]])
