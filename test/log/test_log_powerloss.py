"""
Power loss under the file store (the model of C{test/support/powerloss.py}): a
store runs a load over a L{PowerLossIO}, with its blocking jobs (group
commit fsyncs, index and state writes) run in a seeded order among the
appends; then, for many moments, the disk a power loss then could have
left is rebuilt and opened by a fresh store, which must open the log and
hold every record acknowledged before that moment (and only records that
were written, in order).
"""

import os
import random
import shutil
import tempfile

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial import unittest

from streamproto.log import LogConfig, LogNotFound
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore
from test.support.powerloss import HeldJobs, PowerLossIO
from test.support.torture_harness import make_payload, parse_payload

#: (names, data): how much of what was not fsynced the power loss kept
VARIANTS = [("synced", "synced"), ("all", "synced"), ("all", "prefix"), ("all", "pages"),
            ("cut", "prefix"), ("synced", "all")]


def scratch():
    """
    Where the runs and their images go: memory when the machine has it
    (hundreds of images are opened and fsynced; the model, not the disk,
    says what is durable).
    """
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class PowerLossCase(unittest.SynchronousTestCase):

    def setUp(self):
        self.top = tempfile.mkdtemp(prefix="streamproto-powerloss-", dir=scratch())
        self.addCleanup(shutil.rmtree, self.top, True)
        self.images = 0

    def machine(self, existing=("data",)):
        """A root with C{existing} directories already durable, and its model."""
        self.images += 1
        root = os.path.join(self.top, f"root-{self.images}")
        os.makedirs(root)
        for d in existing:
            os.makedirs(os.path.join(root, d))
        return root, PowerLossIO(root)

    def lose_power(self, io, at, variant, seed):
        names, data = variant
        if names == "cut":
            names = random.Random(seed).randint(0, at)
        self.images += 1
        dest = os.path.join(self.top, f"image-{self.images}")
        return io.image(dest, at=at, names=names, data=data, seed=seed)

    def read_all(self, path, name, where):
        """Every record of log C{name} in the store at C{path}, opened afresh, or None."""
        store = FileLogStore(path, reactor=Clock(), run_blocking=synchronous,
                             retention_interval=None)
        try:
            d = store.get(name)
            failures = []
            d.addErrback(failures.append)
            if failures:
                if failures[0].check(LogNotFound):
                    return None, 0
                self.fail(f"{where}: the log does not open: {failures[0].value!r}")
            log = self.successResultOf(d)
            got = []
            start = position = log.start_position
            while position < log.end_position:
                batch = self.successResultOf(log.read(position))
                got += batch.records()
                position = batch.next_position
            # and it takes appends again
            self.successResultOf(log.append([b"after"]))
            return got, start
        finally:
            self.successResultOf(store.close())

    def check(self, image, name, tag, acked_end, written_end, where):
        got, start = self.read_all(os.path.join(image, *self.data_dir), name, where)
        if got is None:
            self.assertEqual(acked_end, 0, f"{where}: the log is gone, {acked_end} acked")
            return
        seqs = [parse_payload(tag, r) for r in got]
        self.assertEqual(seqs, list(range(start, start + len(seqs))),
                         f"{where}: not the records written, in order")
        self.assertLessEqual(start + len(seqs), written_end, f"{where}: more than written")
        self.assertGreaterEqual(start + len(seqs), acked_end,
                                f"{where}: acknowledged records lost "
                                f"({start + len(seqs)} of {acked_end})")


class RollTests(PowerLossCase):
    """Defect: a power loss during a segment roll made the whole log unreadable."""

    data_dir = ("data",)
    must_roll = True

    def load(self, seed, config, steps=160):
        root, io = self.machine()
        jobs = HeldJobs()
        store = FileLogStore(os.path.join(root, "data"), reactor=Clock(), run_blocking=jobs,
                             io=io, retention_interval=None)
        self.successResultOf(store.create("events", config))
        log = self.successResultOf(store.get("events"))
        jobs.run_all()
        rnd = random.Random(seed)
        acks = []           # (moment, acknowledged end position)
        written = 0
        for _ in range(steps):
            if rnd.random() < 0.55 or not jobs.jobs:
                n = rnd.randint(1, 4)
                records = [make_payload(b"r", written + i, rnd.randint(0, 40)) for i in range(n)]
                written += n
                log.append(records).addCallback(
                    lambda r: acks.append((io.moment, r.end_position)))
            else:
                jobs.run(rnd.randrange(len(jobs.jobs)))
        jobs.run_all()
        self.assertGreater(len(log._segments), 3 if self.must_roll else 0)    # the load rolled
        return io, acks, written

    def power_losses(self, seed, config, every=1, variants=VARIANTS, steps=160):
        io, acks, written = self.load(seed, config, steps)
        start = acks[0][0] - 60
        rnd = random.Random(seed)
        tried = 0
        for at in range(max(start, 0), io.moment + 1, every):
            acked = max([end for moment, end in acks if moment <= at], default=0)
            variant = variants[at % len(variants)] if len(variants) > 1 else variants[0]
            image = self.lose_power(io, at, variant, rnd.randrange(1 << 30))
            self.check(image, "events", b"r", acked, written,
                       f"seed {seed}, power lost at moment {at} of {io.moment}, {variant}")
            shutil.rmtree(image)
            tried += 1
        return tried

    def test_every_moment_of_rolls_only_fsynced_survives(self):
        """The strictest disk: only fsynced data and fsynced names survive."""
        config = LogConfig(segment_max_size=400, index_after_size=64)
        self.assertGreater(self.power_losses(1, config, variants=[("synced", "synced")]), 300)

    def test_every_moment_of_rolls_names_before_data(self):
        """Every name change survives (a journal commit), unsynced data does not."""
        config = LogConfig(segment_max_size=400, index_after_size=64)
        self.power_losses(2, config, variants=[("all", "synced")])

    def test_rolls_with_partial_writeback(self):
        for seed, size in [(3, 300), (4, 700), (5, 2000)]:
            self.power_losses(seed, LogConfig(segment_max_size=size, index_after_size=100),
                              every=2)

    def test_rolls_with_retention(self):
        config = LogConfig(segment_max_size=300, log_max_count=40)
        self.power_losses(6, config, every=2)

    def test_a_cut_is_durable_before_new_appends(self):
        """
        Recovery cuts segments a power loss left behind, then new records
        are acknowledged: a second power loss must not bring the cut data
        back behind them (or refuse the log).
        """
        io, acks, written = self.load(7, LogConfig(segment_max_size=300))
        cuts = 0
        for at in range(acks[0][0], io.moment, 3):
            image = self.lose_power(io, at, ("all", "synced"), at)
            data = os.path.join(image, "data")
            before = sorted(os.listdir(os.path.join(data, "events")))
            second = PowerLossIO(image)
            store = FileLogStore(data, reactor=Clock(), run_blocking=synchronous, io=second,
                                 retention_interval=None)
            log = self.successResultOf(store.get("events"))
            cuts += sorted(os.listdir(os.path.join(data, "events"))) != before
            end = log.end_position
            extra = [make_payload(b"r", end + i, 5) for i in range(3)]
            self.assertEqual(self.successResultOf(log.append(extra)).end_position, end + 3)
            again = second.image(image + "-again")
            got, start = self.read_all(os.path.join(again, "data"), "events", f"moment {at}")
            self.assertEqual([parse_payload(b"r", r) for r in got],
                             list(range(start, end + 3)), f"moment {at}")
        self.assertGreater(cuts, 5)

    def acked_log(self, count, truncate=None):
        """
        A log of C{count} acknowledged records in 300-byte segments (and
        truncated to C{truncate}), closed.  @return: its directory.
        """
        root, _ = self.machine()
        store = FileLogStore(os.path.join(root, "data"), reactor=Clock(),
                             run_blocking=synchronous, retention_interval=None)
        log = self.successResultOf(store.create("events", LogConfig(segment_max_size=300)))
        for i in range(count):
            self.successResultOf(log.append([make_payload(b"r", i, 30)]))
        if truncate is not None:
            self.successResultOf(log.truncate(truncate(log)))
        self.successResultOf(store.close())
        return os.path.join(root, "data", "events")

    def assert_refused(self, seg_dir):
        """The log in C{seg_dir} does not open, and nothing of it was cut."""
        from streamproto.log import CorruptLog
        sizes = {n: os.path.getsize(os.path.join(seg_dir, n)) for n in os.listdir(seg_dir)}
        store = FileLogStore(os.path.dirname(seg_dir), reactor=Clock(),
                             run_blocking=synchronous, retention_interval=None)
        self.failureResultOf(store.get("events"), CorruptLog)
        self.assertEqual({n: os.path.getsize(os.path.join(seg_dir, n))
                          for n in os.listdir(seg_dir)}, sizes)
        self.flushLoggedErrors()

    @staticmethod
    def segments(seg_dir):
        return sorted(n for n in os.listdir(seg_dir) if n.endswith(".seg"))

    def test_damage_to_fsynced_data_is_still_refused(self):
        """
        A batch of a sealed segment rots, and its index is gone: a whole
        later batch still says it was durable; refused, never cut.
        """
        seg_dir = self.acked_log(40)
        path = os.path.join(seg_dir, self.segments(seg_dir)[1])
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 5)
            f.write(b"X")
        os.unlink(path[:-4] + ".idx")
        self.assert_refused(seg_dir)

    def test_a_shortened_indexed_segment_is_refused(self):
        """The index says the segment was fsynced whole: losing its end is damage."""
        seg_dir = self.acked_log(20)
        path = os.path.join(seg_dir, self.segments(seg_dir)[-2])
        self.assertTrue(os.path.exists(path[:-4] + ".idx"))
        os.truncate(path, os.path.getsize(path) - 10)
        self.assert_refused(seg_dir)

    def test_a_truncation_point_past_the_damage_is_refused(self):
        # truncated to just after the first record of the last segment
        seg_dir = self.acked_log(20, truncate=lambda log: log._segments[-1].position + 1)
        last = self.segments(seg_dir)[-1]
        self.assertLess(int(last[:-4]) + 1, 20)
        # the last segment loses its records, which the truncation says were durable
        os.truncate(os.path.join(seg_dir, last), 40)
        self.assert_refused(seg_dir)


class CreatedDirectoryTests(PowerLossCase):
    """Defect: a data directory the server created was never made durable."""

    data_dir = ("var", "lib", "styx")

    def test_power_loss_right_after_the_first_acks(self):
        root, io = self.machine(existing=())
        clock = Clock()
        store = FileLogStore(os.path.join(root, *self.data_dir), reactor=clock,
                             run_blocking=synchronous, io=io, retention_interval=None)
        log = self.successResultOf(store.create("events"))
        acked = 0
        for i in range(0, 100, 10):
            result = self.successResultOf(
                log.append([make_payload(b"r", i + k, 10) for k in range(10)]))
            acked = result.end_position
        for variant in [("synced", "synced"), ("synced", "all")]:
            image = self.lose_power(io, io.moment, variant, 0)
            self.check(image, "events", b"r", acked, 100, f"after {acked} acks, {variant}")

    def test_every_moment_from_creation(self):
        root, io = self.machine(existing=())
        store = FileLogStore(os.path.join(root, *self.data_dir), reactor=Clock(),
                             run_blocking=synchronous, io=io, retention_interval=None)
        log = self.successResultOf(store.create("events", LogConfig(segment_max_size=200)))
        acks = []
        for i in range(12):
            r = self.successResultOf(log.append([make_payload(b"r", i, 20)]))
            acks.append((io.moment, r.end_position))
        for at in range(io.moment + 1):
            acked = max([end for moment, end in acks if moment <= at], default=0)
            image = self.lose_power(io, at, ("synced", "synced"), at)
            self.check(image, "events", b"r", acked, 12, f"power lost at moment {at}")


class ControllerStateTests(PowerLossCase):
    """
    The Pravega controller's state (a log of documents, truncated to the
    newest after each change: state file writes, segment deletions) in a
    data directory the server created: every change acknowledged before
    the power loss is there after it, and the state opens.
    """

    data_dir = ("srv", "pravega")

    def state(self, path, io=None):
        from streamproto.pravega.controller.state import ControllerState
        from streamproto.pravega.segments import SegmentStore
        clock = Clock()
        store = FileLogStore(path, reactor=clock, run_blocking=synchronous,
                             retention_interval=None, **({"io": io} if io else {}))
        state = ControllerState(store, SegmentStore(store), clock)
        self.successResultOf(state.open())
        return store, state

    def test_every_moment(self):
        root, io = self.machine(existing=())
        store, state = self.state(os.path.join(root, *self.data_dir), io)
        acks = []       # (moment, scopes acknowledged so far)
        for i in range(6):
            self.assertEqual(self.successResultOf(state.create_scope(f"s{i}")), "SUCCESS")
            acks.append((io.moment, i + 1))
        self.assertEqual(
            self.successResultOf(state.create_stream("s0", "st", 2)), "SUCCESS")
        acks.append((io.moment, 7))
        for at in range(io.moment + 1):
            image = self.lose_power(io, at, ("synced", "synced"), at)
            acked = max([n for moment, n in acks if moment <= at], default=0)
            _, again = self.state(os.path.join(image, *self.data_dir))
            scopes = sorted(again.scopes)
            self.assertGreaterEqual(len(scopes), min(acked, 6),
                                    f"power lost at moment {at}: scopes {scopes}, "
                                    f"{acked} changes acknowledged")
            self.assertEqual(scopes, [f"s{i}" for i in range(len(scopes))])
            if acked == 7:
                self.assertIn("st", again.scopes["s0"], f"power lost at moment {at}")
            shutil.rmtree(image)


class SessionStoreTests(unittest.TestCase):
    """The reliable-stream session store (SQLite) in a directory it created."""

    @defer.inlineCallbacks
    def test_power_loss_right_after_the_first_acks(self):
        from twisted.internet import reactor
        from streamproto.reliable.session import SQLiteSessionStore
        case = PowerLossCase()
        case.setUp()
        self.addCleanup(case.doCleanups)
        root, io = case.machine(existing=())
        parts = ("var", "lib", "reliable", "sessions.sqlite")
        store = SQLiteSessionStore(os.path.join(root, *parts), clock=Clock(), reactor=reactor,
                                   io=io)
        yield store.register("a", {"n": 0})     # acknowledged: committed
        image = case.lose_power(io, io.moment, ("synced", "synced"), 0)
        yield store.close()
        again = SQLiteSessionStore(os.path.join(image, *parts), clock=Clock(), reactor=reactor)
        try:
            # an unknown session would fail (UnknownSession): it is there, empty
            self.assertIsNone((yield again.after("a", 0)))
        finally:
            yield again.close()


WRITER = """
import json, os, sys
from twisted.internet import defer
from twisted.internet.task import Clock
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore
from test.support.powerloss import PowerLossIO
from test.support.torture_harness import make_payload
root, first, last = sys.argv[1:4]
io = PowerLossIO(root)
store = FileLogStore(os.path.join(root, "var", "styx"), reactor=Clock(),
                     run_blocking=synchronous, io=io, retention_interval=None)
store.create("events").addCallback(lambda log: setattr(store, "the_log", log))
acked = []
for i in range(40):
    store.the_log.append([make_payload(b"r", i, 30)]).addCallback(
        lambda r: acked.append(r.end_position))
    if i == 0:
        io.image(first)     # the power goes right after the first ack
io.image(last)
print(json.dumps({"first": acked[0], "last": acked[-1]}))
"""

READER = """
import json, sys
from twisted.internet import defer
from twisted.internet.task import Clock
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore
from test.support.torture_harness import parse_payload
out = []
store = FileLogStore(sys.argv[1], reactor=Clock(), run_blocking=synchronous)
def read(log):
    d = log.read(log.start_position, -1)
    d.addCallback(lambda b: out.extend(parse_payload(b"r", r) for r in b.records()))
store.get("events").addCallback(read).addErrback(lambda f: out.append(repr(f.value)))
print(json.dumps(out))
"""


class FreshProcessTests(unittest.SynchronousTestCase):
    """A writer process loses power (the model's image); another process reads."""

    def run_python(self, code, *args):
        import json
        import subprocess
        import sys
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))] +
            [p for p in [os.environ.get("PYTHONPATH")] if p]))
        done = subprocess.run([sys.executable, "-c", code, *args], env=env,
                              capture_output=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr.decode(errors="replace"))
        return json.loads(done.stdout)

    def test_acked_records_read_back_by_another_process(self):
        top = tempfile.mkdtemp(prefix="streamproto-powerloss-", dir=scratch())
        self.addCleanup(shutil.rmtree, top, True)
        root = os.path.join(top, "root")
        os.mkdir(root)
        first, last = os.path.join(top, "first"), os.path.join(top, "last")
        acked = self.run_python(WRITER, root, first, last)
        self.assertEqual(acked, {"first": 1, "last": 40})
        for image, n in [(first, 1), (last, 40)]:
            got = self.run_python(READER, os.path.join(image, "var", "styx"))
            self.assertEqual(got[:n], list(range(n)), f"after {n} acks")


class MakeDirsTests(PowerLossCase):
    """streamproto.base.durable.make_dirs: what every store creates its directories with."""

    def test_created_directories_survive(self):
        from streamproto.base.durable import make_dirs
        root, io = self.machine(existing=("a",))
        created = make_dirs(os.path.join(root, "a", "b", "c", "d"), io)
        self.assertEqual(created, [os.path.join(root, "a", "b"), os.path.join(root, "a", "b", "c"),
                                   os.path.join(root, "a", "b", "c", "d")])
        image = self.lose_power(io, io.moment, ("synced", "synced"), 0)
        self.assertTrue(os.path.isdir(os.path.join(image, "a", "b", "c", "d")))
        self.assertEqual(make_dirs(os.path.join(root, "a", "b"), io), [])

    def test_a_file_in_the_way_is_an_error(self):
        from streamproto.base.durable import make_dirs
        root, io = self.machine()
        with open(os.path.join(root, "f"), "w"):
            pass
        self.assertRaises(OSError, make_dirs, os.path.join(root, "f", "g"), io)


class StyxServerTests(unittest.TestCase):
    """
    The issue as reported: a Styx server on the file store with small
    segments, HTTP and styx/0 writers running, the power lost at a moment
    during the rolls; the log must open with every acknowledged record.
    """

    timeout = 180

    @defer.inlineCallbacks
    def test_power_loss_under_http_and_styx0_writers(self):
        from twisted.internet import reactor
        from streamproto.styx.api_client import StyxClient
        from streamproto.styx.stream_client import StyxProducer
        from test.torture.test_torture_faults import InProcessServer, styx_factory
        top = tempfile.mkdtemp(prefix="streamproto-powerloss-", dir=scratch())
        self.addCleanup(shutil.rmtree, top, True)
        root = os.path.join(top, "root")
        os.mkdir(root)
        io = PowerLossIO(root)
        # the data directory does not exist: the server creates it
        server = InProcessServer(self, os.path.join(root, "var", "styx"), styx_factory, io=io)
        yield server.start()
        yield server.store.create("events", LogConfig(segment_max_size=65536))
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor=reactor)
        acks = {b"h": [], b"s": []}       # tag: [(moment, records acknowledged)]

        @defer.inlineCallbacks
        def http_writer():
            for i in range(100):
                yield client.write_records(
                    "events", [make_payload(b"h", i * 20 + k, 200) for k in range(20)])
                acks[b"h"].append((io.moment, (i + 1) * 20))

        @defer.inlineCallbacks
        def styx0_writer():
            producer = yield StyxProducer.connect(reactor, "127.0.0.1", server.port, "events",
                                                  timeout=10)
            for i in range(100):
                yield producer.writeMany([make_payload(b"s", i * 20 + k, 200)
                                          for k in range(20)])
                acks[b"s"].append((io.moment, (i + 1) * 20))
            yield producer.close()

        yield defer.gatherResults([http_writer(), styx0_writer()])
        yield client.close()
        yield server.stop()
        rolls = len([n for n in os.listdir(os.path.join(root, "var", "styx", "events"))
                     if n.endswith(".seg")])
        self.assertGreater(rolls, 12)
        case = PowerLossCase()
        case.data_dir = ("var", "styx")
        case.top = top
        case.images = 0
        checked = 0
        for n, at in enumerate(range(io.moment + 1)):     # every one
            image = case.lose_power(io, at, VARIANTS[n % len(VARIANTS)], n)
            got, _ = case.read_all(os.path.join(image, *case.data_dir), "events",
                                   f"power lost at moment {at}")
            for tag, acked in acks.items():
                seqs = [parse_payload(tag, r) for r in got or []
                        if parse_payload(tag, r) is not None]
                expected = max([c for moment, c in acked if moment <= at], default=0)
                self.assertEqual(seqs, list(range(len(seqs))), f"moment {at}, {tag}")
                self.assertGreaterEqual(len(seqs), expected,
                                        f"power lost at moment {at}: {tag} records lost")
                checked += expected
            shutil.rmtree(image)
        # most moments came after many acks
        self.assertGreater(checked, io.moment * 1000)
