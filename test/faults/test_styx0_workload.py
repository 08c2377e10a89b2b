"""
The styx/0 workload (L{test.faults.workload.run_styx0}) writes a history
the checker can judge: against an in-process styx-server with no fault,
every acknowledged record is stored once and in order; against a server
that never acknowledges, every write is C{unknown}, never C{ok}.
"""

import os

from twisted.internet import defer, reactor
from twisted.internet.endpoints import serverFromString
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.styx.resource import make_site
from test.faults import checker, workload
from test.faults.run import PROMISES
from test.faults.test_refworkloads import workload_args


class Styx0WorkloadTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def serve(self, store):
        port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            make_site(store))
        self.addCleanup(port.stopListening)
        return f"http://127.0.0.1:{port.getHost().port}"

    @defer.inlineCallbacks
    def run_workload(self, store, duration, timeout=3.0):
        args = workload_args((yield self.serve(store)), duration=duration, timeout=timeout)
        args.log = "faults"
        self.addCleanup(os.unlink, args.history)
        yield workload.run_styx0(reactor, args)
        return workload.read_history(args.history)

    @defer.inlineCallbacks
    def test_acknowledged_records_are_ok_and_stored(self):
        store = MemoryLogStore(reactor)
        log = yield store.create("faults")
        history = yield self.run_workload(store, duration=1.0)
        records = (yield log.read(0, max_bytes=1 << 30)).records()
        verdict = checker.check(history, records, PROMISES["styx0"])
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.unknown, 0, verdict.describe())
        self.assertGreater(verdict.acknowledged, 10)
        self.assertEqual(len(records), verdict.acknowledged)

    @defer.inlineCallbacks
    def test_unacknowledged_writes_are_unknown(self):
        """A log whose appends never complete: no ack, so no C{ok}."""
        store = MemoryLogStore(reactor)
        log = yield store.create("faults")
        never = defer.Deferred()
        self.patch(log, "append", lambda *a, **kw: never)
        history = yield self.run_workload(store, duration=1.0, timeout=0.3)
        verdict = checker.check(history, [], PROMISES["styx0"])
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.acknowledged, 0)
        self.assertGreater(verdict.unknown, 0)
