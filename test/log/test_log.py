"""The log store: both implementations, recovery, durability, retention."""

import errno
import os
import random
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial import unittest
from zope.interface.verify import verifyObject

from streamproto.log import (
    ILog, ILogStore, InvalidLogName, LogClosed, LogConfig, LogExists, LogFailed, LogNotFound,
    MemoryLogStore, PositionOutOfRange, RecordTooLarge,
)
from streamproto.log.errors import WriteFailed
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore
from streamproto.log.format import SEGMENT_HEADER_SIZE
from streamproto.log.reader import LogDirectoryReader
from streamproto.log.segments import FileIO
from test.support.powerloss import HeldJobs


def tempdir(case):
    path = tempfile.mkdtemp(prefix="streamproto-log-")
    case.addCleanup(shutil.rmtree, path, True)
    return path


class FaultyIO(FileIO):
    """Injects errors into fsync or write once armed."""

    def __init__(self):
        self.fail_fsync = False
        self.fail_write = None
        self.fsyncs = 0

    def fsync(self, fd):
        self.fsyncs += 1
        if self.fail_fsync:
            raise OSError(errno.EIO, "injected fsync failure")
        super().fsync(fd)

    def writev(self, fd, buffers):
        if self.fail_write is not None:
            # a torn write: half of it reaches the file, then the disk is full
            flat = b"".join(bytes(b) for b in buffers)
            os.write(fd, flat[:len(flat) // 2])
            raise OSError(self.fail_write, os.strerror(self.fail_write))
        return super().writev(fd, buffers)


class StoreBehaviour:
    """The same behaviour suite for every ILogStore implementation."""

    def make_store(self):
        raise NotImplementedError

    def reopen(self, store):
        """A new store over the same data (memory stores return themselves)."""
        return store

    def setUp(self):
        self.clock = Clock()
        self.store = self.make_store()

    def log(self, name="events", config=None):
        return self.successResultOf(self.store.create(name, config))

    def test_interfaces(self):
        self.assertTrue(verifyObject(ILogStore, self.store))
        self.assertTrue(verifyObject(ILog, self.log()))

    def test_append_and_read(self):
        log = self.log()
        r1 = self.successResultOf(log.append([b"a", b"bb", b""]))
        r2 = self.successResultOf(log.append([b"cccc"]))
        self.assertEqual((r1.first_position, r2.first_position), (0, 3))
        self.assertEqual((r2.end_position, r2.end_offset), (4, 7))
        batch = self.successResultOf(log.read(0))
        self.assertEqual(batch.records(), [b"a", b"bb", b"", b"cccc"])
        self.assertEqual(batch.next_position, 4)
        self.assertEqual(self.successResultOf(log.read(1, max_records=2)).records(),
                         [b"bb", b""])
        self.assertEqual(len(self.successResultOf(log.read(4))), 0)
        self.assertEqual(log.info()["record_count"], 4)
        self.assertEqual(log.info()["end_position"], 4)

    def test_conditional_append(self):
        """
        An append with C{expected_position} is written only where it was
        expected; otherwise it fails with L{AppendConflict}, writing nothing.
        """
        from streamproto.log.errors import AppendConflict
        log = self.log()
        r = self.successResultOf(log.append([b"first"], expected_position=0))
        self.assertEqual(r.first_position, 0)
        self.failureResultOf(log.append([b"stale"], expected_position=0), AppendConflict)
        self.failureResultOf(log.append([b"ahead"], expected_position=5), AppendConflict)
        r = self.successResultOf(log.append([b"second"], attributes={"v": 2},
                                            expected_position=1))
        self.assertEqual((r.first_position, r.end_position), (1, 2))
        self.assertEqual(self.successResultOf(log.read(0)).records(), [b"first", b"second"])
        self.assertEqual(log.attributes["v"], 2)

    def test_conditional_attributes(self):
        """
        An append with C{expected_attributes} is written only while each
        key still has the value it expects (None: unset), counting appends
        issued before it and not yet synced; otherwise it fails with
        L{AppendConflict}, writing nothing.
        """
        from streamproto.log.errors import AppendConflict
        log = self.log()
        first = log.append([b"e1"], {"w": 1}, expected_attributes={"w": None})
        # issued right behind the first, expecting what the first sets
        second = log.append([b"e2"], {"w": 2}, expected_attributes={"w": 1})
        stale = log.append([b"e2 again"], {"w": 2}, expected_attributes={"w": 1})
        unset = log.append([b"e1 again"], {"w": 1}, expected_attributes={"w": None})
        other = log.append([b"x"], {"v": 7}, expected_attributes={"v": None, "w": 2})
        self.successResultOf(first)
        self.successResultOf(second)
        self.failureResultOf(stale, AppendConflict)
        self.failureResultOf(unset, AppendConflict)
        self.assertEqual(self.successResultOf(other).first_position, 2)
        self.assertEqual(self.successResultOf(log.read(0)).records(), [b"e1", b"e2", b"x"])
        self.assertEqual((log.attributes["w"], log.attributes["v"]), (2, 7))

    def test_append_record_batch(self):
        from streamproto.log.batch import RecordBatch
        log = self.log()
        batch = RecordBatch.from_records(99, [b"ab", b"", b"cde"])  # its position is ignored
        r = self.successResultOf(log.append(batch))
        self.assertEqual((r.first_position, r.end_position, r.end_offset), (0, 3, 5))
        self.assertEqual(self.successResultOf(log.read(0)).records(), [b"ab", b"", b"cde"])
        big = RecordBatch.from_records(0, [b"x" * 9])
        small = self.successResultOf(self.store.create("small", LogConfig(max_record_size=8)))
        self.failureResultOf(small.append(big), RecordTooLarge)

    def test_read_max_bytes_gives_whole_records_and_at_least_one(self):
        log = self.log()
        self.successResultOf(log.append([b"x" * 10, b"y" * 10, b"z" * 10]))
        self.assertEqual(self.successResultOf(log.read(0, max_bytes=25)).records(),
                         [b"x" * 10, b"y" * 10])
        self.assertEqual(self.successResultOf(log.read(0, max_bytes=3)).records(), [b"x" * 10])

    def test_read_out_of_range(self):
        log = self.log()
        self.successResultOf(log.append([b"a"]))
        self.failureResultOf(log.read(2), PositionOutOfRange)
        self.failureResultOf(log.read(-1), PositionOutOfRange)

    def test_read_bytes_and_offsets(self):
        log = self.log()
        self.successResultOf(log.append([b"hello", b"world", b"!"]))
        self.assertEqual(self.successResultOf(log.read_bytes(3, 5)), b"lowor")
        self.assertEqual(self.successResultOf(log.read_bytes(0)), b"helloworld!")
        self.assertEqual(self.successResultOf(log.read_bytes(11)), b"")
        self.failureResultOf(log.read_bytes(12), PositionOutOfRange)
        self.assertEqual(self.successResultOf(log.position_of_offset(0)), 0)
        self.assertEqual(self.successResultOf(log.position_of_offset(7)), 1)
        self.assertEqual(self.successResultOf(log.position_of_offset(10)), 2)
        self.assertEqual(self.successResultOf(log.position_of_offset(11)), 3)

    def test_record_too_large(self):
        log = self.log(config=LogConfig(max_record_size=4))
        self.failureResultOf(log.append([b"ok", b"too big"]), RecordTooLarge)
        self.assertEqual(log.end_position, 0)

    def test_names_create_get_delete(self):
        self.log("a")
        self.log("b")
        self.assertEqual(self.store.names(), ["a", "b"])
        self.failureResultOf(self.store.create("a"), LogExists)
        self.failureResultOf(self.store.get("nope"), LogNotFound)
        self.successResultOf(self.store.delete("a"))
        self.assertEqual(self.store.names(), ["b"])
        self.failureResultOf(self.store.delete("a"), LogNotFound)

    def test_invalid_names(self):
        for bad in ["", "../x", "a/b", "a.b", ".", "x" * 201, "é"]:
            self.failureResultOf(self.store.create(bad), InvalidLogName)
            self.failureResultOf(self.store.get(bad), InvalidLogName)

    def test_attributes_must_map_names_to_integers(self):
        """
        Every store refuses an attribute map that is not str -> int (a bool
        or a string value, a non-string key) before anything is written.
        """
        log = self.log()
        for bad in ({"writer": True}, {"writer": "1"}, {1: 1}):
            self.failureResultOf(log.append([b"a"], bad), TypeError)
        self.assertEqual((log.end_position, log.attributes), (0, {}))

    def test_attributes_persist(self):
        log = self.log()
        self.successResultOf(log.append([b"a"], {"writer": 1}))
        self.successResultOf(log.append([], {"writer": 2, "other": 7}))
        self.assertEqual(log.attributes, {"writer": 2, "other": 7})
        store = self.reopen(self.store)
        log2 = self.successResultOf(store.get("events"))
        self.assertEqual(log2.attributes, {"writer": 2, "other": 7})
        self.assertEqual(log2.end_position, 1)

    def test_wait_fires_on_append_and_on_timeout(self):
        log = self.log()
        d = log.wait(0)
        self.assertNoResult(d)
        self.successResultOf(log.append([b"a"]))
        self.assertEqual(self.successResultOf(d), 1)
        d2 = log.wait(1, timeout=5)
        self.clock.advance(4)
        self.assertNoResult(d2)
        self.clock.advance(1)
        self.assertEqual(self.successResultOf(d2), 1)
        self.assertEqual(self.successResultOf(log.wait(0)), 1)

    def test_wait_offset(self):
        log = self.log()
        d = log.wait_offset(3)
        self.successResultOf(log.append([b"abc"]))
        self.assertNoResult(d)
        self.successResultOf(log.append([b"d"]))
        self.assertEqual(self.successResultOf(d), 4)

    def test_wait_cancel_and_delete(self):
        log = self.log()
        d = log.wait(0, timeout=10)
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        d2 = log.wait(0)
        self.successResultOf(self.store.delete("events"))
        self.failureResultOf(d2, LogClosed)
        self.failureResultOf(log.append([b"x"]), LogClosed)

    def test_truncate(self):
        log = self.log()
        self.successResultOf(log.append([b"r%d" % i for i in range(10)]))
        self.assertEqual(self.successResultOf(log.truncate(4)), 4)
        self.failureResultOf(log.read(3), PositionOutOfRange)
        self.assertEqual(self.successResultOf(log.read(4, max_records=1)).records(), [b"r4"])
        self.assertEqual(self.successResultOf(log.truncate()), 10)
        self.assertEqual(log.info()["record_count"], 0)
        r = self.successResultOf(log.append([b"after"]))
        self.assertEqual(r.first_position, 10)
        store = self.reopen(self.store)
        log2 = self.successResultOf(store.get("events"))
        self.assertEqual((log2.start_position, log2.end_position), (10, 11))
        self.assertEqual(self.successResultOf(log2.read(10)).records(), [b"after"])

    def test_truncate_offset(self):
        log = self.log()
        self.successResultOf(log.append([b"hello", b"world"]))
        self.assertEqual(self.successResultOf(log.truncate_offset(7)), 7)
        self.assertEqual(log.start_offset, 7)
        self.assertEqual(self.successResultOf(log.read_bytes(7)), b"rld")
        self.failureResultOf(log.read_bytes(6), PositionOutOfRange)
        self.failureResultOf(log.truncate_offset(11), PositionOutOfRange)


    def test_offset_of_position(self):
        """
        L{ILog.offset_of_position} is where a record starts, its first
        record's too after a truncation inside it.
        """
        log = self.log()
        self.successResultOf(log.append([b"hello", b"", b"world"]))
        self.assertEqual([self.successResultOf(log.offset_of_position(p)) for p in range(4)],
                         [0, 5, 5, 10])
        self.successResultOf(log.truncate_offset(7))
        self.assertEqual(log.start_position, 2)
        self.assertEqual(self.successResultOf(log.offset_of_position(2)), 5)
        self.failureResultOf(log.offset_of_position(1), PositionOutOfRange)
        self.failureResultOf(log.offset_of_position(4), PositionOutOfRange)

    def test_skip_to(self):
        """
        An empty log skipped to a position and offset goes on from there,
        also once reopened: what a copy of a log with a truncated head needs.
        """
        log = self.log()
        self.assertEqual(self.successResultOf(log.skip_to(1000, 50000)), 1000)
        self.assertEqual((log.start_position, log.end_position), (1000, 1000))
        self.assertEqual((log.start_offset, log.end_offset), (50000, 50000))
        r = self.successResultOf(log.append([b"abc", b"de"], attributes={"w": 7}))
        self.assertEqual((r.first_position, r.end_position, r.end_offset), (1000, 1002, 50005))
        store = self.reopen(self.store)
        log2 = self.successResultOf(store.get("events"))
        self.assertEqual((log2.start_position, log2.end_position), (1000, 1002))
        self.assertEqual((log2.start_offset, log2.end_offset), (50000, 50005))
        self.assertEqual(self.successResultOf(log2.read(1000)).records(), [b"abc", b"de"])
        self.assertEqual(self.successResultOf(log2.read_bytes(50003)), b"de")
        self.assertEqual(self.successResultOf(log2.offset_of_position(1001)), 50003)
        self.assertEqual(log2.attributes, {"w": 7})
        self.failureResultOf(log2.read(999), PositionOutOfRange)

    def test_skip_to_refused(self):
        """
        A skip of a log with records, or backwards, or of one coordinate
        only, fails with L{AppendConflict} and changes nothing; a log whose
        records were all truncated may skip on from its end.
        """
        from streamproto.log.errors import AppendConflict
        log = self.log()
        self.assertEqual(self.successResultOf(log.skip_to(0, 0)), 0)  # where it is: nothing
        self.successResultOf(log.append([b"abc"]))
        self.failureResultOf(log.skip_to(10, 10), AppendConflict)
        self.successResultOf(log.truncate())
        self.failureResultOf(log.skip_to(0, 0), AppendConflict)
        self.failureResultOf(log.skip_to(1, 10), AppendConflict)   # position stays
        self.failureResultOf(log.skip_to(5, 2), AppendConflict)    # offset back
        self.assertEqual((log.end_position, log.end_offset), (1, 3))
        self.assertEqual(self.successResultOf(log.skip_to(5, 3)), 5)
        self.assertEqual(self.successResultOf(log.append([b"x"])).first_position, 5)


class MemoryStoreTests(StoreBehaviour, unittest.SynchronousTestCase):
    def make_store(self):
        return MemoryLogStore(self.clock)


class JetStreamStoreTests(StoreBehaviour, unittest.SynchronousTestCase):
    """
    The same suite on a real three-node JetStream cluster (R3,
    C{sync_interval: always}), through the synchronous bridge: each call
    waits for the cluster's answer, so the Deferreds have fired when it
    returns, as with the file store's C{run_blocking=synchronous}.
    """

    def make_store(self):
        from streamproto.log.bridge import SynchronousBridge
        from streamproto.log.jetstream import JetStreamLogStore
        from test.support.natsutil import shared_cluster, unique_prefix
        cluster = shared_cluster()
        if not hasattr(self, "prefix"):
            self.prefix = unique_prefix(self)
            self.addCleanup(self.delete_streams, cluster)
        store = JetStreamLogStore(cluster.urls, prefix=self.prefix, clock=self.clock,
                                  bridge=SynchronousBridge(), retention_interval=None)
        self.addCleanup(store.close)
        return store

    def reopen(self, store):
        self.successResultOf(store.close())
        return self.make_store()

    def delete_streams(self, cluster):
        from streamproto.log.bridge import SynchronousBridge
        from streamproto.log.jetstream import JetStreamLogStore
        store = JetStreamLogStore(cluster.urls, prefix=self.prefix, clock=self.clock,
                                  bridge=SynchronousBridge(), retention_interval=None)
        self.successResultOf(store.start())
        for name in store.names():
            self.successResultOf(store.delete(name))
        self.successResultOf(store.close())


class CountingIO(FileIO):
    """Counts the bytes read from segment files."""

    read_bytes = 0

    def pread(self, fd, n, offset):
        data = super().pread(fd, n, offset)
        self.read_bytes += len(data)
        return data


class FileStoreTests(StoreBehaviour, unittest.SynchronousTestCase):
    def make_store(self, path=None, **kwargs):
        self.path = path or getattr(self, "path", None) or tempdir(self)
        store = FileLogStore(self.path, reactor=self.clock, run_blocking=synchronous,
                             retention_interval=None, **kwargs)
        self.addCleanup(store.close)
        return store

    def reopen(self, store):
        self.successResultOf(store.close())
        return self.make_store()

    def test_skip_to_cut_short(self):
        """
        A skip_to that stopped after its state file, before its segment:
        the reopened log goes on from the state's start, whole.
        """
        import json as json_
        log = self.log()
        self.successResultOf(log.append([b"abc", b"de"]))
        self.successResultOf(log.truncate())
        self.successResultOf(self.store.close())
        state_path = os.path.join(self.path, "events", "state.json")
        with open(state_path) as f:
            state = json_.load(f)
        # as skip_to writes it: the new start, and where the empty log ended
        state.update(start_position=500, start_offset=9000, skipped_from=[2, 5])
        with open(state_path, "w") as f:
            json_.dump(state, f)
        store = self.make_store()
        log = self.successResultOf(store.get("events"))
        self.assertEqual((log.start_position, log.end_position, log.start_offset,
                          log.end_offset), (500, 500, 9000, 9000))
        self.assertEqual(self.successResultOf(log.append([b"x"])).first_position, 500)
        self.assertEqual(self.successResultOf(log.read_bytes(9000)), b"x")

    def test_sequential_reads_touch_each_batch_once(self):
        """
        A reader going through the log in byte-bounded reads (a styx/0
        consumer) leaves a batch that does not fit whole to the next read
        instead of reading, checksumming and cutting it, and that next read
        starts right at it: each batch is read from the file once.
        """
        io = CountingIO()
        store = self.make_store(path=tempdir(self), io=io)
        log = self.successResultOf(store.create("events"))
        batches = [[bytes([i]) * 1000] * 600 for i in range(4)]   # 600 KB each
        for records in batches:
            self.successResultOf(log.append(records))
        io.read_bytes = 0
        position, got = 0, []
        while position < log.end_position:
            batch = self.successResultOf(log.read(position, -1, 1024 * 1024))
            self.assertEqual(len(batch), 600)      # one whole batch a read, never cut
            got.extend(batch.records())
            position = batch.next_position
        self.assertEqual(got, [r for records in batches for r in records])
        payload = 4 * 600 * 1000
        # each batch read once, plus the slack of each read's first chunk
        # (reading the next batch too, as before, would be about 5x)
        self.assertLess(io.read_bytes, payload * 2)

    def test_segments_roll_and_reads_cross_them(self):
        log = self.log(config=LogConfig(segment_max_count=3, index_after_size=1))
        for i in range(5):
            self.successResultOf(log.append([b"%d-%d" % (i, j) for j in range(2)]))
        segs = sorted(n for n in os.listdir(os.path.join(self.path, "events"))
                      if n.endswith(".seg"))
        self.assertEqual(len(segs), 5)  # an append never straddles the count limit
        got = []
        position = 0
        while position < log.end_position:
            batch = self.successResultOf(log.read(position))
            got += batch.records()
            position = batch.next_position
        self.assertEqual(got, [b"%d-%d" % (i, j) for i in range(5) for j in range(2)])
        data = b""
        while len(data) < log.end_offset:  # like read(), one segment per call
            data += self.successResultOf(log.read_bytes(len(data), 100))
        self.assertEqual(data, b"".join(got))

    def test_retention_by_count_keeps_at_least_the_limit(self):
        log = self.log(config=LogConfig(segment_max_count=2, log_max_count=3))
        for i in range(10):
            self.successResultOf(log.append([b"%d" % i]))
        self.assertGreaterEqual(log.end_position - log.start_position, 3)
        self.assertLessEqual(log.end_position - log.start_position, 3 + 2)
        self.assertEqual(self.successResultOf(log.read(log.start_position)).records()[0],
                         b"%d" % log.start_position)
        self.failureResultOf(log.read(0), PositionOutOfRange)

    def test_retention_by_size(self):
        log = self.log(config=LogConfig(segment_max_count=1, log_max_size=400))
        for _i in range(20):
            self.successResultOf(log.append([b"x" * 50]))
        # the limit is in durable payload bytes: at least 400 kept, and less
        # than one more segment (one 50-byte record each here)
        kept = log.end_offset - log.start_offset
        self.assertGreaterEqual(kept, 400)
        self.assertLess(kept, 400 + 50)
        self.assertGreater(log.start_position, 0)

    def test_retention_by_age(self):
        log = self.log(config=LogConfig(segment_max_age=10, log_max_age=60))
        self.successResultOf(log.append([b"old"]))
        self.clock.advance(11)
        self.successResultOf(log.append([b"new"]))    # rolls: a new segment
        self.assertEqual(log.start_position, 0)
        self.clock.advance(61)
        self.successResultOf(log.append([b"newer"]))  # retention runs after each sync
        self.assertEqual(log.start_position, 1)

    def test_no_ack_before_fsync(self):
        runner = HeldJobs()
        io = FaultyIO()
        store = FileLogStore(tempdir(self), reactor=self.clock, run_blocking=runner, io=io,
                             retention_interval=None)
        log = self.successResultOf(store.create("events"))
        runner.run_all()
        before = io.fsyncs
        d1 = log.append([b"a"])
        d2 = log.append([b"b"])
        self.assertNoResult(d1)
        self.assertNoResult(d2)
        self.assertEqual(len(self.successResultOf(log.read(0))), 0)  # not visible yet
        self.assertEqual(len(runner.jobs), 1)  # one fsync in flight, for d1
        f, args, kwargs, job = runner.jobs.pop(0)
        self.assertNoResult(d1)
        f(*args, **kwargs)
        self.assertGreater(io.fsyncs, before)
        job.callback(None)
        self.assertEqual(self.successResultOf(d1).end_position, 1)
        self.assertNoResult(d2)  # written after that fsync began: needs the next one
        runner.run_all()
        self.assertEqual(self.successResultOf(d2).end_position, 2)

    def test_group_commit_second_fsync_for_late_appends(self):
        runner = HeldJobs()
        store = FileLogStore(tempdir(self), reactor=self.clock, run_blocking=runner,
                             retention_interval=None)
        log = self.successResultOf(store.create("events"))
        runner.run_all()
        d1 = log.append([b"a"])
        f, args, kwargs, job = runner.jobs.pop(0)
        d2 = log.append([b"b"])          # arrives while the first fsync runs
        f(*args, **kwargs)
        job.callback(None)
        self.assertEqual(self.successResultOf(d1).end_position, 1)
        self.assertNoResult(d2)
        runner.run_all()
        self.assertEqual(self.successResultOf(d2).end_position, 2)

    def test_group_commit_appends_made_by_acknowledgements(self):
        """
        Appends that acknowledgements make (each keep-alive connection's
        next request, parsed once its answer went out) share one fsync,
        handed over once every acknowledgement ran: not one fsync for the
        first and another for the rest.
        """
        runner = HeldJobs()
        store = FileLogStore(tempdir(self), reactor=self.clock, run_blocking=runner,
                             retention_interval=None)
        log = self.successResultOf(store.create("events"))
        runner.run_all()
        log.append([b"x"])                # its fsync runs while a, b, c arrive
        nexts = []
        for record in (b"a", b"b", b"c"):
            log.append([record]).addCallback(
                lambda _, r=record: nexts.append(log.append([r + b"2"])))
        runner.run()                      # x's fsync; then one run for a, b and c
        self.assertEqual(len(runner.jobs), 1)
        runner.run()                      # a, b, c acknowledged: each appends
        self.assertEqual(len(nexts), 3)
        self.assertEqual(len(runner.jobs), 1)   # one fsync for a2, b2 and c2
        runner.run()
        self.assertEqual([self.successResultOf(d).end_position for d in nexts], [7, 7, 7])
        self.assertEqual(runner.jobs, [])

    def test_fsync_failure_fail_stops(self):
        io = FaultyIO()
        store = self.make_store(io=io)
        log = self.successResultOf(store.create("events"))
        self.successResultOf(log.append([b"safe"]))
        io.fail_fsync = True
        self.failureResultOf(log.append([b"lost"]), LogFailed)
        io.fail_fsync = False
        self.failureResultOf(log.append([b"refused"]), LogFailed)  # no retry-and-pretend
        self.assertEqual(log.info()["status"], "tainted")
        self.assertEqual(log.end_position, 1)
        store2 = self.reopen(store)
        log2 = self.successResultOf(store2.get("events"))
        self.assertEqual(self.successResultOf(log2.read(0)).records()[0], b"safe")
        self.successResultOf(log2.append([b"again"]))

    def test_write_failure_rolls_back(self):
        io = FaultyIO()
        store = self.make_store(io=io)
        log = self.successResultOf(store.create("events"))
        self.successResultOf(log.append([b"one"]))
        io.fail_write = errno.ENOSPC
        self.failureResultOf(log.append([b"two", b"three"]), WriteFailed)
        io.fail_write = None
        r = self.successResultOf(log.append([b"four"]))
        self.assertEqual(r.first_position, 1)
        self.assertEqual(self.successResultOf(log.read(0)).records(), [b"one", b"four"])
        log2 = self.successResultOf(self.reopen(store).get("events"))
        self.assertEqual(self.successResultOf(log2.read(0)).records(), [b"one", b"four"])

    def test_corrupt_sealed_data_is_never_served(self):
        log = self.log(config=LogConfig(segment_max_count=2))
        for i in range(4):
            self.successResultOf(log.append([b"record-%d" % i]))
        first = os.path.join(self.path, "events", "%020d.seg" % 0)
        with open(first, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"XXX")
        failure = self.failureResultOf(log.read(0))
        self.assertIn("checksum", str(failure.value))
        self.assertEqual(log.info()["status"], "corrupt")

    def test_directory_reader_matches(self):
        log = self.log(config=LogConfig(segment_max_count=4, index_after_size=16))
        expected = []
        for i in range(7):
            recs = [b"%d:%d" % (i, j) for j in range(3)]
            expected += recs
            self.successResultOf(log.append(recs))
        self.successResultOf(log.truncate(2))
        reader = LogDirectoryReader(self.path)
        self.assertEqual(reader.names(), ["events"])
        self.assertEqual(reader.bounds("events"), (2, 21))
        got = [r for b in reader.read("events", 2, 21, max_bytes=10) for r in b.records()]
        self.assertEqual(got, expected[2:])
        got = [r for b in reader.read("events", 5, 9) for r in b.records()]
        self.assertEqual(got, expected[5:9])
        self.assertRaises(PositionOutOfRange, list, reader.read("events", 0, 5))
        self.assertRaises(LogNotFound, reader.bounds, "nope")

    def test_directory_reader_sees_appends_after_a_cached_scan(self):
        log = self.log()
        self.successResultOf(log.append([b"a", b"b"]))
        reader = LogDirectoryReader(self.path)
        self.assertEqual(reader.bounds("events"), (0, 2))
        self.successResultOf(log.append([b"c"]))
        self.successResultOf(log.append([b"d", b"e"]))
        self.assertEqual(reader.bounds("events"), (0, 5))  # resumed, not rescanned
        got = [r for b in reader.read("events", 1, 5) for r in b.records()]
        self.assertEqual(got, [b"b", b"c", b"d", b"e"])
        # a torn batch after the cached part ends what a reader sees
        seg = os.path.join(self.path, "events", "%020d.seg" % 0)
        self.successResultOf(log.append([b"f"]))
        with open(seg, "r+b") as f:
            f.truncate(os.path.getsize(seg) - 1)
        self.assertEqual(reader.bounds("events"), (0, 5))

    def test_big_append_splits_into_batches(self):
        from streamproto.log import format as fmt
        self.patch(fmt, "MAX_BATCH_DATA", 100)
        import streamproto.log.file as file_module
        self.patch(file_module, "MAX_BATCH_DATA", 100)
        log = self.log()
        records = [bytes([i]) * 30 for i in range(10)]
        self.successResultOf(log.append(records, {"k": 1}))
        self.assertEqual(self.successResultOf(log.read(0)).records(), records)
        log2 = self.successResultOf(self.reopen(self.store).get("events"))
        self.assertEqual(self.successResultOf(log2.read(0)).records(), records)
        self.assertEqual(log2.attributes, {"k": 1})


class CrashRecoveryTests(unittest.SynchronousTestCase):
    """
    Simulated crashes: everything fsynced stays, the unsynced tail is cut
    anywhere or garbled, and recovery must give back exactly a prefix of what
    was written that includes every acknowledged record.
    """

    def crash_copy(self, path):
        copy = tempdir(self)
        shutil.rmtree(copy)
        shutil.copytree(path, copy)
        return copy

    def run_trial(self, seed):
        rnd = random.Random(seed)
        clock = Clock()
        runner = HeldJobs()
        path = tempdir(self)
        store = FileLogStore(path, reactor=clock, run_blocking=runner, retention_interval=None)
        config = LogConfig(segment_max_size=rnd.choice([300, 2000, 1 << 20]))
        log = self.successResultOf(store.create("events", config))
        runner.run_all()
        written = []
        acked = 0
        for _ in range(rnd.randint(1, 8)):
            recs = [rnd.randbytes(rnd.randint(0, 60)) for _ in range(rnd.randint(1, 6))]
            written += recs
            log.append(recs)
            if rnd.random() < 0.6:
                runner.run_all()
                acked = len(written)
        runner.jobs.clear()  # the fsyncs that never happened
        copy = self.crash_copy(path)
        # the crash: the unsynced tail of the newest segment is cut or garbled
        seg_dir = os.path.join(copy, "events")
        newest = sorted(n for n in os.listdir(seg_dir) if n.endswith(".seg"))[-1]
        seg_path = os.path.join(seg_dir, newest)
        synced_size = self.synced_size(log, newest)
        size = os.path.getsize(seg_path)
        if size > synced_size:
            action = rnd.choice(["cut", "garble", "both"])
            with open(seg_path, "r+b") as f:
                if action in ("cut", "both"):
                    size = rnd.randint(synced_size, size)
                    f.truncate(size)
                if action in ("garble", "both") and size > synced_size:
                    at = rnd.randint(synced_size, size - 1)
                    f.seek(at)
                    f.write(bytes([rnd.randrange(256)]))
        store2 = FileLogStore(copy, reactor=clock, run_blocking=synchronous,
                              retention_interval=None)
        log2 = self.successResultOf(store2.get("events"))
        got = []
        position = 0
        while position < log2.end_position:
            batch = self.successResultOf(log2.read(position))
            got += batch.records()
            position = batch.next_position
        self.assertEqual(got, written[:len(got)], f"seed {seed}: not a prefix")
        self.assertGreaterEqual(len(got), acked, f"seed {seed}: lost acked records")
        self.cut_unsynced += len(got) < len(written)
        # and the recovered log takes appends again
        self.successResultOf(log2.append([b"after-crash"]))
        self.successResultOf(store2.close())
        for seg in log._segments:  # the crashed process's files
            os.close(seg.fd)

    def synced_size(self, log, seg_name):
        """Bytes of segment C{seg_name} that the last completed fsync covered."""
        for seg in log._segments:
            if os.path.basename(seg.path) == seg_name:
                if seg.position >= log.end_position and seg.position > 0:
                    return 0
                if seg.end_position <= log.end_position:
                    return seg.size
                # partly synced: find the batch boundary at the synced end
                from streamproto.log.segments import iter_batches
                for _buf, h, at in iter_batches(log._io, seg.fd, SEGMENT_HEADER_SIZE,
                                               seg.position, seg.offset, seg.size):
                    if h.end_position == log.end_position:
                        return at + h.size
                return SEGMENT_HEADER_SIZE
        return 0

    def test_random_crashes(self):
        self.cut_unsynced = 0
        for seed in range(150):
            self.run_trial(seed)
        # the trials did cut into unsynced data, not only clean tails
        self.assertGreater(self.cut_unsynced, 20)

    def test_damaged_durable_batch_is_refused_not_cut(self):
        """
        Bit rot inside acknowledged data in the last segment, with whole
        batches after it: recovery must not cut everything from there on
        (that would silently drop acked records); the log is corrupt.
        """
        from streamproto.log import CorruptLog
        path = tempdir(self)
        clock = Clock()
        store = FileLogStore(path, reactor=clock, run_blocking=synchronous,
                             retention_interval=None)
        log = self.successResultOf(store.create("events"))
        for i in range(3):
            self.successResultOf(log.append([b"record-%d" % i * 10]))  # each acked
        self.successResultOf(store.close())
        seg = os.path.join(path, "events", "%020d.seg" % 0)
        with open(seg, "r+b") as f:
            f.seek(SEGMENT_HEADER_SIZE + 40 + 4 + 5)  # inside the first batch's data
            f.write(b"X")
        store2 = FileLogStore(path, reactor=clock, run_blocking=synchronous,
                              retention_interval=None)
        self.failureResultOf(store2.get("events"), CorruptLog)
        self.assertEqual(os.path.getsize(seg) > 3 * 100, True)  # nothing was cut

    def test_torn_new_segment_header(self):
        path = tempdir(self)
        clock = Clock()
        store = FileLogStore(path, reactor=clock, run_blocking=synchronous,
                             retention_interval=None)
        log = self.successResultOf(store.create("events", LogConfig(segment_max_count=1)))
        self.successResultOf(log.append([b"a"]))
        self.successResultOf(log.append([b"b"]))
        self.successResultOf(store.close())
        with open(os.path.join(path, "events", "%020d.seg" % 2), "wb") as f:
            f.write(b"SPSEG")  # a crash while creating the next segment
        store2 = FileLogStore(path, reactor=clock, run_blocking=synchronous,
                              retention_interval=None)
        log2 = self.successResultOf(store2.get("events"))
        self.assertEqual(log2.end_position, 2)
        self.assertEqual(self.successResultOf(log2.append([b"c"])).first_position, 2)


class LogModel(RuleBasedStateMachine):
    """Appends, reads, truncation and reopening against a list."""

    def __init__(self):
        super().__init__()
        self.path = tempfile.mkdtemp(prefix="streamproto-sm-")
        self.clock = Clock()
        self.config = LogConfig(segment_max_size=400, index_after_size=64)
        self.open()
        self.log = self.result(self.store.create("m", self.config))
        self.model = []
        self.start = 0
        self.attrs = {}

    def open(self):
        self.store = FileLogStore(self.path, reactor=self.clock, run_blocking=synchronous,
                                  retention_interval=None)

    @staticmethod
    def result(d):
        out = []
        d.addBoth(out.append)
        assert out, "deferred did not fire synchronously"
        if isinstance(out[0], Exception) or hasattr(out[0], "raiseException"):
            out[0].raiseException()
        return out[0]

    @rule(records=st.lists(st.binary(max_size=80), max_size=12),
          attr=st.one_of(st.none(), st.integers(0, 1 << 40)))
    def append(self, records, attr):
        attrs = {"a": attr} if attr is not None else None
        r = self.result(self.log.append(records, attrs))
        assert r.first_position == len(self.model)
        self.model += records
        if attrs:
            self.attrs.update(attrs)

    @rule(position=st.integers(0, 200), max_records=st.integers(-1, 20),
          max_bytes=st.integers(0, 500))
    def read(self, position, max_records, max_bytes):
        if not self.start <= position <= len(self.model):
            return
        batch = self.result(self.log.read(position, max_records, max_bytes))
        got = batch.records()
        expect = self.model[position:]
        if max_records >= 0:
            expect = expect[:max_records]
        assert got == expect[:len(got)]
        if expect and max_records != 0:
            assert got, "no record returned though one was available"
        assert sum(map(len, got)) <= max_bytes or len(got) == 1

    @rule(offset=st.integers(0, 3000), max_bytes=st.integers(1, 300))
    def read_bytes(self, offset, max_bytes):
        data = b"".join(self.model)
        start_offset = sum(map(len, self.model[:self.start]))
        if not start_offset <= offset <= len(data):
            return
        got = self.result(self.log.read_bytes(offset, max_bytes))
        assert got and got == data[offset:offset + len(got)] or offset == len(data)

    @rule(position=st.integers(0, 200))
    def truncate(self, position):
        position = min(position, len(self.model))
        self.start = max(self.start, self.result(self.log.truncate(position)))
        assert self.start == max(self.start, position)

    @rule()
    def reopen(self):
        self.result(self.store.close())
        self.open()
        self.log = self.result(self.store.get("m"))

    @invariant()
    def coordinates(self):
        assert self.log.end_position == len(self.model)
        assert self.log.start_position == self.start
        assert self.log.end_offset == sum(map(len, self.model))
        assert self.log.attributes == self.attrs

    def teardown(self):
        self.result(self.store.close())
        shutil.rmtree(self.path, True)


class StateMachineTests(unittest.SynchronousTestCase):
    def test_against_model(self):
        run_state_machine_as_test(LogModel, settings=settings(
            max_examples=60, stateful_step_count=30, deadline=None,
            suppress_health_check=list(HealthCheck)))


class ConcurrencyTests(unittest.TestCase):
    """Many appenders on one log with the real reactor and real fsync threads."""

    timeout = 60

    @defer.inlineCallbacks
    def test_many_appenders(self):
        store = FileLogStore(tempdir(self), reactor=reactor)
        self.addCleanup(store.close)
        log = yield store.create("events")
        writers, rounds = 20, 25

        @defer.inlineCallbacks
        def writer(w):
            results = []
            for i in range(rounds):
                r = yield log.append([b"%d:%d:%d" % (w, i, k) for k in range(3)])
                results.append(r)
            return results

        all_results = yield defer.gatherResults([writer(w) for w in range(writers)])
        self.assertEqual(log.end_position, writers * rounds * 3)
        firsts = sorted(r.first_position for rs in all_results for r in rs)
        self.assertEqual(firsts, list(range(0, writers * rounds * 3, 3)))
        for rs in all_results:
            for r in rs:
                self.assertGreaterEqual(r.end_position, r.first_position + 3)
        seen = []
        position = 0
        while position < log.end_position:
            batch = yield log.read(position)
            seen += batch.records()
            position = batch.next_position
        for w in range(writers):  # every writer's records in its own order
            mine = [r for r in seen if r.startswith(b"%d:" % w)]
            self.assertEqual(mine, [b"%d:%d:%d" % (w, i, k) for i in range(rounds)
                                    for k in range(3)])

    @defer.inlineCallbacks
    def test_follower_wakes_from_fsync(self):
        store = FileLogStore(tempdir(self), reactor=reactor)
        self.addCleanup(store.close)
        log = yield store.create("events")
        waiting = log.wait(0, timeout=10)
        yield log.append([b"x"])
        end = yield waiting
        self.assertEqual(end, 1)
        batch = yield log.read(0)
        self.assertEqual(batch.records(), [b"x"])
