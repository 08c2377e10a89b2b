"""
The JetStream targets of the other protocols (L{test.faults.jstargets}),
without processes: each is the protocol's server as a front-end of the
cluster (in C{fe} for partitions), and the store's records are turned into
the workload's payloads.  The runs themselves: C{test_faults}.
"""

import json
import shutil

from twisted.internet import defer, reactor
from twisted.trial.unittest import SynchronousTestCase

from test.faults import run
from test.faults.jstargets import LogsOnJetStream
from test.faults.logtargets import SERVERS


class CompositionTests(SynchronousTestCase):
    def target(self, fault, protocol):
        target = run.make_target(reactor, fault, "nats", protocol)
        self.addCleanup(shutil.rmtree, target.work, True)
        self.addCleanup(shutil.rmtree, target.cluster.directory, True)
        return target

    def test_each_protocol_is_a_front_end(self):
        """Its own server plugin, with C{--store} naming the 3 nodes."""
        for protocol, (plugin, log) in SERVERS.items():
            for fault in ("kill9", "pause", "clock", "partition"):
                target = self.target(fault, protocol)
                argv = target.server.argv()
                self.assertIn(plugin, argv)
                self.assertEqual(argv[argv.index("--store") + 1],
                                 target.cluster.url + "?replicas=3")
                self.assertEqual((target.store, target.protocol, target.log),
                                 ("nats", protocol, log))
                self.assertEqual(target.use_clock, fault == "clock")

    def test_partitions_run_in_namespaces(self):
        """The server and the workload in C{fe}, the nodes in theirs."""
        for protocol in SERVERS:
            target = self.target("partition", protocol)
            fe = target.fabric.prefix("fe")
            self.assertEqual(target.server.prefix, fe)
            self.assertEqual(target.client_prefix(), fe)
            n1 = target.fabric.prefix("n1")
            self.assertEqual(target.cluster.command(1)[:len(n1)], n1)

    def test_segment_is_created_in_fe(self):
        """
        Only Pravega's log is made before the workload (the others are made
        by their first write); in namespaces, from inside C{fe}.
        """
        created = []
        for protocol in SERVERS:
            target = self.target("partition", protocol)
            target._in_fe = lambda *argv: created.append(argv) or defer.succeed(b"")
            self.successResultOf(target.create_log())
            if protocol == "pravega":
                port = str(target.server.port)
        self.assertEqual(created, [("pravega-create", port, SERVERS["pravega"][1])])


class _Reader(LogsOnJetStream):
    """L{LogsOnJetStream} over records given here instead of a cluster's."""

    def __init__(self, protocol, records):
        self.protocol = protocol
        self.log = SERVERS[protocol][1]
        self.cluster = self   # its urls: unused here
        self.urls = []
        self.records = records

    def on_cluster(self, function, servers, name):
        self.asked = name
        return defer.succeed(self.records)

    def payloads(self, records):
        from test.faults.logtargets import LogFileTarget
        return LogFileTarget.payloads(self, records)


class ReadBackTests(SynchronousTestCase):
    def test_pravega_events(self):
        """
        The segment log's records are Event frames back to back, a frame
        may span records; bytes that are no whole frame come out as one
        more (corrupt) record.
        """
        from streamproto.pravega.blocks import event_frames
        from streamproto.pravega.segments import log_name
        data, _ = event_frames([b"w0:1:x", b"w1:1:yy", b"w0:2:zzz"])
        reader = _Reader("pravega", [data[:5], data[5:20], data[20:], b"\0\0"])
        self.assertEqual(self.successResultOf(reader.read_back()),
                         [b"w0:1:x", b"w1:1:yy", b"w0:2:zzz", b"\0\0"])
        self.assertEqual(reader.asked, log_name(SERVERS["pravega"][1]))

    def test_lumberjack_payloads(self):
        """Lumberjack's stored events hold the workload's payload in C{m}."""
        stored = [json.dumps({"event": {"m": "w0:1:abc"}, "@metadata": {}}).encode(), b"junk"]
        reader = _Reader("lumberjack", stored)
        self.assertEqual(self.successResultOf(reader.read_back()), [b"w0:1:abc", b"junk"])
        self.assertEqual(reader.asked, "lumberjack")
