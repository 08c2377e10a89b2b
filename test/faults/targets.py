"""
Targets of the nemesis: the real processes of one configuration, and the
verbs a fault class uses on them (L{test.faults.nemesis}).

L{StyxFileTarget}: a real C{styx-server} (file store) whose data directory
is on a lazy FS (L{test.faults.lazyfs}), optionally under libfaketime, and
the workload's client process.  The final state is read by two other
paths: the disk itself after a last power cut (or kill -9), with the
read-only reader, and a fresh server process, with a client of the
harness's own.
"""

import os
import shutil
import signal
import sys
import tempfile
import weakref

from twisted.internet import defer, protocol

from streamproto.log.reader import LogDirectoryReader
from streamproto.styx.api_client import StyxClient
from test.faults import lazyfs
from test.support.torture_harness import ROOT, ServerProcess, suspicious_output

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"

#: small segments, so that faults land on rolls and index writes too
SEGMENT_MAX_SIZE = 65536


#: targets set up and not torn down yet: L{abort_all} ends them (Ctrl-C, a
#: test's timeout, whose pending calls trial cancels before the teardown ran)
LIVE = weakref.WeakSet()


def abort_all():
    """End every live target at once, synchronously (see L{StyxFileTarget.abort})."""
    for target in list(LIVE):
        target.abort()


def node_clock_unavailable(binary=None):
    """
    Why a nats-server node's wall clock cannot be jumped here: libfaketime
    works by LD_PRELOAD on a dynamically linked program's libc calls, the
    kernel's time namespaces offset only the monotonic and boot clocks
    (never CLOCK_REALTIME), and setting the machine's clock would step
    every process on it (the tests, CI, other people's work).
    """
    from test.support.natsutil import nats_server_binary
    binary = binary or nats_server_binary()
    if binary is None:
        return "nats-server not installed"
    with open(binary, "rb") as f:
        static = not _has_interpreter(f.read(1 << 16))
    how = ("a statically linked Go binary: it reads the clock through the vDSO, "
           "out of LD_PRELOAD's (libfaketime's) reach" if static else
           "dynamically linked, but Go reads the clock through the vDSO, not libc")
    return (f"{binary} is {how}; time namespaces offset only the monotonic clocks, and "
            "stepping this machine's clock would step every process on it")


def _has_interpreter(head):
    """Whether an ELF file's program headers (in C{head}) name a dynamic loader."""
    import struct
    if head[:4] != b"\x7fELF" or head[4] != 2:
        return False
    phoff, = struct.unpack_from("<Q", head, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
    for i in range(phnum):
        at = phoff + i * phentsize
        if at + 4 <= len(head) and struct.unpack_from("<I", head, at)[0] == 3:  # PT_INTERP
            return True
    return False


def faketime_unavailable():
    if not os.path.exists(FAKETIME_LIB):
        return f"libfaketime not installed ({FAKETIME_LIB}: Debian package faketime)"
    return None


class _ClientProtocol(protocol.ProcessProtocol):
    def __init__(self):
        self.output = []
        self.ended = defer.Deferred()

    def outReceived(self, data):
        self.output.append(data)

    errReceived = outReceived

    def processEnded(self, reason):
        self.ended.callback(reason.value)


class StyxFileTarget:
    """
    One styx-server on the file store, its data on a lazy FS.

    @param clock: run the server under libfaketime (a clock the nemesis
        can jump); off unless the run has clock faults.
    @param plugin: the server (the other protocols' targets,
        L{test.faults.logtargets}, run theirs), with C{args}.
    """

    store = "file"
    protocol = "styx"
    #: the workload process: C{python -m MODULE PROTOCOL} (L{test.faults.workload};
    #: the reference clients', L{test.faults.refworkloads})
    workload = ("test.faults.workload", "styx")

    def __init__(self, reactor, clock=False, log="faults", plugin="styx-server", args=()):
        self.reactor = reactor
        self.work = tempfile.mkdtemp(prefix="faults-styx-")
        self.lazy = lazyfs.LazyMount(os.path.join(self.work, "disk"),
                                     os.path.join(self.work, "mnt"))
        self.clock_file = os.path.join(self.work, "clock")
        self.use_clock = clock
        self.log = log
        env = None
        if clock:
            with open(self.clock_file, "w") as f:
                f.write("+0\n")
            env = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME_TIMESTAMP_FILE": self.clock_file,
                   "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        self.server = ServerProcess(reactor, plugin, os.path.join(self.lazy.mountpoint, "data"),
                                    args=args, env=env)
        self.client = None
        self.client_transport = None
        self.notes = []

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server.port}"

    @defer.inlineCallbacks
    def setup(self):
        LIVE.add(self)
        self.lazy.mount()
        os.makedirs(self.server.data_dir, exist_ok=True)
        yield self.server.start()
        yield self.create_log(segment_max_size=SEGMENT_MAX_SIZE)
        # the log and its directory are durable before the workload starts
        self.lazy.control("sync")

    @defer.inlineCallbacks
    def create_log(self, **config):
        client = StyxClient(self.url, reactor=self.reactor)
        try:
            yield client.create_log(self.log, **config)
        finally:
            yield client.close()

    @defer.inlineCallbacks
    def read_back(self):
        """The whole log, read by a client of the harness's own."""
        client = StyxClient(self.url, reactor=self.reactor)
        try:
            return (yield client.read_records(self.log))
        finally:
            yield client.close()

    def read_settled(self):
        """The final read (L{read_back}), once the store is ready to serve it."""
        return self.read_back()

    def client_prefix(self):
        """What the workload's argv is wrapped in (a namespace, for partitions)."""
        return []

    def start_client(self, history, duration, producers=3, timeout=3.0):
        """Spawn the workload process of this protocol (L{test.faults.workload})."""
        argv = self.client_prefix() + [
            sys.executable, "-m", *self.workload, "--url", self.url,
            "--log", self.log, "--history", history, "--duration", str(duration),
            "--producers", str(producers), "--timeout", str(timeout)]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.client = _ClientProtocol()
        self.client_transport = self.reactor.spawnProcess(
            self.client, argv[0], argv, env=env, path=ROOT)
        return self.client.ended

    # -- the verbs of the fault classes ---------------------------------

    def killable(self):
        return ["server"]

    def pausable(self):
        return ["server", "client"]

    def disks(self):
        return ["disk"]

    def kill(self, name):
        return self.server.kill()

    def start(self, name):
        return self.server.start()

    def signal(self, name, signum):
        pid = self.server.pid if name == "server" else self.client_transport.pid
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, TypeError):
            pass   # it ended meanwhile (the client at its deadline)

    def lazy_unavailable(self):
        return lazyfs.unavailable()

    @defer.inlineCallbacks
    def power_cut(self, disks):
        yield self.server.kill()
        return [self.lazy.drop()]

    def power_on(self, disks):
        return self.server.start()

    def clock_unavailable(self):
        if not self.use_clock:
            return "the server was not started under libfaketime"
        return faketime_unavailable()

    def set_clock(self, offset):
        with open(self.clock_file, "w") as f:
            f.write(f"{offset:+.0f}\n")

    def partition_unavailable(self):
        return ("one file-store server has no peers to be cut from: partitions run "
                "against the JetStream cluster (the nats rows)")

    def node_clock_unavailable(self):
        return "one file-store server has no cluster nodes (the clock row jumps its own)"

    # -- the end ---------------------------------------------------------

    def disk_records(self):
        """
        The log as the file system holds it (after a power cut: as the disk
        does), read with the read-only L{LogDirectoryReader}: no server, no
        recovery.
        """
        reader = LogDirectoryReader(self.server.data_dir)
        start, end = reader.bounds(self.log)
        return [bytes(r) for batch in reader.read(self.log, start, end)
                for r in batch.records()]

    @defer.inlineCallbacks
    def _heal_and_cut(self, power_cut):
        """Resume the server, set its clock right, then cut its power (or
        kill -9 it where the lazy FS cannot run): the last fault."""
        self.signal("server", signal.SIGCONT)
        if self.use_clock:
            self.set_clock(0)
        if power_cut and lazyfs.unavailable() is None:
            yield self.power_cut(["disk"])
        else:
            yield self.server.kill()

    @defer.inlineCallbacks
    def final_records(self, power_cut=True):
        """
        Heal, cut the power (or kill -9) a last time, read the disk as it
        is, then start a fresh server and read the whole log back with a
        client of our own: C{{"disk": records, "served": records}}.
        """
        yield self._heal_and_cut(power_cut)
        disk, disk_error = None, None
        if self.store == "file":
            try:
                disk = self.disk_records()
            except Exception as e:   # noqa: BLE001 - an unreadable disk is a finding
                disk_error = f"the read-only reader failed on the disk: {e!r}"
                self.notes.append(disk_error)
        yield self.server.start()
        records = yield self.read_settled()
        self.note_tracebacks()
        return {"disk": disk, "disk_error": disk_error, "served": records}

    def note_tracebacks(self):
        """Note (and keep) the server's output if it holds tracebacks."""
        bad = suspicious_output(self.server.output_text())
        if bad:
            fd, path = tempfile.mkstemp(prefix="faults-server-", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write(self.server.output_text())
            self.notes.append(f"{len(bad)} tracebacks in the server's output: {path}")

    @defer.inlineCallbacks
    def teardown(self):
        if self.client_transport is not None and self.client_transport.pid:
            self.signal("client", signal.SIGCONT)
            self.signal("client", signal.SIGKILL)
        self.signal("server", signal.SIGCONT)
        yield self.server.kill()
        self.lazy.unmount()
        shutil.rmtree(self.work, True)
        LIVE.discard(self)

    def abort(self):
        """
        The teardown, synchronous and without the reactor: SIGKILL the
        client and the server, unmount, remove the work directory.  For an
        interrupted run (Ctrl-C, SIGTERM, a test's timeout).
        """
        from twisted.internet.error import ProcessExitedAlready
        for signum in (signal.SIGCONT, signal.SIGKILL):
            if self.client_transport is not None:
                try:
                    self.client_transport.signalProcess(signum)
                except ProcessExitedAlready:
                    pass
            self.server.signal(signum)
        self.lazy.unmount()
        shutil.rmtree(self.work, True)
        LIVE.discard(self)


class StyxNatsTarget(StyxFileTarget):
    """
    One styx-server on the JetStream store (C{--store nats://...}) of a
    3-node C{nats-server} cluster (C{sync_interval: always}), each node's
    store directory on a lazy FS of its own: kill -9 and pauses of the
    front-end or of any node, power loss of one node or of all at once.
    The final state is read by a fresh front-end process.
    """

    store = "nats"

    def __init__(self, reactor, clock=False, log="faults", sync_interval="always", **kwargs):
        self.sync_interval = sync_interval
        super().__init__(reactor, clock=clock, log=log, **kwargs)
        self.cluster = self.make_cluster()
        self.node_lazy = [
            lazyfs.LazyMount(os.path.join(self.work, f"n{i}-disk"),
                             os.path.join(self.cluster.directory, f"n{i}"))
            for i in range(3)]
        self.server.args += ["--store", self.cluster.url + "?replicas=3"]

    def make_cluster(self):
        from test.support.natsutil import NatsCluster
        return NatsCluster(3, sync_interval=self.sync_interval)

    @defer.inlineCallbacks
    def setup(self):
        from twisted.internet import threads
        LIVE.add(self)
        for mount in self.node_lazy:
            mount.mount()
        yield threads.deferToThread(self.cluster.start)
        os.makedirs(self.server.data_dir, exist_ok=True)
        yield self.server.start()
        yield self.create_log()
        # the stream is durable before the workload starts, as the file
        # target's log is (nats-server does not fsync the directories it
        # creates: the strict model would lose the stream itself)
        for mount in self.node_lazy:
            mount.control("sync")

    @defer.inlineCallbacks
    def read_settled(self, patience=60.0):
        """
        The final read, asked again while it fails for up to C{patience}
        seconds: nodes answer /healthz before the stream has elected its
        leader again, and until then the front-end cannot read the log.
        A front-end that gave up on a cluster it could not reach at
        start-up (its documented exit status 1) is started again, as its
        supervisor would, with its last lines noted.  Each retry is noted
        in the run's report.
        """
        import time

        from test.faults.nemesis import sleep
        deadline = time.monotonic() + patience
        while True:
            try:
                return (yield self.read_back())
            except Exception as e:   # noqa: BLE001 - noted, and raised at the deadline
                if time.monotonic() > deadline:
                    raise
                last = (str(e).strip().splitlines() or [""])[-1]
                self.notes.append(f"the final read failed, retried: {type(e).__name__}: "
                                  f"{last[-300:]}")
                yield sleep(self.reactor, 1.0)
                if not self.server.running:
                    said = self.server.output_text().strip().splitlines()[-3:]
                    self.notes.append("the front-end had exited, started again; it said: "
                                      + " / ".join(line[-200:] for line in said))
                    try:
                        yield self.server.start()
                    except Exception as e:   # noqa: BLE001 - noted; the next try says
                        self.notes.append(f"the front-end did not start again: {e!r}"[:400])

    def killable(self):
        return ["server", "n0", "n1", "n2"]

    def pausable(self):
        return ["server", "client", "n0", "n1", "n2"]

    def disks(self):
        return ["n0", "n1", "n2"]

    def _node(self, name):
        return int(name[1:])

    def kill(self, name):
        if name == "server":
            return self.server.kill()
        self.cluster.kill(self._node(name))
        return defer.succeed(None)

    def start(self, name):
        if name == "server":
            return self.server.start()
        from twisted.internet import threads
        return threads.deferToThread(self.cluster.start_node, self._node(name))

    def signal(self, name, signum):
        if name in ("server", "client"):
            return super().signal(name, signum)
        process = self.cluster.processes[self._node(name)]
        if process is not None:
            process.send_signal(signum)

    def power_cut(self, disks):
        answers = []
        for name in disks:
            self.cluster.kill(self._node(name))
            answers.append(f"{name}: {self.node_lazy[self._node(name)].drop()}")
        return defer.succeed(answers)

    def power_on(self, disks):
        # all at once: after a power cut of the whole cluster a node is not
        # healthy before it has a meta leader, which needs the others up
        from twisted.internet import threads
        for name in disks:
            self.cluster.start_node(self._node(name), wait=False)
        return threads.deferToThread(self.cluster.wait_ready, 60.0)

    def clock_unavailable(self):
        # the front-end's clock (libfaketime): the nodes keep true time
        return super().clock_unavailable()

    def node_clock_unavailable(self):
        return node_clock_unavailable()

    def _keep_fatal_logs(self):
        """Copy the nodes' logs out of the doomed directory when one died (fatal error, panic)."""
        logs = [os.path.join(self.cluster.directory, f"n{i}.log") for i in range(3)]
        logs = [path for path in logs if os.path.exists(path)]   # never started: none
        fatal = False
        for path in logs:
            with open(path, errors="replace") as f:
                text = f.read()
                fatal = fatal or "[FTL]" in text or "\npanic: " in text
        if fatal:
            keep = tempfile.mkdtemp(prefix="faults-nats-logs-")
            for path in logs:
                shutil.copy(path, keep)
            self.notes.append(f"a nats-server node died ([FTL] or a panic): logs in {keep}")

    def on_cluster(self, function, *args):
        """
        C{function(*args)} (blocking) in a thread from where the nodes are
        reached; a Deferred of its result.
        """
        from twisted.internet import threads
        return threads.deferToThread(function, *args)

    @defer.inlineCallbacks
    def heal_cluster(self, power_cut=True):
        """Resume every node (and cut their power a last time); fires once the cluster is ready."""
        for name in self.disks():
            self.signal(name, signal.SIGCONT)
        if power_cut:
            yield self.power_cut(self.disks())
            yield self.power_on(self.disks())
        from twisted.internet import threads
        yield threads.deferToThread(self.cluster.wait_ready)
        # a deposed stream leader still answers, with its stale state,
        # for seconds after a partition heals (finding 15)
        settled = yield threads.deferToThread(self.cluster.wait_streams_settled, 60.0)
        if not settled:
            self.notes.append("the streams' leaders did not settle in 60 s")

    @defer.inlineCallbacks
    def final_records(self, power_cut=True):
        yield self.heal_cluster(power_cut)
        return (yield super().final_records(power_cut=False))

    @defer.inlineCallbacks
    def teardown(self):
        for name in self.disks():
            self.signal(name, signal.SIGCONT)
        for i in range(3):
            self.cluster.kill(i)
        self._keep_fatal_logs()
        for mount in self.node_lazy:
            mount.unmount()
        self.cluster.stop()
        yield super().teardown()

    def abort(self):
        for i in range(3):
            self.signal(f"n{i}", signal.SIGCONT)
            self.cluster.kill(i)
        for mount in self.node_lazy:
            mount.unmount()
        self.cluster.stop()
        super().abort()
