"""
How the file store reads: batches kept in the parts they were read into,
and reads served by the page cache on the calling thread.
"""

import errno
import os
import sys

from twisted.internet.defer import maybeDeferred
from twisted.internet.task import Clock
from twisted.trial import unittest

from streamproto.log.batch import RecordBatch, lengths_array
from streamproto.log.filestore import FileLogStore
from streamproto.log.segments import FileIO, PageCacheIO


def records(n, size=100, start=0):
    return [bytes([(start + i) % 251]) * (size + (start + i) % 7) for i in range(n)]


class PartsTests(unittest.SynchronousTestCase):
    """L{RecordBatch.from_parts}: several buffers, joined only on demand."""

    def setUp(self):
        self.recs = records(10)
        lengths = lengths_array(map(len, self.recs))
        a, b, c = b"".join(self.recs[:3]), b"".join(self.recs[3:4]), b"".join(self.recs[4:])
        self.views = [memoryview(a), memoryview(b), memoryview(c)]
        self.batch = RecordBatch.from_parts(
            7, [(lengths[:3], a), (lengths[3:4], b), (lengths[4:], c)])

    def test_chunks_are_the_parts(self):
        chunks = self.batch.chunks()
        self.assertEqual([len(lengths) for lengths, _ in chunks], [3, 1, 6])
        self.assertEqual([bytes(data) for _, data in chunks],
                         [bytes(v) for v in self.views])
        for lengths, data in chunks:
            self.assertEqual(sum(lengths), len(data))

    def test_nbytes_without_joining(self):
        self.assertEqual(self.batch.nbytes, sum(map(len, self.recs)))
        self.assertIsNone(self.batch._data)

    def test_data_joins_once(self):
        data = self.batch.data
        self.assertEqual(bytes(data), b"".join(self.recs))
        self.assertIs(self.batch.data, data)

    def test_records_slice_and_equality(self):
        self.assertEqual(self.batch.records(), self.recs)
        self.assertEqual(self.batch.slice(2, 5).records(), self.recs[2:5])
        self.assertEqual(self.batch, RecordBatch.from_records(7, self.recs))
        self.assertEqual(len(self.batch), 10)
        self.assertEqual(self.batch.next_position, 17)

    def test_one_part_is_a_plain_batch(self):
        batch = RecordBatch.from_parts(0, [(lengths_array([3]), b"abc")])
        self.assertEqual(len(batch.chunks()), 1)
        self.assertEqual(bytes(batch.data), b"abc")

    def test_data_can_be_replaced(self):
        self.batch.data = b"".join(self.recs)
        self.assertEqual(len(self.batch.chunks()), 1)


class ScriptedIO(FileIO):
    """A file layer whose page-cache reads do what the test says."""

    def __init__(self, cached=None):
        #: None: served; or the exception every pread_cached raises
        self.cached = cached
        self.cached_calls = 0

    def pread_cached(self, fd, n, offset):
        self.cached_calls += 1
        if self.cached is not None:
            raise self.cached
        return os.pread(fd, n, offset)


class InlineReadTests(unittest.SynchronousTestCase):
    """
    With C{inline_reads}, a read that the page cache serves runs on the
    calling thread; the others go through C{run_blocking} as before.
    """

    def make_log(self, io, inline_reads=True):
        self.blocking_calls = []

        def run_blocking(f, *args, **kwargs):
            # a stand-in for the thread pool: records what was sent there
            self.blocking_calls.append(getattr(f, "__name__", f))
            return maybeDeferred(f, *args, **kwargs)

        store = FileLogStore(self.mktemp(), reactor=Clock(), run_blocking=run_blocking,
                             io=io, retention_interval=None, inline_reads=inline_reads)
        self.addCleanup(store.close)
        log = self.successResultOf(store.create("events"))
        self.recs = records(300)
        for i in range(0, 300, 50):
            self.successResultOf(log.append(self.recs[i:i + 50]))
        del self.blocking_calls[:]
        return log

    def reads(self):
        return [c for c in self.blocking_calls if c in ("read_records", "read_payload")]

    def test_served_by_the_page_cache(self):
        io = ScriptedIO()
        log = self.make_log(io)
        batch = self.successResultOf(log.read(10, 200))
        self.assertEqual(batch.records(), self.recs[10:210])
        data = self.successResultOf(log.read_bytes(5, 1000))
        self.assertEqual(data, b"".join(self.recs)[5:1005])
        self.assertEqual(self.reads(), [])
        self.assertGreater(io.cached_calls, 0)

    def test_large_reads_go_to_a_thread(self):
        from streamproto.log.file import INLINE_READ_MAX_BYTES
        io = ScriptedIO()
        log = self.make_log(io)
        self.successResultOf(log.read(0, -1, INLINE_READ_MAX_BYTES + 1))
        self.successResultOf(log.read_bytes(0, INLINE_READ_MAX_BYTES + 1))
        self.assertEqual(self.reads(), ["read_records", "read_payload"])
        self.assertEqual(io.cached_calls, 0)

    def test_would_block_goes_to_a_thread(self):
        io = ScriptedIO(BlockingIOError(errno.EAGAIN, "not cached"))
        log = self.make_log(io)
        batch = self.successResultOf(log.read(10, 200))
        self.assertEqual(batch.records(), self.recs[10:210])
        self.assertEqual(self.reads(), ["read_records"])
        # and is tried inline again next time (the page cache may hold it then)
        calls = io.cached_calls
        self.successResultOf(log.read(0, 1))
        self.assertEqual(io.cached_calls, calls + 1)

    def test_unsupported_stops_trying(self):
        for error in (NotImplementedError(), OSError(errno.EOPNOTSUPP, "no RWF_NOWAIT")):
            io = ScriptedIO(error)
            log = self.make_log(io)
            self.assertEqual(self.successResultOf(log.read(0, 300)).records(), self.recs)
            self.successResultOf(log.read(5, 10))
            self.assertEqual(io.cached_calls, 1)
            self.assertEqual(self.reads(), ["read_records", "read_records"])

    def test_other_errors_fail_the_read(self):
        io = ScriptedIO(OSError(errno.EIO, "disk error"))
        log = self.make_log(io)
        failure = self.failureResultOf(log.read(0, 10), OSError)
        self.assertEqual(failure.value.errno, errno.EIO)
        self.assertEqual(self.reads(), [])

    def test_off_by_default_with_a_given_runner(self):
        io = ScriptedIO()
        log = self.make_log(io, inline_reads=None)
        self.successResultOf(log.read(0, 10))
        self.assertEqual(io.cached_calls, 0)
        self.assertEqual(self.reads(), ["read_records"])


class SharedReadTests(unittest.SynchronousTestCase):
    """
    Followers woken together by one fsync ask the same read: the file
    store reads and decodes it once and hands each the same batch, until
    the log's end moves.
    """

    def setUp(self):
        self.io = ScriptedIO()
        self.log = InlineReadTests.make_log(self, self.io)

    def test_the_same_read_read_once(self):
        first = self.successResultOf(self.log.read(100))
        calls = self.io.cached_calls
        for _ in range(10):
            self.assertIs(self.successResultOf(self.log.read(100)), first)
        self.assertEqual(self.io.cached_calls, calls)
        self.assertEqual(first.records(), self.recs[100:])

    def test_another_read_is_read(self):
        self.successResultOf(self.log.read(100))
        calls = self.io.cached_calls
        self.assertEqual(self.successResultOf(self.log.read(100, 5)).records(),
                         self.recs[100:105])
        self.assertEqual(self.successResultOf(self.log.read(101)).records(), self.recs[101:])
        self.assertEqual(self.io.cached_calls, calls + 2)

    def test_new_records_are_read(self):
        """An append moves the end: the same request now reads the new records too."""
        before = self.successResultOf(self.log.read(250))
        more = records(5, start=300)
        self.successResultOf(self.log.append(more))
        after = self.successResultOf(self.log.read(250))
        self.assertEqual(before.records(), self.recs[250:])
        self.assertEqual(after.records(), self.recs[250:] + more)

    def test_truncated_is_refused(self):
        self.successResultOf(self.log.read(10))
        self.successResultOf(self.log.truncate(200))
        from streamproto.log.errors import PositionOutOfRange
        self.failureResultOf(self.log.read(10), PositionOutOfRange)

    def test_closed_is_refused(self):
        self.successResultOf(self.log.read(10))
        self.log._close()
        from streamproto.log.errors import LogClosed
        self.failureResultOf(self.log.read(10), LogClosed)


class PageCacheReadTests(unittest.SynchronousTestCase):
    """The C accelerator's C{pread_cached} on this machine's file system."""

    def setUp(self):
        if not sys.platform.startswith("linux"):
            raise unittest.SkipTest("RWF_NOWAIT is Linux's")
        self.path = self.mktemp()
        self.data = os.urandom(300_000)
        with open(self.path, "wb") as f:
            f.write(self.data)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.addCleanup(os.close, self.fd)

    def test_reads_what_is_cached(self):
        io = PageCacheIO(FileIO())
        self.assertEqual(io.pread(self.fd, 100_000, 1234), self.data[1234:101_234])
        # short only at the end of the file
        self.assertEqual(io.pread(self.fd, 100_000, 250_000), self.data[250_000:])
        self.assertEqual(io.pread(self.fd, 10, 300_000), b"")

    def test_bounded(self):
        io = PageCacheIO(FileIO(), max_read=1000)
        self.assertEqual(io.pread(self.fd, 1000, 0), self.data[:1000])
        self.assertRaises(BlockingIOError, io.pread, self.fd, 1001, 0)
