"""
C{streamproto store copy}'s engine on memory and file stores: positions,
offsets, boundaries and attributes kept; resuming; refusing another log
of the same name; a corrupt source; a source written meanwhile; following.
"""

import os
import shutil
import tempfile

from twisted.internet.task import Clock
from twisted.trial import unittest

from streamproto.log import LogConfig, MemoryLogStore
from streamproto.log.copy import (
    JOURNAL_LOG, CopyFailed, CopyRefused, Digest, SourceWritten, StoreCopy, last_journal_entry,
    select,
)
from streamproto.log.copy.plan import Bounds, resume_point
from streamproto.log.errors import StoreUnavailable
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore


def records(n, size=10, tag=b""):
    return [(tag + b"%d:" % i).ljust(size, b"x") for i in range(n)]


class SelectTests(unittest.SynchronousTestCase):
    def test_patterns(self):
        names = ["a", "events", "events-2", "pravega_s_1", "pravega-controller", JOURNAL_LOG]
        self.assertEqual(select(names), sorted(n for n in names if n != JOURNAL_LOG))
        self.assertEqual(select(names, ["events*"]), ["events", "events-2"])
        self.assertEqual(select(names, ["pravega*"], ["pravega_*"]), ["pravega-controller"])
        self.assertEqual(select(names, ["a", "nothing"]), ["a"])


class ResumePointTests(unittest.SynchronousTestCase):
    def test_fresh(self):
        self.assertEqual(resume_point("l", Bounds(0, 5, 0, 50), 0, None).position, 0)
        start = resume_point("l", Bounds(3, 5, 35, 50), 30, None)
        self.assertEqual((start.position, start.skip), (3, (3, 30)))

    def test_resume(self):
        start = resume_point("l", Bounds(0, 5, 0, 50), 0, Bounds(0, 2, 0, 20))
        self.assertEqual((start.position, start.check, start.offset), (2, 1, 20))

    def test_refusals(self):
        with self.assertRaises(CopyRefused):
            resume_point("l", Bounds(0, 5, 0, 50), 0, Bounds(0, 6, 0, 60))
        with self.assertRaises(CopyRefused):
            resume_point("l", Bounds(10, 15, 100, 150), 100, Bounds(0, 2, 0, 20))
        with self.assertRaises(CopyRefused):
            resume_point("l", Bounds(0, 5, 0, 50), 0, Bounds(4, 4, 7, 7))


class DigestTests(unittest.SynchronousTestCase):
    def test_same_however_cut(self):
        from streamproto.log.batch import RecordBatch
        recs = records(10, 7)
        whole, cut = Digest(), Digest()
        whole.feed(RecordBatch.from_records(0, recs))
        cut.feed(RecordBatch.from_records(0, recs[:3]))
        cut.feed(RecordBatch.from_records(3, recs[3:]))
        self.assertEqual(whole, cut)
        other = Digest()
        other.feed(RecordBatch.from_records(0, [b"".join(recs[:2])] + recs[2:]))
        self.assertNotEqual(whole, other)   # the same bytes, other boundaries


def temp_file_store(case, clock, **options):
    """
    A file store (synchronous, no retention rounds) in a fresh temporary
    directory, closed and removed after C{case}.

    @return: C{(path, store)}.
    """
    path = tempfile.mkdtemp(prefix="streamproto-copy-")
    case.addCleanup(shutil.rmtree, path, True)
    store = FileLogStore(path, reactor=clock, run_blocking=synchronous, retention_interval=None,
                         **options)
    case.addCleanup(store.close)
    return path, store


class CopyTestsMixin:
    """The engine between two stores made by C{make_store}."""

    def setUp(self):
        self.clock = Clock()
        self.src = self.make_store("src")
        self.dst = self.make_store("dst")

    def get(self, store, name):
        return self.successResultOf(store.get(name))

    def copy(self, **kwargs):
        kwargs.setdefault("describe", "test")
        copier = StoreCopy(self.src, self.dst, self.clock, **kwargs)
        return copier, copier.run()

    def assertSameLog(self, name):
        a, b = self.get(self.src, name), self.get(self.dst, name)
        self.assertEqual(Bounds.of(a), Bounds.of(b))
        self.assertEqual(a.attributes, b.attributes)
        self.assertEqual(a.config, b.config)
        if a.end_position > a.start_position:
            self.assertEqual(self.successResultOf(a.read(a.start_position, max_bytes=1 << 30)),
                             self.successResultOf(b.read(b.start_position, max_bytes=1 << 30)))

    def test_copy_keeps_positions_offsets_attributes(self):
        """
        Every log, internal ones included, arrives with the same positions,
        offsets, boundaries, attributes and configuration; a log whose head
        was truncated (inside a record too) starts where the source's does.
        """
        config = LogConfig(log_max_count=1000, max_record_size=4096)
        events = self.successResultOf(self.src.create("events", config))
        self.successResultOf(events.append(records(50), attributes={"writer-1": 49}))
        self.successResultOf(events.append([b"", b"z" * 3000, b""]))
        controller = self.successResultOf(self.src.create("pravega-controller"))
        self.successResultOf(controller.append([b'{"scopes": {}}']))
        segment = self.successResultOf(self.src.create("pravega_s_t_0"))
        self.successResultOf(segment.append(records(20, 33)))
        self.successResultOf(segment.truncate_offset(5 * 33 + 7))
        self.successResultOf(self.src.create("empty"))
        gone = self.successResultOf(self.src.create("all-truncated"))
        self.successResultOf(gone.append(records(4)))
        self.successResultOf(gone.truncate())
        _, d = self.copy()
        report = self.successResultOf(d)
        for name in ["events", "pravega-controller", "pravega_s_t_0", "empty", "all-truncated"]:
            self.assertSameLog(name)
        self.assertEqual(report["events"]["records"], 53)
        self.assertEqual(self.get(self.dst, "pravega_s_t_0").start_offset, 5 * 33 + 7)
        self.assertEqual(self.successResultOf(
            self.get(self.dst, "pravega_s_t_0").offset_of_position(5)), 5 * 33)
        entry = self.successResultOf(last_journal_entry(self.dst))
        self.assertEqual(entry["event"], "verified")
        self.assertEqual(entry["logs"]["events"]["records"], 53)

    def test_selected_logs_only(self):
        for name in ("a1", "a2", "b1"):
            log = self.successResultOf(self.src.create(name))
            self.successResultOf(log.append([name.encode()]))
        self.successResultOf(self.copy(include=("a*",), exclude=("a2",))[1])
        self.assertEqual([n for n in self.dst.names() if n != JOURNAL_LOG], ["a1"])

    def test_resume_copies_each_record_once(self):
        """
        A copy cut short (the destination failing under it) and run again
        finishes with every record once, where it was.
        """
        log = self.successResultOf(self.src.create("events"))
        self.successResultOf(log.append(records(30000, 100)))
        original = self.dst
        self.dst = FailingAfter(original, appends=2)
        failure = self.failureResultOf(self.copy()[1], CopyFailed)
        self.assertIn("events", failure.getErrorMessage())
        partial = self.get(original, "events")
        self.assertTrue(0 < partial.end_position < 30000, partial.end_position)
        entry = self.successResultOf(last_journal_entry(original))
        self.assertEqual(entry["event"], "start")   # not marked complete
        self.dst = original
        report = self.successResultOf(self.copy()[1])
        self.assertEqual(report["events"]["records"], 30000)
        self.assertSameLog("events")

    def test_refuses_a_different_log_of_the_same_name(self):
        log = self.successResultOf(self.src.create("events"))
        self.successResultOf(log.append(records(10)))
        other = self.successResultOf(self.dst.create("events"))
        self.successResultOf(other.append(records(3, tag=b"other")))
        failure = self.failureResultOf(self.copy()[1], CopyRefused)
        self.assertIn("different log of the same name", failure.getErrorMessage())
        self.assertEqual(self.get(self.dst, "events").end_position, 3)  # untouched
        config = self.successResultOf(self.dst.create("configured", LogConfig(log_max_count=5)))
        del config
        self.successResultOf(self.src.create("configured"))
        self.successResultOf(self.dst.delete("events"))
        failure = self.failureResultOf(self.copy()[1], CopyRefused)
        self.assertIn("configuration", failure.getErrorMessage())

    def test_source_written_during_copy_is_refused(self):
        """
        Without follow, a source log that grows while the copy runs makes
        it fail (saying so) rather than pass an arbitrary point off as the
        copy; the same copy run again goes on.
        """
        log = self.successResultOf(self.src.create("events"))
        self.successResultOf(log.append(records(10)))
        self.src = WritingWhileRead(self.src)
        failure = self.failureResultOf(self.copy()[1], SourceWritten)
        self.assertIn("--follow", failure.getErrorMessage())
        self.src = self.src.store
        self.successResultOf(self.copy()[1])
        self.assertSameLog("events")

    def test_follow_until_stopped(self):
        """
        With follow, what is appended to the source (records, attributes,
        new logs) keeps being copied; stop() finishes, verifies and fires.
        """
        log = self.successResultOf(self.src.create("events"))
        self.successResultOf(log.append(records(5)))
        copier, d = self.copy(follow=True)
        self.assertNoResult(d)
        self.successResultOf(log.append(records(7, tag=b"late"), attributes={"w": 1}))
        self.clock.advance(1)
        self.assertEqual(self.get(self.dst, "events").end_position, 12)
        new = self.successResultOf(self.src.create("new"))
        self.successResultOf(new.append([b"n"]))
        self.clock.advance(1)
        self.successResultOf(log.append([b"last"]))
        copier.stop()
        self.clock.advance(1)
        report = self.successResultOf(d)
        self.assertEqual(report["events"]["records"], 13)
        self.assertSameLog("events")
        self.assertSameLog("new")


class MemoryCopyTests(CopyTestsMixin, unittest.SynchronousTestCase):
    def make_store(self, name):
        return MemoryLogStore(self.clock)

    def test_corrupt_source_stops_the_copy(self):
        """
        A record the source cannot read back intact stops the copy, naming
        the log and position; nothing of it or after it is written.
        """
        from streamproto.log.errors import CorruptLog
        log = self.successResultOf(self.src.create("events"))
        self.successResultOf(log.append(records(100)))
        real_read = log.read

        def read(position, max_records=-1, max_bytes=1048576):
            if position <= 40 < position + (max_records if max_records > 0 else 1 << 30):
                if position == 40:
                    from twisted.internet.defer import fail
                    return fail(CorruptLog("batch at position 40: checksum mismatch"))
                max_records = 40 - position
            return real_read(position, max_records, max_bytes)
        log.read = read
        failure = self.failureResultOf(self.copy()[1], CopyFailed)
        self.assertIn("log events", failure.getErrorMessage())
        self.assertIn("position 40 corrupt", failure.getErrorMessage())
        self.assertEqual(self.get(self.dst, "events").end_position, 40)


    def test_verification_catches_a_bad_destination(self):
        """
        A destination that stores other bytes than it was given (one per
        append flipped here) fails the verification, naming the log.
        """
        log = self.successResultOf(self.src.create("events"))
        self.successResultOf(log.append(records(100)))
        self.dst = Flipping(self.dst)
        failure = self.failureResultOf(self.copy()[1], CopyFailed)
        self.assertIn("log events: verification failed over [0, 100)", failure.getErrorMessage())
        entry = self.successResultOf(last_journal_entry(self.dst.store))
        self.assertEqual(entry["event"], "start")


class FileToMemoryCopyTests(CopyTestsMixin, unittest.SynchronousTestCase):
    def make_store(self, name):
        if name == "dst":
            return MemoryLogStore(self.clock)
        return temp_file_store(self, self.clock)[1]


class MemoryToFileCopyTests(CopyTestsMixin, unittest.SynchronousTestCase):
    def make_store(self, name):
        if name == "src":
            return MemoryLogStore(self.clock)
        return temp_file_store(self, self.clock)[1]

    def test_corrupt_file_source(self):
        """A damaged byte in a file store source stops the copy naming the log."""
        path, src = temp_file_store(self, self.clock, inline_reads=False)
        log = self.successResultOf(src.create("events", LogConfig(segment_max_count=10)))
        for i in range(5):
            self.successResultOf(log.append(records(10, tag=b"%d" % i)))
        self.successResultOf(src.close())
        seg = os.path.join(path, "events", "00000000000000000020.seg")
        with open(seg, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        self.src = FileLogStore(path, reactor=self.clock, run_blocking=synchronous,
                                retention_interval=None, inline_reads=False)
        self.addCleanup(self.src.close)
        failure = self.failureResultOf(self.copy()[1], CopyFailed)
        self.assertIn("log events", failure.getErrorMessage())
        self.assertIn("position 20 corrupt", failure.getErrorMessage())
        copied = self.get(self.dst, "events")
        self.assertEqual(copied.end_position, 20)


class LiveFileSourceTests(unittest.SynchronousTestCase):
    """
    A data directory a server is writing, copied through the read-only
    view and reopened each round: never changed, its torn tail ignored.
    """

    def setUp(self):
        from streamproto.log.copy.readonly import open_read_only, reopening_store
        self.clock = Clock()
        self.path, self.server = temp_file_store(self, self.clock)
        self.log = self.successResultOf(self.server.create("events"))
        self.successResultOf(self.log.append(records(10)))
        self.view = open_read_only(self.path, self.clock, run_blocking=synchronous)
        self.refresh = reopening_store(self.path, self.clock, run_blocking=synchronous)
        self.dst = MemoryLogStore(self.clock)

    def tear(self):
        """A batch half written at the end of the segment, as a server leaves it mid-write."""
        seg = os.path.join(self.path, "events", "00000000000000000000.seg")
        with open(seg, "ab") as f:
            f.write(b"SPB1" + b"\x00" * 20)
        return seg, os.path.getsize(seg)

    def test_follow_and_leave_the_source_alone(self):
        seg, size = self.tear()
        copier = StoreCopy(self.view, self.dst, self.clock, follow=True, refresh=self.refresh)
        d = copier.run()
        self.assertEqual(os.path.getsize(seg), size)    # the torn tail is not cut
        self.assertEqual(self.successResultOf(self.dst.get("events")).end_position, 10)
        with open(seg, "r+b") as f:   # the server's write completes... as a new append
            f.truncate(size - 24)
        self.successResultOf(self.log.append(records(5, tag=b"more"), attributes={"w": 5}))
        self.clock.advance(1)
        copied = self.successResultOf(self.dst.get("events"))
        self.assertEqual((copied.end_position, copied.attributes), (15, {"w": 5}))
        copier.stop()
        self.clock.advance(1)
        self.assertEqual(self.successResultOf(d)["events"]["records"], 15)

    def test_written_without_follow_is_refused(self):
        """Without follow, a directory written meanwhile fails the copy; run again, it goes on."""
        copier = StoreCopy(self.view, self.dst, self.clock, refresh=self.refresh)
        self.successResultOf(self.view.get("events"))   # what the view sees: 10 records
        self.successResultOf(self.log.append([b"meanwhile"]))
        failure = self.failureResultOf(copier.run(), SourceWritten)
        self.assertIn("1 records after the 10 copied", failure.getErrorMessage())
        again = StoreCopy(self.refresh().result, self.dst, self.clock, refresh=self.refresh)
        self.assertEqual(self.successResultOf(again.run())["events"]["records"], 11)


class StoreProxy:
    """
    A store that is C{store} but for its logs (the copy's journal aside),
    each of which L{wrap} makes into another: the one mechanism of the
    faulty and lagging stores below.
    """

    def __init__(self, store):
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get(self, name):
        return self.store.get(name).addCallback(self._wrapped)

    def create(self, name, config=None):
        return self.store.create(name, config).addCallback(self._wrapped)

    def _wrapped(self, log):
        return log if log.name == JOURNAL_LOG else self.wrap(log)

    def wrap(self, log):
        raise NotImplementedError


class LogProxy:
    """A log that is C{log} but for what a subclass defines."""

    def __init__(self, log):
        self._log = log

    def __getattr__(self, name):
        return getattr(self._log, name)


class Flipping(StoreProxy):
    """A store whose logs store each append with its first byte flipped."""

    def wrap(self, log):
        return FlippedLog(log)


class FlippedLog(LogProxy):
    def append(self, records, *args, **kwargs):
        from streamproto.log.batch import RecordBatch
        if len(records):
            data = bytearray(bytes(records.data))
            data[0] ^= 1
            records = RecordBatch(records.position, records.lengths, bytes(data))
        return self._log.append(records, *args, **kwargs)


class FailingAfter(StoreProxy):
    """A store whose logs fail every append after the first C{appends}."""

    def __init__(self, store, appends):
        super().__init__(store)
        self.left = appends

    def wrap(self, log):
        return FailingLog(log, self)


class FailingLog(LogProxy):
    def __init__(self, log, store):
        super().__init__(log)
        self._owner = store

    def append(self, *args, **kwargs):
        from twisted.internet.defer import fail
        self._owner.left -= 1
        if self._owner.left < 0:
            return fail(StoreUnavailable("unreachable"))
        return self._log.append(*args, **kwargs)


class WritingWhileRead(StoreProxy):
    """A source store whose logs, at the first read of any, get a record appended."""

    def __init__(self, store):
        super().__init__(store)
        self.written = False

    def wrap(self, log):
        return WrittenAtFirstRead(log, self)


class WrittenAtFirstRead(LogProxy):
    def __init__(self, log, store):
        super().__init__(log)
        self._owner = store

    def read(self, *args, **kwargs):
        d = self._log.read(*args, **kwargs)
        if not self._owner.written:
            self._owner.written = True
            self._log.append([b"meanwhile"])
        return d


class Lagging(StoreProxy):
    """
    A source store whose open logs learn of appends late, as a JetStream
    front-end's do (its follower): a log's C{end_position} is the end as of
    its last C{get} or its last C{wait} fired, and a C{wait} fires C{lag}
    seconds after the append that ends it.
    """

    def __init__(self, store, clock, lag=0.5):
        super().__init__(store)
        self.clock = clock
        self.lag = lag

    def wrap(self, log):
        return LaggingLog(log, self.clock, self.lag)


class LaggingLog(LogProxy):
    def __init__(self, log, clock, lag):
        super().__init__(log)
        self._clock = clock
        self._lag = lag
        self.end_position = log.end_position

    def wait(self, position, timeout=None):
        from twisted.internet import task

        def learned(result):
            self.end_position = self._log.end_position
            return result
        return self._log.wait(position, timeout).addCallback(
            lambda result: task.deferLater(self._clock, self._lag, lambda: result)
        ).addCallback(learned)


class LaggingSourceTests(unittest.SynchronousTestCase):
    """
    The ends a copy stops or checks at are read from the source store
    then, not from what its open logs had learned (seen in CI: the record
    acknowledged just before SIGTERM, not yet seen by the copy's follower,
    was left out of a C{--follow} copy that said it had caught up).
    """

    def setUp(self):
        self.clock = Clock()
        self.store = MemoryLogStore(self.clock)
        self.src = Lagging(self.store, self.clock)
        self.dst = MemoryLogStore(self.clock)
        self.log = self.successResultOf(self.store.create("events"))
        self.successResultOf(self.log.append(records(5)))

    def test_stop_catches_up_with_the_store(self):
        copier = StoreCopy(self.src, self.dst, self.clock, follow=True, describe="test")
        d = copier.run()
        self.successResultOf(self.log.append(records(7, tag=b"late")))
        self.clock.advance(1)
        self.assertEqual(self.successResultOf(self.dst.get("events")).end_position, 12)
        self.successResultOf(self.log.append([b"just before the stop"]))
        copier.stop()
        self.clock.advance(1)
        self.assertEqual(self.successResultOf(d)["events"]["records"], 13)
        self.assertEqual(self.successResultOf(self.dst.get("events")).end_position, 13)

    def test_written_meanwhile_is_seen_in_the_store(self):
        copier = StoreCopy(Lagging(WritingWhileRead(self.store), self.clock),
                           self.dst, self.clock, describe="test")
        self.failureResultOf(copier.run(), SourceWritten)
