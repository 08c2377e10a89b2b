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

#: set-ups tried (new ports each time) before the run is an error
SETUP_ATTEMPTS = 3


class PravegaOfficialTarget(LogFileTarget):
    """C{pravega-server} with its controller, for C{pravega-official[-tx]}."""

    def __init__(self, reactor, workload, clock=False):
        super().__init__(reactor, "pravega", clock=clock)
        self.workload = (MODULE, workload)
        self.segments = [f"{SCOPE}/{STREAM}/{i}.#epoch.0" for i in range(SEGMENTS)]
        self.server = ServerProcess(reactor, "pravega-server", self.server.data_dir,
                                    env=self.server.env)
        self.new_ports()

    def new_ports(self):
        """Ports for the segment store and the controller, fixed across restarts."""
        self.server.port = free_port()
        self.controller_port = free_port()
        self.server.args = ["--controller", f"tcp:{self.controller_port}:interface=127.0.0.1"]

    @property
    def url(self):
        """The controller: where the official client starts."""
        return f"tcp://127.0.0.1:{self.controller_port}"

    @defer.inlineCallbacks
    def setup(self):
        self.lazy.mount()
        os.makedirs(self.server.data_dir, exist_ok=True)
        for _ in range(SETUP_ATTEMPTS):
            why = yield self.create_stream()
            if why is None:
                break
            # a port taken meanwhile by another process of the machine
            # (the controller's: the server stops; another listener: no
            # answer): new ports, once more
            self.notes.append(f"creating the stream failed ({why}); server output: "
                              f"{self.server.output_text()[-1000:]}")
            yield self.server.kill()
            self.new_ports()
        else:
            raise RuntimeError(f"the official client could not create the stream "
                               f"{SETUP_ATTEMPTS} times")
        # the stream's segments and the controller's state are durable
        # before the workload starts
        self.lazy.control("sync")

    @defer.inlineCallbacks
    def create_stream(self):
        """Start the server, create the workloads' stream with the official client:
        None, or why not."""
        try:
            yield self.server.start()
            yield wait_for_port(self.reactor, self.controller_port, timeout=10,
                                process=self.server)
        except Exception as e:   # noqa: BLE001 - said, and tried again
            return repr(e)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # "--duration 0": the process ends itself after HARD_STOP seconds
        out, err, code = yield utils.getProcessOutputAndValue(
            sys.executable, ["-m", MODULE, "create", "--url", self.url, "--history", os.devnull,
                             "--duration", "0"], env=env, path=ROOT)
        return None if code == 0 else err.decode(errors="replace")[-500:]

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
