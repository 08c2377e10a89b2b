"""
The power-loss model of C{test/support/powerloss.py}: what survives a power loss
at a given moment, call by call.
"""

import os
import sqlite3

from twisted.trial import unittest

from test.support.powerloss import PowerLossIO


def tree(path):
    """{relative path: content (None for a directory)} under C{path}."""
    found = {}
    for top, dirs, files in os.walk(path):
        rel = os.path.relpath(top, path)
        for d in dirs:
            found[os.path.normpath(os.path.join(rel, d))] = None
        for f in files:
            with open(os.path.join(top, f), "rb") as fh:
                found[os.path.normpath(os.path.join(rel, f))] = fh.read()
    return found


class PowerLossModelTests(unittest.TestCase):

    def setUp(self):
        self.root = self.mktemp()
        os.makedirs(self.root)
        self.io = PowerLossIO(self.root)
        self.images = 0

    def image(self, **kwargs):
        self.images += 1
        return tree(self.io.image(f"{self.root}-image-{self.images}", **kwargs))

    def write(self, name, data, flags=os.O_CREAT | os.O_WRONLY | os.O_APPEND, sync=False):
        fd = self.io.open(os.path.join(self.root, name), flags)
        self.io.writev(fd, [data])
        if sync:
            self.io.fsync(fd)
        self.io.close(fd)

    def test_what_was_there_before_survives(self):
        with open(os.path.join(self.root, "old"), "wb") as f:
            f.write(b"before")
        io = PowerLossIO(self.root)
        self.assertEqual(tree(io.image(self.root + "-x")), {"old": b"before"})

    def test_new_name_needs_its_directory_fsynced(self):
        self.write("a", b"data", sync=True)
        self.assertEqual(self.image(), {})          # data durable, name not
        self.assertEqual(self.image(names="all"), {"a": b"data"})
        self.io.fsync_dir(self.root)
        self.assertEqual(self.image(), {"a": b"data"})

    def test_unsynced_data_is_lost_or_kept_as_asked(self):
        self.write("a", b"one", sync=True)
        self.io.fsync_dir(self.root)
        self.write("a", b"two")
        self.assertEqual(self.image(), {"a": b"one"})
        self.assertEqual(self.image(data="all"), {"a": b"onetwo"})
        prefixes = {self.image(data="prefix", seed=s)["a"] for s in range(30)}
        self.assertEqual(prefixes, {b"one", b"onet", b"onetw", b"onetwo"})

    def test_name_durable_before_data_leaves_an_empty_file(self):
        self.write("seg", b"header")
        self.io.fsync_dir(self.root)      # someone else's directory fsync
        self.assertEqual(self.image(), {"seg": b""})

    def test_moments(self):
        self.write("a", b"x", sync=True)
        self.io.fsync_dir(self.root)
        middle = self.io.moment
        self.write("b", b"y", sync=True)
        self.io.fsync_dir(self.root)
        self.assertEqual(self.image(at=middle), {"a": b"x"})
        self.assertEqual(self.image(), {"a": b"x", "b": b"y"})
        self.assertEqual(self.image(at=0), {})

    def test_rename_survives_only_with_its_directory(self):
        self.write("f", b"old", sync=True)
        self.io.fsync_dir(self.root)
        self.write("f.tmp", b"new", sync=True)
        self.io.replace(os.path.join(self.root, "f.tmp"), os.path.join(self.root, "f"))
        self.assertEqual(self.image(), {"f": b"old"})
        self.assertEqual(self.image(names="all"), {"f": b"new"})
        self.io.fsync_dir(self.root)
        self.assertEqual(self.image(), {"f": b"new"})

    def test_a_renamed_directory_keeps_its_files(self):
        d = os.path.join(self.root, "d")
        self.io.mkdir(d)
        self.write("d/f", b"x", sync=True)
        self.io.fsync_dir(d)
        self.io.fsync_dir(self.root)
        self.io.replace(d, os.path.join(self.root, "e"))
        self.assertEqual(self.image(), {"d": None, "d/f": b"x"})
        self.io.fsync_dir(self.root)
        self.write("e/g", b"y", sync=True)      # the live path follows the rename
        self.io.fsync_dir(os.path.join(self.root, "e"))
        self.assertEqual(self.image(), {"e": None, "e/f": b"x", "e/g": b"y"})

    def test_unlink_and_truncate(self):
        self.write("a", b"abcdef", sync=True)
        self.io.fsync_dir(self.root)
        fd = self.io.open(os.path.join(self.root, "a"), os.O_RDWR)
        self.io.ftruncate(fd, 2)
        self.io.close(fd)
        self.assertEqual(self.image(), {"a": b"abcdef"})
        self.assertEqual(self.image(data="all"), {"a": b"ab"})
        self.io.unlink(os.path.join(self.root, "a"))
        self.assertEqual(self.image(), {"a": b"abcdef"})
        self.io.fsync_dir(self.root)
        self.assertEqual(self.image(), {})

    def test_created_directory_needs_its_parent_fsynced(self):
        sub = os.path.join(self.root, "d")
        self.io.mkdir(sub)
        self.write("d/f", b"x", sync=True)
        self.io.fsync_dir(sub)
        self.assertEqual(self.image(), {})
        self.io.fsync_dir(self.root)
        self.assertEqual(self.image(), {"d": None, "d/f": b"x"})

    def test_writes_at_the_file_position(self):
        fd = self.io.open(os.path.join(self.root, "p"), os.O_CREAT | os.O_WRONLY)
        self.io.writev(fd, [b"ab", b"cd"])
        self.io.writev(fd, [b"ef"])
        self.io.fsync(fd)
        self.io.close(fd)
        self.io.fsync_dir(self.root)
        self.assertEqual(self.image(), {"p": b"abcdef"})

    def test_pages_mix_old_and_new(self):
        self.write("a", b"o" * 10000, sync=True)
        self.io.fsync_dir(self.root)
        fd = self.io.open(os.path.join(self.root, "a"), os.O_WRONLY)
        self.io.writev(fd, [b"n" * 10000])
        self.io.close(fd)
        seen = {self.image(data="pages", seed=s)["a"] for s in range(20)}
        self.assertIn(b"n" * 4096 + b"o" * 5904, seen)
        self.assertIn(b"o" * 4096 + b"n" * 4096 + b"o" * 1808, seen)

    def test_pages_of_a_file_that_shrank(self):
        self.write("a", b"o" * 9000, sync=True)
        self.io.fsync_dir(self.root)
        fd = self.io.open(os.path.join(self.root, "a"), os.O_RDWR)
        self.io.ftruncate(fd, 100)
        self.io.close(fd)
        sizes = {len(self.image(data="pages", seed=s)["a"]) for s in range(20)}
        self.assertEqual(sizes, {100, 9000})

    def test_names_cut_moment(self):
        self.write("a", b"1", sync=True)
        cut = self.io.moment
        self.write("b", b"2", sync=True)
        self.assertEqual(self.image(names=cut), {"a": b"1"})

    def test_paths_outside_root_are_not_journaled(self):
        other = self.mktemp()
        os.makedirs(other)
        fd = self.io.open(os.path.join(other, "x"), os.O_CREAT | os.O_WRONLY)
        self.io.writev(fd, [b"x"])
        self.io.close(fd)
        self.assertEqual(self.io.moment, 0)

    def test_foreign_files_are_adopted_when_their_directory_is_fsynced(self):
        path = os.path.join(self.root, "s.db")
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (1)")
        db.commit()
        db.close()
        self.assertEqual(self.image(), {})
        self.io.fsync_dir(self.root)
        image = self.io.image(self.root + "-db")
        db = sqlite3.connect(os.path.join(image, "s.db"))
        self.assertEqual(db.execute("SELECT x FROM t").fetchall(), [(1,)])
        db.close()
