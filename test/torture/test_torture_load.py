"""
Load: a few hundred concurrent connections to each server (a real child
process), every one streaming a few acknowledged rounds; all acks arrive,
and the server's RSS per idle connection stays small.  ``bench/torture_load.py``
runs 1,000 connections per server and prints the figures.
"""

import os
import shutil
import tempfile

from twisted.internet import defer, reactor
from twisted.trial import unittest

from test.support.torture_harness import suspicious_output
from test.support.torture_harness import LOAD_TARGETS, run_load

CONNECTIONS = int(os.environ.get("TORTURE_CONNECTIONS", "300"))
#: measured 5-11 KiB per idle connection (doc/reliability.rst); a leak of a
#: buffer per connection would blow well past this
MAX_KIB_PER_CONNECTION = 64
MAX_IDLE_RSS_KIB = 256 * 1024


class Load(unittest.TestCase):
    timeout = 120

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="streamproto-load-")
        self.addCleanup(shutil.rmtree, self.workdir, True)

    @defer.inlineCallbacks
    def load(self, name):
        result = yield run_load(reactor, LOAD_TARGETS[name], self.workdir, CONNECTIONS)
        self.assertEqual(result.acked, result.expected, result.describe())
        self.assertLess(result.kib_per_connection, MAX_KIB_PER_CONNECTION, result.describe())
        self.assertLess(result.rss_idle_kib, MAX_IDLE_RSS_KIB, result.describe())
        self.assertEqual(suspicious_output(result.server_output), [])

    def test_styx(self):
        return self.load("styx")

    def test_lumberjack(self):
        return self.load("lumberjack")

    def test_pravega(self):
        return self.load("pravega")

    def test_relink(self):
        return self.load("relink")

    def test_reliable(self):
        return self.load("reliable")
