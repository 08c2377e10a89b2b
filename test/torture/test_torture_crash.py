"""
Crash consistency: kill -9 each server (a real ``twist`` process) under
full-speed traffic from our client, restart it, read everything back.

A few seeded trials per protocol here; ``bench/torture_crash.py`` runs
many (``--trials 100``).  Set ``TORTURE_SEED`` to replay a failing seed.
"""

import os
import shutil
import tempfile

from twisted.internet import defer, reactor
from twisted.trial import unittest

from test.support.torture_harness import TARGETS, make_payload, parse_payload, run_trial

TRIALS = os.environ.get("TORTURE_TRIALS")
FIRST_SEED = int(os.environ.get("TORTURE_SEED", "1000"))


class PayloadTests(unittest.SynchronousTestCase):
    def test_payloads_check_themselves(self):
        p = make_payload(b"styx", 42, 7)
        self.assertEqual(parse_payload(b"styx", p), 42)
        self.assertIsNone(parse_payload(b"styx", p[:-1] + b"q"))
        self.assertIsNone(parse_payload(b"styx", p.replace(b"42", b"43")))
        self.assertIsNone(parse_payload(b"pv", p))
        self.assertIsNone(parse_payload(b"styx", b"garbage"))


class CrashConsistency(unittest.TestCase):
    timeout = 150

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="streamproto-torture-")

    def tearDown(self):
        if not getattr(self, "_keep", False):
            shutil.rmtree(self.workdir, True)

    @defer.inlineCallbacks
    def trials(self, name):
        target = TARGETS[name]
        why = target.available()
        if why:
            raise unittest.SkipTest(f"{name} has not landed: {why}")
        total_acked = 0
        trials = int(TRIALS) if TRIALS else target.ci_trials
        for seed in range(FIRST_SEED, FIRST_SEED + trials):
            result = yield run_trial(reactor, target, seed, self.workdir, traffic=(0.3, 0.9))
            problems = result.check(target.duplicates_forbidden, target.in_order)
            if problems:
                self._keep = True
                self.fail(f"{result.describe()}: {problems}\n(data kept in {self.workdir})\n"
                          f"{result.server_output[-4000:]}")
            total_acked += len(result.acked)
        # something was acked (on a busy machine a short trial may ack nothing)
        self.assertGreater(total_acked, 0)

    def test_styx(self):
        return self.trials("styx")

    def test_styx_with_retention(self):
        return self.trials("styx-retention")


    def test_lumberjack(self):
        return self.trials("lumberjack")

    def test_pravega(self):
        return self.trials("pravega")

    def test_relink(self):
        return self.trials("relink")

    def test_relink_transactions(self):
        return self.trials("relink-tx")

    def test_reliable(self):
        return self.trials("reliable")
