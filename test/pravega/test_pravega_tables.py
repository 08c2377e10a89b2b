"""
Table segments (versioned key/value segments), MergeSegments and the
controller: semantics on the memory store, the wire commands through the
server, replay after reopening, and the gRPC service in-process.
"""

import uuid

from twisted.internet import defer, reactor, threads
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.pravega import codec
from streamproto.pravega.codec import TableKey
from streamproto.pravega.controller import (
    ControllerService, ControllerState, segment_name, txn_segment_name,
)
from streamproto.pravega.segments import SegmentNotFound, SegmentStore
from streamproto.pravega.tables import (
    BadContinuationToken, KeyBadVersion, KeyDoesNotExist, TableStore,
)
from test.pravega.test_pravega_server import ServerTestBase

TABLE = "scope/_rgtable_kvtable/0.#epoch.0"
NO = TableKey.NO_VERSION


class TableSemanticsTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore(reactor)
        self.tables = TableStore(self.store)
        yield self.tables.create(TABLE)
        self.table = yield self.tables.get(TABLE)

    @defer.inlineCallbacks
    def test_conditional_updates(self):
        t = self.table
        [v1] = yield t.update([(TableKey(b"k", -1), b"one")])
        # -1: must not exist
        yield self.assertFailure(t.update([(TableKey(b"k", -1), b"x")]), KeyBadVersion)
        # a stale version
        [v2] = yield t.update([(TableKey(b"k", v1), b"two")])
        self.assertGreater(v2, v1)
        yield self.assertFailure(t.update([(TableKey(b"k", v1), b"x")]), KeyBadVersion)
        # a version on a key that does not exist
        yield self.assertFailure(t.update([(TableKey(b"nope", 5), b"x")]), KeyDoesNotExist)
        # all or nothing: the good entry of a failing batch is not applied
        yield self.assertFailure(
            t.update([(TableKey(b"new", -1), b"n"), (TableKey(b"k", v1), b"x")]), KeyBadVersion)
        self.assertEqual(t.read([TableKey(b"new"), TableKey(b"k")]),
                         [(TableKey(b"new", -1), b""), (TableKey(b"k", v2), b"two")])
        # Long.MIN_VALUE: unconditional
        [v3] = yield t.update([(TableKey(b"k", NO), b"three")])
        self.assertEqual(t.read([TableKey(b"k")]), [(TableKey(b"k", v3), b"three")])

    @defer.inlineCallbacks
    def test_remove(self):
        t = self.table
        [v] = yield t.update([(TableKey(b"a", -1), b"1")])
        yield self.assertFailure(t.remove([TableKey(b"a", v + 1)]), KeyBadVersion)
        yield self.assertFailure(t.remove([TableKey(b"zz", 3)]), KeyDoesNotExist)
        yield t.remove([TableKey(b"a", v), TableKey(b"zz", NO)])
        self.assertEqual(t.read([TableKey(b"a")]), [(TableKey(b"a", -1), b"")])

    @defer.inlineCallbacks
    def test_delta_pages_and_replay(self):
        t = self.table
        versions = []
        for i in range(5):
            vs = yield t.update([(TableKey(b"k%d" % i, NO), b"v%d" % i)])
            versions += vs
        yield t.update([(TableKey(b"k1", NO), b"again")])     # k1 moves to the end
        yield t.remove([TableKey(b"k3")])
        seen, position, pages = [], 0, 0
        while True:
            entries, reached_end, position = t.delta(position, 2)
            if not entries:
                break
            pages += 1
            seen += [(k.data, v) for k, v in entries]
        self.assertEqual(seen, [(b"k0", b"v0"), (b"k2", b"v2"), (b"k4", b"v4"),
                                (b"k1", b"again")])
        self.assertEqual(pages, 2)
        self.assertEqual(t.delta(position, 10), ([], True, position))
        # a new store over the same logs replays to the same entries and versions
        again = yield TableStore(self.store).get(TABLE)
        self.assertEqual(again.entries, t.entries)
        self.assertEqual(again.delta(0, 100), t.delta(0, 100))

    @defer.inlineCallbacks
    def test_pages_in_key_order_with_token_and_bounds(self):
        t = self.table
        keys = [b"k%d" % i for i in (5, 1, 9, 3, 7, 0, 2, 8, 4, 6)]
        versions = {}
        for k in keys:
            [versions[k]] = yield t.update([(TableKey(k, NO), b"v" + k)])
        items, token = t.page(b"", 3)
        self.assertEqual(items, [(TableKey(b"k%d" % i, versions[b"k%d" % i]), b"vk%d" % i)
                                 for i in range(3)])
        # the key the token names goes, a key behind the cursor comes: the
        # iteration continues strictly after the token's key and skips it
        yield t.remove([TableKey(b"k2")])
        yield t.update([(TableKey(b"k0a", NO), b"late")])
        seen = [k.data for k, _ in items]
        while True:
            items, next_token = t.page(token, 3)
            if not items:
                self.assertEqual(next_token, token)     # over: the same token again
                break
            seen += [k.data for k, _ in items]
            token = next_token
        self.assertEqual(seen, [b"k%d" % i for i in range(10)])
        # inclusive bounds, and a token inside them
        items, token = t.page(b"", 2, b"k3", b"k6")
        self.assertEqual([k.data for k, _ in items], [b"k3", b"k4"])
        items, token = t.page(token, 10, b"k3", b"k6")
        self.assertEqual([k.data for k, _ in items], [b"k5", b"k6"])
        self.assertEqual(t.page(b"", 0), ([(TableKey(b"k0", versions[b"k0"]), b"vk0")],
                                          b"\x01k0"))          # at least one
        self.assertRaises(BadContinuationToken, t.page, b"\x07junk", 3)
        # replay gives the same pages
        again = yield TableStore(self.store).get(TABLE)
        self.assertEqual(again.page(b"", 100), t.page(b"", 100))

    @defer.inlineCallbacks
    def test_java_style_iteration_by_bounds(self):
        """The Java client (0.10+) sends no token: it asks from the last key
        plus one (fixed-length keys, carried as a big-endian number) up to
        an inclusive upper bound."""
        t = self.table
        keys = [bytes([a, b]) for a in (0, 1, 255) for b in (0, 7, 255)]
        for k in keys:
            yield t.update([(TableKey(k, NO), b"v")])

        def after(key):
            n = int.from_bytes(key, "big") + 1
            return n.to_bytes(len(key), "big") if n < 1 << (8 * len(key)) else None
        seen, start, upper = [], b"\x00\x07", b"\xff\x00"
        while start is not None and start <= upper:
            items, _ = t.page(b"", 2, start, upper)
            if not items:
                break
            seen += [k.data for k, _ in items]
            start = after(items[-1][0].data)
        self.assertEqual(seen, [k for k in sorted(keys) if b"\x00\x07" <= k <= upper])

    @defer.inlineCallbacks
    def test_table_is_not_a_stream_segment(self):
        # one namespace: the name is taken, and tables only open tables
        segments = SegmentStore(self.store)
        yield segments.create("scope/stream/0.#epoch.0")
        yield self.assertFailure(self.tables.get("scope/stream/0.#epoch.0"), SegmentNotFound)


@defer.inlineCallbacks
def reply(client):
    """The next reply that is not the server's Hello."""
    while True:
        r = yield client.next()
        if not isinstance(r, codec.Hello):
            return r


class TableWireTests(ServerTestBase):
    @defer.inlineCallbacks
    def test_table_commands(self):
        c = yield self.connect()
        c.send(codec.CreateTableSegment(1, TABLE, codec.encode_utf("")))
        self.assertEqual((yield reply(c)), codec.SegmentCreated(1, TABLE))
        c.send(codec.CreateTableSegment(2, TABLE, codec.encode_utf("")))
        self.assertEqual((yield reply(c)), codec.SegmentAlreadyExists(2, TABLE, ""))
        c.send(codec.UpdateTableEntries(3, TABLE, "", ((TableKey(b"a", -1), b"A"),
                                                       (TableKey(b"b", -1), b"B")), -1))
        updated = yield c.next(codec.TableEntriesUpdated)
        va, vb = updated.updated_versions
        c.send(codec.UpdateTableEntries(4, TABLE, "", ((TableKey(b"a", -1), b"X"),), -1))
        self.assertEqual((yield reply(c)), codec.TableKeyBadVersion(4, TABLE, ""))
        c.send(codec.UpdateTableEntries(5, TABLE, "", ((TableKey(b"c", 9), b"X"),), -1))
        self.assertEqual((yield reply(c)), codec.TableKeyDoesNotExist(5, TABLE, ""))
        c.send(codec.ReadTable(6, TABLE, "", (TableKey(b"b"), TableKey(b"c"))))
        self.assertEqual((yield reply(c)), codec.TableRead(
            6, TABLE, ((TableKey(b"b", vb), b"B"), (TableKey(b"c", -1), b""))))
        c.send(codec.ReadTableEntriesDelta(7, TABLE, "", 0, 10))
        self.assertEqual((yield reply(c)), codec.TableEntriesDeltaRead(
            7, TABLE, ((TableKey(b"a", va), b"A"), (TableKey(b"b", vb), b"B")), False, True,
            vb + 1))
        c.send(codec.RemoveTableKeys(8, TABLE, "", (TableKey(b"a", va),), -1))
        self.assertEqual((yield reply(c)), codec.TableKeysRemoved(8, TABLE))
        c.send(codec.DeleteTableSegment(9, TABLE, True, ""))
        self.assertEqual((yield reply(c)), codec.TableSegmentNotEmpty(9, TABLE, ""))
        c.send(codec.DeleteTableSegment(10, TABLE, False, ""))
        self.assertEqual((yield reply(c)), codec.SegmentDeleted(10, TABLE))
        c.send(codec.ReadTable(11, TABLE, "", (TableKey(b"b"),)))
        self.assertEqual((yield reply(c)), codec.NoSuchSegment(11, TABLE, "", -1))

    @defer.inlineCallbacks
    def test_read_table_keys_and_entries_paged(self):
        c = yield self.connect()
        c.send(codec.CreateTableSegment(1, TABLE, codec.encode_utf("")))
        yield c.next(codec.SegmentCreated)
        entries = tuple((TableKey(b"key%02d" % i, -1), b"value%d" % i) for i in range(7))
        c.send(codec.UpdateTableEntries(2, TABLE, "", entries, -1))
        versions = (yield c.next(codec.TableEntriesUpdated)).updated_versions
        expected = [(TableKey(k.data, v), value) for (k, value), v in zip(entries, versions)]

        keys, token, rid = [], b"", 10
        while True:
            c.send(codec.ReadTableKeys(rid, TABLE, "", 3, token, b"", b"", b""))
            r = yield reply(c)
            self.assertIsInstance(r, codec.TableKeysRead)
            self.assertEqual((r.request_id, r.segment), (rid, TABLE))
            self.assertLessEqual(len(r.keys), 3)
            rid += 1
            if not r.keys:
                break
            keys += r.keys
            token = r.continuation_token
        self.assertEqual(keys, [k for k, _ in expected])

        got, token = [], b""
        while True:
            c.send(codec.ReadTableEntries(rid, TABLE, "", 4, token, b"", b"", b""))
            r = yield reply(c)
            self.assertIsInstance(r, codec.TableEntriesRead)
            rid += 1
            if not r.entries:
                break
            got += r.entries
            token = r.continuation_token
        self.assertEqual(got, expected)

        # the Rust client's frames end with the token (no bounds)
        c.send_raw(codec.pack_header(85, 8 + 2 + len(TABLE) + 2 + 4 + 4) + (40).to_bytes(8, "big")
                   + codec.encode_utf(TABLE) + codec.encode_utf("") + (2).to_bytes(4, "big")
                   + bytes(4))
        r = yield reply(c)
        self.assertEqual((r.request_id, list(r.entries)), (40, expected[:2]))
        # bounds (Java's fixed-key-length tables), inclusive
        c.send(codec.ReadTableKeys(41, TABLE, "", 10, b"", b"", b"key02", b"key04"))
        r = yield reply(c)
        self.assertEqual([k.data for k in r.keys], [b"key02", b"key03", b"key04"])
        c.send(codec.ReadTableKeys(42, TABLE, "", 10, b"forged", b"", b"", b""))
        r = yield reply(c)
        self.assertEqual((type(r), r.request_id, r.error_code), (codec.ErrorMessage, 42, 0))
        c.send(codec.ReadTableEntries(43, "no/such/table", "", 10, b"", b"", b"", b""))
        self.assertEqual((yield reply(c)), codec.NoSuchSegment(43, "no/such/table", "", -1))

    @defer.inlineCallbacks
    def test_merge_segments(self):
        target, source = "s/t/0.#epoch.0", "s/t/0.#epoch.0#transaction." + "0" * 32
        c = yield self.connect()
        yield c.create_segment(target)
        yield c.create_segment(source)
        yield self.writer(target).write(b"before")
        w = self.writer(source)
        yield w.write_batch([b"tx1", b"tx2"])
        c.send(codec.MergeSegments(1, target, source, ""))
        merged = yield c.next(codec.SegmentsMerged)
        size = 3 * 8 + len(b"beforetx1tx2")
        self.assertEqual(merged, codec.SegmentsMerged(1, target, source, size))
        # the source is gone; merging it again is a no-op answered the same way
        c.send(codec.GetStreamSegmentInfo(2, source, ""))
        self.assertEqual((yield c.next(codec.NoSuchSegment)), codec.NoSuchSegment(2, source, "", -1))
        c.send(codec.MergeSegments(3, target, source, ""))
        self.assertEqual((yield c.next(codec.SegmentsMerged)),
                         codec.SegmentsMerged(3, target, source, size))
        c.send(codec.ReadSegment(target, 0, 1000, "", 4))
        read = yield c.next(codec.SegmentRead)
        self.assertEqual(codec.split_events(read.data)[0], [b"before", b"tx1", b"tx2"])
        c.send(codec.MergeSegments(5, target, "s/t/nope", ""))
        self.assertEqual((yield c.next(codec.NoSuchSegment)).request_id, 5)


class ControllerStateTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore(reactor)
        self.segments = SegmentStore(self.store)
        self.state = ControllerState(self.store, self.segments)
        yield self.state.open()

    @defer.inlineCallbacks
    def test_scopes_streams_and_restart(self):
        s = self.state
        self.assertEqual((yield s.create_stream("sc", "st", 2)), "SCOPE_NOT_FOUND")
        self.assertEqual((yield s.create_scope("sc")), "SUCCESS")
        self.assertEqual((yield s.create_scope("sc")), "SCOPE_EXISTS")
        self.assertEqual((yield s.create_scope("bad/name")), "INVALID_SCOPE_NAME")
        self.assertEqual((yield s.create_stream("sc", "st", 2)), "SUCCESS")
        self.assertEqual((yield s.create_stream("sc", "st", 2)), "STREAM_EXISTS")
        seg = yield self.segments.get(segment_name("sc", "st", 1))
        self.assertFalse(seg.sealed)
        self.assertEqual((yield s.delete_stream("sc", "st")), "STREAM_NOT_SEALED")
        self.assertEqual((yield s.delete_scope("sc")), "SCOPE_NOT_EMPTY")
        self.assertEqual((yield s.seal_stream("sc", "st")), "SUCCESS")
        self.assertTrue(seg.sealed)
        self.assertEqual((yield s.create_stream("sc", "other", 1)), "SUCCESS")
        # a restart reads the same state back
        again = ControllerState(self.store, self.segments)
        yield again.open()
        self.assertEqual(again.scopes, {"sc": {"st": {"segments": 2, "sealed": True},
                                               "other": {"segments": 1, "sealed": False}}})
        self.assertEqual((yield again.delete_stream("sc", "st")), "SUCCESS")
        yield self.assertFailure(self.segments.get(segment_name("sc", "st", 0)),
                                 SegmentNotFound)
        # the state log keeps only its newest document
        log = yield self.store.get("pravega-controller")
        self.assertEqual(log.end_position - log.start_position, 1)

    @defer.inlineCallbacks
    def test_transactions(self):
        s = self.state
        yield s.create_scope("sc")
        yield s.create_stream("sc", "st", 2)
        self.assertEqual((yield s.create_txn("sc", "nope", 1000))[0], "STREAM_NOT_FOUND")
        status, txn, count = yield s.create_txn("sc", "st", 60000)
        self.assertEqual((status, count, txn[:8]), ("SUCCESS", 2, "00000000"))
        self.assertEqual(s.txn_state("sc", "st", txn), "OPEN")
        tseg = yield self.segments.get(txn_segment_name("sc", "st", 1, txn))
        yield tseg.append(codec.encode_event(b"in-txn"), uuid.uuid4(), 1)
        self.assertEqual((yield s.ping_txn("sc", "st", txn, 60000)), "OK")
        self.assertEqual((yield s.commit_txn("sc", "st", txn)), "SUCCESS")
        self.assertEqual(s.txn_state("sc", "st", txn), "COMMITTED")
        self.assertEqual((yield s.abort_txn("sc", "st", txn)), "FAILURE")
        self.assertEqual((yield s.ping_txn("sc", "st", txn, 1000)), "COMMITTED")
        target = yield self.segments.get(segment_name("sc", "st", 1))
        data, _, _ = yield target.read(0, 100)
        self.assertEqual(codec.split_events(data)[0], [b"in-txn"])
        yield self.assertFailure(self.segments.get(txn_segment_name("sc", "st", 1, txn)),
                                 SegmentNotFound)
        # abort deletes the transaction segments
        _, aborted, _ = yield s.create_txn("sc", "st", 60000)
        self.assertEqual((yield s.abort_txn("sc", "st", aborted)), "SUCCESS")
        self.assertEqual(s.txn_state("sc", "st", aborted), "ABORTED")
        yield self.assertFailure(self.segments.get(txn_segment_name("sc", "st", 0, aborted)),
                                 SegmentNotFound)
        # an expired lease aborts
        _, expiring, _ = yield s.create_txn("sc", "st", 1)
        s.txns[expiring]["deadline"] -= 10
        yield s.expire_txns()
        self.assertEqual(s.txn_state("sc", "st", expiring), "ABORTED")
        self.assertEqual(s.txn_state("sc", "st", "f" * 32), "UNKNOWN")

    @defer.inlineCallbacks
    def test_lease_survives_a_wall_clock_step(self):
        """
        A step of the wall clock forward (NTP, an operator) does not expire
        an open transaction: leases run on the monotonic clock (before, the
        fault matrix's clock row saw every open transaction aborted by a
        step of more than its lease).  After a restart, the lease left
        (the persisted wall-time deadline) carries on on the new monotonic
        clock.
        """
        from twisted.internet import task
        wall = task.Clock()
        wall.advance(1_000_000)
        s = ControllerState(self.store, self.segments, clock=wall)
        yield s.open()
        monotonic = [0.0]
        s.monotonic = lambda: monotonic[0]
        yield s.create_scope("sc")
        yield s.create_stream("sc", "st", 1)
        _, txn, _ = yield s.create_txn("sc", "st", 60000)
        wall.advance(3600)                 # the wall clock steps an hour forward
        yield s.expire_txns()
        self.assertEqual(s.txn_state("sc", "st", txn), "OPEN")
        monotonic[0] = 59.0
        yield s.expire_txns()
        self.assertEqual(s.txn_state("sc", "st", txn), "OPEN")
        monotonic[0] = 61.0
        yield s.expire_txns()
        self.assertEqual(s.txn_state("sc", "st", txn), "ABORTED")
        # a restart: 30 s of the lease left in wall time
        _, kept, _ = yield s.create_txn("sc", "st", 30000)
        restarted = ControllerState(self.store, self.segments, clock=wall)
        yield restarted.open()
        monotonic = [500.0]
        restarted.monotonic = lambda: monotonic[0]
        yield restarted.expire_txns()
        self.assertEqual(restarted.txn_state("sc", "st", kept), "OPEN")
        wall.advance(-3600)   # a step back does not lengthen it either
        monotonic[0] = 529.0
        yield restarted.expire_txns()
        self.assertEqual(restarted.txn_state("sc", "st", kept), "OPEN")
        monotonic[0] = 531.0
        yield restarted.expire_txns()
        self.assertEqual(restarted.txn_state("sc", "st", kept), "ABORTED")

    @defer.inlineCallbacks
    def test_interrupted_commit_finishes_on_open(self):
        s = self.state
        yield s.create_scope("sc")
        yield s.create_stream("sc", "st", 1)
        _, txn, _ = yield s.create_txn("sc", "st", 60000)
        tseg = yield self.segments.get(txn_segment_name("sc", "st", 0, txn))
        yield tseg.append(codec.encode_event(b"once"), uuid.uuid4(), 1)
        # as if we crashed after merging but before recording the commit
        s.txns[txn]["state"] = "COMMITTING"
        yield s._save()
        yield self.segments.merge(segment_name("sc", "st", 0),
                                  txn_segment_name("sc", "st", 0, txn))
        again = ControllerState(self.store, self.segments)
        yield again.open()
        self.assertEqual(again.txn_state("sc", "st", txn), "COMMITTED")
        target = yield self.segments.get(segment_name("sc", "st", 0))
        data, _, _ = yield target.read(0, 100)
        self.assertEqual(codec.split_events(data)[0], [b"once"])


class ControllerGrpcTests(unittest.TestCase):
    """The gRPC service in-process: handlers on grpcio threads, state on the reactor."""

    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        import grpc

        from streamproto.pravega import controller_pb2
        self.pb = controller_pb2
        self.store = MemoryLogStore(reactor)
        self.service = ControllerService(self.store, SegmentStore(self.store), "127.0.0.1", 0,
                                         ("store.example", 12345))
        self.service.startService()
        self.addCleanup(self.service.stopService)
        yield self.service.ready
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.addCleanup(self.channel.close)

    def call(self, method, request, response):
        rpc = self.channel.unary_unary(
            f"/io.pravega.controller.stream.api.grpc.v1.ControllerService/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response.FromString)
        return threads.deferToThread(rpc, request, timeout=10)

    @defer.inlineCallbacks
    def test_scope_stream_segments_uri(self):
        pb = self.pb
        r = yield self.call("createScope", pb.ScopeInfo(scope="sc"), pb.CreateScopeStatus)
        self.assertEqual(r.status, pb.CreateScopeStatus.SUCCESS)
        info = pb.StreamInfo(scope="sc", stream="st")
        r = yield self.call("createStream", pb.StreamConfig(
            streamInfo=info, scalingPolicy=pb.ScalingPolicy(minNumSegments=4)),
            pb.CreateStreamStatus)
        self.assertEqual(r.status, pb.CreateStreamStatus.SUCCESS)
        r = yield self.call("getCurrentSegments", info, pb.SegmentRanges)
        self.assertEqual([(s.segmentId.segmentId, s.minKey, s.maxKey) for s in r.segmentRanges],
                         [(0, 0.0, 0.25), (1, 0.25, 0.5), (2, 0.5, 0.75), (3, 0.75, 1.0)])
        r = yield self.call("getURI", pb.SegmentId(streamInfo=info, segmentId=2), pb.NodeUri)
        self.assertEqual((r.endpoint, r.port), ("store.example", 12345))
        r = yield self.call("createTransaction", pb.CreateTxnRequest(streamInfo=info, lease=5000),
                            pb.CreateTxnResponse)
        self.assertEqual(len(r.activeSegments), 4)
        r = yield self.call("checkTransactionState", pb.TxnRequest(streamInfo=info, txnId=r.txnId),
                            pb.TxnState)
        self.assertEqual(r.state, pb.TxnState.OPEN)
        r = yield self.call("sealStream", info, pb.UpdateStreamStatus)
        self.assertEqual(r.status, pb.UpdateStreamStatus.SUCCESS)
        r = yield self.call("getCurrentSegments", info, pb.SegmentRanges)
        self.assertEqual(list(r.segmentRanges), [])


class TapOptionTests(unittest.SynchronousTestCase):
    def test_controller_options(self):
        from twisted.python import usage

        from streamproto.pravega import tap
        o = tap.Options()
        o.parseOptions(["--port", "tcp:7000:interface=10.1.2.3"])
        self.assertEqual((o["controller-address"], o["advertise-address"]),
                         (("0.0.0.0", 9090), ("10.1.2.3", 7000)))
        o = tap.Options()
        o.parseOptions(["--port", "tcp:7000", "--controller", "tcp:0:interface=127.0.0.1",
                        "--advertise", "store.example:7100"])
        self.assertEqual((o["controller-address"], o["advertise-address"]),
                         (("127.0.0.1", 0), ("store.example", 7100)))
        o = tap.Options()
        o.parseOptions(["--port", "tcp:7000"])
        self.assertEqual(o["advertise-address"], ("127.0.0.1", 7000))
        for bad in (["--controller", "ssl:9090"], ["--controller", "tcp:x"],
                    ["--controller", "tcp:9090:backlog=5"], ["--advertise", "nohost"],
                    ["--port", "unix:/tmp/s"]):
            self.assertRaises(usage.UsageError, tap.Options().parseOptions, bad)
