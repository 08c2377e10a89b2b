"""
Shared helpers of the torture suite (``test/torture/``,
``bench/torture_*.py``): run a server as a real ``twist`` child process on
its own data directory, wait until it accepts connections, SIGKILL it,
restart it, and keep what it logged for diagnostics; the fault-injecting
file layer; and the per-protocol logic of the
crash trials (L{run_trial}, L{ALL_TARGETS}) and of the load runs
(L{run_load}, L{ALL_LOAD}), shared by the tests and the benchmarks.

Child processes run ``sys.executable -m twisted <plugin> --port
tcp:PORT:interface=127.0.0.1 --data DIR`` (``python -m twisted`` is
``twist``: twistd's foreground-only sibling, same plugins, no pid file).
"""

import errno
import importlib
import os
import random
import sys
import time
import zlib
from collections import Counter

from twisted.internet import defer, error, protocol, task

from streamproto.core.fdlimit import raise_open_files_limit
from streamproto.log.segments import FileIO
from test.support.netutil import free_port, with_timeout

#: The project root, so that children import this very work tree.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def raise_nofile_limit():
    """Raise RLIMIT_NOFILE's soft limit as a server does (L{raise_open_files_limit}); return it."""
    return raise_open_files_limit()[1]


def rss_kib(pid):
    """VmRSS of process C{pid} in KiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sleep(reactor, seconds):
    return task.deferLater(reactor, seconds, lambda: None)


@defer.inlineCallbacks
def wait_for_port(reactor, port, timeout=30.0, host="127.0.0.1", process=None):
    """
    Wait until C{host:port} accepts a TCP connection (connect, then close at
    once).  Fails with C{TimeoutError} after C{timeout} seconds, or at once
    if C{process} (a L{ServerProcess}) exited meanwhile.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.exited.called:
            raise RuntimeError(f"server exited before listening:\n{process.output_text()}")
        try:
            yield protocol.ClientCreator(reactor, protocol.Protocol).connectTCP(
                host, port, timeout=1).addCallback(lambda p: p.transport.abortConnection())
            return
        except (error.ConnectError, error.ConnectionRefusedError, error.TimeoutError,
                OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} did not accept connections in {timeout}s")
            yield sleep(reactor, 0.05)


class _ServerProcessProtocol(protocol.ProcessProtocol):
    def __init__(self, owner):
        self.owner = owner

    def outReceived(self, data):
        self.owner._output.append(data)

    errReceived = outReceived

    def processEnded(self, reason):
        self.owner._ended(reason)


class ServerProcess:
    """
    One server plugin run as a child process: C{start()}, C{kill()}
    (SIGKILL), C{stop()} (SIGTERM, graceful), C{restart()}.  Everything it
    writes to stdout/stderr is kept (C{output_text()}).

    @ivar port: the TCP port it listens on (fixed across restarts).
    @ivar pid: the current child's pid.
    @ivar exited: Deferred firing with the exit reason of the current child.
    """

    def __init__(self, reactor, plugin, data_dir, args=(), port=None, ports=(), env=None,
                 fsize_limit=None):
        self.reactor = reactor
        self.plugin = plugin
        self.data_dir = data_dir
        self.args = list(args)
        self.port = port or free_port()
        self.extra_ports = list(ports)  # more --port descriptions (e.g. mtls)
        self.env = env
        self.fsize_limit = fsize_limit  # RLIMIT_FSIZE of the child: "disk full" (EFBIG)
        self.pid = None
        #: argv prefix the child runs under (e.g. C{ip netns exec NS})
        self.prefix = []
        self.exited = defer.succeed(None)
        self._output = []
        self._transport = None
        self.starts = 0

    def argv(self):
        if self.fsize_limit is None:
            argv = [sys.executable, "-m", "twisted"]
        else:
            # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG
            argv = [sys.executable, "-c",
                    "import resource, runpy, sys; "
                    f"resource.setrlimit(resource.RLIMIT_FSIZE, ({self.fsize_limit}, "
                    f"{self.fsize_limit})); sys.argv[0] = 'twist'; "
                    "runpy.run_module('twisted', run_name='__main__')"]
        argv += ["--log-format", "text", self.plugin,
                "--port", f"tcp:{self.port}:interface=127.0.0.1", "--data", self.data_dir]
        for p in self.extra_ports:
            argv += ["--port", p]
        return argv + self.args

    def output_text(self):
        return b"".join(self._output).decode("utf-8", "replace")

    @property
    def running(self):
        """Whether the current child is alive (spawned and not yet exited)."""
        return self._transport is not None

    def _ended(self, reason):
        self._transport = None
        # the exit reason is a Failure (ProcessDone/ProcessTerminated): hand
        # over its exception, or every waiter would see an error
        reason = getattr(reason, "value", reason)
        d, self.exited = self.exited, defer.succeed(reason)
        if not d.called:
            d.callback(reason)

    def spawn(self):
        """Spawn the child without waiting for it (see L{start})."""
        if self._transport is not None:
            raise RuntimeError("already running")
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.update(self.env or {})
        self.exited = defer.Deferred()
        self._output.append(f"--- start #{self.starts} ---\n".encode())
        self.starts += 1
        argv = self.prefix + self.argv()
        self._transport = self.reactor.spawnProcess(
            _ServerProcessProtocol(self), argv[0], argv, env=env, path=ROOT)
        self.pid = self._transport.pid

    @defer.inlineCallbacks
    def start(self, timeout=30.0):
        """Spawn the child and wait until it accepts connections; fires with seconds taken."""
        started = time.monotonic()
        self.spawn()
        try:
            yield wait_for_port(self.reactor, self.port, timeout, process=self)
        except Exception:
            yield self.kill()
            raise
        return time.monotonic() - started

    def signal(self, name):
        if self._transport is not None:
            try:
                self._transport.signalProcess(name)
            except error.ProcessExitedAlready:
                pass

    def kill(self):
        """SIGKILL; fires once the child is gone."""
        d = self.exited
        self.signal("KILL")
        return d

    @defer.inlineCallbacks
    def stop(self, timeout=15.0):
        """SIGTERM (graceful shutdown), SIGKILL after C{timeout}; fires with the exit reason."""
        d = self.exited
        if self._transport is None:
            return (yield d)
        self.signal("TERM")
        timer = self.reactor.callLater(timeout, self.signal, "KILL")
        reason = yield d
        if timer.active():
            timer.cancel()
        return reason

    @defer.inlineCallbacks
    def restart(self, timeout=30.0):
        yield self.kill()
        return (yield self.start(timeout))

    def rss_kib(self):
        return rss_kib(self.pid)


def suspicious_output(text):
    """Lines of a server's output that point at a bug (tracebacks, unhandled errors)."""
    bad = []
    for line in text.splitlines():
        if "Traceback" in line or "Unhandled" in line:
            bad.append(line)
    return bad


class FaultyIO(FileIO):
    """
    A file layer that injects storage faults once armed:

    - C{fail_fsync}: every fsync raises EIO (the kernel may already have
      dropped the dirty pages: the store must fail-stop, never retry);
    - C{enospc}: every write puts half of its bytes in the file (a torn
      write), then raises ENOSPC, until disarmed ("space is back");
    - C{flip_write_bit}: the next write has one bit flipped before it
      reaches the file (silent corruption below the store).
    """

    def __init__(self):
        self.fail_fsync = False
        self.enospc = False
        self.flip_write_bit = False
        self.fsyncs = 0
        self.failed_fsyncs = 0
        self.failed_writes = 0

    def fsync(self, fd):
        self.fsyncs += 1
        if self.fail_fsync:
            self.failed_fsyncs += 1
            raise OSError(errno.EIO, "injected fsync failure")
        super().fsync(fd)

    def writev(self, fd, buffers):
        if self.enospc:
            self.failed_writes += 1
            flat = b"".join(bytes(b) for b in buffers)
            os.write(fd, flat[:len(flat) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.flip_write_bit:
            self.flip_write_bit = False
            flat = bytearray(b"".join(bytes(b) for b in buffers))
            flat[len(flat) // 2] ^= 0x10
            buffers = [bytes(flat)]
        return super().writev(fd, buffers)


# == crash consistency trials ==================================================
#
# Crash consistency (kill -9) trials, shared by ``test/torture/test_torture_crash.py``
# (a few trials per protocol) and ``bench/torture_crash.py`` (many).
#
# A trial: start the server as a real process on a fresh data directory,
# drive it with our client at full speed, recording every item the client saw
# acknowledged (each payload unique and self-checking: a sequence number and
# a CRC of it), SIGKILL it at a random moment drawn from the trial's seed,
# restart it, read everything back, and compare.

def make_payload(tag, seq, pad=0):
    """A unique, self-checking record: tag, sequence number, CRC, padding."""
    body = b"%s:%010d" % (tag, seq)
    return body + b":%08x:" % zlib.crc32(body) + b"p" * pad


def parse_payload(tag, payload):
    """The sequence number of a payload made by L{make_payload}, or None if corrupt."""
    try:
        t, seq, crc, pad = bytes(payload).split(b":", 3)
        body = b"%s:%s" % (t, seq)
        if t != tag or int(crc, 16) != zlib.crc32(body) or pad.strip(b"p"):
            return None
        return int(seq)
    except ValueError:
        return None


class TrialResult:
    """What one trial found."""

    def __init__(self, target, seed):
        self.target = target
        self.seed = seed
        self.acked = set()
        self.sent = 0
        self.read_back = []      # sequence numbers in the order served (None = corrupt)
        self.recovery_seconds = None
        self.kill_after = None
        self.second_kill_after = None   # also killed while restarting
        self.server_output = ""
        self.problems = []

    @property
    def corrupt(self):
        return sum(1 for s in self.read_back if s is None)

    @property
    def counts(self):
        return Counter(s for s in self.read_back if s is not None)

    @property
    def lost(self):
        counts = self.counts
        return sorted(s for s in self.acked if not counts.get(s))

    @property
    def duplicates(self):
        return sorted(s for s, n in self.counts.items() if n > 1)

    def check(self, duplicates_forbidden=True, in_order=False):
        """The list of broken promises (empty when the trial passed)."""
        problems = list(self.problems)
        if self.corrupt:
            problems.append(f"{self.corrupt} corrupt records served")
        if self.lost:
            problems.append(f"{len(self.lost)} acked records lost, e.g. {self.lost[:5]}")
        if duplicates_forbidden and self.duplicates:
            problems.append(f"{len(self.duplicates)} duplicates, e.g. {self.duplicates[:5]}")
        if in_order:
            good = [s for s in self.read_back if s is not None]
            if good != sorted(good):
                problems.append("records served out of order")
        bad_lines = suspicious_output(self.server_output.split("--- start #1 ---")[-1])
        if bad_lines:
            problems.append("restarted server logged errors: " + " | ".join(bad_lines[:3]))
        return problems

    def describe(self):
        second = "" if self.second_kill_after is None else \
            f" second_kill_after={self.second_kill_after:.3f}s"
        return (f"{self.target} seed={self.seed} kill_after={self.kill_after:.3f}s{second} "
                f"sent={self.sent} acked={len(self.acked)} read={len(self.read_back)} "
                f"recovery={self.recovery_seconds}")


class CrashTarget:
    """One protocol's part of a crash trial.  Subclasses fill in the steps."""

    name = None
    plugin = None
    args = ()
    duplicates_forbidden = True
    in_order = False
    tag = b"t"
    ci_trials = 3
    #: the log to read with the read-only LogDirectoryReader straight after
    #: the kill, before the restart's recovery (None: not a plain log)
    offline_log = None
    #: the modules the target's client and server are in
    modules = ()

    def available(self):
        """None, or why this protocol cannot be tried (not landed yet)."""
        for name in self.modules:
            try:
                importlib.import_module(name)
            except ImportError as e:
                return str(e)
        return None

    def setup(self, reactor, server, result):
        """Deferred: prepare the server (create logs...)."""
        return defer.succeed(None)

    def drive(self, reactor, server, result, rng, stopping):
        """
        Deferred firing when the client stops: write at full speed until
        C{stopping[0]} is true or the connection dies; add every
        acknowledged sequence number to C{result.acked}.
        """
        raise NotImplementedError

    def resume(self, reactor, server, result):
        """
        Deferred: after the restart, let a client that reconnects on its own
        finish (Pravega's writer, Lumberjack's resend).  Whatever it then
        reports acked joins C{result.acked}.
        """
        return defer.succeed(None)

    def read_back(self, reactor, server, result):
        """Deferred list of payloads served after the restart."""
        raise NotImplementedError

    def cleanup(self, result):
        """Stop whatever client is left (the trial is over)."""
        return defer.succeed(None)


@defer.inlineCallbacks
def run_trial(reactor, target, seed, workdir, traffic=(0.3, 1.5), stop_signal="KILL"):
    """
    Run one trial; fires with a L{TrialResult} (check it with C{.check()}).

    @param stop_signal: "KILL" (a crash) or "TERM" (a graceful shutdown under load).
    """
    rng = random.Random(seed)
    result = TrialResult(target.name, seed)
    result.stop_signal = stop_signal
    data = os.path.join(workdir, f"{target.name}-{seed}")
    server = ServerProcess(reactor, target.plugin, data, target.args)
    try:
        yield server.start()
        yield target.setup(reactor, server, result)
        stopping = [False]
        result.killed = defer.Deferred()
        driving = defer.maybeDeferred(target.drive, reactor, server, result, rng, stopping)
        driving.addErrback(lambda f: None)  # the kill ends it with an error, by design
        result.kill_after = rng.uniform(*traffic)
        yield sleep(reactor, result.kill_after)
        stopping[0] = True
        if stop_signal == "KILL":
            yield server.kill()
        else:
            reason = yield server.stop(timeout=20)
            result.stop_reason = reason
        result.killed.callback(None)
        yield _with_timeout(reactor, driving, 10)
        acked_at_kill = set(result.acked)
        if target.offline_log:
            check_offline(target, server.data_dir, acked_at_kill, result)
        if rng.random() < 0.25:
            # a second crash, this time while the server starts and recovers
            server.spawn()
            result.second_kill_after = rng.uniform(0.05, 0.6)
            yield sleep(reactor, result.second_kill_after)
            yield server.kill()
        started = time.monotonic()
        yield server.start()
        result.recovery_seconds = time.monotonic() - started
        result.acked = acked_at_kill  # nothing is acked by a dead server
        yield target.resume(reactor, server, result)
        payloads = yield target.read_back(reactor, server, result)
        result.read_back = [parse_payload(target.tag, p) for p in payloads]
    finally:
        try:
            yield target.cleanup(result)
        finally:
            yield server.stop()
        result.server_output = server.output_text()
    return result


def check_offline(target, data_dir, acked, result):
    """
    Read the crashed directory as it is (torn tail and all) with the
    read-only reader: it must see whole, valid records only, and every one
    acked (an acked batch was fsynced, hence whole).
    """
    from streamproto.log.reader import LogDirectoryReader
    try:
        reader = LogDirectoryReader(data_dir)
        start, end = reader.bounds(target.offline_log)
        seqs = [parse_payload(target.tag, r)
                for batch in reader.read(target.offline_log, start, end)
                for r in batch.records()]
    except Exception as e:   # noqa: BLE001 - any failure is a finding
        result.problems.append(f"offline reader failed on the crashed directory: {e!r}")
        return
    if None in seqs:
        result.problems.append("offline reader returned a corrupt record")
    missing = acked - set(seqs)
    if missing and start == 0:
        result.problems.append(f"offline reader misses {len(missing)} acked records")


def _with_timeout(reactor, d, seconds):
    """C{d}, cancelled after C{seconds}; fires None on its failure (a timeout too)."""
    return with_timeout(d, seconds, reactor).addErrback(lambda f: None)


# -- Styx -------------------------------------------------------------------

class StyxTarget(CrashTarget):
    """styx/0 producer into one log; read back over the HTTP API."""

    name = "styx"
    plugin = "styx-server"
    # small segments: kills also land on segment rolls and index writes
    args = ("--segment-max-size", "262144", "--index-after-size", "16384")
    tag = b"styx"
    in_order = True
    log_name = "torture"
    offline_log = "torture"
    batch = 200

    def setup(self, reactor, server, result):
        from streamproto.styx.api_client import StyxClient
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor=reactor)
        return client.create_log(self.log_name).addBoth(
            lambda r: client.close().addCallback(lambda _: r))

    @defer.inlineCallbacks
    def drive(self, reactor, server, result, rng, stopping):
        from streamproto.styx.stream_client import StyxProducer
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", server.port, self.log_name,
                                              window_bytes=512 * 1024)
        seq = 0
        while not stopping[0]:
            records = [make_payload(self.tag, s, rng.randrange(0, 64))
                       for s in range(seq, seq + self.batch)]
            first = seq
            seq += self.batch
            result.sent = seq
            d = producer.writeMany(records)
            d.addCallback(lambda _, a=first, b=seq: result.acked.update(range(a, b)))
            d.addErrback(lambda f: None)
            yield producer.whenWritable()
            if producer.writable:
                yield sleep(reactor, 0)  # let acks in: never starve the reactor

    @defer.inlineCallbacks
    def read_back(self, reactor, server, result):
        from streamproto.styx.api_client import StyxClient
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor=reactor)
        try:
            records = yield client.read_records(self.log_name)
        finally:
            yield client.close()
        return records


class StyxRetentionTarget(StyxTarget):
    """
    Styx with size retention on (1 MiB kept, 256 KiB segments): kills also
    land while old segments are deleted and state.json rewritten.  What is
    served must be a contiguous run of the newest records, at least 1 MiB of
    them (the limit keeps at least that much), with every acked record from
    its first one on.
    """

    name = "styx-retention"
    offline_log = None   # retention moves the start: checked after the restart
    args = StyxTarget.args + ("--log-max-size", "1048576")
    keep_bytes = 1 << 20
    ci_trials = 2

    @defer.inlineCallbacks
    def read_back(self, reactor, server, result):
        from streamproto.styx.api_client import StyxClient
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor=reactor)
        try:
            info = yield client.get_log(self.log_name)
            records = yield client.read_records(self.log_name,
                                                position=info["start_position"])
        finally:
            yield client.close()
        seqs = [parse_payload(self.tag, p) for p in records]
        good = [s for s in seqs if s is not None]
        if good:
            first = good[0]
            if good != list(range(first, first + len(good))):
                result.problems.append("served records are not one contiguous run")
            result.acked = {s for s in result.acked if s >= first}
            served_bytes = sum(map(len, records))
            if first > 0 and served_bytes < self.keep_bytes:
                result.problems.append(f"retention kept {served_bytes} bytes, "
                                       f"less than {self.keep_bytes}")
        return records


# -- Lumberjack ---------------------------------------------------------------

class LumberjackTarget(CrashTarget):
    """
    Beats events through our Lumberjack client into the sink log.  After
    the restart the client reconnects and resends whatever was not acked
    (at least once), so every event sent must be there at least once;
    duplicates are allowed (the protocol has no dedup).  Read back with the
    read-only directory reader once the server is stopped.
    """

    name = "lumberjack"
    plugin = "lumberjack-server"
    tag = b"lj"
    duplicates_forbidden = False
    batch = 500
    max_pending = 8
    modules = ("streamproto.lumberjack.client", "streamproto.lumberjack.tap")

    @defer.inlineCallbacks
    def drive(self, reactor, server, result, rng, stopping):
        from streamproto.core.tls import client_endpoint
        from streamproto.lumberjack.client import LumberjackClient
        client = LumberjackClient(client_endpoint(reactor, "127.0.0.1", server.port),
                                  reactor, bulk_max_size=2048, backoff_initial=0.05,
                                  backoff_max=0.3, slow_start=False, timeout=30)
        result.client = client
        result.pending = set()
        seq = 0
        while not stopping[0]:
            first, seq = seq, seq + self.batch
            result.sent = seq
            events = [{"m": make_payload(self.tag, s, rng.randrange(0, 64)).decode()}
                      for s in range(first, seq)]
            d = client.send(events)
            result.pending.add(d)
            d.addCallback(lambda _, a=first, b=seq: result.acked.update(range(a, b)))
            d.addErrback(lambda f: None)
            d.addBoth(lambda _, d=d: result.pending.discard(d))
            while len(result.pending) >= self.max_pending and not stopping[0]:
                # the client retries for ever: wake up at the kill as well
                yield defer.DeferredList(list(result.pending) + [result.killed],
                                         fireOnOneCallback=True)
            yield sleep(reactor, 0)

    @defer.inlineCallbacks
    def resume(self, reactor, server, result):
        # the client resends what the dead server never acked: wait for it
        pending = list(result.pending)
        if pending:
            yield _with_timeout(reactor, defer.DeferredList(pending), 30)
        result.resent_ok = not result.pending
        if result.pending:
            result.problems.append(f"{len(result.pending)} sends never acked after restart")
        # everything sent is now acked (at least once)
        result.acked.update(range(result.sent))

    def cleanup(self, result):
        client = getattr(result, "client", None)
        return client.close() if client is not None else defer.succeed(None)

    @defer.inlineCallbacks
    def read_back(self, reactor, server, result):
        import json

        from streamproto.log.reader import LogDirectoryReader
        yield server.stop()
        reader = LogDirectoryReader(server.data_dir)
        start, end = reader.bounds("lumberjack")
        payloads = []
        for batch in reader.read("lumberjack", start, end):
            for record in batch.records():
                try:
                    payloads.append(json.loads(record)["event"]["m"].encode())
                except (ValueError, KeyError, TypeError):
                    payloads.append(b"?")
        return payloads


# -- Pravega ----------------------------------------------------------------

class PravegaTarget(CrashTarget):
    """
    One SegmentWriter (fixed writer id) appending to a segment.  After the
    restart the same writer reconnects, learns the last durable event
    number from AppendSetup and resends the rest: every event written must
    be in the segment exactly once, in order (writer dedup survives the
    crash through the log's attributes).
    """

    name = "pravega"
    plugin = "pravega-server"
    tag = b"pv"
    in_order = True
    segment = "torture/crash/0.#epoch.0"
    batch = 500
    modules = ("streamproto.pravega.client", "streamproto.pravega.tap")

    def _endpoint(self, reactor, server):
        from streamproto.core.tls import client_endpoint
        return client_endpoint(reactor, "127.0.0.1", server.port)

    @defer.inlineCallbacks
    def setup(self, reactor, server, result):
        from streamproto.pravega.client import connect
        proto = yield connect(self._endpoint(reactor, server))
        try:
            yield proto.create_segment(self.segment)
        finally:
            proto.transport.loseConnection()
            yield proto.closed

    @defer.inlineCallbacks
    def drive(self, reactor, server, result, rng, stopping):
        import uuid

        from streamproto.pravega.client import SegmentWriter
        writer = SegmentWriter(self._endpoint(reactor, server), self.segment,
                               writer_id=uuid.UUID(int=result.seed + 1), clock=reactor,
                               window_bytes=1 << 20, max_retries=400, retry_delay=0.05,
                               max_retry_delay=0.2)
        result.writer = writer
        seq = 0
        while not stopping[0]:
            first, seq = seq, seq + self.batch
            result.sent = seq
            d = writer.write_batch([make_payload(self.tag, s, rng.randrange(0, 64))
                                    for s in range(first, seq)])
            d.addCallback(lambda _, a=first, b=seq: result.acked.update(range(a, b)))
            d.addErrback(lambda f: None)
            if writer.pending > 20 * self.batch:
                yield d
            else:
                yield sleep(reactor, 0)

    @defer.inlineCallbacks
    def resume(self, reactor, server, result):
        writer = result.writer
        try:
            yield with_timeout(writer.flush(), 30, reactor)
        except Exception as e:
            result.problems.append(f"writer did not finish after the restart: {e!r}")
            return
        result.acked.update(range(result.sent))  # exactly-once: all of it must be there

    def cleanup(self, result):
        writer = getattr(result, "writer", None)
        if writer is None:
            return defer.succeed(None)
        writer.stop(None)
        return defer.succeed(None)

    @defer.inlineCallbacks
    def read_back(self, reactor, server, result):
        from streamproto.pravega import codec
        from streamproto.pravega.client import connect
        proto = yield connect(self._endpoint(reactor, server))
        try:
            info = yield proto.segment_info(self.segment)
            offset, buf, payloads = 0, b"", []
            while offset < info.write_offset:
                reply = yield proto.read_segment(self.segment, offset, 1 << 20)
                if not reply.data:
                    break
                offset += len(reply.data)
                buf += reply.data
                events, used = codec.split_events(buf)
                buf = buf[used:]
                payloads += events
            if buf:
                result.problems.append(f"{len(buf)} bytes of a torn event at the end")
        finally:
            proto.transport.loseConnection()
            yield proto.closed
        return payloads


# -- Relink -----------------------------------------------------------------

def read_log_stopped(server, name):
    """Stop the server, then read log C{name} with the read-only directory reader."""
    from streamproto.log.reader import LogDirectoryReader

    def read(_):
        reader = LogDirectoryReader(server.data_dir)
        start, end = reader.bounds(name)
        return [r for batch in reader.read(name, start, end) for r in batch.records()]
    return server.stop().addCallback(read)


class RelinkTarget(CrashTarget):
    """
    A Connector on the C{log} endpoint: channel 1 goes to log C{relink-1},
    a message acknowledged CONSUMED only once its append is durable.  The
    link state dies with the server (no resumption across a server crash),
    and the connector runs with C{failover=False} (this measures the
    server: a failing-over connector would resend the unacknowledged
    messages to the restarted server, at least once), so nothing is
    resent: exactly once, in order.
    """

    name = "relink"
    plugin = "relink-server"
    tag = b"rl"
    in_order = True
    batch = 500
    channel = 1
    offline_log = "relink-1"
    modules = ("streamproto.relink.api", "streamproto.relink.tap")

    @defer.inlineCallbacks
    def drive(self, reactor, server, result, rng, stopping):
        channel = yield self._open_channel(reactor, server, result, "log")
        # the server acks each message, a batch's Deferred only fires for the
        # whole batch: the channel's count of consumed messages is exact
        result.channel = channel
        yield self._send_until_stopped(reactor, channel, result, rng, stopping)

    @defer.inlineCallbacks
    def _open_channel(self, reactor, server, result, endpoint, **connector_options):
        """Link a Connector (kept as C{result.connector}) to C{endpoint}; its channel."""
        from streamproto.core.tls import client_endpoint
        from streamproto.relink.api import Connector
        connector = Connector(client_endpoint(reactor, "127.0.0.1", server.port), endpoint,
                              connector_id_size=4, listener_id_size=4, clock=reactor,
                              failover=False, **connector_options)
        result.connector = connector
        connector.start()
        link = yield connector.when_linked()
        return link.channel(self.channel)

    @defer.inlineCallbacks
    def _send_until_stopped(self, reactor, channel, result, rng, stopping):
        """Send batches of payloads as fast as the channel takes them."""
        seq = 0
        while not stopping[0]:
            if channel.room < self.batch:
                yield defer.DeferredList([channel.when_writable(), result.killed],
                                         fireOnOneCallback=True)
                yield sleep(reactor, 0)
                continue
            first, seq = seq, seq + self.batch
            try:
                d = self._send_batch(channel, [make_payload(self.tag, s, rng.randrange(0, 64))
                                               for s in range(first, seq)])
            except Exception:   # noqa: BLE001 - the link went down with the server
                break
            result.sent = seq
            d.addCallback(lambda ok, a=first, b=seq: ok and result.acked.update(range(a, b)))
            d.addErrback(lambda f: None)
            yield sleep(reactor, 0)

    def _send_batch(self, channel, payloads):
        """Send one batch: a Deferred firing True once the server has it durably."""
        return channel.send_payloads(payloads).addCallback(lambda _: True)

    def cleanup(self, result):
        channel = getattr(result, "channel", None)
        if channel is not None:
            result.acked.update(range(channel.consumed))
        connector = getattr(result, "connector", None)
        return connector.stop() if connector is not None else defer.succeed(None)

    def read_back(self, reactor, server, result):
        return self.cleanup(result).addCallback(
            lambda _: read_log_stopped(server, f"relink-{self.channel}"))


# -- reliable stream -----------------------------------------------------------

class ReliableTarget(CrashTarget):
    """
    One stateful session (C{count} values under a UUID) read by our
    StatefulClient while the server (SQLite sessions under --data, rate
    limited so the kill lands mid-stream) is killed.  The client
    reconnects and resumes the session from its last id on the restarted
    server; the run must end with every value received exactly once: the
    client checks the server's final CRC over the whole session.  The
    items are the value indexes the client ends up holding.
    """

    name = "reliable"
    plugin = "reliable-stream-server"
    args = ("--rate", "20000")
    tag = b"rs"
    in_order = True
    count = 60000
    ci_trials = 2   # each costs the client's 5 s reconnect delay (the spec's)
    modules = ("streamproto.reliable.client", "streamproto.reliable.tap")

    def drive(self, reactor, server, result, rng, stopping):
        import uuid

        from streamproto.core.tls import client_endpoint
        from streamproto.reliable.client import StatefulClient
        client = StatefulClient(client_endpoint(reactor, "127.0.0.1", server.port),
                                self.count, uuid=str(uuid.UUID(int=result.seed)),
                                clock=reactor, give_up_after=60)
        result.run = client.run()
        result.outcome = []
        result.run.addBoth(result.outcome.append)
        result.sent = self.count
        # driving ends at the kill; the run goes on (reconnecting) until done
        return result.killed

    @defer.inlineCallbacks
    def resume(self, reactor, server, result):
        if not result.outcome:
            yield _with_timeout(reactor, result.run, 60)
        outcome = result.outcome[0] if result.outcome else None
        if outcome is None or hasattr(outcome, "getErrorMessage"):
            result.problems.append(f"stateful session did not complete: {outcome!r}")
            result.values = []
            return
        result.values = outcome.values
        result.reconnects = outcome.reconnects
        if outcome.reconnects < 1 and result.stop_signal == "KILL":
            result.problems.append("the session ended before the kill: nothing was tested")
        result.acked.update(range(self.count))   # the CRC covers the whole session

    def read_back(self, reactor, server, result):
        values = getattr(result, "values", [])
        if len(values) != self.count:
            result.problems.append(f"{len(values)} values for a session of {self.count}")
        return defer.succeed([make_payload(self.tag, i) for i in range(len(values))])


class RelinkTransactionTarget(RelinkTarget):
    """
    The ``log-tx`` endpoint (connector transactions): 500 messages, then a
    commit; a commit acked True is durable and atomic.  Every committed
    message is there exactly once, in order, and no transaction is visible
    in part (all of its messages or none).
    """

    name = "relink-tx"
    tag = b"rt"
    channel = 2
    offline_log = "relink-2"
    ci_trials = 2

    @defer.inlineCallbacks
    def drive(self, reactor, server, result, rng, stopping):
        # no result.channel: a consumed message is not committed
        channel = yield self._open_channel(reactor, server, result, "log-tx",
                                           connector_transactions=True)
        yield self._send_until_stopped(reactor, channel, result, rng, stopping)

    def _send_batch(self, channel, payloads):
        # one transaction a batch: commit fires True once it is durable
        channel.send_payloads(payloads, ack=None)
        return channel.commit()

    @defer.inlineCallbacks
    def read_back(self, reactor, server, result):
        payloads = yield RelinkTarget.read_back(self, reactor, server, result)
        seqs = {parse_payload(self.tag, p) for p in payloads} - {None}
        for start in {s - s % self.batch for s in seqs}:
            present = len(seqs & set(range(start, start + self.batch)))
            if present != self.batch:
                result.problems.append(f"transaction {start} visible in part "
                                       f"({present}/{self.batch})")
                break
        return payloads


ALL_TARGETS = [StyxTarget(), StyxRetentionTarget(), LumberjackTarget(), PravegaTarget(),
               RelinkTarget(), RelinkTransactionTarget(), ReliableTarget()]
TARGETS = {t.name: t for t in ALL_TARGETS}


# == load ====================================================================
#
# Load: many concurrent connections to one server (a real ``twist`` child
# process, so that its RSS is its own), each streaming at a modest rate in a
# bounded loop.  Shared by ``test/torture/test_torture_load.py`` (a few hundred
# connections) and ``bench/torture_load.py`` (1,000).
#
# Each protocol's L{LoadTarget} opens C{n} clients, runs C{rounds} rounds of
# a small acknowledged write on every one (all acks must arrive), and holds
# the connections idle while the server's VmRSS is read.

class LoadResult:
    def __init__(self, target, connections):
        self.target = target
        self.connections = connections
        self.acked = 0
        self.expected = 0
        self.rss_before_kib = None
        self.rss_idle_kib = None
        self.rss_peak_kib = 0
        self.seconds = None
        self.problems = []

    @property
    def kib_per_connection(self):
        return (self.rss_idle_kib - self.rss_before_kib) / self.connections

    def describe(self):
        return (f"{self.target}: {self.connections} connections, {self.acked}/{self.expected} "
                f"acks, RSS {self.rss_before_kib} -> {self.rss_idle_kib} KiB "
                f"(peak {self.rss_peak_kib}), {self.kib_per_connection:.1f} KiB/connection, "
                f"{self.seconds:.1f}s")


def gather(ds):
    return defer.gatherResults(ds, consumeErrors=True)


class LoadTarget:
    one_round = False   # True: a single round (a whole session) per connection
    name = None
    plugin = None
    args = ()
    per_round = 10

    def setup(self, reactor, server):
        return defer.succeed(None)

    def open(self, reactor, server, i):
        """Deferred: client number C{i}, connected."""
        raise NotImplementedError

    def round(self, reactor, client, i, r):
        """Deferred firing once this round's writes of client C{i} are acked."""
        raise NotImplementedError

    def payloads(self, i, r):
        """What client C{i} writes in round C{r} (unique across clients and rounds)."""
        return [make_payload(b"L", i * 1000 + r * 10 + k) for k in range(self.per_round)]

    def close(self, client):
        return client.close()


def _endpoint(reactor, server):
    from streamproto.core.tls import client_endpoint
    return client_endpoint(reactor, "127.0.0.1", server.port)


class StyxLoad(LoadTarget):
    name = "styx"
    plugin = "styx-server"

    def setup(self, reactor, server):
        from streamproto.styx.api_client import StyxClient
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor=reactor)
        return client.create_log("load").addBoth(lambda r: client.close())

    def open(self, reactor, server, i):
        from streamproto.styx.stream_client import StyxProducer
        return StyxProducer.connect(reactor, "127.0.0.1", server.port, "load", timeout=30)

    def round(self, reactor, client, i, r):
        return client.writeMany(self.payloads(i, r))


class LumberjackLoad(LoadTarget):
    name = "lumberjack"
    plugin = "lumberjack-server"

    def open(self, reactor, server, i):
        from streamproto.lumberjack.client import LumberjackClient
        client = LumberjackClient(_endpoint(reactor, server), reactor, timeout=60,
                                  slow_start=False, bulk_max_size=64)
        return defer.succeed(client)

    def round(self, reactor, client, i, r):
        return client.send([{"m": payload.decode()} for payload in self.payloads(i, r)])


class PravegaLoad(LoadTarget):
    name = "pravega"
    plugin = "pravega-server"
    segment = "load/s/0.#epoch.0"

    @defer.inlineCallbacks
    def setup(self, reactor, server):
        from streamproto.pravega.client import connect
        proto = yield connect(_endpoint(reactor, server))
        yield proto.create_segment(self.segment)
        proto.transport.loseConnection()
        yield proto.closed

    def open(self, reactor, server, i):
        from streamproto.pravega.client import SegmentWriter
        return defer.succeed(SegmentWriter(_endpoint(reactor, server), self.segment,
                                           clock=reactor, max_retries=5))

    def round(self, reactor, client, i, r):
        return client.write_batch(self.payloads(i, r))


class RelinkLoad(LoadTarget):
    """Every connection a link to the echo endpoint; acked CONSUMED."""

    name = "relink"
    plugin = "relink-server"

    @defer.inlineCallbacks
    def open(self, reactor, server, i):
        from streamproto.relink.api import Connector
        c = Connector(_endpoint(reactor, server), "echo", connector_id_size=4,
                      listener_id_size=4, clock=reactor)
        c.start()
        link = yield c.when_linked()
        return (c, link)

    def round(self, reactor, client, i, r):
        return client[1].channel(1).send_payloads(self.payloads(i, r))

    def close(self, client):
        return client[0].stop()


class ReliableLoad(LoadTarget):
    """
    Stateful sessions, rate-limited by the server: each connection's
    session is one round's worth of messages per "round" second, and the
    client verifies every value and the final CRC.
    """

    name = "reliable"
    plugin = "reliable-stream-server"
    args = ("--rate", "20")

    def open(self, reactor, server, i):
        from streamproto.reliable.client import StatefulClient
        client = StatefulClient(_endpoint(reactor, server), 60, clock=reactor)
        client.outcome = client.run()
        return defer.succeed(client)

    one_round = True   # the whole (rate-limited) session is the one round

    def round(self, reactor, client, i, r):
        # fires with whether the session delivered every value (its CRC was
        # verified by the client, or run() would have failed)
        return client.outcome.addCallback(lambda result: len(result.values) == 60)

    def close(self, client):
        return defer.succeed(None)


ALL_LOAD = [StyxLoad(), LumberjackLoad(), PravegaLoad(), RelinkLoad(), ReliableLoad()]
LOAD_TARGETS = {t.name: t for t in ALL_LOAD}


@defer.inlineCallbacks
def run_load(reactor, target, workdir, connections=300, rounds=3, batch_open=100):
    """Open C{connections} clients, C{rounds} acknowledged rounds each, measure RSS."""
    raise_nofile_limit()
    result = LoadResult(target.name, connections)
    server = ServerProcess(reactor, target.plugin, os.path.join(workdir, target.name),
                           target.args)
    started = time.monotonic()
    clients = []
    try:
        yield server.start()
        yield target.setup(reactor, server)
        yield sleep(reactor, 0.3)
        result.rss_before_kib = server.rss_kib()
        for first in range(0, connections, batch_open):
            opened = yield gather([target.open(reactor, server, i)
                                   for i in range(first, min(connections, first + batch_open))])
            clients += opened
        if target.one_round:
            rounds = 1
            # measured while every session streams (rate-limited), before they end
            yield sleep(reactor, 1.0)
            result.rss_peak_kib = server.rss_kib()
        result.expected = connections * rounds
        for r in range(rounds):
            acks = yield gather([target.round(reactor, c, i, r)
                                 for i, c in enumerate(clients)])
            result.acked += sum(1 for a in acks if a is not False)
            result.rss_peak_kib = max(result.rss_peak_kib, server.rss_kib())
        # idle: every connection open, nothing in flight
        yield sleep(reactor, 0.5)
        result.rss_idle_kib = server.rss_kib()
        result.rss_peak_kib = max(result.rss_peak_kib, result.rss_idle_kib)
        if target.one_round:
            # the sessions have ended: the figure is the one taken while they streamed
            result.rss_idle_kib = result.rss_peak_kib
    finally:
        yield gather([defer.maybeDeferred(target.close, c) for c in clients]).addErrback(
            lambda f: None)
        yield server.stop()
        result.seconds = time.monotonic() - started
        result.server_output = server.output_text()
    return result
