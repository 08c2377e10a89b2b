"""
The lazy FUSE filesystem loses what was not fsynced, and only that: the
state logic without FUSE (any machine), then through a real mount (root,
/dev/fuse and libfuse2, which .ci/run installs: without them these tests
fail and say why, they do not skip).
"""

import mmap
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from test.faults import lazyfs

#: a SQLite writer in WAL mode, killed mid-transaction by the test: it
#: commits rows with synchronous=FULL, then (argv[2]) with the mode given,
#: then opens a transaction it never commits, and says so
SQLITE_WRITER = """
import os, sqlite3, sys
path, mode = sys.argv[1], sys.argv[2]
db = sqlite3.connect(path, isolation_level=None)
assert db.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
db.execute("PRAGMA synchronous=FULL")
db.execute("CREATE TABLE t (name TEXT)")
# SQLite syncs the WAL's name (its first sync), never the database's
fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
os.fsync(fd)
os.close(fd)
db.execute("INSERT INTO t VALUES ('full')")
db.execute("PRAGMA synchronous=" + mode)
db.execute("INSERT INTO t VALUES (?)", (mode.lower(),))
db.execute("BEGIN")
db.execute("INSERT INTO t VALUES ('uncommitted')")
assert os.path.exists(path + "-shm")
print("ready", flush=True)
sys.stdin.read()
"""


class StateTests(SynchronousTestCase):
    """L{lazyfs.LazyState} on a plain directory: the model itself."""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="lazystate-")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.state = lazyfs.LazyState(self.root)

    def fd(self, name, create=False):
        path = os.path.join(self.root, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0))
        self.addCleanup(os.close, fd)
        if create:
            self.state.created("/" + name)
        return fd

    def test_unsynced_write_is_lost_synced_kept(self):
        fd = self.fd("f", create=True)
        self.state.fsyncdir("/")
        self.state.write(fd, b"a" * 5000, 0)
        self.state.fsync(fd)
        self.state.write(fd, b"b" * 10, 4990)
        self.state.write(fd, b"c" * 100, 5000)
        self.assertEqual(self.state.read(fd, 20, 4990), b"b" * 10 + b"c" * 10)
        self.state.drop()
        with open(os.path.join(self.root, "f"), "rb") as f:
            self.assertEqual(f.read(), b"a" * 5000)

    def test_truncate_then_grow_reads_zeros(self):
        fd = self.fd("f", create=True)
        self.state.write(fd, b"x" * 9000, 0)
        self.state.fsync(fd)
        self.state.truncate(fd, 100)
        self.state.write(fd, b"y", 8999)
        data = self.state.read(fd, 9000, 0)
        self.assertEqual(data, b"x" * 100 + bytes(8899) + b"y")
        self.state.fsync(fd)
        with open(os.path.join(self.root, "f"), "rb") as f:
            self.assertEqual(f.read(), data)

    def test_truncate_undone_by_drop(self):
        fd = self.fd("f", create=True)
        self.state.write(fd, b"x" * 300, 0)
        self.state.fsync(fd)
        self.state.truncate(fd, 0)
        self.assertEqual(self.state.read(fd, 300, 0), b"")
        self.state.drop()
        self.assertEqual(os.pread(fd, 400, 0), b"x" * 300)

    def test_created_name_needs_directory_fsync(self):
        fd = self.fd("new", create=True)
        self.state.write(fd, b"data", 0)
        self.state.fsync(fd)                 # the data, not the name
        self.state.drop()
        self.assertFalse(os.path.exists(os.path.join(self.root, "new")))

    def test_rename_over_existing_undone(self):
        for name, body in (("old", b"old"), ("tmp", b"new")):
            fd = self.fd(name, create=True)
            self.state.write(fd, body, 0)
            self.state.fsync(fd)
        self.state.fsyncdir("/")
        self.state.rename("/tmp", "/old")
        with open(os.path.join(self.root, "old"), "rb") as f:
            self.assertEqual(f.read(), b"new")
        self.state.drop()
        with open(os.path.join(self.root, "old"), "rb") as f:
            self.assertEqual(f.read(), b"old")
        with open(os.path.join(self.root, "tmp"), "rb") as f:
            self.assertEqual(f.read(), b"new")

    def test_rename_durable_after_fsyncdir(self):
        self.fd("a", create=True)
        self.state.fsyncdir("/")
        self.state.rename("/a", "/b")
        self.state.fsyncdir("/")
        self.state.drop()
        self.assertEqual(sorted(os.listdir(self.root)), [lazyfs.STASH, "b"])

    def test_unlink_undone(self):
        fd = self.fd("f", create=True)
        self.state.write(fd, b"keep", 0)
        self.state.fsync(fd)
        self.state.fsyncdir("/")
        self.state.unlink("/f")
        self.assertFalse(os.path.exists(os.path.join(self.root, "f")))
        self.state.drop()
        with open(os.path.join(self.root, "f"), "rb") as f:
            self.assertEqual(f.read(), b"keep")

    def test_new_file_on_a_freed_inode_starts_empty(self):
        """
        A file created on the inode number of a removed file whose pages
        were never synced starts empty: the model keys pages by inode, and
        ext4 reuses a freed number at once.  Before the fix the new file
        inherited the old one's size and tail (nats-server's 34-byte
        C{tav.idx}, see L{lazyfs.LazyState.fresh}).  On a filesystem that
        never reuses a number (tmpfs) this meets no stale state;
        L{test_fresh_forgets_state_under_the_number} does everywhere.
        """
        for _ in range(20):
            fd = os.open(os.path.join(self.root, "old"), os.O_RDWR | os.O_CREAT | os.O_EXCL)
            self.state.created("/old")
            self.state.write(fd, b"stale" * 7, 0)   # 35 bytes, never synced
            os.close(fd)
            self.state.unlink("/old")
            self.state.fsyncdir("/")                # the unlink is durable: inode freed
            fd = os.open(os.path.join(self.root, "new"), os.O_RDWR | os.O_CREAT | os.O_EXCL)
            self.state.fresh(fd)
            self.state.created("/new")
            self.state.write(fd, b"n" * 16, 0)
            self.assertEqual(self.state.read(fd, 100, 0), b"n" * 16)
            self.assertEqual(self.state.size_of(fd, 0), 16)
            self.state.fsync(fd)
            os.close(fd)
            with open(os.path.join(self.root, "new"), "rb") as f:
                self.assertEqual(f.read(), b"n" * 16)
            self.state.unlink("/new")
            self.state.fsyncdir("/")

    def test_fresh_forgets_state_under_the_number(self):
        fd = self.fd("f", create=True)
        self.state.write(fd, b"x" * 34, 0)
        self.state.fresh(fd)
        self.assertEqual(self.state.read(fd, 100, 0), b"")
        self.assertEqual(self.state.size_of(fd, 0), 0)

    def test_mkdir_undone_with_its_contents(self):
        os.mkdir(os.path.join(self.root, "d"))
        self.state.created("/d")
        fd = self.fd("d/f", create=True)
        self.state.fsync(fd)
        self.state.fsyncdir("/d")            # f is durable in d, but d is not in /
        self.state.drop()
        self.assertFalse(os.path.exists(os.path.join(self.root, "d")))


class MountTests(SynchronousTestCase):
    """Through a real FUSE mount, with the system calls a store makes."""

    def setUp(self):
        why = lazyfs.unavailable()
        if why:
            self.fail(f"the lazy FS cannot run on this machine: {why} "
                      "(.ci/run installs libfuse2 and mfusepy)")
        top = tempfile.mkdtemp(prefix="lazyfs-")
        self.addCleanup(shutil.rmtree, top, True)
        self.mount = lazyfs.LazyMount(os.path.join(top, "backing"), os.path.join(top, "mnt"))
        self.mount.mount()
        self.addCleanup(self.mount.unmount)
        self.mnt = self.mount.mountpoint

    def path(self, *names):
        return os.path.join(self.mnt, *names)

    def fsync_dir(self, *names):
        fd = os.open(self.path(*names), os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)

    def test_write_without_fsync_vanishes(self):
        fd = os.open(self.path("seg"), os.O_RDWR | os.O_CREAT | os.O_APPEND)
        os.write(fd, b"synced ")
        os.fsync(fd)
        self.fsync_dir()
        os.writev(fd, [b"not ", b"synced"])
        os.close(fd)
        with open(self.path("seg"), "rb") as f:
            self.assertEqual(f.read(), b"synced not synced")
        self.assertIn("dropped", self.mount.drop())
        with open(self.path("seg"), "rb") as f:
            self.assertEqual(f.read(), b"synced ")

    def test_write_with_fsync_survives(self):
        os.mkdir(self.path("log"))
        self.fsync_dir()
        fd = os.open(self.path("log", "seg"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(fd, b"x" * 100000)
        os.fdatasync(fd)
        os.close(fd)
        self.fsync_dir("log")
        self.mount.drop()
        with open(self.path("log", "seg"), "rb") as f:
            self.assertEqual(f.read(), b"x" * 100000)

    def test_new_name_needs_its_directory_fsynced(self):
        fd = os.open(self.path("state.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(fd, b"{}")
        os.fsync(fd)
        os.close(fd)
        os.replace(self.path("state.tmp"), self.path("state.json"))
        self.assertEqual(os.listdir(self.mnt), ["state.json"])
        self.mount.drop()
        self.assertEqual(os.listdir(self.mnt), [])

    def test_o_sync_write_survives(self):
        """
        A write to a file opened C{O_SYNC} or C{O_DSYNC} is durable when it
        returns, with no fsync (the kernel syncs it; through FUSE with
        C{direct_io} it does not ask us to, so the model does).
        """
        self.fsync_dir()
        for name, flag in (("sync", os.O_SYNC), ("dsync", os.O_DSYNC), ("plain", 0)):
            fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | flag)
            os.write(fd, b"first")
            os.close(fd)
            self.fsync_dir()
            fd = os.open(self.path(name), os.O_WRONLY | os.O_APPEND | flag)
            os.write(fd, b" second")
            os.close(fd)
        self.mount.drop()
        for name, body in (("sync", b"first second"), ("dsync", b"first second"),
                           ("plain", b"")):
            with open(self.path(name), "rb") as f:
                self.assertEqual(f.read(), body, name)

    def test_atomic_rewrites_after_removed_unsynced_files(self):
        """
        nats-server's term-and-vote file, rewritten as it does (a C{.tmp}
        opened C{O_TRUNC|O_SYNC}, written, renamed over the name, the
        directory synced) after larger files that were never synced were
        removed: it always reads back as written.  Before
        L{lazyfs.LazyState.fresh}, the new C{.tmp} could take a removed
        file's inode number and its unsynced size and tail with it.
        """
        for i in range(20):
            with open(self.path(f"big{i}"), "wb") as f:
                f.write(b"stale-bytes-" * 3)        # 36 bytes, never synced
            os.unlink(self.path(f"big{i}"))
            self.fsync_dir()
            body = i.to_bytes(8, "little") + b"peer%04d" % i
            fd = os.open(self.path("tav.idx.tmp"),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_SYNC, 0o640)
            os.write(fd, body)
            os.close(fd)
            os.replace(self.path("tav.idx.tmp"), self.path("tav.idx"))
            self.fsync_dir()
            with open(self.path("tav.idx"), "rb") as f:
                self.assertEqual(f.read(), body)
        self.mount.drop()
        with open(self.path("tav.idx"), "rb") as f:
            self.assertEqual(f.read(), body)

    def test_control_file_is_not_listed_and_stats(self):
        self.assertEqual(os.listdir(self.mnt), [])
        with open(self.path("f"), "wb") as f:
            f.write(b"x")
        self.assertIn("dirty_pages 1", self.mount.control("stats"))
        self.assertEqual(self.mount.control("sync"), "ok synced")
        self.mount.drop()
        with open(self.path("f"), "rb") as f:
            self.assertEqual(f.read(), b"x")

    def test_only_the_wal_index_is_page_cached(self):
        """
        Every file is direct_io (FUSE refuses it a shared writable map)
        except SQLite's -shm wal-index, which must be mapped so.
        """
        for name, shared in (("data", False), ("db-wal", False), ("db-shm", True)):
            fd = os.open(self.path(name), os.O_RDWR | os.O_CREAT)
            self.addCleanup(os.close, fd)
            os.ftruncate(fd, 4096)
            if shared:
                m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                m[:3] = b"shm"
                m.close()
                self.assertEqual(os.pread(fd, 3, 0), b"shm")
            else:
                with self.assertRaises(OSError, msg=name):
                    mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def crash_sqlite_writer(self, mode, stale_index=False):
        """
        Run L{SQLITE_WRITER} with C{mode}, SIGKILL it, cut the power: the
        rows before the kill and after the cut.  The first read maps the
        wal-index (page-cached) before the cut; the second must see only
        what the model kept.

        @param stale_index: put the wal-index as it was before the kill
            back after the cut, as if it had survived it (it describes WAL
            frames the cut lost).
        """
        os.mkdir(self.path("d"))
        self.fsync_dir()
        path = self.path("d", "s.sqlite")
        writer = subprocess.Popen([sys.executable, "-c", SQLITE_WRITER, path, mode],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.addCleanup(writer.wait)
        self.addCleanup(writer.stdin.close)
        self.addCleanup(writer.stdout.close)
        self.assertEqual(writer.stdout.readline(), b"ready\n")
        before = self.rows(path)
        with open(path + "-shm", "rb") as f:
            index = f.read()
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        self.mount.drop()
        if stale_index:
            self.assertGreaterEqual(len(index), 32768)   # a wal-index, not a stub
            with open(path + "-shm", "wb") as f:
                f.write(index)
        return before, self.rows(path)

    def rows(self, path):
        db = sqlite3.connect(path)
        try:
            return sorted(name for name, in db.execute("SELECT name FROM t"))
        finally:
            db.close()

    def test_sqlite_wal_full_commits_survive_power_loss(self):
        """
        SQLite in WAL mode works on the lazy FS; with synchronous=FULL
        every committed row survives a crash and a power cut, the
        uncommitted one does not.
        """
        before, after = self.crash_sqlite_writer("FULL")
        self.assertEqual(before, ["full", "full"])
        self.assertEqual(after, ["full", "full"])

    def test_sqlite_wal_unsynced_commit_lost(self):
        """
        With synchronous=NORMAL a commit in WAL mode is not synced (only a
        checkpoint is): a power cut loses it, and only it.
        """
        before, after = self.crash_sqlite_writer("NORMAL")
        self.assertEqual(before, ["full", "normal"])
        self.assertEqual(after, ["full"])

    def test_sqlite_wal_commit_never_synced_lost(self):
        """With synchronous=OFF nothing after the FULL commit is synced: lost."""
        before, after = self.crash_sqlite_writer("OFF")
        self.assertEqual(before, ["full", "off"])
        self.assertEqual(after, ["full"])

    def test_sqlite_stale_wal_index_not_believed(self):
        """
        Why the wal-index may be page-cached (L{lazyfs.page_cached}): one
        that survived the cut, describing the lost commit's frames, is
        rebuilt from the WAL by the first connection, not believed.
        """
        before, after = self.crash_sqlite_writer("NORMAL", stale_index=True)
        self.assertEqual(before, ["full", "normal"])
        self.assertEqual(after, ["full"])
