"""
Upgrades: this release opens the data of the release that made
C{test/fixtures/formats/} (C{make_formats.py}), file store and JetStream,
record for record; and it refuses, with one line and without touching
the data, a format newer than it reads.
"""

import json
import os
import shutil
import struct
import tarfile
import tempfile

from crc32c import crc32c
from twisted.internet.task import Clock
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.log.copy.engine import digest
from streamproto.log.file import synchronous
from streamproto.log.filestore import FileLogStore
from streamproto.log.format import SEGMENT_HEADER
from streamproto.log.filestore import check_file_store
from streamproto.log.versions import NewerFormat

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "formats")


def manifest():
    with open(os.path.join(FIXTURE, "manifest.json")) as f:
        return json.load(f)


class FormatsTestsMixin:
    def assertHolds(self, store, expected):
        self.assertEqual(sorted(store.names()), sorted(expected))
        for name, want in expected.items():
            log = self.successResultOf(store.get(name))
            got = {"start_position": log.start_position, "end_position": log.end_position,
                   "start_offset": log.start_offset, "end_offset": log.end_offset,
                   "attributes": log.attributes, "config": log.config.as_dict(),
                   "digest": self.successResultOf(
                       digest(log, log.start_position, log.end_position)).as_dict()}
            self.assertEqual(got, want, name)
        # and they go on: an append lands after what was there
        log = self.successResultOf(store.get("events"))
        end = log.end_position
        self.assertEqual(self.successResultOf(log.append([b"new"])).first_position, end)


class FileStoreFormatTests(FormatsTestsMixin, unittest.SynchronousTestCase):

    def setUp(self):
        self.path = os.path.join(tempfile.mkdtemp(prefix="streamproto-formats-"), "data")
        self.addCleanup(shutil.rmtree, os.path.dirname(self.path), True)
        shutil.copytree(os.path.join(FIXTURE, "filestore"), self.path)

    def open(self):
        store = FileLogStore(self.path, reactor=Clock(), run_blocking=synchronous,
                             retention_interval=None)
        self.addCleanup(store.close)
        return store

    def test_opens_the_fixture(self):
        check_file_store(self.path)
        self.assertHolds(self.open(), manifest()["filestore"])

    def bump_segment(self, name):
        """Rewrite a segment's header as a release with segment version 2 would."""
        path = os.path.join(self.path, "events", name)
        with open(path, "r+b") as f:
            head = bytearray(f.read(SEGMENT_HEADER.size))
            head[7] = 2
            f.seek(0)
            f.write(bytes(head) + struct.pack("<I", crc32c(bytes(head))))
        return path

    def test_controller_and_sessions_of_the_fixture(self):
        """The controller's document and the reliable sessions open as they were."""
        from streamproto.pravega.controller.state import ControllerState
        from streamproto.pravega.segments import SegmentStore
        from streamproto.reliable.session import Message, SQLiteSessionStore
        store = self.open()
        state = ControllerState(store, SegmentStore(store))
        self.successResultOf(state.open())
        self.assertEqual(list(state.scopes["s"]), ["t"])
        sessions = SQLiteSessionStore(os.path.join(self.path, "reliable-sessions.sqlite"),
                                      clock=Clock())
        try:
            self.assertEqual(self.successResultOf(sessions.after("a", 2)),
                             Message(3, {"value": 3}))
            self.assertEqual(self.successResultOf(sessions.after("b/\u00e9", 0)),
                             Message(1, {"value": 11}))
        finally:
            sessions._stop_pool()

    def test_newer_segment_refused_and_kept(self):
        """
        A segment of a newer format is refused with one line naming it,
        at start-up and when its log is opened; it is not taken for a
        torn header (which recovery deletes when it is the last segment).
        """
        path = self.bump_segment("00000000000000000120.seg")
        size = os.path.getsize(path)
        with self.assertRaises(NewerFormat) as caught:
            check_file_store(self.path)
        message = str(caught.exception)
        self.assertIn("00000000000000000120.seg is in format version 2", message)
        self.assertIn("reads up to version 1", message)
        self.assertNotIn("\n", message)
        self.failureResultOf(self.open().get("events"), NewerFormat)
        self.assertEqual(os.path.getsize(path), size)

    def test_newer_log_files_refused(self):
        state = os.path.join(self.path, "events", "state.json")
        with open(state) as f:
            doc = json.load(f)
        doc["format"] = 3
        with open(state, "w") as f:
            json.dump(doc, f)
        with self.assertRaises(NewerFormat) as caught:
            check_file_store(self.path)
        self.assertIn("state.json is in format version 3", str(caught.exception))

    def test_server_refuses_to_start(self):
        """The store service stops the server with the one line."""
        from streamproto.core.stores import StoreService
        self.bump_segment("00000000000000000030.seg")
        lines = []
        service = StoreService(self.path, reactor=Clock(), run_blocking=synchronous)

        class Top:
            parent = None

            def _cannot_start(self, error):
                lines.append(str(error))
        service.parent = Top()
        service.startService()
        self.assertEqual(len(lines), 1)
        self.assertIn("00000000000000000030.seg is in format version 2", lines[0])
        self.successResultOf(service.store.close())


class ControllerFormatTests(unittest.SynchronousTestCase):
    def test_newer_controller_document_refused(self):
        from streamproto.pravega.controller.state import STATE_LOG, ControllerState
        from streamproto.pravega.segments import SegmentStore
        store = MemoryLogStore()
        log = self.successResultOf(store.create(STATE_LOG))
        self.successResultOf(log.append([json.dumps({"format": 2, "scopes": {}}).encode()]))
        state = ControllerState(store, SegmentStore(store))
        failure = self.failureResultOf(state.open(), NewerFormat)
        self.assertIn("is in format version 2", failure.getErrorMessage())


class JetStreamFormatTests(FormatsTestsMixin, unittest.SynchronousTestCase):

    def setUp(self):
        from test.support.natsutil import NatsCluster
        self.cluster = NatsCluster(1)
        self.addCleanup(self.cluster.stop)
        with tarfile.open(os.path.join(FIXTURE, "jetstream.tar.gz")) as tar:
            tar.extractall(self.cluster.directory, filter="data")
        self.cluster.start()

    def store(self, prefix):
        from streamproto.log.bridge import SynchronousBridge
        from streamproto.log.jetstream import JetStreamLogStore
        store = JetStreamLogStore(self.cluster.urls, prefix=prefix, clock=Clock(),
                                  bridge=SynchronousBridge(), retention_interval=None)
        self.addCleanup(store.close)
        self.successResultOf(store.start())
        return store

    def test_opens_the_fixture(self):
        fixture = manifest()["jetstream"]
        self.assertHolds(self.store(fixture["prefix"]), fixture["logs"])

    def test_sessions_of_the_fixture(self):
        from streamproto.log.bridge import SynchronousBridge
        from streamproto.log.natsio import NatsIO
        from streamproto.reliable.sessioncopy import BucketSessions
        bridge = SynchronousBridge()
        sessions = BucketSessions(NatsIO(self.cluster.urls, bridge), bridge.call,
                                  manifest()["jetstream"]["prefix"], 1, bridge)
        try:
            self.assertEqual(self.successResultOf(sessions.read()), manifest()["sessions"])
        finally:
            self.successResultOf(sessions.close())

    def test_newer_stream_refused(self):
        from streamproto.log.jetstream import store as js
        store = self.store("newer")
        config = store._stream_config("events", js.LogConfig())
        config["metadata"][js.FORMAT_KEY] = "2"
        self.successResultOf(store._call(store.io.add_stream, config))
        failure = self.failureResultOf(self.store("newer").get("events"), NewerFormat)
        self.assertIn("JetStream stream newer_events is in format version 2",
                      failure.getErrorMessage())
