"""
The JetStream targets of the other protocols (L{test.faults.jstargets}),
without processes: each is the protocol's server as a front-end of the
cluster (in C{fe} for partitions), and the store's records are turned into
the workload's payloads; and what the runner keeps of a run the checker
finds invalid.  The runs themselves: C{test_faults}.
"""

import json
import os
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


class _FakeStore:
    """What the targets' log or bucket creation asks of a store, recorded."""

    made = []

    def __init__(self, servers, *args, **kwargs):
        self.calls = [("servers", list(servers)), ("replicas", kwargs.get("replicas"))]
        self.made.append(self)

    def start(self):
        self.calls.append(("start",))
        return defer.succeed(None)

    def get_or_create(self, name):
        self.calls.append(("get_or_create", name))
        return defer.succeed(None)

    def close(self):
        self.calls.append(("close",))
        return defer.succeed(None)


class CreatedBeforeTheSyncTests(SynchronousTestCase):
    """
    The setup makes the nodes' disks durable after C{create_log}: what a
    power cut must not take (the log, the sessions' bucket) is made there,
    not by the server's first write (doc/reliability.rst, finding 21).
    """

    def target(self, protocol):
        target = run.make_target(reactor, "powerloss", "nats", protocol)
        self.addCleanup(shutil.rmtree, target.work, True)
        self.addCleanup(shutil.rmtree, target.cluster.directory, True)
        self.patch(_FakeStore, "made", [])
        return target

    def test_logs_are_created_in_the_cluster(self):
        import streamproto.log.jetstream
        self.patch(streamproto.log.jetstream, "JetStreamLogStore", _FakeStore)
        for protocol in ("lumberjack", "relink", "relink-tx"):
            target = self.target(protocol)
            self.successResultOf(target.create_log())
            [store] = _FakeStore.made
            self.assertEqual(store.calls, [
                ("servers", target.cluster.urls), ("replicas", 3), ("start",),
                ("get_or_create", SERVERS[protocol][1]), ("close",)])

    def test_sessions_bucket_is_opened(self):
        import streamproto.reliable.natsessions
        self.patch(streamproto.reliable.natsessions, "JetStreamSessionStore", _FakeStore)
        target = self.target("reliable")
        self.successResultOf(target.create_log())
        [store] = _FakeStore.made
        self.assertEqual(store.calls, [("servers", target.cluster.urls), ("replicas", 3),
                                       ("start",), ("close",)])


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


class KeptEvidenceTests(SynchronousTestCase):
    """An invalid verdict keeps the run's history and the server's output."""

    def test_history_and_output_kept_and_named(self):
        class Server:
            def output_text(self):
                return "2026-11-29 log {name}: append failed\n"

        class Target:
            server = Server()

        history = self.mktemp()
        with open(history, "w") as f:
            f.write('{"process": "w0", "seq": 1, "type": "invoke"}\n')
        row = run.Row("partition", "nats", "styx")
        run.keep_evidence(Target(), history, row)
        [note] = row.notes
        keep = note.rsplit(" ", 1)[-1]
        self.addCleanup(shutil.rmtree, keep, True)
        with open(f"{keep}/history.jsonl") as f:
            self.assertIn('"w0"', f.read())
        with open(f"{keep}/server.log") as f:
            self.assertIn("append failed", f.read())

    def test_a_target_without_a_server(self):
        row = run.Row("kill9", "reference", "lumberjack")
        run.keep_evidence(object(), self.mktemp(), row)   # no history either
        keep = row.notes[0].rsplit(" ", 1)[-1]
        self.addCleanup(shutil.rmtree, keep, True)
        self.assertEqual(os.listdir(keep), [])
