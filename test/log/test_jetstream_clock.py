"""
A front-end's wall clock that disagrees with the cluster's, on a real
JetStream cluster: retention by age goes by the cluster's clock, which
stamped the messages.  (Steps of the clock during appends:
L{test.log.test_jetstream_chain.ClockStepTests}.)
"""

import time
import types

from twisted.internet import defer
from twisted.trial import unittest

from streamproto.log.config import LogConfig
from streamproto.log.jetstream import JetStreamLogStore, truncation
from streamproto.log.jetstream.truncation import cluster_time
from test.support.logutil import read_records


class ClusterTime(unittest.SynchronousTestCase):

    def test_parsed(self):
        self.assertEqual(cluster_time({"ts": "2026-11-28T09:36:18.015284669Z"}),
                         1795858578.015284669)
        self.assertEqual(cluster_time({"ts": "1970-01-01T00:00:10Z"}), 10.0)

    def test_ours_without_one(self):
        for info in (None, {}, {"ts": "yesterday"}):
            self.assertLess(abs(cluster_time(info) - time.time()), 5)


class AgeRetentionTests(unittest.TestCase):
    timeout = 60

    @defer.inlineCallbacks
    def test_front_end_clock_ahead_keeps_young_records(self):
        """
        With the front-end's clock two hours ahead, a log keeping an hour
        keeps its records of the last minute (it purged them all before).
        """
        from test.support.natsutil import shared_cluster, unique_prefix
        cluster = shared_cluster()
        store = JetStreamLogStore(cluster.urls, replicas=3, prefix=unique_prefix(self),
                                  retention_interval=None)
        self.addCleanup(store.close)
        log = yield store.create("aged", LogConfig(log_max_age=3600))
        for i in range(5):
            yield log.append([b"young %d" % i])
        ahead = types.SimpleNamespace(time=lambda: time.time() + 7200, strftime=time.strftime,
                                      gmtime=time.gmtime, strptime=time.strptime)
        self.patch(truncation, "time", ahead)
        yield log._truncation.retain()
        self.assertEqual(log.start_position, 0)
        records = yield read_records(store, "aged")
        self.assertEqual(records, [b"young %d" % i for i in range(5)])
