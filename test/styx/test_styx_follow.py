"""
The log-follower cursor shared by the styx/0 and WebSocket consumers, on
the memory log store with a fake clock.
"""

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial import unittest

from streamproto.log import LogClosed, MemoryLogStore, PositionOutOfRange
from streamproto.styx.follow import LogFollower


class CountingLog:
    """A log whose reads are counted and, when C{hold} is set, answered
    only on L{release} (a disk that takes its time)."""

    def __init__(self, log):
        self._log = log
        self.reads = []      # (position, max_records, max_bytes)
        self.waits = 0
        self.hold = False
        self._held = []

    def __getattr__(self, name):
        return getattr(self._log, name)

    def read(self, position, max_records=-1, max_bytes=1048576):
        self.reads.append((position, max_records, max_bytes))
        result = self._log.read(position, max_records, max_bytes)
        if not self.hold:
            return result
        d = defer.Deferred()
        self._held.append((result, d))
        return d

    def release(self):
        held, self._held = self._held, []
        for result, d in held:
            result.chainDeferred(d)

    def wait(self, position, timeout=None):
        self.waits += 1
        return self._log.wait(position, timeout)


class Owner:
    """What a consumer protocol gives the follower: records what it gets."""

    def __init__(self):
        self.batches = []
        self.ended = 0
        self.failures = []

    @property
    def records(self):
        return [r for batch in self.batches for r in batch.records()]

    def deliver(self, batch):
        self.batches.append(batch)

    def end(self):
        self.ended += 1

    def failed(self, failure):
        self.failures.append(failure)


class LogFollowerTests(unittest.SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.store = MemoryLogStore(self.clock)
        self.raw = self.successResultOf(self.store.create("log"))
        self.log = CountingLog(self.raw)
        self.owner = Owner()

    def append(self, *records):
        self.successResultOf(self.raw.append(list(records)))

    def follower(self, position=0, count=-1, follow=False, read_bytes=1024):
        # looked up at each call: a test may replace the owner's deliver
        return LogFollower(self.log, position, count, follow, read_bytes,
                           deliver=lambda batch: self.owner.deliver(batch),
                           end=self.owner.end, failed=self.owner.failed)

    def test_reads_to_the_end_in_batches(self):
        """Whole batches within read_bytes, in order, then end (not following)."""
        self.append(b"aa", b"bb", b"cc", b"dd", b"ee")
        f = self.follower(position=1, read_bytes=4)
        f.start()
        self.assertEqual([len(b) for b in self.owner.batches], [2, 2])
        self.assertEqual(self.owner.records, [b"bb", b"cc", b"dd", b"ee"])
        self.assertEqual(self.owner.batches[1].position, 3)
        self.assertEqual((f.position, f.delivered, self.owner.ended), (5, 4, 1))
        self.assertTrue(f.stopped)
        self.assertEqual(self.log.waits, 0)

    def test_count_bounds_the_reads(self):
        """At most C{count} records: the reads ask for no more than remain."""
        self.append(*[b"r%d" % i for i in range(10)])
        f = self.follower(count=3, read_bytes=4)
        f.start()
        self.assertEqual(self.owner.records, [b"r0", b"r1", b"r2"])
        self.assertEqual([r[1] for r in self.log.reads], [3, 1])
        self.assertEqual((f.remaining, self.owner.ended), (0, 1))

    def test_count_zero_reads_nothing(self):
        self.append(b"x")
        self.follower(count=0).start()
        self.assertEqual((self.log.reads, self.owner.batches, self.owner.ended), ([], [], 1))

    def test_empty_log_not_following_ends(self):
        f = self.follower()
        f.start()
        self.assertEqual((self.owner.batches, self.owner.ended), ([], 1))
        self.assertEqual(f.position, 0)

    def test_nothing_before_start(self):
        self.append(b"x")
        f = self.follower()
        f.resumeProducing()
        self.assertEqual(self.log.reads, [])
        f.start()
        self.assertEqual(self.owner.records, [b"x"])

    def test_follow_waits_without_polling(self):
        """At the synced end a follower waits for the append that makes more
        visible: no reads meanwhile, however long; then it carries on."""
        self.append(b"a")
        f = self.follower(follow=True)
        f.start()
        self.assertEqual(self.owner.records, [b"a"])
        reads = len(self.log.reads)
        self.clock.advance(3600)
        self.assertEqual(len(self.log.reads), reads)
        self.assertEqual(self.log.waits, 1)
        self.append(b"b", b"c")
        self.assertEqual(self.owner.records, [b"a", b"b", b"c"])
        self.append(b"d")
        self.assertEqual(self.owner.records, [b"a", b"b", b"c", b"d"])
        self.assertEqual((self.owner.ended, f.position), (0, 4))

    def test_follow_with_count_ends_after_count(self):
        f = self.follower(count=2, follow=True)
        f.start()
        self.append(b"a")
        self.assertEqual(self.owner.ended, 0)
        self.append(b"b", b"c")
        self.assertEqual(self.owner.records, [b"a", b"b"])
        self.assertEqual(self.owner.ended, 1)

    def test_paused_holds_one_batch_read_ahead(self):
        """While paused: the next batch is read ahead, nothing more."""
        self.append(*[b"%02d" % i for i in range(10)])
        f = self.follower(read_bytes=4)
        f.pauseProducing()
        f.start()
        self.assertEqual(self.owner.batches, [])
        self.assertEqual(len(self.log.reads), 1)
        f.resumeProducing()
        self.assertEqual(len(self.owner.batches), 5)
        self.assertEqual(self.owner.ended, 1)

    def test_pause_while_delivering(self):
        """The owner's transport fills during a delivery: one more batch is
        read ahead and held until it resumes."""
        self.append(*[b"%02d" % i for i in range(6)])
        f = self.follower(read_bytes=2)
        self.owner.deliver = lambda batch: (self.owner.batches.append(batch),
                                            f.pauseProducing())
        f.start()
        self.assertEqual(self.owner.records, [b"00"])
        self.assertEqual(len(self.log.reads), 2)
        f.resumeProducing()
        self.assertEqual(self.owner.records, [b"00", b"01"])
        self.assertEqual(len(self.log.reads), 3)

    def test_slow_reads_one_at_a_time(self):
        """Reads that fire later: never two in flight."""
        self.append(b"a", b"b", b"c")
        self.log.hold = True
        f = self.follower(read_bytes=1)
        f.start()
        for expected in ([b"a"], [b"a", b"b"], [b"a", b"b", b"c"]):
            self.assertEqual(len(self.log._held), 1)
            self.log.release()
            self.assertEqual(self.owner.records, expected)
        self.log.release()   # the empty read at the end
        self.assertEqual(self.owner.ended, 1)
        self.assertEqual(f.delivered, 3)

    def test_synchronous_reads_loop_not_recurse(self):
        """Thousands of batches read at once (the memory store answers
        synchronously) go through the loop, not the Python stack."""
        self.append(*[b"x"] * 5000)
        self.follower(read_bytes=1).start()
        self.assertEqual(len(self.owner.batches), 5000)
        self.assertEqual(self.owner.ended, 1)

    def test_stop_cancels_the_wait(self):
        f = self.follower(follow=True)
        f.start()
        self.assertEqual(len(self.raw._waiters), 1)
        f.stop()
        self.assertEqual(len(self.raw._waiters), 0)
        self.append(b"late")
        self.assertEqual((self.owner.batches, self.owner.ended, self.owner.failures),
                         ([], 0, []))

    def test_stop_producing_is_stop(self):
        self.append(b"a", b"b")
        self.log.hold = True
        f = self.follower(read_bytes=1)
        f.start()
        f.stopProducing()
        self.log.release()
        self.assertEqual((self.owner.batches, self.owner.ended), ([], 0))

    def test_stop_from_deliver(self):
        """An owner that stops while handling a batch gets no more calls."""
        self.append(b"a", b"b", b"c")
        f = self.follower(read_bytes=1)
        self.owner.deliver = lambda batch: (self.owner.batches.append(batch), f.stop())
        f.start()
        self.assertEqual(self.owner.records, [b"a"])
        self.assertEqual(self.owner.ended, 0)

    def test_read_failure(self):
        """A failed read is handed over once; no end, nothing more read."""
        self.append(b"a")
        f = self.follower(position=5)
        f.start()
        self.assertEqual(len(self.owner.failures), 1)
        self.assertIsInstance(self.owner.failures[0], Failure)
        self.owner.failures[0].trap(PositionOutOfRange)
        self.assertEqual((self.owner.ended, f.stopped, len(self.log.reads)), (0, True, 1))

    def test_wait_failure(self):
        """The log closed under a follower waiting at its end."""
        self.append(b"a")
        f = self.follower(follow=True)
        f.start()
        self.successResultOf(self.store.close())
        self.assertEqual(self.owner.records, [b"a"])
        self.assertEqual(len(self.owner.failures), 1)
        self.owner.failures[0].trap(LogClosed)
        self.assertTrue(f.stopped)
        self.assertEqual(self.owner.ended, 0)
