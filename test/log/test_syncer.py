"""
Where the group commit's fsyncs run (L{streamproto.log.syncer}): the
accelerator's native threads when it can, the thread pool (or inline)
otherwise; either way an acknowledgement comes only after its fsync.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

from twisted.internet import defer, reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase

from streamproto.core import sendthread
from streamproto.log import MemoryLogStore, metrics, syncer
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore
from streamproto.log.result import AppendResult
from streamproto.log.segments import FileIO
from streamproto.log.syncer import NativeSyncer, ThreadSyncer, make_syncer
from test.support.ciutil import missing
from test.support.netutil import readable, wait_until

def require_native():
    """Skip without the accelerator's Syncer on a developer's machine; fail under CI."""
    if syncer._Syncer is None:
        missing("the C accelerator's Syncer is not built (Linux, setup.py build_ext)")


class FsyncCounter(FileIO):
    def __init__(self):
        self.fsyncs = 0

    def fsync(self, fd):
        self.fsyncs += 1
        super().fsync(fd)


def fsync_count() -> float:
    """How many group commits the fsync histogram has seen."""
    [family] = metrics.FSYNC_SECONDS.collect()
    return next(s.value for s in family.samples if s.name.endswith("_count"))


class ChoiceTests(SynchronousTestCase):
    def test_native_by_default(self):
        require_native()
        chosen = make_syncer(reactor, None, synchronous, FileIO(), default_io=True)
        self.assertIsInstance(chosen, NativeSyncer)

    def test_thread_pool_where_the_store_was_given_its_own_runner_or_file_layer(self):
        # fault injection wraps the file layer: its fsyncs must go through it
        self.assertIsInstance(make_syncer(reactor, synchronous, synchronous, FileIO(), True),
                              ThreadSyncer)
        self.assertIsInstance(make_syncer(reactor, None, synchronous, FsyncCounter(), False),
                              ThreadSyncer)

    def test_thread_pool_without_the_accelerators_syncer(self):
        # STREAMPROTO_PURE_PYTHON=1 leaves it out (base.speedups, whose own
        # test is test.core.test_accelerator.PureEnvTests), as does a
        # checkout without the extension built
        self.patch(syncer, "_Syncer", None)
        self.assertIsInstance(make_syncer(reactor, None, synchronous, FileIO(), True),
                              ThreadSyncer)

    def test_reactor_without_file_descriptors(self):
        from twisted.internet.task import Clock
        self.assertIsInstance(make_syncer(Clock(), None, synchronous, FileIO(), True),
                              ThreadSyncer)

    def test_injected_file_layer_sees_every_fsync(self):
        io = FsyncCounter()
        with tempfile.TemporaryDirectory() as d:
            store = FileLogStore(d, run_blocking=synchronous, io=io)
            log = self.successResultOf(store.create("a"))
            before = io.fsyncs
            self.successResultOf(log.append([b"x"]))
            self.assertGreater(io.fsyncs, before)
            self.successResultOf(store.close())


class ThreadSyncerLaneTests(SynchronousTestCase):
    """
    L{ThreadSyncer}'s lanes, on a runner that holds each run until the
    test lets it finish: the same order and merging as the native threads.
    """

    def setUp(self):
        self.runs = []

        def run_blocking(f, fds, directory):
            d = defer.Deferred()
            self.runs.append((fds, directory, d))
            return d
        self.syncer = ThreadSyncer(run_blocking, FileIO())

    def test_what_waits_for_a_lane_runs_as_one_after_it(self):
        fired = []
        a = self.syncer.sync([3], None, lane=1).addCallback(lambda _: fired.append("a"))
        b = self.syncer.sync([3, 4], None, lane=1).addCallback(lambda _: fired.append("b"))
        c = self.syncer.sync([4, 5], "/logs/x", lane=1).addCallback(lambda _: fired.append("c"))
        other = self.syncer.sync([9], None, lane=2)
        alone = self.syncer.sync([8], None)
        self.assertEqual([(fds, directory) for fds, directory, _ in self.runs],
                         [([3], None), ([9], None), ([8], None)])
        self.runs[0][2].callback(None)
        self.assertEqual(fired, ["a"])
        # b and c: each file once, in order, then the directory
        self.assertEqual(self.runs[3][:2], ([3, 4, 5], "/logs/x"))
        self.runs[3][2].callback(None)
        self.assertEqual(fired, ["a", "b", "c"])
        for d in (a, b, c):
            self.successResultOf(d)
        self.assertNoResult(other)
        self.assertNoResult(alone)
        # the lane is free again: the next sync runs at once
        self.syncer.sync([3], None, lane=1)
        self.assertEqual(len(self.runs), 5)

    def test_a_failed_run_fails_every_sync_in_it(self):
        self.syncer.sync([3], None, lane=1)
        b = self.syncer.sync([3], None, lane=1)
        c = self.syncer.sync([3], None, lane=1)
        self.runs[0][2].callback(None)
        self.runs[1][2].errback(OSError(5, "EIO"))
        self.assertEqual(self.failureResultOf(b, OSError).value.errno, 5)
        self.assertEqual(self.failureResultOf(c, OSError).value.errno, 5)


class LogLaneTests(SynchronousTestCase):
    """
    A file log hands each group commit to the syncer as soon as it has
    written it, on the log's lane, rather than after the one before is
    done: the syncer starts it the moment that one ends.
    """

    def test_appends_are_handed_over_while_an_fsync_runs(self):
        d = self.mktemp()
        store = FileLogStore(d, run_blocking=synchronous)
        self.addCleanup(lambda: self.successResultOf(store.close()))
        runs = []

        def held(f, *args):
            done = defer.Deferred()
            runs.append((f, args, done))
            return done
        lanes = []

        class Spy(ThreadSyncer):
            def sync(self, fds, directory, lane=0, *rest):
                lanes.append(lane)
                return super().sync(fds, directory, lane, *rest)
        store._syncer = Spy(held, FileIO())
        log = self.successResultOf(store.create("a"))
        del lanes[:], runs[:]     # the creation's own sync, if any
        acks = [log.append([b"record-%d" % i]) for i in range(3)]
        # three syncs handed over at once, on one lane, one of them running
        self.assertEqual(len(lanes), 3)
        self.assertEqual(len(set(lanes)), 1)
        self.assertGreater(lanes[0], 0)
        self.assertEqual(len(runs), 1)

        def finish(run):
            f, args, done = run
            f(*args)
            done.callback(None)
        finish(runs[0])
        self.assertEqual(self.successResultOf(acks[0]).end_position, 1)
        self.assertNoResult(acks[1])
        self.assertNoResult(acks[2])
        # what waited runs as one
        self.assertEqual(len(runs), 2)
        finish(runs[1])
        self.assertEqual([self.successResultOf(a).end_position for a in acks[1:]], [2, 3])
        self.assertEqual(log.info()["end_position"], 3)

    def test_a_failed_fsync_fails_what_was_handed_over_after_it(self):
        d = self.mktemp()
        store = FileLogStore(d, run_blocking=synchronous)
        self.addCleanup(lambda: store.close())
        runs = []

        def held(f, *args):
            done = defer.Deferred()
            runs.append(done)
            return done
        store._syncer = ThreadSyncer(held, FileIO())
        log = self.successResultOf(store.create("a"))
        del runs[:]
        first = log.append([b"one"])
        second = log.append([b"two"])
        runs[0].errback(OSError(5, "EIO"))
        self.failureResultOf(first)
        self.failureResultOf(second)
        # the run that waited may succeed: nothing of a failed log is
        # acknowledged after its first failed fsync
        self.assertEqual(len(runs), 2)
        runs[1].callback(None)
        self.assertEqual(log.info()["end_position"], 0)
        self.assertEqual(log.info()["status"], "tainted")


class MadeBeforeAFork:
    """A native syncer as the child of a fork finds it: made in the parent."""

    def forked(self):
        return True


class NativeSyncerTests(TestCase):
    def setUp(self):
        require_native()
        self.syncer = NativeSyncer(reactor, max_threads=2)
        self.addCleanup(self.syncer.close)
        self.file = tempfile.NamedTemporaryFile()
        self.addCleanup(self.file.close)

    @defer.inlineCallbacks
    def test_fsyncs_fire_on_the_reactor_and_leave_nothing_watched(self):
        self.assertNotIn(self.syncer, reactor.getReaders())
        before = fsync_count()
        os.write(self.file.fileno(), b"data")
        results = yield defer.gatherResults([
            self.syncer.sync([self.file.fileno()], None) for _ in range(5)
        ] + [self.syncer.sync([self.file.fileno()], os.path.dirname(self.file.name))])
        self.assertEqual(results, [None] * 6)
        self.assertEqual(fsync_count() - before, 6)
        # the eventfd stays watched until the syncer closes (no epoll_ctl
        # pair a group commit), then nothing is left in the reactor
        self.assertIn(self.syncer, reactor.getReaders())
        self.syncer.close()
        self.assertNotIn(self.syncer, reactor.getReaders())

    @defer.inlineCallbacks
    def test_a_failed_fsync_fails_its_deferred_only(self):
        bad = self.syncer.sync([10 ** 6], None)    # no such descriptor: EBADF
        good = self.syncer.sync([self.file.fileno()], None)
        error = yield self.assertFailure(bad, OSError)
        self.assertEqual(error.errno, 9)
        self.assertIsNone((yield good))

    @defer.inlineCallbacks
    def test_a_missing_directory_fails(self):
        error = yield self.assertFailure(self.syncer.sync([], "/nonexistent/dir"), OSError)
        self.assertEqual(error.errno, 2)

    @defer.inlineCallbacks
    def test_a_new_process_gets_new_threads(self):
        yield self.syncer.sync([self.file.fileno()], None)
        first = self.syncer._native
        self.syncer._native = MadeBeforeAFork()
        yield self.syncer.sync([self.file.fileno()], None)
        self.assertIsNot(self.syncer._native, first)
        # watched once, by the new eventfd
        self.assertEqual(self.syncer.fileno(), self.syncer._native.fileno())
        self.assertIn(self.syncer, reactor.getReaders())
        first.close()

    @defer.inlineCallbacks
    def test_a_fork_is_noticed(self):
        """
        In the child of a fork, the native syncer made before says so
        (its first sync there makes new threads); in the parent it does
        not.
        """
        yield self.syncer.sync([self.file.fileno()], None)
        native = self.syncer._native
        pid = os.fork()
        if pid == 0:
            os._exit(0 if native.forked() else 1)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        self.assertFalse(native.forked())

    def test_the_native_types_refuse_a_forked_child(self):
        """
        In a forked child, a native Syncer or SendThread made before the
        fork refuses to be used (its threads stayed in the parent) and
        closes without touching the parent's lock; one made in the child
        works.  The parent's go on.
        """
        from streamproto.base.speedups import speedups
        native = syncer._Syncer(2)
        sender = speedups.SendThread()
        self.addCleanup(native.close)
        self.addCleanup(sender.close)
        fd = self.file.fileno()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if not (native.forked() and sender.forked()):
                    os._exit(5)
                for call in (lambda: native.submit([fd], None), native.completed,
                             lambda: sender.socket(os.dup(fd), 1)):
                    try:
                        call()
                    except RuntimeError:
                        pass
                    else:
                        os._exit(2)
                native.close()
                sender.close()
                fresh = syncer._Syncer(1)
                if fresh.forked():
                    os._exit(6)
                fresh.submit([fd], None)
                if not readable(fresh.fileno(), 10):
                    os._exit(3)
                if [error for _, error, _ in fresh.completed()] != [0]:
                    os._exit(4)
                fresh.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        self.assertFalse(native.forked() or sender.forked())
        native.submit([fd], None)
        self.assertTrue(readable(native.fileno(), 10))
        self.assertEqual([error for _, error, _ in native.completed()], [0])

    @defer.inlineCallbacks
    def test_close_with_jobs_out_reports_them_first(self):
        os.write(self.file.fileno(), b"data")
        pending = [self.syncer.sync([self.file.fileno()], None) for _ in range(3)]
        self.syncer.close()
        self.assertIsNotNone(self.syncer._native)   # the threads still have work
        self.assertRaises(RuntimeError, self.syncer.sync, [self.file.fileno()], None)
        self.assertEqual((yield defer.gatherResults(pending)), [None] * 3)
        self.assertIsNone(self.syncer._native)
        self.assertNotIn(self.syncer, reactor.getReaders())

    def test_close_when_idle_stops_at_once(self):
        self.syncer.close()
        self.assertIsNone(self.syncer._native)
        self.assertRaises(RuntimeError, self.syncer.sync, [self.file.fileno()], None)

    def dirty_file(self, directory, mib=64):
        """A file with C{mib} MiB not yet synced: its fsync takes a while."""
        f = open(os.path.join(directory, "big"), "wb", buffering=0)
        self.addCleanup(f.close)
        chunk = b"x" * (1 << 20)
        for _ in range(mib):
            f.write(chunk)
        return f

    def completions(self, native, count):
        done = []
        while len(done) < count:
            self.assertTrue(readable(native.fileno(), 60))
            done += native.completed()
        return done

    def test_a_lane_runs_in_order_and_merges_what_waits(self):
        """
        A lane's jobs given while its first one runs wait for it, then run
        as one (the first of them timed, the others merged: -1 seconds); a
        job on no lane runs beside them, on the other thread, and is done
        first.
        """
        native = syncer._Syncer(2)
        self.addCleanup(native.close)
        d = self.mktemp()
        os.makedirs(d)
        small = open(os.path.join(d, "small"), "wb")
        self.addCleanup(small.close)
        os.fsync(small.fileno())     # nothing left to sync: its fsync is quick
        big = self.dirty_file(d)
        first = native.submit([big.fileno()], None, 7)
        second = native.submit([big.fileno()], None, 7)
        third = native.submit([small.fileno(), big.fileno()], d, 7)
        alone = native.submit([small.fileno()], None)
        done = self.completions(native, 4)
        self.assertEqual([job for job, _, _ in done], [alone, first, second, third])
        self.assertEqual([error for _, error, _ in done], [0] * 4)
        seconds = {job: s for job, _, s in done}
        self.assertGreater(seconds[first], 0)
        # a run takes every job of its lane queued when it starts: the
        # second and third merged behind the first (the first taken at
        # once: the third -1, the second too if it came before that run
        # began), or, when the thread took the first only once the second
        # was queued, the second merged into the first's run and the third
        # alone after it.  Never each alone.
        self.assertIn((seconds[second] == -1, seconds[third] == -1),
                      [(True, True), (False, True), (True, False)], seconds)

    def test_a_merged_run_fails_every_job_in_it(self):
        """
        The jobs of one run share its outcome: a bad descriptor in one
        fails the others merged with it (and they complete in order).
        """
        native = syncer._Syncer(1)
        self.addCleanup(native.close)
        d = self.mktemp()
        os.makedirs(d)
        big = self.dirty_file(d)
        first = native.submit([big.fileno()], None, 3)
        second = native.submit([10 ** 6], None, 3)   # EBADF
        third = native.submit([big.fileno()], None, 3)
        done = self.completions(native, 3)
        self.assertEqual([job for job, _, _ in done], [first, second, third])
        # runs: each starts with a timed job, merged ones follow (-1)
        runs = []
        for job, error, seconds in done:
            if seconds >= 0:
                runs.append([])
            runs[-1].append((job, error))
        for run in runs:
            self.assertEqual(len({error for _, error in run}), 1, run)
        errors = dict((job, error) for run in runs for job, error in run)
        self.assertEqual(errors[second], 9)
        # the third merged with the second (given while the lane ran), or,
        # when the thread took the first only once the second was queued,
        # alone after their run: its own fsync then, which succeeds
        with_second = next(run for run in runs if (second, 9) in run)
        self.assertEqual(errors[third], 9 if (third, 9) in with_second else 0, runs)

    def test_bad_arguments(self):
        from streamproto._speedups import Syncer
        native = Syncer(1)
        self.addCleanup(native.close)
        self.assertRaises(ValueError, native.submit, [], None, -1)
        self.assertRaises(TypeError, native.submit, [], None, "lane")
        self.assertRaises(ValueError, self.syncer.sync, [-1], None)
        self.assertRaises(TypeError, self.syncer.sync, ["x"], None)
        self.assertRaises(TypeError, self.syncer.sync, 5, None)
        self.assertEqual(self.syncer._out, {})
        from streamproto._speedups import Syncer
        self.assertRaises(ValueError, Syncer, 0)


class NoMemoryTests(SynchronousTestCase):
    """The native Syncer when the interpreter cannot allocate its answer."""

    def setUp(self):
        require_native()
        try:
            import _testcapi
        except ImportError:
            # CPython's test module: absent from some distributions' builds
            missing("_testcapi (CPython's C-API test module)")
        self.testcapi = _testcapi

    def test_completed_keeps_the_jobs_when_the_list_cannot_be_made(self):
        """
        No memory for completed()'s list: it raises, and the jobs stay
        done for the next call, with the eventfd readable again (freed
        there, their acknowledgements would never come).
        """
        native = syncer._Syncer(1)
        self.addCleanup(native.close)
        f = tempfile.TemporaryFile()
        self.addCleanup(f.close)
        job = native.submit([f.fileno()], None)
        self.assertTrue(readable(native.fileno(), 10))
        # nothing between the hooks but the call (assertRaises allocates)
        self.testcapi.set_nomemory(0)
        try:
            native.completed()
        except MemoryError:
            raised = True
        else:
            raised = False
        finally:
            self.testcapi.remove_mem_hooks()
        self.assertTrue(raised)
        self.assertTrue(readable(native.fileno(), 0))
        [(done, error, _)] = native.completed()
        self.assertEqual((done, error), (job, 0))


class StoreOnNativeThreadsTests(TestCase):
    """A store on the real reactor: its acks wait for the native fsync."""

    def setUp(self):
        require_native()

    @defer.inlineCallbacks
    def test_acknowledged_appends_are_read_back_by_a_fresh_process(self):
        d = self.mktemp()
        store = FileLogStore(d)
        self.assertIsInstance(store._syncer, NativeSyncer)
        log = yield store.create("events")
        before = fsync_count()
        results = yield defer.gatherResults(
            [log.append([b"record-%d" % i]) for i in range(50)])
        self.assertEqual(results[-1].end_position, 50)
        self.assertGreater(fsync_count(), before)
        yield store.close()
        self.assertIsNone(store._syncer._native)
        out = subprocess.run(
            [sys.executable, "-c",
             "import sys\n"
             "from streamproto.log.filestore import FileLogStore\n"
             "from streamproto.log.file import synchronous\n"
             "s = FileLogStore(sys.argv[1], run_blocking=synchronous)\n"
             "log = s.get(sys.argv[2]).result\n"
             "print(log.info()['record_count'])\n", d, "events"],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self.assertEqual(out.stdout.strip(), "50")

    @defer.inlineCallbacks
    def test_a_failed_fsync_fail_stops_the_log(self):
        d = self.mktemp()
        store = FileLogStore(d)
        self.addCleanup(store.close)
        log = yield store.create("events")
        yield log.append([b"first"])
        real = store._syncer.sync
        self.patch(store._syncer, "sync",
                   lambda fds, directory, *rest: real([10 ** 6], directory, *rest))
        yield self.assertFailure(log.append([b"second"]), Exception)
        self.assertIsNotNone(log.failed)


class PreparedAnswerTests(TestCase):
    """C{ILog.append(prepare_answers=...)} on the file store: asked for once,
    before the fsync, with the result the append then fires with; the held
    answers it gives go out from the syncer's thread, only once durable."""

    def setUp(self):
        require_native()

    @defer.inlineCallbacks
    def log_and_socket(self):
        """A file store on the native syncer and a log in it; a native
        socket to hold answers on, and the peer that receives them."""
        store = FileLogStore(self.mktemp())
        self.addCleanup(store.close)
        log = yield store.create("events")
        thread = sendthread._SendThread()
        self.addCleanup(thread.close)
        a, b = socket.socketpair()
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        b.setblocking(False)
        sock = thread.socket(os.dup(a.fileno()), 1)
        self.addCleanup(sock.close)
        return store, log, sock, b

    @defer.inlineCallbacks
    def test_asked_before_the_fsync_with_the_result(self):
        store = FileLogStore(self.mktemp())
        self.addCleanup(store.close)
        log = yield store.create("events")
        yield log.append([b"first"])
        asked = []

        def prepare(result):
            asked.append((result, log.end_position))
            return ()
        result = yield log.append([b"a", b"b"], prepare_answers=prepare)
        # asked as the fsync was handed over, when nothing of it was synced
        self.assertEqual(asked, [(AppendResult(1, 3, 7), 1)])
        self.assertEqual(result, asked[0][0])

    @defer.inlineCallbacks
    def test_appends_sharing_an_fsync_each_asked_in_order(self):
        store = FileLogStore(self.mktemp())
        self.addCleanup(store.close)
        log = yield store.create("events")
        asked = []
        # the first append's fsync runs while the others are written: those
        # two share the next one, and each is asked for once, in order
        ds = [log.append([b"r%d" % i], prepare_answers=lambda r, i=i: asked.append(i) or ())
              for i in range(3)]
        results = yield defer.gatherResults(ds)
        self.assertEqual(asked, [0, 1, 2])
        self.assertEqual([r.first_position for r in results], [0, 1, 2])

    @defer.inlineCallbacks
    def test_held_answers_go_out_once_durable(self):
        store, log, sock, b = yield self.log_and_socket()
        holds = []

        def prepare(result):
            holds.append(sock.hold(b"ack %d" % result.end_position))
            return holds
        yield log.append([b"x"], prepare_answers=prepare)
        yield wait_until(lambda: not holds[0].pending)
        self.assertTrue(holds[0].sent)
        self.assertTrue(readable(b.fileno(), 10))
        self.assertEqual(b.recv(100), b"ack 1")

    @defer.inlineCallbacks
    def test_readers_never_behind_an_answer(self):
        """The answer leaves from the fsync's thread before the reactor
        learns of the fsync: a reader it serves meanwhile (here, before it
        runs again at all) already sees the record."""
        store, log, sock, b = yield self.log_and_socket()
        d = log.append([b"x"], prepare_answers=lambda r: [sock.hold(b"ack")])
        self.assertEqual(log.end_position, 0)
        # the reactor does not run until this test yields
        self.assertTrue(readable(b.fileno(), 10))
        self.assertEqual(b.recv(100), b"ack")
        self.assertNoResult(d)
        self.assertEqual((log.end_position, log.end_offset), (1, 1))
        self.assertEqual(log.info()["record_count"], 1)
        records = yield log.read(0)
        self.assertEqual([bytes(r) for r in records], [b"x"])
        result = yield d
        self.assertEqual(result.end_position, 1)
        self.assertEqual(log.end_position, 1)

    @defer.inlineCallbacks
    def test_not_after_a_failed_fsync(self):
        store, log, sock, b = yield self.log_and_socket()
        real = store._syncer.sync
        self.patch(store._syncer, "sync",
                   lambda fds, directory, *rest: real([10 ** 6], directory, *rest))
        holds = []
        yield self.assertFailure(
            log.append([b"x"], prepare_answers=lambda r: holds.append(sock.hold(b"ack")) or holds),
            Exception)
        self.assertEqual(len(holds), 1)
        self.assertFalse(holds[0].sent or holds[0].pending)
        self.assertFalse(readable(b.fileno(), 0.05))

    @defer.inlineCallbacks
    def test_stores_that_cannot_never_ask(self):
        asked = []
        threads = FileLogStore(self.mktemp(), run_blocking=synchronous)
        self.addCleanup(threads.close)
        memory = MemoryLogStore()
        for store in (threads, memory):
            log = yield store.create("events")
            yield log.append([b"x"], prepare_answers=asked.append)
        self.assertEqual(asked, [])
