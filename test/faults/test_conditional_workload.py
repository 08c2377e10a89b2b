"""
The Pravega conditional-append workload
(L{test.faults.workload.run_pravega_conditional}) writes a history the
checker can judge: against an in-process segment store with no fault,
producers racing on one segment each get some appends stored (C{ok}) and
some refused by the condition (C{failed}); every C{ok} event is in the
segment once, in order, and no C{failed} one is.
"""

import os

from twisted.internet import defer, reactor
from twisted.internet.endpoints import serverFromString
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.pravega.client import SegmentReader, connect
from streamproto.pravega.server import PravegaServerFactory
from test.faults import checker, workload
from test.faults.checker import FAILED
from test.faults.run import PROMISES
from test.faults.test_refworkloads import workload_args
from test.faults.workload import _endpoint

SEGMENT = "faults/stream/0.#epoch.0"


class ConditionalWorkloadTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_refused_appends_are_failed_and_absent(self):
        factory = PravegaServerFactory(MemoryLogStore(reactor))
        port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(factory)
        self.addCleanup(port.stopListening)
        url = f"tcp://127.0.0.1:{port.getHost().port}"
        proto = yield connect(_endpoint(reactor, url))
        yield proto.create_segment(SEGMENT)
        args = workload_args(url, duration=1.5, producers=3)
        args.log = SEGMENT
        self.addCleanup(os.unlink, args.history)
        yield workload.run_pravega_conditional(reactor, args)
        history = workload.read_history(args.history)
        info = yield proto.segment_info(SEGMENT)
        proto.transport.loseConnection()
        reader = SegmentReader(_endpoint(reactor, url), SEGMENT)
        events = []
        while reader.offset < info.write_offset:
            events.extend((yield reader.read()))
        reader.close()
        verdict = checker.check(history, events, PROMISES["pravega-conditional"])
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertGreater(verdict.acknowledged, 10)
        self.assertEqual(len(events), verdict.acknowledged)
        refused = [op for op in history if op.outcome == FAILED]
        self.assertTrue(refused, "three producers never raced on the segment")
