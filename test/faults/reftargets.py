"""
Targets of the reference clients' workloads (L{test.faults.refworkloads}):
the same servers, file store and lazy FS as L{LogFileTarget}, with the
workload process of the official client.

L{PravegaOfficialTarget}: C{pravega-server} with its gRPC controller on a
port of its own (the official client finds the segment store through it),
the workloads' stream (L{SEGMENTS} segments) created by the official
client before the faults; the final state is every segment read through a
fresh server (C{ReadSegment}), one after the other: a producer's events
are in one segment (its routing key), so its order is judged there.
Committed transactions are merged into those segments.

L{PylogbeatTarget}: C{lumberjack-server}, read back as
L{LogFileTarget} reads it (the disk, then after a fresh server's
recovery).
"""

import os
import sys

from twisted.internet import defer, utils

from test.faults.logtargets import LogFileTarget
from test.faults.refworkloads import SCOPE, SEGMENTS, STREAM
from test.support.netutil import free_port
from test.support.torture_harness import ROOT, ServerProcess, wait_for_port

MODULE = "test.faults.refworkloads"


class PravegaOfficialTarget(LogFileTarget):
    """C{pravega-server} with its controller, for C{pravega-official[-tx]}."""

    def __init__(self, reactor, workload, clock=False):
        super().__init__(reactor, "pravega", clock=clock)
        self.workload = (MODULE, workload)
        self.controller_port = free_port()
        self.segments = [f"{SCOPE}/{STREAM}/{i}.#epoch.0" for i in range(SEGMENTS)]
        self.server = ServerProcess(
            reactor, "pravega-server", self.server.data_dir, env=self.server.env,
            args=["--controller", f"tcp:{self.controller_port}:interface=127.0.0.1"])

    @property
    def url(self):
        """The controller: where the official client starts."""
        return f"tcp://127.0.0.1:{self.controller_port}"

    @defer.inlineCallbacks
    def setup(self):
        self.lazy.mount()
        os.makedirs(self.server.data_dir, exist_ok=True)
        yield self.server.start()
        yield wait_for_port(self.reactor, self.controller_port, process=self.server)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out, err, code = yield utils.getProcessOutputAndValue(
            sys.executable, ["-m", MODULE, "create", "--url", self.url, "--history", os.devnull,
                             "--duration", "30"], env=env, path=ROOT)
        if code:
            raise RuntimeError(f"the official client could not create the stream: {err!r}")
        # the stream's segments and the controller's state are durable
        # before the workload starts
        self.lazy.control("sync")

    @defer.inlineCallbacks
    def read_segment(self):
        """Every event of every segment, segment after segment."""
        events = []
        for name in self.segments:
            self.log = name
            events += yield super().read_segment()
        return events


class PylogbeatTarget(LogFileTarget):
    """C{lumberjack-server}, for C{lumberjack-pylogbeat}."""

    def __init__(self, reactor, clock=False):
        super().__init__(reactor, "lumberjack", clock=clock)
        self.workload = (MODULE, "lumberjack-pylogbeat")


def make_target(reactor, fault, protocol):
    """The file-store target of reference-client workload C{protocol}."""
    clock = fault == "clock"
    if protocol == "lumberjack-pylogbeat":
        return PylogbeatTarget(reactor, clock=clock)
    return PravegaOfficialTarget(reactor, protocol, clock=clock)
