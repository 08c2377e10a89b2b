"""
Pravega segment store replies against a store that answers later
(L{HeldStore}): SegmentCreated, AppendSetup, DataAppended (blocks and
conditional appends), SegmentSealed, SegmentAttributeUpdated, and the
table segment replies go out only once the store stored what they stand
for; a store that fails is an error reply or a closed connection, never
the success reply.
"""

import uuid

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from streamproto.log import MemoryLogStore
from streamproto.pravega import codec
from streamproto.pravega.blocks import pack_blocks
from streamproto.pravega.segments import log_name
from streamproto.pravega.server import PravegaServerFactory
from test.support.heldstore import HeldStore, unreachable
from test.pravega.test_pravega_server import chunk

SEG = "scope/stream/0.#epoch.0"
TABLE = "_system/_tables/t"


class _ServerBase(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.store = HeldStore(MemoryLogStore(self.clock))
        self.factory = PravegaServerFactory(self.store, clock=self.clock)
        self.reconnect()

    def reconnect(self):
        """A new connection to the same server (as a client does after a
        store error closed the last one)."""
        self.proto = self.factory.buildProtocol(None)
        self.transport = StringTransport()
        self.proto.makeConnection(self.transport)
        self.addCleanup(self.proto.connectionLost, None)
        self.decoder = codec.Decoder()

    def send(self, *commands):
        self.proto.dataReceived(b"".join(
            codec.encode(c) if hasattr(c, "FIELDS") else bytes(c) for c in commands))

    def replies(self):
        data = self.transport.value()
        self.transport.clear()
        return self.decoder.feed(data)

    def create_segment(self, name=SEG):
        self.send(codec.CreateSegment(1, name, 0, 0, ""))
        self.store.release_all()
        [created] = self.replies()
        self.assertIsInstance(created, codec.SegmentCreated)

    def setup_writer(self):
        self.create_segment()
        writer = uuid.uuid4()
        self.send(codec.SetupAppend(2, writer, SEG, ""))
        self.store.release_all()
        [setup] = self.replies()
        self.assertIsInstance(setup, codec.AppendSetup)
        return writer

    def stored(self, name=SEG):
        return self.store.inner.get(log_name(name)).result.end_offset


class SegmentCreationTests(_ServerBase):
    def test_created_after_the_store_created_it(self):
        self.send(codec.CreateSegment(1, SEG, 0, 0, ""))
        self.assertEqual([h.operation for h in self.store.pending()], ["create"])
        self.assertEqual(self.replies(), [])
        self.store.release_all("create")
        # the segment's first attribute write (its mtime) is part of the creation
        self.assertEqual([h.operation for h in self.store.pending()], ["append"])
        self.assertEqual(self.replies(), [], "SegmentCreated before it was durable")
        self.store.release_all()
        self.assertEqual(self.replies(), [codec.SegmentCreated(1, SEG)])

    def test_create_fails(self):
        self.send(codec.CreateSegment(1, SEG, 0, 0, ""))
        self.store.fail_all(unreachable())
        self.assertNotIn(codec.SegmentCreated(1, SEG), self.replies())
        self.assertTrue(self.transport.disconnecting)
        self.flushLoggedErrors()

    def test_first_write_fails(self):
        self.send(codec.CreateSegment(1, SEG, 0, 0, ""))
        self.store.release_all("create")
        self.store.fail_all(unreachable())
        self.assertNotIn(codec.SegmentCreated(1, SEG), self.replies())
        self.assertTrue(self.transport.disconnecting)
        self.flushLoggedErrors()


class AppendTests(_ServerBase):
    def test_setup_waits_for_the_segment(self):
        self.create_segment()
        self.proto.factory.segments._open.clear()     # as after a restart: opened again
        writer = uuid.uuid4()
        self.send(codec.SetupAppend(2, writer, SEG, ""))
        self.assertEqual([h.operation for h in self.store.pending()], ["get"])
        self.assertEqual(self.replies(), [])
        self.store.release_all()
        [setup] = self.replies()
        self.assertEqual((setup.writer_id, setup.last_event_number),
                         (writer, codec.NULL_EVENT_NUMBER))

    def test_data_appended_after_the_append(self):
        writer = self.setup_writer()
        self.send(*pack_blocks([chunk([b"a", b"b"], 1)], writer, 2, 1000))
        self.assertEqual(len(self.store.pending("append")), 1)
        self.assertEqual(self.replies(), [], "DataAppended before the append was stored")
        self.store.release_all()
        [ack] = self.replies()
        self.assertIsInstance(ack, codec.DataAppended)
        self.assertEqual((ack.event_number, ack.current_segment_write_offset), (1, 18))
        self.assertEqual(self.stored(), 18)

    def test_conditional_append_after_the_append(self):
        writer = self.setup_writer()
        self.send(codec.ConditionalAppend(writer, 1, 0, b"x", 3))
        self.assertEqual(len(self.store.pending("append")), 1)
        self.assertEqual(self.replies(), [])
        self.store.release_all()
        [ack] = self.replies()
        self.assertEqual((type(ack), ack.event_number, ack.current_segment_write_offset),
                         (codec.DataAppended, 1, 9))

    def test_failed_append_is_not_acknowledged(self):
        writer = self.setup_writer()
        self.send(*pack_blocks([chunk([b"a"], 1)], writer, 2, 1000))
        self.store.fail_all(unreachable())
        self.assertEqual([r for r in self.replies() if isinstance(r, codec.DataAppended)], [])
        self.assertTrue(self.transport.disconnecting)
        self.flushLoggedErrors()

    def test_append_after_a_failed_one_does_not_acknowledge_it(self):
        """
        DataAppended acknowledges every event number up to its own: a
        later append must not be acknowledged after an earlier one failed
        (the store refuses it, as it expects the writer's event number the
        failed one would have set).
        """
        writer = self.setup_writer()
        self.send(*pack_blocks([chunk([b"a"], 1)], writer, 2, 1000))
        self.send(*pack_blocks([chunk([b"b"], 2)], writer, 2, 1000))
        first, second = self.store.pending("append")
        first.fail(unreachable())
        second.release()
        self.assertEqual([r for r in self.replies() if isinstance(r, codec.DataAppended)], [])
        self.assertEqual(self.stored(), 0)
        self.flushLoggedErrors()


class AdminTests(_ServerBase):
    def test_sealed_after_the_seal_is_durable(self):
        self.create_segment()
        self.send(codec.SealSegment(4, SEG, ""))
        self.assertEqual(self.replies(), [])
        self.store.release_all()
        self.assertEqual(self.replies(), [codec.SegmentSealed(4, SEG)])

    def test_seal_fails(self):
        self.create_segment()
        self.send(codec.SealSegment(4, SEG, ""))
        self.store.fail_all(unreachable())
        self.assertNotIn(codec.SegmentSealed(4, SEG), self.replies())
        self.flushLoggedErrors()

    def test_attribute_updated_after_it_is_durable(self):
        self.create_segment()
        attribute = uuid.uuid4()
        self.send(codec.UpdateSegmentAttribute(5, SEG, attribute, 7,
                                               codec.NULL_ATTRIBUTE_VALUE, ""))
        self.assertEqual(self.replies(), [])
        self.store.release_all()
        self.assertEqual(self.replies(), [codec.SegmentAttributeUpdated(5, True)])

    def test_attribute_update_fails(self):
        self.create_segment()
        self.send(codec.UpdateSegmentAttribute(5, SEG, uuid.uuid4(), 7,
                                               codec.NULL_ATTRIBUTE_VALUE, ""))
        self.store.fail_all(unreachable())
        self.assertNotIn(codec.SegmentAttributeUpdated(5, True), self.replies())
        self.flushLoggedErrors()


class MergeTests(_ServerBase):
    """MergeSegments (a transaction commit): SegmentsMerged once the target holds it."""

    SOURCE = SEG + "#transaction.00000000000000000000000000000001"

    def connect(self):
        proto = self.factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        self.addCleanup(proto.connectionLost, None)
        return proto, transport

    def merge_in_flight(self):
        """Start a merge; release the store until the target's append is asked."""
        self.create_segment()
        self.create_segment(self.SOURCE)
        self.store.inner.get(log_name(self.SOURCE)).result.append([b"txn data"])
        self.send(codec.MergeSegments(9, SEG, self.SOURCE, ""))
        target = log_name(SEG)
        while not [h for h in self.store.pending("append") if h.name == target]:
            self.store.pending()[0].release()
        self.assertEqual(self.replies(), [])

    def test_merged_after_the_append(self):
        self.merge_in_flight()
        self.store.release_all()
        [merged] = self.replies()
        self.assertEqual((type(merged), merged.new_target_write_offset),
                         (codec.SegmentsMerged, 8))
        self.assertEqual(self.stored(), 8)

    def test_retried_merge_waits_for_the_merge_in_flight(self):
        """
        A client retrying a commit on another connection while the first
        merge's append is in flight is answered only once that append is
        stored, and not at all if it fails (it was answered at once).
        """
        self.merge_in_flight()
        proto, transport = self.connect()
        proto.dataReceived(codec.encode(codec.MergeSegments(10, SEG, self.SOURCE, "")))
        self.assertEqual(codec.Decoder().feed(transport.value()), [],
                         "the retry answered before the merge was stored")
        self.store.fail_all(unreachable(), "append")
        self.assertNotIn(codec.SegmentsMerged, [type(r) for r in self.replies()])
        self.assertNotIn(codec.SegmentsMerged,
                         [type(r) for r in codec.Decoder().feed(transport.value())])
        # the source was kept: the retry does the merge itself
        self.store.release_all()
        [merged] = codec.Decoder().feed(transport.value())
        self.assertEqual((type(merged), merged.new_target_write_offset),
                         (codec.SegmentsMerged, 8))
        self.assertEqual(self.stored(), 8)
        self.flushLoggedErrors()

    def test_retried_merge_answered_once_stored(self):
        self.merge_in_flight()
        proto, transport = self.connect()
        proto.dataReceived(codec.encode(codec.MergeSegments(10, SEG, self.SOURCE, "")))
        self.store.release_all()
        [merged] = codec.Decoder().feed(transport.value())
        self.assertEqual((type(merged), merged.new_target_write_offset),
                         (codec.SegmentsMerged, 8))
        self.assertEqual(self.stored(), 8)


class TableTests(_ServerBase):
    def create_table(self):
        self.send(codec.CreateTableSegment(1, TABLE, b""))
        self.assertEqual(self.replies(), [])
        self.store.release_all()
        self.assertEqual(self.replies(), [codec.SegmentCreated(1, TABLE)])

    def update(self, request_id=2):
        key = codec.TableKey(b"k", codec.TableKey.NOT_EXISTS)
        self.send(codec.UpdateTableEntries(request_id, TABLE, "", ((key, b"v"),), -1))

    def test_table_created_after_durable(self):
        self.send(codec.CreateTableSegment(1, TABLE, b""))
        self.store.release_all("create")
        self.assertEqual(self.replies(), [], "SegmentCreated before the table was durable")
        self.store.release_all()
        self.assertEqual(self.replies(), [codec.SegmentCreated(1, TABLE)])

    def test_entries_updated_after_the_append(self):
        self.create_table()
        self.update()
        self.assertEqual(self.replies(), [], "TableEntriesUpdated before the append")
        self.assertTrue(self.store.pending("append"))
        self.store.release_all()
        [updated] = self.replies()
        self.assertIsInstance(updated, codec.TableEntriesUpdated)
        self.assertEqual(len(updated.updated_versions), 1)

    def test_retry_finishes_a_half_made_table(self):
        """
        A table is a log and then its marker: when the marker's append
        fails, the client hears an error and retries, and the retry makes
        the table (before, every retry answered "exists" and every use
        "no such segment", for good).
        """
        self.send(codec.CreateTableSegment(1, TABLE, b""))
        self.store.release_all("create")
        self.store.fail_all(unreachable())
        self.assertNotIn(codec.SegmentCreated(1, TABLE), self.replies())
        self.flushLoggedErrors()
        self.assertTrue(self.transport.disconnecting)
        self.reconnect()
        self.send(codec.CreateTableSegment(2, TABLE, b""))
        self.store.release_all()
        self.assertEqual(self.replies(), [codec.SegmentCreated(2, TABLE)])
        self.update(3)
        self.store.release_all()
        [updated] = self.replies()
        self.assertIsInstance(updated, codec.TableEntriesUpdated)

    def test_finished_table_still_exists(self):
        """The retry's leniency is for an unmarked, empty log only."""
        self.create_table()
        self.send(codec.CreateTableSegment(2, TABLE, b""))
        self.store.release_all()
        [reply] = self.replies()
        self.assertIsInstance(reply, codec.SegmentAlreadyExists)

    def test_segment_of_that_name_still_exists(self):
        self.create_segment(TABLE)
        self.send(codec.CreateTableSegment(2, TABLE, b""))
        self.store.release_all()
        [reply] = self.replies()
        self.assertIsInstance(reply, codec.SegmentAlreadyExists)

    def test_update_fails(self):
        self.create_table()
        self.update()
        self.store.fail_all(unreachable())
        self.assertEqual([r for r in self.replies()
                          if isinstance(r, codec.TableEntriesUpdated)], [])
        self.flushLoggedErrors()


class ControllerStateTests(SynchronousTestCase):
    """
    The controller's answers (SUCCESS, SCOPE_EXISTS, ...) stand for its
    state document as stored: after a save that failed, an answer must
    not come from the change that was not stored.
    """

    def setUp(self):
        from streamproto.pravega.controller.state import ControllerState
        from streamproto.pravega.segments import SegmentStore
        self.clock = Clock()
        self.store = HeldStore(MemoryLogStore(self.clock))
        self.state = ControllerState(self.store, SegmentStore(self.store), self.clock)
        d = self.state.open()
        self.store.release_all()
        self.successResultOf(d)

    def test_scope_created_after_the_save(self):
        d = self.state.create_scope("sc")
        self.store.release_all("get")
        self.assertNoResult(d)
        self.store.release_all()
        self.assertEqual(self.successResultOf(d), "SUCCESS")

    def test_failed_save_is_not_answered_later(self):
        d = self.state.create_scope("sc")
        self.store.release_all("get")
        self.store.fail_all(unreachable(), "append")
        self.failureResultOf(d)
        # the client retries: the scope is not stored, so it is created now
        again = self.state.create_scope("sc")
        self.store.release_all()
        self.assertEqual(self.successResultOf(again), "SUCCESS")
        self.assertEqual(len(self.store.pending()), 0)
        self.assertIn("sc", json_state(self.store)["scopes"])
        self.flushLoggedErrors()


def json_state(store):
    import json
    from streamproto.pravega.controller.state import STATE_LOG
    log = store.inner.get(STATE_LOG).result
    return json.loads(log.read(log.end_position - 1).result.records()[0])
