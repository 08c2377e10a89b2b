"""
The Pravega server, writer and reader end to end over real sockets (TCP and
TLS), on the in-memory log store, and on the file store for restarts.
"""

import uuid
from functools import partial

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, protocol, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, serverFromString
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint
from streamproto.log import MemoryLogStore
from streamproto.pravega import codec, segments
from streamproto.pravega.blocks import EventChunk, pack_blocks
from streamproto.pravega.client import (
    ConditionalCheckFailedError, NoSuchSegmentError,
    PravegaClientProtocol, SegmentExistsError, SegmentReader, SegmentSealedError,
    SegmentTruncatedError, SegmentWriter, ServerError, connect,
)
from streamproto.pravega.server import PravegaServerFactory
from test.support.logutil import error_lines
from test.support.tlsutil import certs

SEG = "scope/stream/0.#epoch.0"


class RecordingClient(PravegaClientProtocol):
    """Keeps every reply (besides dispatching it) for raw protocol tests."""

    def __init__(self):
        super().__init__()
        self.received = defer.DeferredQueue()

    def _reply(self, reply):
        self.received.put(reply)
        super()._reply(reply)

    def send_raw(self, data):
        self.transport.write(data)

    @defer.inlineCallbacks
    def next(self, kind=None):
        while True:
            reply = yield self.received.get()
            if kind is None or isinstance(reply, kind):
                return reply


def chunk(payloads, last):
    frames = [codec.encode_event(p) for p in payloads]
    ends, total = [], 0
    for f in frames:
        total += len(f)
        ends.append(total)
    c = EventChunk(b"".join(frames), ends, None)
    c.last = last
    return c


class ServerTestBase(unittest.TestCase):
    timeout = 30

    def make_store(self):
        return MemoryLogStore(reactor)

    @defer.inlineCallbacks
    def setUp(self):
        self.store = self.make_store()
        self.factory = PravegaServerFactory(self.store, read_wait=0.3)
        yield self.listen(self.factory)

    @defer.inlineCallbacks
    def listen(self, factory, description=None):
        if description is None:
            port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
        else:
            port = yield serverFromString(reactor, description).listen(factory)
        self.port = port
        self.addCleanup(self.stop_server, port, factory)
        self.endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)

    @defer.inlineCallbacks
    def stop_server(self, port, factory):
        yield port.stopListening()
        for p in list(factory.connections):
            p.transport.loseConnection()

    @defer.inlineCallbacks
    def connect(self, cls=RecordingClient, endpoint=None):
        proto = yield (endpoint or self.endpoint).connect(protocol.Factory.forProtocol(cls))
        self.addCleanup(self.disconnect, proto)
        yield proto.ready
        return proto

    def disconnect(self, proto):
        if not proto.closed.called:
            proto.transport.loseConnection()
            return proto.closed

    def writer(self, segment=SEG, endpoint=None, **kw):
        w = SegmentWriter(endpoint or self.endpoint, segment, **kw)
        self.addCleanup(w.stop, None)
        self.addCleanup(self.wait_closed, w)
        return w

    def wait_closed(self, w):
        proto = getattr(w, "_setup_proto", None)
        if proto is not None and not proto.closed.called:
            proto.transport.loseConnection()
            return proto.closed

    def reader(self, segment=SEG, **kw):
        r = SegmentReader(self.endpoint, segment, **kw)
        self.addCleanup(r.close)
        return r

    @defer.inlineCallbacks
    def read_all(self, segment=SEG):
        """Every event of the segment, straight from the log store."""
        log = yield self.store.get(segments.log_name(segment))
        data = yield log.read_bytes(log.start_offset, log.end_offset - log.start_offset)
        events, used = codec.split_events(data)
        self.assertEqual(used, len(data))
        return events


class SessionTests(ServerTestBase):
    @defer.inlineCallbacks
    def test_hello(self):
        c = yield self.connect()
        self.assertEqual(c.server_versions, (17, 5))

    @defer.inlineCallbacks
    def test_overlapping_versions_accepted(self):
        for high, low in [(17, 17), (30, 10), (5, 1)]:
            c = yield self.connect()
            c.send(codec.Hello(high, low))
            reply = yield c.next(codec.Hello)
            self.assertEqual(reply, codec.Hello(17, 5))
            c.send(codec.KeepAlive())
            yield c.next(codec.KeepAlive)   # still open

    @defer.inlineCallbacks
    def test_disjoint_versions_closed(self):
        for high, low in [(4, 1), (100, 18)]:
            c = yield self.connect()
            c.send(codec.Hello(high, low))
            reply = yield c.next(codec.Hello)
            self.assertEqual(reply, codec.Hello(17, 5))
            yield c.closed

    @defer.inlineCallbacks
    def test_keepalive_echo(self):
        c = yield self.connect()
        c.send(codec.KeepAlive())
        self.assertEqual((yield c.next(codec.KeepAlive)), codec.KeepAlive())

    @defer.inlineCallbacks
    def test_garbage_closes_only_that_connection(self):
        good = yield self.connect()
        bad = yield self.connect()
        bad.send_raw(b"\x00\x00\x00\x06\x00\x00\x00\x00")   # unknown type 6
        yield bad.closed
        oversized = yield self.connect()
        oversized.send_raw(b"\x00\x00\x00\x03\x01\x00\x00\x00")   # 16 MiB frame
        yield oversized.closed
        yield good.create_segment(SEG)
        info = yield good.segment_info(SEG)
        self.assertTrue(info.exists)

    @defer.inlineCallbacks
    def test_event_outside_block_closes(self):
        c = yield self.connect()
        c.send(codec.Event(b"x"))
        yield c.closed

    @defer.inlineCallbacks
    def test_append_before_setup_closes(self):
        c = yield self.connect()
        c.send(codec.AppendBlockEnd(uuid.uuid4(), 0, codec.encode_event(b"x"), 1, 1, 1))
        yield c.closed

    @defer.inlineCallbacks
    def test_unsupported_command(self):
        c = yield self.connect()
        # GetTableSegmentInfo(requestId, segment, token)
        c.send_raw(codec.pack_header(68, 8 + 2 + 2) + (42).to_bytes(8, "big")
                   + b"\x00\x00" + b"\x00\x00")
        reply = yield c.next(codec.OperationUnsupported)
        self.assertEqual(reply.request_id, 42)
        d = c.request(codec.CreateSegment(43, SEG, 0, 0, "", 0))
        yield d   # the connection carries on

    @defer.inlineCallbacks
    def test_idle_timeout(self):
        self.factory.idle_timeout = 0.2
        c = yield self.connect()
        yield c.closed


class AdminTests(ServerTestBase):
    @defer.inlineCallbacks
    def test_lifecycle(self):
        c = yield self.connect()
        created = yield c.create_segment(SEG)
        self.assertEqual(created, codec.SegmentCreated(1, SEG))
        yield self.assertFailure(c.create_segment(SEG), SegmentExistsError)
        info = yield c.segment_info(SEG)
        self.assertEqual((info.exists, info.is_sealed, info.write_offset, info.start_offset),
                         (True, False, 0, 0))
        self.assertGreater(info.last_modified, 0)
        yield c.seal_segment(SEG)
        e = yield self.assertFailure(c.seal_segment(SEG), SegmentSealedError)
        self.assertEqual(e.reply.segment, SEG)
        info = yield c.segment_info(SEG)
        self.assertTrue(info.is_sealed)
        yield c.delete_segment(SEG)
        yield self.assertFailure(c.delete_segment(SEG), NoSuchSegmentError)
        yield self.assertFailure(c.segment_info(SEG), NoSuchSegmentError)
        yield self.assertFailure(c.seal_segment(SEG), NoSuchSegmentError)
        yield self.assertFailure(c.truncate_segment(SEG, 0), NoSuchSegmentError)
        yield self.assertFailure(c.read_segment(SEG, 0), NoSuchSegmentError)
        e = yield self.assertFailure(c.setup_append(uuid.uuid4(), SEG), NoSuchSegmentError)
        self.assertEqual(e.reply.segment, SEG)

    @defer.inlineCallbacks
    def test_transient_segments(self):
        """
        CreateTransientSegment makes C{parent#transient.<writer>.<random>};
        a writer appends to it, a merge moves its events into the parent; a
        transient segment not merged is deleted with its connection.
        """
        import re
        c = yield self.connect()
        yield c.create_segment(SEG)
        writer_id = uuid.UUID(int=0xABC)
        created = yield c.create_transient_segment(SEG, writer_id)
        name = created.segment
        self.assertRegex(name, "^" + re.escape(SEG + "#transient." + writer_id.hex + ".")
                         + "[0-9a-f]{32}$")
        self.assertTrue(segments.is_transient(name))
        other = yield c.create_transient_segment(SEG, writer_id)
        self.assertNotEqual(other.segment, name)
        c.send(codec.SetupAppend(50, writer_id, name, ""))
        yield c.next(codec.AppendSetup)
        c.send(codec.AppendBlockEnd(writer_id, 0, codec.encode_event(b"large") * 2, 2, 1, 50))
        yield c.next(codec.DataAppended)
        merged = yield c.merge_segments(SEG, name)
        self.assertEqual(merged.new_target_write_offset, 2 * (8 + 5))
        self.assertEqual((yield self.read_all()), [b"large", b"large"])
        yield self.assertFailure(c.segment_info(name), NoSuchSegmentError)

        c2 = yield self.connect()
        yield c2.segment_info(other.segment)          # visible to others meanwhile
        yield self.disconnect(c)
        for _ in range(100):
            if other.segment not in self.factory.segments.names():
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        yield self.assertFailure(c2.segment_info(other.segment), NoSuchSegmentError)
        self.assertEqual(self.factory.segments.names(), [SEG])
        # the parent must exist
        e = yield self.assertFailure(c2.create_transient_segment("no/such/0", writer_id),
                                     NoSuchSegmentError)
        self.assertEqual(e.reply.segment, "no/such/0")

    @defer.inlineCallbacks
    def test_leftover_transient_segments_deleted_at_start(self):
        store = segments.SegmentStore(self.store)
        yield store.create(SEG)
        leftover = segments.transient_name(SEG, uuid.uuid4())
        yield store.create(leftover)
        lookalike = SEG + "#transient.short"
        yield store.create(lookalike)
        factory = PravegaServerFactory(self.store, read_wait=0.3)
        factory.doStart()
        self.addCleanup(factory.doStop)
        for _ in range(100):
            if leftover not in store.names():
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(sorted(store.names()), sorted([SEG, lookalike]))

    @defer.inlineCallbacks
    def test_attributes(self):
        c = yield self.connect()
        yield c.create_segment(SEG)
        attr = uuid.uuid4()
        got = yield c.get_attribute(SEG, attr)
        self.assertEqual(got.value, codec.NULL_ATTRIBUTE_VALUE)
        ok = yield c.update_attribute(SEG, attr, 5)          # expected: unset
        self.assertTrue(ok.success)
        ok = yield c.update_attribute(SEG, attr, 6, 4)       # wrong expectation
        self.assertFalse(ok.success)
        ok = yield c.update_attribute(SEG, attr, 6, 5)
        self.assertTrue(ok.success)
        self.assertEqual((yield c.get_attribute(SEG, attr)).value, 6)
        # a writer's event number is the attribute named by its id, as in Pravega
        w = self.writer()
        yield w.write_batch([b"a", b"b", b"c"])
        self.assertEqual((yield c.get_attribute(SEG, w.writer_id)).value, 2)
        yield c.seal_segment(SEG)
        yield self.assertFailure(c.update_attribute(SEG, attr, 7, 6), SegmentSealedError)
        self.assertEqual((yield c.get_attribute(SEG, attr)).value, 6)
        yield self.assertFailure(c.get_attribute("nope", attr), NoSuchSegmentError)
        yield self.assertFailure(c.update_attribute("nope", attr, 1), NoSuchSegmentError)

    @defer.inlineCallbacks
    def test_names_stored_escaped(self):
        c = yield self.connect()
        yield c.create_segment(SEG)
        self.assertEqual(self.store.names(), ["pravega_scope_2fstream_2f0_2e_23epoch_2e0"])
        self.assertEqual(self.factory.segments.names(), [SEG])

    @defer.inlineCallbacks
    def test_truncate(self):
        c = yield self.connect()
        yield c.create_segment(SEG)
        w = self.writer()
        yield w.write_batch([b"%03d" % i for i in range(10)])
        # each event is 8 + 3 bytes: drop the first four
        yield c.truncate_segment(SEG, 44)
        info = yield c.segment_info(SEG)
        self.assertEqual((info.start_offset, info.write_offset), (44, 110))
        e = yield self.assertFailure(c.read_segment(SEG, 0), SegmentTruncatedError)
        self.assertEqual((e.reply.start_offset, e.reply.offset), (44, 0))
        r = self.reader(offset=44)
        events = yield r.read()
        self.assertEqual(events, [b"%03d" % i for i in range(4, 10)])
        # truncating below the start is a no-op, beyond the end an error
        yield c.truncate_segment(SEG, 11)
        e = yield self.assertFailure(c.truncate_segment(SEG, 111), SegmentTruncatedError)
        self.assertEqual(e.reply.start_offset, 110)
        yield c.seal_segment(SEG)
        yield c.truncate_segment(SEG, 110)   # sealed segments may be truncated
        info = yield c.segment_info(SEG)
        self.assertEqual(info.start_offset, 110)


class SegmentTestBase(ServerTestBase):
    """Tests that start with SEG created, and a client connection in C{self.c}."""

    @defer.inlineCallbacks
    def setUp(self):
        yield super().setUp()
        self.c = yield self.connect()
        yield self.c.create_segment(SEG)


class AppendTests(SegmentTestBase):
    @defer.inlineCallbacks
    def test_setup_new_writer(self):
        wid = uuid.uuid4()
        reply = yield self.c.setup_append(wid, SEG)
        self.assertEqual(reply.last_event_number, codec.NULL_EVENT_NUMBER)
        self.assertEqual(reply.writer_id, wid)

    @defer.inlineCallbacks
    def test_acks_only_advance_and_dups_dropped(self):
        c = self.c
        wid = uuid.uuid4()
        setup = yield c.setup_append(wid, SEG)
        rid = setup.request_id
        c.send_raw(b"".join(pack_blocks([chunk([b"a", b"b"], 1)], wid, rid, 1000)))
        ack = yield c.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.previous_event_number, ack.request_id,
                          ack.current_segment_write_offset),
                         (1, codec.NULL_EVENT_NUMBER, rid, 18))
        # a duplicate block (numbers <= 1) is dropped without an ack; the
        # next block's ack proves it came and went
        c.send_raw(b"".join(pack_blocks([chunk([b"a", b"b"], 1)], wid, rid, 1000)))
        c.send_raw(b"".join(pack_blocks([chunk([b"c"], 2)], wid, rid, 1000)))
        ack = yield c.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.previous_event_number,
                          ack.current_segment_write_offset), (2, 1, 27))
        events = yield self.read_all()
        self.assertEqual(events, [b"a", b"b", b"c"])

    @defer.inlineCallbacks
    def test_java_encoder_shapes(self):
        """
        What the Java CommandEncoder sends besides full blocks: a block cut
        short by Padding (breakCurrentAppend), an AppendBlockEnd carrying
        all the data without a block, and ConditionalAppend.
        """
        c = self.c
        wid = uuid.uuid4()
        setup = yield c.setup_append(wid, SEG)
        rid = setup.request_id
        events = b"".join(codec.encode_event(p) for p in (b"a", b"b"))
        padding = codec.encode(codec.Padding(40))
        c.send_raw(codec.encode_append_block_header(wid, len(events) + len(padding))
                   + events + padding
                   + codec.encode(codec.AppendBlockEnd(wid, len(events), b"", 2, 1, rid)))
        ack = yield c.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.current_segment_write_offset), (1, 18))
        c.send(codec.AppendBlockEnd(wid, 0, codec.encode_event(b"c"), 1, 2, rid))
        ack = yield c.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.previous_event_number), (2, 1))
        c.send(codec.ConditionalAppend(wid, 3, 5, b"d", rid))
        failed = yield c.next(codec.ConditionalCheckFailed)
        self.assertEqual((failed.writer_id, failed.event_number, failed.request_id),
                         (wid, 3, rid))
        c.send(codec.ConditionalAppend(wid, 3, 27, b"d", rid))
        ack = yield c.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.current_segment_write_offset), (3, 36))
        # the Rust client's conditional block: several events, one number
        two = codec.encode_event(b"e") + codec.encode_event(b"f")
        c.send(codec.ConditionalBlockEnd(wid, 5, 0, two, 77))
        failed = yield c.next(codec.ConditionalCheckFailed)
        self.assertEqual((failed.event_number, failed.request_id), (5, 77))
        c.send(codec.ConditionalBlockEnd(wid, 5, 36, two, 78))
        ack = yield c.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.previous_event_number, ack.request_id,
                          ack.current_segment_write_offset), (5, 3, 78, 54))
        self.assertEqual((yield self.read_all()), [b"a", b"b", b"c", b"d", b"e", b"f"])

    @defer.inlineCallbacks
    def test_bad_block_closes_connection_without_storing(self):
        c = self.c
        wid = uuid.uuid4()
        setup = yield c.setup_append(wid, SEG)
        events = codec.encode_event(b"a")
        c.send_raw(codec.encode_append_block_header(wid, len(events)) + events
                   + codec.encode(codec.AppendBlockEnd(wid, len(events), b"", 0, 1,
                                                       setup.request_id)))
        yield c.closed
        self.assertEqual((yield self.read_all()), [])

    @defer.inlineCallbacks
    def test_overlapping_resend_keeps_new_events_only(self):
        wid = uuid.uuid4()
        setup = yield self.c.setup_append(wid, SEG)
        self.c.send_raw(b"".join(pack_blocks([chunk([b"0", b"1", b"2"], 2)], wid,
                                             setup.request_id, 1000)))
        yield self.c.next(codec.DataAppended)
        # a new connection for the same writer learns 2 and resends 1..4
        c2 = yield self.connect()
        setup = yield c2.setup_append(wid, SEG)
        self.assertEqual(setup.last_event_number, 2)
        c2.send_raw(b"".join(pack_blocks([chunk([b"1", b"2", b"3", b"4"], 4)], wid,
                                         setup.request_id, 1000)))
        ack = yield c2.next(codec.DataAppended)
        self.assertEqual((ack.event_number, ack.previous_event_number), (4, 2))
        self.assertEqual((yield self.read_all()), [b"0", b"1", b"2", b"3", b"4"])

    @defer.inlineCallbacks
    def test_many_writers_per_connection_and_segment(self):
        other = "scope/stream/1.#epoch.0"
        yield self.c.create_segment(other)
        w1, w2, w3 = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        s1 = yield self.c.setup_append(w1, SEG)
        s2 = yield self.c.setup_append(w2, SEG)
        s3 = yield self.c.setup_append(w3, other)
        wire = []
        for n in range(5):
            wire += pack_blocks([chunk([b"1-%d" % n], n)], w1, s1.request_id, 64)
            wire += pack_blocks([chunk([b"2-%d" % n], n)], w2, s2.request_id, 64)
            wire += pack_blocks([chunk([b"3-%d" % n], n)], w3, s3.request_id, 64)
        self.c.send_raw(b"".join(wire))
        acks = {w1: [], w2: [], w3: []}
        for _ in range(15):
            ack = yield self.c.next(codec.DataAppended)
            acks[ack.writer_id].append((ack.previous_event_number, ack.event_number))
        chain = [(codec.NULL_EVENT_NUMBER, 0)] + [(n - 1, n) for n in range(1, 5)]
        self.assertEqual(acks, {w1: chain, w2: chain, w3: chain})
        events = yield self.read_all()
        self.assertEqual([e for e in events if e.startswith(b"1-")],
                         [b"1-%d" % n for n in range(5)])
        self.assertEqual(len(events), 10)
        self.assertEqual((yield self.read_all(other)), [b"3-%d" % n for n in range(5)])

    @defer.inlineCallbacks
    def test_writer_end_to_end(self):
        w = self.writer(block_size=100)
        singles = [w.write(b"event %d" % i) for i in range(50)]
        batch = w.write_batch([b"batch %d" % i for i in range(500)])
        numbers = yield defer.gatherResults(singles + [batch])
        self.assertEqual(numbers, list(range(50)) + [549])
        yield w.close()
        events = yield self.read_all()
        self.assertEqual(events, [b"event %d" % i for i in range(50)]
                         + [b"batch %d" % i for i in range(500)])

    @defer.inlineCallbacks
    def test_large_events_split_over_blocks(self):
        w = self.writer(block_size=1000)
        big = [bytes([i]) * (3000 + i) for i in range(5)]
        yield w.write_batch(big)
        self.assertEqual((yield self.read_all()), big)

    @defer.inlineCallbacks
    def test_window_bounds_unacked(self):
        w = self.writer(window_events=10, block_size=64)
        ds = [w.write(b"%d" % i) for i in range(100)]
        yield task.deferLater(reactor, 0, lambda: None)
        self.assertLessEqual(w._unacked_events, 10)
        yield defer.gatherResults(ds)
        self.assertEqual(len((yield self.read_all())), 100)

    @defer.inlineCallbacks
    def test_idle_writer_kept_alive(self):
        self.factory.idle_timeout = 0.6
        w = self.writer(keepalive_interval=0.05)
        yield w.write(b"a")
        yield task.deferLater(reactor, 1.5, lambda: None)
        yield w.write(b"b")
        self.assertEqual(w.connections, 1)

    @defer.inlineCallbacks
    def test_closed_writer_refuses_writes(self):
        from streamproto.pravega.client import WriterClosed
        w = self.writer()
        yield w.write(b"a")
        yield w.close()
        yield self.assertFailure(w.write(b"b"), WriterClosed)
        yield self.assertFailure(w.flush(), WriterClosed)

    @defer.inlineCallbacks
    def test_writer_restart_continues_numbering(self):
        wid = uuid.uuid4()
        w = self.writer(writer_id=wid)
        yield w.write_batch([b"a", b"b"])
        yield w.close()
        w2 = self.writer(writer_id=wid)
        n = yield w2.write(b"c")
        self.assertEqual(n, 2)
        self.assertEqual((yield self.read_all()), [b"a", b"b", b"c"])

    @defer.inlineCallbacks
    def test_conditional_append_race(self):
        writers = [self.writer(), self.writer(), self.writer()]
        yield defer.gatherResults([w.flush() for w in writers])
        results = yield defer.DeferredList(
            [w.write_conditional(b"winner?", 0) for w in writers], consumeErrors=True)
        ok = [r for success, r in results if success]
        failed = [r for success, r in results if not success]
        self.assertEqual(len(ok), 1)
        self.assertEqual(len(failed), 2)
        for f in failed:
            f.trap(ConditionalCheckFailedError)
        # at the right offset a loser succeeds, and its writer carries on
        loser = [w for w, (s, _) in zip(writers, results) if not s][0]
        yield loser.write_conditional(b"second", 15)
        yield loser.write(b"plain")
        self.assertEqual((yield self.read_all()), [b"winner?", b"second", b"plain"])

    @defer.inlineCallbacks
    def test_sealed_segment_fails_writes(self):
        w = self.writer()
        yield w.write(b"before")
        yield self.c.seal_segment(SEG)
        e = yield self.assertFailure(w.write(b"after"), SegmentSealedError)
        self.assertEqual(e.reply.segment, SEG)
        yield self.assertFailure(w.write(b"again"), SegmentSealedError)
        self.assertEqual((yield self.read_all()), [b"before"])

    @defer.inlineCallbacks
    def test_writer_gives_up_when_server_is_gone(self):
        yield self.port.stopListening()
        w = self.writer(max_retries=3, retry_delay=0.01)
        yield self.assertFailure(w.write(b"x"), ConnectionError)
        yield self.assertFailure(w.write(b"y"), ConnectionError)

    @defer.inlineCallbacks
    def test_failed_log_fails_writer_at_once_with_reason(self):
        """
        A fail-stopped log: the append gets an ErrorMessage with the reason
        and the writer fails at once (no reconnect); a new writer's
        SetupAppend gets the same answer; once the log is back (a restart)
        writing works, and nothing of the failed append was kept.
        """
        from streamproto.log import LogFailed
        logged = error_lines(self)
        w = self.writer(max_retries=3, retry_delay=0.01)
        yield w.write(b"ok")
        log = yield self.store.get(segments.log_name(SEG))
        log.failed = LogFailed("disk on fire")
        e = yield self.assertFailure(w.write(b"lost?"), ServerError)
        self.assertIn("disk on fire", str(e))
        self.assertIn("restart the server", str(e))
        self.assertEqual(e.reply.segment, SEG)
        self.assertEqual(w.connections, 1)              # no retry
        e = yield self.assertFailure(w.write(b"again"), ServerError)
        # one line, no traceback: the store said why
        self.assertEqual(len([line for line in logged
                              if line.startswith("append to") and "disk on fire" in line]), 1, logged)

        w2 = self.writer(max_retries=3, retry_delay=0.01)
        e = yield self.assertFailure(w2.write(b"new writer"), ServerError)
        self.assertIn("disk on fire", str(e))
        self.assertEqual(w2.connections, 0)             # refused at SetupAppend

        log.failed = None
        w3 = self.writer()
        yield w3.write(b"back")
        self.assertEqual((yield self.read_all()), [b"ok", b"back"])

    @defer.inlineCallbacks
    def test_transient_storage_error_closes_and_writer_resends(self):
        """A write that failed and was rolled back (ENOSPC) leaves the log
        usable: the connection is closed, the writer reconnects and resends."""
        from streamproto.log.errors import WriteFailed
        logged = error_lines(self)
        w = self.writer(retry_delay=0.01)
        yield w.write(b"one")
        log = yield self.store.get(segments.log_name(SEG))
        real = log.append

        def fail_once(records, attributes=None, **conditions):
            log.append = real
            return defer.fail(WriteFailed("no space left"))
        log.append = fail_once
        yield w.write(b"two")
        self.assertEqual((yield self.read_all()), [b"one", b"two"])
        self.assertEqual(w.connections, 2)
        self.assertEqual(len([line for line in logged
                              if line.startswith("append to") and "no space left" in line]), 1, logged)

    @defer.inlineCallbacks
    def test_failed_log_answers_only_its_writers(self):
        """On one connection: the writer of the failed log gets one
        ErrorMessage, the writer of a healthy segment carries on, and so
        does the connection."""
        from streamproto.log import LogFailed
        logged = error_lines(self)
        yield self.c.create_segment("other")
        c = yield self.connect()
        bad, good = uuid.UUID(int=1), uuid.UUID(int=2)
        c.send(codec.SetupAppend(5, bad, SEG, ""))
        yield c.next(codec.AppendSetup)
        c.send(codec.SetupAppend(6, good, "other", ""))
        yield c.next(codec.AppendSetup)
        log = yield self.store.get(segments.log_name(SEG))
        log.failed = LogFailed("fsync failed")
        for n in range(3):
            c.send(codec.AppendBlockEnd(bad, 0, codec.encode_event(b"x%d" % n), 1, n, 5))
            c.send(codec.AppendBlockEnd(good, 0, codec.encode_event(b"y%d" % n), 1, n, 6))
        # then a new SetupAppend on the failed log, and a request (in order)
        c.send(codec.SetupAppend(7, uuid.UUID(int=3), SEG, ""))
        info = yield c.segment_info("other")
        self.assertEqual(info.write_offset, 3 * 10)
        replies = []
        while not isinstance(replies[-1:] and replies[-1], codec.StreamSegmentInfo):
            replies.append((yield c.received.get()))
        errors = [r for r in replies if isinstance(r, codec.ErrorMessage)]
        acks = [r for r in replies if isinstance(r, codec.DataAppended)]
        self.assertEqual([(e.request_id, e.segment, e.error_code) for e in errors],
                         [(5, SEG, -1), (7, SEG, -1)])        # once per writer
        self.assertIn("fsync failed", errors[0].message)
        self.assertIn("fsync failed", errors[1].message)
        self.assertEqual([(a.writer_id, a.event_number) for a in acks],
                         [(good, 0), (good, 1), (good, 2)])
        self.assertEqual(len([line for line in logged
                              if line.startswith("append to") and "fsync failed" in line]), 1, logged)

    @defer.inlineCallbacks
    def test_write_to_missing_segment_fails(self):
        w = self.writer(segment="nope")
        yield self.assertFailure(w.write(b"x"), NoSuchSegmentError)


class ProxyProtocol(protocol.Protocol):
    """Forwards to the server; the first connection can be cut mid-stream."""

    def connectionMade(self):
        self.transport.pauseProducing()
        self.peer = None
        self.forwarded = 0
        proxy = self.factory
        self.cut_after = proxy.cuts.pop(0) if proxy.cuts else None
        # with drop_replies, forward the Hello and AppendSetup, drop the acks
        self.reply_allowance = proxy.reply_allowance if (
            self.cut_after is not None and proxy.drop_replies) else None
        out = protocol.Protocol()
        out.dataReceived = self.reply
        out.connectionLost = lambda reason: self.transport.loseConnection()
        proxy.target.connect(protocol.Factory.forProtocol(lambda: out)).addCallback(
            self.linked)

    def linked(self, out):
        self.peer = out
        self.factory.links.append((self, out))
        self.transport.resumeProducing()

    def reply(self, data):
        if self.reply_allowance is None:
            self.transport.write(data)
        elif self.reply_allowance > 0:
            self.transport.write(data[:self.reply_allowance])
            self.reply_allowance -= len(data[:self.reply_allowance])

    def dataReceived(self, data):
        if self.cut_after is not None and self.forwarded + len(data) >= self.cut_after:
            part = data[:self.cut_after - self.forwarded]
            self.peer.transport.write(part)
            self.forwarded += len(part)
            self.factory.cut_points.append(self.forwarded)
            # the server gets the bytes up to the cut, then the connection ends
            self.peer.transport.loseConnection()
            self.transport.abortConnection()
            self.cut_after = None
            return
        self.forwarded += len(data)
        self.peer.transport.write(data)

    def connectionLost(self, reason):
        if self.peer is not None:
            self.peer.transport.loseConnection()


class DroppedConnectionTests(ServerTestBase):
    @defer.inlineCallbacks
    def setUp(self):
        yield super().setUp()
        c = yield self.connect()
        yield c.create_segment(SEG)
        proxy = protocol.Factory.forProtocol(ProxyProtocol)
        proxy.target = self.endpoint
        proxy.cuts = []
        proxy.cut_points = []
        proxy.links = []
        proxy.drop_replies = False
        proxy.reply_allowance = 16 + len(codec.encode(codec.AppendSetup(0, SEG, uuid.uuid4(), 0)))
        self.proxy = proxy
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(proxy)
        self.addCleanup(self.stop_proxy, port)
        self.proxy_endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)

    @defer.inlineCallbacks
    def stop_proxy(self, port):
        yield port.stopListening()
        for a, b in self.proxy.links:
            a.transport.loseConnection()
            b.transport.loseConnection()

    @defer.inlineCallbacks
    def check_exactly_once(self, cut, drop_replies, durable_before_cut=None):
        self.proxy.cuts = [cut]
        self.proxy.drop_replies = drop_replies
        w = self.writer(endpoint=self.proxy_endpoint, block_size=4096, retry_delay=0.01)
        payloads = [b"event-%05d" % i for i in range(3000)]
        ds = [w.write_batch(payloads[i:i + 100]) for i in range(0, 3000, 100)]
        yield defer.gatherResults(ds)
        yield w.close()
        self.assertEqual(self.proxy.cut_points, [cut])
        self.assertEqual(w.connections, 2)
        self.assertEqual(w.setups[0], codec.NULL_EVENT_NUMBER)
        if durable_before_cut is not None:
            # blocks before the cut were durable but never acknowledged
            self.assertEqual(w.setups[1], durable_before_cut)
        events = yield self.read_all()
        self.assertEqual(len(events), len(payloads))
        self.assertEqual(events, payloads)

    def test_cut_mid_block(self):
        # 19-byte events, 4096-byte blocks: 10000 is inside the third block
        return self.check_exactly_once(10000, drop_replies=False)

    def test_cut_mid_block_acks_lost(self):
        """Durable blocks whose acks never arrived are not written twice."""
        return self.check_exactly_once(30001, drop_replies=True)

    def test_cut_in_second_block_header(self):
        # where the second AppendBlock starts on the wire: after the Hello,
        # the SetupAppend and the first block with its BlockEnd
        payloads = [b"event-%05d" % i for i in range(3000)]
        wire = b"".join(pack_blocks([chunk(payloads, 2999)], uuid.uuid4(), 1, 4096))
        pos, blocks = 0, []
        while pos < len(wire):
            kind, length = codec.unpack_header_from(wire, pos)
            if kind == 3:
                blocks.append(pos)
            pos += 8 + length
        prefix = 16 + len(codec.encode(codec.SetupAppend(1, uuid.uuid4(), SEG, "")))
        # 19-byte events: the first block holds events 0..215 (the last split)
        return self.check_exactly_once(prefix + blocks[1] + 12, drop_replies=True,
                                       durable_before_cut=215)


class ReadTests(SegmentTestBase):
    @defer.inlineCallbacks
    def test_read_size_bounds(self):
        w = self.writer()
        yield w.write(b"x" * (3 * 1024 * 1024))
        small = yield self.c.read_segment(SEG, 0, 1)
        self.assertEqual(len(small.data), 8)
        self.assertFalse(small.at_tail)
        big = yield self.c.read_segment(SEG, 0, 100 * 1024 * 1024)
        self.assertEqual(len(big.data), 2 * 1024 * 1024)
        rest = yield self.c.read_segment(SEG, len(big.data), 2 * 1024 * 1024)
        self.assertEqual(rest.offset, 2 * 1024 * 1024)
        self.assertTrue(rest.at_tail)
        self.assertFalse(rest.end_of_segment)

    @defer.inlineCallbacks
    def test_tail_wait_bounded(self):
        start = reactor.seconds()
        reply = yield self.c.read_segment(SEG, 0, 100)
        self.assertGreaterEqual(reactor.seconds() - start, 0.25)
        self.assertEqual((reply.data, reply.at_tail, reply.end_of_segment), (b"", True, False))

    @defer.inlineCallbacks
    def test_reader_follows_tail(self):
        self.factory.read_wait = 5
        r = self.reader()
        pending = r.read()
        yield task.deferLater(reactor, 0.05, lambda: None)
        self.assertFalse(pending.called)
        w = self.writer()
        yield w.write(b"new")
        self.assertEqual((yield pending), [b"new"])
        yield w.write_batch([b"a", b"b"])
        got = []
        while len(got) < 2:
            got += yield r.read()
        self.assertEqual(got, [b"a", b"b"])

    @defer.inlineCallbacks
    def test_seal_wakes_tail_reader(self):
        self.factory.read_wait = 5
        w = self.writer()
        yield w.write(b"only")
        r = self.reader()
        self.assertEqual((yield r.read()), [b"only"])
        pending = r.read()
        yield task.deferLater(reactor, 0.05, lambda: None)
        yield self.c.seal_segment(SEG)
        self.assertEqual((yield pending), [])
        self.assertTrue(r.end_of_segment)

    @defer.inlineCallbacks
    def test_events_spanning_reads(self):
        w = self.writer()
        payloads = [bytes([i % 256]) * (i * 37 % 500) for i in range(200)]
        yield w.write_batch(payloads)
        yield self.c.seal_segment(SEG)
        r = self.reader(read_size=333)
        got = []
        while True:
            events = yield r.read()
            if not events:
                break
            got += events
        self.assertEqual(got, payloads)

    @defer.inlineCallbacks
    def test_reader_reconnects(self):
        w = self.writer()
        yield w.write_batch([b"1", b"2"])
        r = self.reader()
        self.assertEqual((yield r.read()), [b"1", b"2"])
        # drop the reader's connection from the server side
        reader_side = [p for p in self.factory.connections
                       if p.transport.getPeer().port == r._proto.transport.getHost().port]
        self.assertEqual(len(reader_side), 1)
        reader_side[0].transport.abortConnection()
        yield r._proto.closed
        yield w.write(b"3")
        self.assertEqual((yield r.read()), [b"3"])

    @defer.inlineCallbacks
    def test_delete_ends_tail_read(self):
        self.factory.read_wait = 5
        pending = self.c.read_segment(SEG, 0, 100)
        yield task.deferLater(reactor, 0.05, lambda: None)
        yield self.c.delete_segment(SEG)
        yield self.assertFailure(pending, NoSuchSegmentError)


class HeldLogStore(MemoryLogStore):
    """Appends become durable only when the test releases them."""

    def __init__(self, clock):
        super().__init__(clock)
        self.held = []

    def create(self, name, config=None):
        d = super().create(name, config)

        def wrap(log):
            real = log.append

            def append(records, attributes=None, **conditions):
                result = defer.Deferred()
                self.held.append((partial(real, **conditions), records, attributes, result))
                return result
            log.append = append
            return log
        return d.addCallback(wrap)

    def release(self):
        held, self.held = self.held, []
        for real, records, attributes, result in held:
            real(records, attributes).chainDeferred(result)


class HeldStoreTestBase(ServerTestBase):
    """The server's appends become durable only when the test releases them."""

    def make_store(self):
        return HeldLogStore(reactor)

    @defer.inlineCallbacks
    def connect_and_create(self):
        """A client connection, once it has created SEG (its append released)."""
        c = yield self.connect()
        create = c.create_segment(SEG)
        yield task.deferLater(reactor, 0.05, lambda: None)
        self.store.release()
        yield create
        return c

    @defer.inlineCallbacks
    def until_held(self):
        """Fire once an append waits for the test to release it."""
        while not self.store.held:
            yield task.deferLater(reactor, 0.01, lambda: None)


class FlowControlTests(HeldStoreTestBase):
    @defer.inlineCallbacks
    def test_acks_wait_for_durability_and_reading_pauses(self):
        self.factory.max_outstanding_bytes = 64 * 1024
        yield self.connect_and_create()
        w = self.writer(block_size=16 * 1024)
        done = w.write_batch([b"x" * 100] * 2000)
        server = None
        for _ in range(500):
            servers = [p for p in self.factory.connections if p.writers]
            if servers and "storage" in servers[0]._pause_reasons:
                server = servers[0]
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertIsNotNone(server, "reading never paused")
        self.assertFalse(done.called)          # nothing durable, nothing acked
        # bounded by the limit plus what one read from the socket can hold
        self.assertLessEqual(server._outstanding_bytes, 64 * 1024 + 256 * 1024)
        while not done.called:
            self.store.release()
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(len((yield self.read_all())), 2000)
        self.assertEqual(server._pause_reasons, set())


class InFlightDuplicateTests(HeldStoreTestBase):
    @defer.inlineCallbacks
    def test_resend_of_events_in_flight_elsewhere_is_acked_once_stored_once(self):
        c1 = yield self.connect_and_create()
        wid = uuid.uuid4()
        s1 = yield c1.setup_append(wid, SEG)
        blocks = b"".join(pack_blocks([chunk([b"a", b"b", b"c"], 2)], wid, s1.request_id, 100))
        c1.send_raw(blocks)
        yield self.until_held()
        # a second connection of the same writer (a sloppy client that did
        # not wait for AppendSetup to tell it what is stored) resends them
        c2 = yield self.connect()
        c2.send(codec.SetupAppend(9, wid, SEG, ""))
        c2.send_raw(blocks)
        yield task.deferLater(reactor, 0.05, lambda: None)
        self.store.release()                  # the first copy becomes durable
        setup = yield c2.next(codec.AppendSetup)
        self.assertEqual(setup.last_event_number, 2)
        ack1 = yield c1.next(codec.DataAppended)
        self.assertEqual(ack1.event_number, 2)
        self.assertEqual((yield self.read_all()), [b"a", b"b", b"c"])


class TLSTests(ServerTestBase):
    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore(reactor)
        self.factory = PravegaServerFactory(self.store, read_wait=0.3)
        yield self.listen(self.factory, certs().server_endpoint())
        self.endpoint = client_endpoint(reactor, "127.0.0.1", self.port.getHost().port,
                                        certs().client_options(with_cert=True))

    @defer.inlineCallbacks
    def test_write_and_read_over_mtls(self):
        c = yield self.connect()
        yield c.create_segment(SEG)
        w = self.writer()
        yield w.write_batch([b"secret %d" % i for i in range(100)])
        yield w.close()
        r = self.reader()
        got = []
        while len(got) < 100:
            got += yield r.read()
        self.assertEqual(got, [b"secret %d" % i for i in range(100)])

    @defer.inlineCallbacks
    def test_client_without_certificate_refused(self):
        ep = client_endpoint(reactor, "127.0.0.1", self.port.getHost().port,
                             certs().client_options(with_cert=False))
        yield self.assertFailure(connect(ep), Exception)


class NameTests(unittest.SynchronousTestCase):
    def test_examples(self):
        self.assertEqual(segments.log_name("a_b"), "pravega_a_5fb")
        self.assertEqual(segments.log_name("s/t/0.#epoch.0"), "pravega_s_2ft_2f0_2e_23epoch_2e0")
        self.assertEqual(segments.segment_name("pravega_a_5fb"), "a_b")
        self.assertIsNone(segments.segment_name("styxlog"))
        long_name = "x/" * 150
        hashed = segments.log_name(long_name)
        self.assertTrue(hashed.startswith("pravega__h"))
        self.assertLessEqual(len(hashed), 200)
        self.assertIsNone(segments.segment_name(hashed))

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.text(min_size=1, max_size=60))
    def test_reversible_and_valid(self, name):
        from streamproto.log.config import validate_name
        log = segments.log_name(name)
        validate_name(log)
        if not log.startswith("pravega__h"):
            self.assertEqual(segments.segment_name(log), name)


class ShutdownTests(HeldStoreTestBase):
    @defer.inlineCallbacks
    def test_graceful_shutdown_acks_in_flight_appends(self):
        c = yield self.connect_and_create()
        w = self.writer(max_retries=0)
        done = w.write_batch([b"in flight %d" % i for i in range(100)])
        pending_read = c.read_segment(SEG, 10 ** 6, 100)
        yield self.until_held()
        [server] = [p for p in self.factory.connections if p.writers]
        shutdown = server.gracefulShutdown()
        yield task.deferLater(reactor, 0.05, lambda: None)
        self.assertFalse(shutdown.called)      # an append is not durable yet
        self.assertFalse(done.called)
        self.store.release()
        yield shutdown
        self.assertEqual((yield done), 99)     # acknowledged before the close
        for p in list(self.factory.connections):
            yield p.gracefulShutdown()
        yield self.assertFailure(pending_read, Exception)


class SlowReaderTests(ServerTestBase):
    @defer.inlineCallbacks
    def test_slow_reader_stops_log_reads(self):
        c = yield self.connect()
        yield c.create_segment(SEG)
        w = self.writer()
        yield w.write_batch([bytes(1024 * 1024)] * 6)
        c.transport.pauseProducing()            # the client stops reading
        size = 2 * 1024 * 1024
        replies = [c.read_segment(SEG, (i % 3) * size, size) for i in range(30)]
        [server] = [p for p in self.factory.connections
                    if p.transport.getPeer().port == c.transport.getHost().port]
        for _ in range(500):
            if "send buffer" in server._pause_reasons:
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        yield task.deferLater(reactor, 0.2, lambda: None)
        self.assertIn("send buffer", server._pause_reasons)
        # most reads are not served: queued, or waiting before reading the log
        self.assertGreater(len(server._queue) + len(server._send_waiters), 20)
        c.transport.resumeProducing()
        got = yield defer.gatherResults(replies)
        self.assertEqual([r.offset for r in got], [(i % 3) * size for i in range(30)])
        self.assertTrue(all(len(r.data) == size for r in got))
        self.assertEqual(server._pause_reasons, set())


class ErrorReplyTests(unittest.SynchronousTestCase):
    """The one table request errors are answered from."""

    def test_table(self):
        from streamproto.log.errors import CorruptLog, LogFailed, WriteFailed
        from streamproto.pravega.server import error_reply
        from streamproto.pravega.tables import BadContinuationToken, TableNotEmpty, UpdateTooLarge
        read = codec.ReadSegment(SEG, 70, 10, "", 9)
        trunc = codec.TruncateSegment(9, SEG, 500, "")
        merge = codec.MergeSegments(9, "target", "source", "")
        keys = codec.ReadTableKeys(9, "table", "", 10, b"x", b"", b"", b"")
        cases = [
            (read, segments.SegmentNotFound(SEG), codec.NoSuchSegment(9, SEG, "", 70)),
            (trunc, segments.BadOffset(400), codec.SegmentIsTruncated(9, SEG, 400, "", 500)),
            (read, segments.SegmentTruncated(50), codec.SegmentIsTruncated(9, SEG, 50, "", 70)),
            (merge, segments.SegmentNotFound("source"), codec.NoSuchSegment(9, "source", "", -1)),
            (merge, segments.SegmentSealed("target"), codec.SegmentIsSealed(9, "target", "", -1)),
            (merge, segments.MergeTooLarge("source: 9 bytes"),
             codec.ErrorMessage(9, "source", "source: 9 bytes", -1)),
            (codec.CreateSegment(9, SEG, 0, 0, "", 0), segments.SegmentExists(SEG),
             codec.SegmentAlreadyExists(9, SEG, "")),
            (codec.DeleteTableSegment(9, "table", True, ""), TableNotEmpty("table"),
             codec.TableSegmentNotEmpty(9, "table", "")),
            (keys, BadContinuationToken("bad token"),
             codec.ErrorMessage(9, "table", "bad token", 0)),
            (keys, UpdateTooLarge("big"), codec.ErrorMessage(9, "table", "big", -1)),
        ]
        for cmd, error, expected in cases:
            self.assertEqual(error_reply(cmd, error), expected, repr(error))
        for error in (LogFailed("fsync: EIO"), CorruptLog("bad crc")):
            reply = error_reply(read, error)
            self.assertEqual((type(reply), reply.segment, reply.error_code),
                             (codec.ErrorMessage, SEG, -1))
            self.assertIn(str(error), reply.message)
        # anything else is an internal error: no reply, the connection closes
        self.assertIsNone(error_reply(read, WriteFailed("ENOSPC")))
        self.assertIsNone(error_reply(read, KeyError("bug")))
