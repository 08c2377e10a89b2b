"""
The reliable target's reading of the session database (the disk column):
a session counts only if the database could resume it where its client
left it.  No server, no lazy FS: a database written here.  And where its
data lives: on the lazy FS, for every fault class, power loss included.
"""

import os
import shutil
import sqlite3

from twisted.trial.unittest import SynchronousTestCase

from streamproto.reliable.session import _SCHEMA
from streamproto.reliable.tap import SQLITE_FILE
from test.faults import lazyfs, nemesis, run
from test.faults.checker import decode
from test.faults.logtargets import ReliableFileTarget
from test.faults.workload import RELIABLE_COUNT, reliable_session_id


class _Server:
    def __init__(self, data_dir):
        self.data_dir = data_dir


class ResumableOnDiskTests(SynchronousTestCase):
    def setUp(self):
        data = self.mktemp()
        os.makedirs(data)
        db = sqlite3.connect(os.path.join(data, SQLITE_FILE))
        db.executescript(_SCHEMA)
        rows = {"ahead": 7, "exact": 5, "behind": 3, "hole": 7}
        for name, last_id in rows.items():
            sid = reliable_session_id(name)
            db.execute("INSERT INTO sessions VALUES (?, '{}', ?, 0, NULL)", (sid, last_id))
            for i in range(1, last_id + 1):
                if not (name == "hole" and i == 6):
                    db.execute("INSERT INTO messages VALUES (?, ?, '{}')", (sid, i))
        db.commit()
        db.close()
        # the target's reading needs only its server's data directory
        self.target = ReliableFileTarget.__new__(ReliableFileTarget)
        self.target.server = _Server(data)

    def test_resumable(self):
        received = {name: [1, 2, 3, 4, 5] for name in ("ahead", "exact", "behind", "hole",
                                                      "missing")}
        received["finished"] = list(range(1, RELIABLE_COUNT + 1))
        received["refused"] = [1]
        self.assertEqual(self.target.resumable_on_disk(received, {"refused"}),
                         {"ahead", "exact", "finished", "refused"})

    def test_records_drop_whole_sessions(self):
        records = ReliableFileTarget.records({"a": [1, 2], "b": [1]}, {"b"}, [b"bad"])
        # message id n is operation n - 1; a dropped session leaves nothing
        self.assertEqual([decode(r) for r in records], [("a", 0), ("a", 1), None])


class PlacementTests(SynchronousTestCase):
    """The session database is on the lazy FS, so power cuts reach it."""

    def target(self, fault):
        from twisted.internet import reactor
        target = run.make_target(reactor, fault, "file", "reliable")
        self.addCleanup(shutil.rmtree, target.work, True)
        return target

    def test_data_on_the_lazy_fs(self):
        for fault in ("kill9", "powerloss", "pause", "clock"):
            target = self.target(fault)
            mount = os.path.join(target.lazy.mountpoint, "")
            self.assertTrue(target.server.data_dir.startswith(mount), fault)

    def test_power_loss_not_refused(self):
        """
        The power-loss row runs wherever a lazy FS can be mounted, and
        where it cannot it says the lazy FS's own reason.
        """
        target = self.target("powerloss")
        self.assertEqual(nemesis.FAULTS["powerloss"].unavailable(target), lazyfs.unavailable())
