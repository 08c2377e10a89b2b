"""
The reference clients' workloads (L{test.faults.refworkloads}) write
histories the checker can judge: against an in-process server, with no
fault, every acknowledged operation is stored once, and an operation the
server never acknowledges is C{unknown}, never C{ok}.
"""

import argparse
import os
import shutil
import sys
import tempfile

from twisted.internet import defer, protocol, reactor, utils
from twisted.internet.endpoints import serverFromString
from twisted.internet.threads import deferToThread
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import LogStoreSink
from test.faults import checker, refworkloads
from test.faults.logtargets import lumberjack_payload
from test.faults.run import PROMISES
from test.faults.workload import TX_PARTS, read_history
from test.support.ciutil import missing
from test.support.netutil import free_port
from test.support.torture_harness import ROOT


def workload_args(url, duration, timeout=3.0, producers=2):
    history = tempfile.mktemp(prefix="refworkload-", suffix=".jsonl")
    return argparse.Namespace(url=url, history=history, duration=duration, timeout=timeout,
                              producers=producers, size=100, tag="w", log="unused")


class Silent(protocol.Protocol):
    """Reads everything, answers nothing: no window is ever acknowledged."""

    def dataReceived(self, data):
        pass


class PylogbeatWorkloadTests(unittest.TestCase):
    timeout = 30

    def setUp(self):
        try:
            import pylogbeat  # noqa: F401
        except ImportError:   # pragma: no cover - in the test extra
            missing("pylogbeat (the test extra) is not installed")

    @defer.inlineCallbacks
    def listen(self, factory):
        port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(factory)
        self.addCleanup(port.stopListening)
        return f"tcp://127.0.0.1:{port.getHost().port}"

    @defer.inlineCallbacks
    def test_acknowledged_windows_are_ok_and_stored(self):
        store = MemoryLogStore(reactor)
        factory = LumberjackServerFactory(LogStoreSink(store, "lj"))
        args = workload_args((yield self.listen(factory)), duration=1.0)
        self.addCleanup(os.unlink, args.history)
        yield deferToThread(refworkloads.run_pylogbeat, args)
        for proto in list(factory.connections):
            proto.transport.loseConnection()
        history = read_history(args.history)
        log = yield store.get("lj")
        records = [lumberjack_payload(r) for r in (yield log.read(0, max_bytes=1 << 30)).records()]
        verdict = checker.check(history, records, PROMISES["lumberjack-pylogbeat"])
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.unknown, 0, verdict.describe())
        self.assertGreater(verdict.acknowledged, 0)
        # whole windows: each producer's ops in windows of BATCH
        self.assertEqual(verdict.acknowledged % refworkloads.BATCH, 0)
        self.assertEqual(len(records), verdict.acknowledged)

    @defer.inlineCallbacks
    def test_unacknowledged_window_is_unknown(self):
        url = yield self.listen(protocol.Factory.forProtocol(Silent))
        args = workload_args(url, duration=0.5, timeout=0.3, producers=1)
        self.addCleanup(os.unlink, args.history)
        yield deferToThread(refworkloads.run_pylogbeat, args)
        history = read_history(args.history)
        self.assertGreater(len(history), 0)
        self.assertEqual({op.outcome for op in history}, {checker.UNKNOWN})
        # every op completed (the timeout), none left without an answer
        self.assertTrue(all(op.complete is not None for op in history))
        self.assertEqual(len(history) % refworkloads.BATCH, 0)


class PravegaOfficialWorkloadTests(unittest.TestCase):
    """The official client in a process of its own, our server in this one."""

    timeout = 60

    @defer.inlineCallbacks
    def setUp(self):
        try:
            import pravega_client  # noqa: F401
        except ImportError:   # pragma: no cover - in the test extra
            missing("the pravega package (the test extra) is not installed")
        from streamproto.pravega import tap
        from streamproto.pravega.controller import ControllerService
        self.store_port, controller_port = free_port(), free_port()
        options = tap.Options()
        data = tempfile.mkdtemp(prefix="refworkload-pravega-")
        self.addCleanup(shutil.rmtree, data, True)
        options.parseOptions(["--data", data,
                              "--port", f"tcp:{self.store_port}:interface=127.0.0.1",
                              "--controller", f"tcp:{controller_port}:interface=127.0.0.1"])
        self.top = tap.makeService(options)
        [controller] = [s for s in self.top if isinstance(s, ControllerService)]
        self.top.startService()
        self.addCleanup(self.top.stopService)
        yield controller.ready
        self.url = f"tcp://127.0.0.1:{controller_port}"
        yield self.workload("create", duration=30)

    @defer.inlineCallbacks
    def workload(self, name, duration, producers=2):
        args = workload_args(self.url, duration, producers=producers)
        self.addCleanup(lambda: os.path.exists(args.history) and os.unlink(args.history))
        env = dict(os.environ, PYTHONPATH=ROOT)
        out, err, code = yield utils.getProcessOutputAndValue(
            sys.executable, ["-m", "test.faults.refworkloads", name, "--url", self.url,
                             "--history", args.history, "--duration", str(duration),
                             "--producers", str(producers)], env=env, path=ROOT)
        self.assertEqual(code, 0, err.decode(errors="replace")[-2000:])
        return read_history(args.history) if name != "create" else None

    @defer.inlineCallbacks
    def stored(self):
        """Every event of the workloads' segments, read with our own client."""
        from streamproto.core.tls import client_endpoint
        from streamproto.pravega.client import SegmentReader, connect
        endpoint = client_endpoint(reactor, "127.0.0.1", self.store_port)
        events = []
        for i in range(refworkloads.SEGMENTS):
            name = f"{refworkloads.SCOPE}/{refworkloads.STREAM}/{i}.#epoch.0"
            proto = yield connect(endpoint)
            info = yield proto.segment_info(name)
            proto.transport.loseConnection()
            yield proto.closed
            reader = SegmentReader(endpoint, name)
            while reader.offset < info.write_offset:
                events += yield reader.read()
            yield reader.close()
        return events

    @defer.inlineCallbacks
    def test_writer_events(self):
        history = yield self.workload("pravega-official", duration=1.5)
        verdict = checker.check(history, (yield self.stored()), PROMISES["pravega-official"])
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.unknown, 0, verdict.describe())
        self.assertGreater(verdict.acknowledged, 0)
        self.assertEqual(verdict.records_read, verdict.acknowledged)

    @defer.inlineCallbacks
    def test_transactions_committed_whole(self):
        history = yield self.workload("pravega-official-tx", duration=1.5)
        records = yield self.stored()
        verdict = checker.check(history, records, PROMISES["pravega-official-tx"])
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.unknown, 0, verdict.describe())
        self.assertGreater(verdict.acknowledged, 0)
        self.assertEqual(len(records), verdict.acknowledged * TX_PARTS)
        # a transaction's events are contiguous in its segment
        keys = [checker.split_part(checker.decode(r)) for r in records]
        for i in range(0, len(keys), TX_PARTS):
            self.assertEqual([k for k, _ in keys[i:i + TX_PARTS]], [keys[i][0]] * TX_PARTS)
            self.assertEqual([p for _, p in keys[i:i + TX_PARTS]], list(range(TX_PARTS)))
