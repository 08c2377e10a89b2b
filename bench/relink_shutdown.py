"""
Relink under a graceful stop (SIGTERM) with load: does the log store hold
exactly what the server acknowledged CONSUMED?

    PYTHONPATH=. python bench/relink_shutdown.py [--trials N] [--seed S]

Each trial is the crash harness's relink trial (test/support/torture_harness.py,
``bench/torture_crash.py --signal TERM --only relink``): ``twistd
relink-server`` on a fresh data directory, a Connector streaming 500-message
batches to the ``log`` endpoint, SIGTERM after 0.3-1.5 s, restart, read
``relink-1`` back.  The harness counts a message acknowledged only when its
whole batch's Deferred fired; a stop can split a batch (the server
acknowledges per message), so this script also keeps the connector's
channel and compares the store with the link's own CONSUMED count:

- ``unacked durable``: stored but never acknowledged consumed (a connector
  would resend them on a new link: duplicates).  Must be 0.
- ``acked lost``: acknowledged consumed but not stored.  Must be 0.
- ``split batch``: stored and acknowledged, but in a batch whose Deferred
  never fired (the harness's ``acked`` leaves them out; not a bug).
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

from test.support.torture_harness import RelinkTarget, run_trial  # noqa: E402


class CountingRelinkTarget(RelinkTarget):
    """The harness's relink target, keeping the connector's channel to read its acks."""

    def drive(self, reactor, server, result, rng, stopping):
        d = defer.maybeDeferred(super().drive, reactor, server, result, rng, stopping)

        def keep(outcome):
            connector = getattr(result, "connector", None)
            if connector is not None:
                result.channel = connector.link.out_channels.get(self.channel)
            return outcome
        return d.addBoth(keep)


@defer.inlineCallbacks
def main(reactor, argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    target = CountingRelinkTarget()
    workdir = tempfile.mkdtemp(prefix="relink-shutdown-")
    head = ("seed", "sent", "stored", "acked", "unacked durable", "acked lost",
            "split batch", "problems")
    print("  ".join(f"{h:>15}" for h in head), flush=True)
    failed = False
    for seed in range(args.seed, args.seed + args.trials):
        r = yield run_trial(reactor, target, seed, workdir, stop_signal="TERM")
        channel = getattr(r, "channel", None)
        acked = set(range(channel.consumed)) if channel is not None else set()
        stored = {s for s in r.read_back if s is not None}
        unacked_durable = stored - acked
        acked_lost = acked - stored
        problems = r.check(target.duplicates_forbidden, target.in_order)
        if channel is None:
            problems.append("the connector's channel was not kept")
        bad = bool(unacked_durable or acked_lost or problems)
        failed = failed or bad
        row = (seed, r.sent, len(stored), len(acked), len(unacked_durable), len(acked_lost),
               len(acked - r.acked), "; ".join(problems) or "-")
        print("  ".join(f"{v!s:>15}" for v in row), flush=True)
        if not bad:
            shutil.rmtree(os.path.join(workdir, f"{target.name}-{seed}"), True)
    if failed:
        raise SystemExit(f"some trials failed; data kept in {workdir}")
    shutil.rmtree(workdir, True)


if __name__ == "__main__":
    task.react(main, [sys.argv[1:]])
