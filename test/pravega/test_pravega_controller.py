"""
The Pravega controller: manual scaling, truncation and configuration updates
(state on the memory store, durable across reopening), retention policies
(on a fake clock), segments between stream cuts and stream-cut validity,
the same through gRPC, the controller over TLS (with and without client
certificates), the advertised port learned from a port-0 listener, and the
umbrella plugin's --pravega-controller.
"""

import uuid

from twisted.internet import defer, reactor, task, threads
from twisted.python import usage
from twisted.trial import unittest

from streamproto.log import MemoryLogStore
from streamproto.pravega import codec
from streamproto.pravega.controller import (
    MAX_RETENTION_CUTS, ControllerService, ControllerState, Layout, choose_retention_cut,
    name_of, parse_controller_endpoint, retention_policy, segment_id, txn_name_of,
)
from streamproto.pravega.segments import SegmentNotFound, SegmentSealed, SegmentStore
from test.support.tlsutil import certs

SERVICE = "/io.pravega.controller.stream.api.grpc.v1.ControllerService/"


def e1(number):
    """The id of segment C{number} created by the first scale."""
    return segment_id(number, 1)


class LayoutTests(unittest.SynchronousTestCase):
    """The pure part: which scales and stream cuts are valid, and what they make."""

    def test_new_stream(self):
        layout = Layout.new(3)
        self.assertEqual(layout.active(), [(0, 0.0, 1 / 3), (1, 1 / 3, 2 / 3), (2, 2 / 3, 1.0)])
        self.assertEqual(layout.head(), {0: 0, 1: 0, 2: 0})
        self.assertEqual(layout.successors(0), [])

    def test_split_and_merge(self):
        reason, doc = Layout.new(2).plan_scale([1], [(0.5, 0.75), (0.75, 1.0)])
        self.assertIsNone(reason)
        layout = Layout(doc)
        self.assertEqual(layout.epoch, 1)
        self.assertEqual(layout.active(), [(0, 0.0, 0.5), (e1(2), 0.5, 0.75),
                                           (e1(3), 0.75, 1.0)])
        self.assertEqual(layout.active(0), [(0, 0.0, 0.5), (1, 0.5, 1.0)])
        self.assertEqual(layout.successors(1), [(e1(2), 0.5, 0.75, [1]),
                                                (e1(3), 0.75, 1.0, [1])])
        self.assertEqual(layout.successors(0), [])
        # merge all three: one successor, three predecessors
        reason, doc = layout.plan_scale([0, e1(2), e1(3)], [(0.0, 1.0)])
        self.assertIsNone(reason)
        merged = Layout(doc)
        e2 = segment_id(4, 2)
        self.assertEqual(merged.active(), [(e2, 0.0, 1.0)])
        self.assertEqual(merged.successors(e1(3)), [(e2, 0.0, 1.0, [0, e1(2), e1(3)])])
        # the plan did not touch the layout it came from
        self.assertEqual(layout.epoch, 1)

    def test_refused_scales(self):
        layout = Layout.new(2)
        for sealed, ranges in [
                ([], [(0.0, 1.0)]),                       # nothing to seal
                ([7], [(0.0, 1.0)]),                      # not a segment
                ([0, 0], [(0.0, 0.5)]),                   # twice
                ([0], [(0.0, 0.3)]),                      # a gap at the end
                ([0], [(0.0, 0.2), (0.3, 0.5)]),          # a gap inside
                ([0], [(0.0, 0.3), (0.2, 0.5)]),          # overlapping
                ([0], [(0.0, 0.6)]),                      # beyond the sealed range
                ([0], [(0.3, 0.1), (0.0, 0.5)]),          # start after end
                ([0], []),                                # no ranges
                ([0], [(-0.1, 0.5)])]:                    # outside the key space
            reason, doc = layout.plan_scale(sealed, ranges)
            self.assertIsNotNone(reason, (sealed, ranges))
            self.assertIsNone(doc)
        reason, _ = Layout(layout.plan_scale([0], [(0.0, 0.5)])[1]).plan_scale([0], [(0.0, 0.5)])
        self.assertIn("active", reason)

    def test_stream_cuts(self):
        layout = Layout(Layout.new(2).plan_scale([1], [(0.5, 0.75), (0.75, 1.0)])[1])
        # the first epoch's segments: nothing before it
        self.assertEqual(layout.plan_truncation({0: 5, 1: 7}), (None, []))
        # past the scale: segment 1 is before the cut
        self.assertEqual(layout.plan_truncation({0: 5, e1(2): 0, e1(3): 3}), (None, [1]))
        for cut in ({0: 5},                          # does not cover the key space
                    {0: 5, 1: 0, e1(2): 0},          # covers part of it twice
                    {0: 5, 1: 0, e1(3): 0},          # 1 and its successor
                    {0: 5, 9: 0},                    # unknown segment
                    {0: -1, 1: 0}):                  # negative offset
            reason, before = layout.plan_truncation(cut)
            self.assertIsNotNone(reason, cut)
        # a cut behind an earlier truncation is refused
        layout.doc["head"] = {"0": 5, str(e1(2)): 0, str(e1(3)): 0}
        layout.doc["deleted"] = [1]
        self.assertIsNotNone(layout.plan_truncation({0: 4, e1(2): 0, e1(3): 0})[0])
        self.assertIsNotNone(layout.plan_truncation({0: 5, 1: 0})[0])
        self.assertEqual(layout.plan_truncation({0: 6, e1(2): 1, e1(3): 0}), (None, []))


    def scaled_twice(self):
        """0 and 1; 1 split into e1(2), e1(3); then e1(3) merged... into e2(4) with e1(2)."""
        layout = Layout(Layout.new(2).plan_scale([1], [(0.5, 0.75), (0.75, 1.0)])[1])
        return Layout(layout.plan_scale([e1(2), e1(3)], [(0.5, 1.0)])[1])

    def test_cut_validity(self):
        layout = self.scaled_twice()
        e2 = segment_id(4, 2)
        for cut in ({0: 0, 1: 0}, {0: 3, e1(2): 0, e1(3): 9}, {0: 1, e2: 0}):
            self.assertIsNone(layout.cut_problem(cut), cut)
        for cut in ({0: 0}, {0: 0, 1: 0, e2: 0}, {0: 0, e1(2): 0, e2: 0}, {0: 0, 7: 0},
                    {0: -1, 1: 0}, {}):
            self.assertIsNotNone(layout.cut_problem(cut), cut)
        # a cut of segments truncated away was valid once
        layout.doc["deleted"] = [1]
        layout.doc["head"] = {"0": 0, str(e1(2)): 0, str(e1(3)): 0}
        self.assertIsNotNone(layout.cut_problem({0: 0, 1: 0}))
        self.assertIsNone(layout.cut_problem({0: 0, 1: 0}, include_deleted=True))

    def test_segments_between(self):
        layout = self.scaled_twice()
        e2 = segment_id(4, 2)
        self.assertEqual(layout.between(None, None), (None, sorted([0, 1, e1(2), e1(3), e2])))
        self.assertEqual(layout.between({0: 0, 1: 5}, {0: 9, 1: 6}), (None, [0, 1]))
        self.assertEqual(layout.between({0: 0, e1(2): 0, e1(3): 0}, None),
                         (None, sorted([0, e1(2), e1(3), e2])))
        self.assertEqual(layout.between(None, {0: 0, e1(2): 1, e1(3): 0}),
                         (None, sorted([0, 1, e1(2), e1(3)])))
        self.assertEqual(layout.between({0: 4, e2: 0}, {0: 4, e2: 0}), (None, [0, e2]))
        # from after to, in one segment and across a scale; bad cuts
        for start, end in (({0: 5, 1: 0}, {0: 4, 1: 0}),
                           ({0: 0, e2: 0}, {0: 0, 1: 0}),
                           ({0: 0}, None), (None, {0: 0, 1: 0, e2: 0})):
            reason, ids = layout.between(start, end)
            self.assertIsNotNone(reason, (start, end))
            self.assertIsNone(ids)
        # truncated away: not listed
        layout.doc["deleted"] = [1]
        layout.doc["head"] = {"0": 0, str(e1(2)): 0, str(e1(3)): 0}
        self.assertEqual(layout.between(None, None)[1], sorted([0, e1(2), e1(3), e2]))

    def test_retained_bytes(self):
        layout = self.scaled_twice()
        e2 = segment_id(4, 2)
        lengths = {0: 100, 1: 50, e1(2): 20, e1(3): 30, e2: 7}
        # from epoch 0's cut: the rest of 0 and 1, and every later segment
        self.assertEqual(layout.retained_bytes(0, {0: 60, 1: 50}, lengths), 40 + 20 + 30 + 7)
        self.assertEqual(layout.retained_bytes(1, {0: 100, e1(2): 5, e1(3): 30}, lengths),
                         15 + 7)
        self.assertEqual(layout.retained_bytes(2, {0: 100, e2: 7}, lengths), 0)


class RetentionPolicyTests(unittest.SynchronousTestCase):
    def test_policy_from_configuration(self):
        # as json_format writes them: int64 as strings, enums by name
        self.assertEqual(retention_policy(
            {"retentionPolicy": {"retentionType": "SIZE", "retentionParam": "1048576",
                                 "retentionMax": "9223372036854775807"}}), ("SIZE", 1 << 20))
        self.assertEqual(retention_policy(
            {"retentionPolicy": {"retentionType": "TIME", "retentionParam": "60000"}}),
            ("TIME", 60000))
        self.assertEqual(retention_policy({"retentionPolicy": {"retentionType": "SIZE"}}),
                         ("SIZE", 0))
        for config in (None, {}, {"retentionPolicy": {}},
                       {"retentionPolicy": {"retentionType": "UNKNOWN", "retentionParam": "5"}},
                       {"retentionPolicy": {"retentionType": "SIZE", "retentionParam": "-1"}},
                       {"retentionPolicy": {"retentionType": "SIZE", "retentionParam": "x"}}):
            self.assertIsNone(retention_policy(config), config)

    def test_choose_cut(self):
        records = [{"t": 0, "size": 100}, {"t": 10, "size": 60}, {"t": 20, "size": 10},
                   {"t": 30, "size": 0}]

        def size(r):
            return r["size"]
        # SIZE: the cut keeping least, but at least the parameter
        self.assertIs(choose_retention_cut("SIZE", 50, records, 30, size), records[1])
        self.assertIs(choose_retention_cut("SIZE", 60, records, 30, size), records[1])
        self.assertIs(choose_retention_cut("SIZE", 61, records, 30, size), records[0])
        self.assertIs(choose_retention_cut("SIZE", 0, records, 30, size), records[3])
        self.assertIsNone(choose_retention_cut("SIZE", 101, records, 30, size))
        # TIME: the newest cut at least that old
        self.assertIs(choose_retention_cut("TIME", 15, records, 30, size), records[1])
        self.assertIs(choose_retention_cut("TIME", 10, records, 30, size), records[2])
        self.assertIsNone(choose_retention_cut("TIME", 31, records, 30, size))
        self.assertIsNone(choose_retention_cut("TIME", 0, [], 30, size))


def get_uri(port):
    """The controller's answer to getURI (where the segment store is), from a thread."""
    import grpc

    from streamproto.pravega import controller_pb2 as pb

    def call():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            rpc = channel.unary_unary(SERVICE + "getURI",
                                      request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=pb.NodeUri.FromString)
            return rpc(pb.SegmentId(), timeout=10)
    return threads.deferToThread(call)


class ControllerStateTestBase(unittest.TestCase):
    """A L{ControllerState} on the memory store, with scope C{sc} (no tests here)."""

    timeout = 30
    clock = None    # the reactor's

    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore(reactor)
        self.segments = SegmentStore(self.store)
        yield self.reopen()
        yield self.state.create_scope("sc")

    @defer.inlineCallbacks
    def reopen(self):
        """A new state over the same store, as after a restart."""
        self.state = ControllerState(self.store, self.segments, self.clock)
        yield self.state.open()
        return self.state

    @defer.inlineCallbacks
    def append(self, seg_id, *events):
        seg = yield self.segments.get(name_of("sc", "st", seg_id))
        writer = uuid.uuid4()
        for n, e in enumerate(events, 1):
            yield seg.append(codec.encode_event(e), writer, n)
        return seg


class ScalingStateTests(ControllerStateTestBase):
    @defer.inlineCallbacks
    def setUp(self):
        yield super().setUp()
        yield self.state.create_stream("sc", "st", 2)

    @defer.inlineCallbacks
    def test_scale_seals_creates_and_survives_restart(self):
        s = self.state
        old = yield self.append(1, b"a")
        status, reason, new, epoch = yield s.scale("sc", "st", [1], [(0.5, 0.75), (0.75, 1.0)])
        self.assertEqual((status, reason, epoch), ("STARTED", "", 0))
        self.assertEqual(new, [(e1(2), 0.5, 0.75), (e1(3), 0.75, 1.0)])
        self.assertTrue(old.sealed)
        yield self.assertFailure(old.append(codec.encode_event(b"b"), uuid.uuid4(), 1),
                                 SegmentSealed)
        seg = yield self.segments.get("sc/st/3.#epoch.1")
        self.assertFalse(seg.sealed)
        self.assertEqual(s.check_scale("sc", "st", 0), "SUCCESS")
        self.assertEqual(s.check_scale("sc", "st", 1), "INVALID_INPUT")
        again = yield self.reopen()
        self.assertEqual(again.layout("sc", "st").active(), [(0, 0.0, 0.5), (e1(2), 0.5, 0.75),
                                                             (e1(3), 0.75, 1.0)])
        self.assertEqual(again.layout("sc", "st").successors(1)[0][0], e1(2))
        # sealing the stream seals the current segments, deleting deletes them all
        self.assertEqual((yield again.seal_stream("sc", "st")), "SUCCESS")
        self.assertTrue(seg.sealed)
        self.assertEqual((yield again.delete_stream("sc", "st")), "SUCCESS")
        for i in (0, 1, e1(2), e1(3)):
            yield self.assertFailure(self.segments.get(name_of("sc", "st", i)), SegmentNotFound)

    @defer.inlineCallbacks
    def test_refusals(self):
        s = self.state
        self.assertEqual((yield s.scale("sc", "nope", [0], [(0.0, 0.5)]))[0], "FAILURE")
        self.assertEqual((yield s.scale("sc", "st", [0], [(0.0, 0.4)]))[0],
                         "PRECONDITION_FAILED")
        _, txn, _ = yield s.create_txn("sc", "st", 60000)
        status, reason, _, _ = yield s.scale("sc", "st", [0], [(0.0, 0.5)])
        self.assertEqual((status, reason), ("PRECONDITION_FAILED",
                                            "the stream has open transactions"))
        yield s.abort_txn("sc", "st", txn)
        self.assertEqual((yield s.scale("sc", "st", [0], [(0.0, 0.5)]))[0], "STARTED")
        yield s.seal_stream("sc", "st")
        self.assertEqual((yield s.scale("sc", "st", [1], [(0.5, 1.0)]))[0],
                         "PRECONDITION_FAILED")

    @defer.inlineCallbacks
    def test_transaction_after_scale_uses_the_new_segments(self):
        s = self.state
        yield s.scale("sc", "st", [0, 1], [(0.0, 1.0)])
        status, txn, count = yield s.create_txn("sc", "st", 60000)
        self.assertEqual((status, count, txn[:8]), ("SUCCESS", 1, "00000001"))
        tseg = yield self.segments.get(txn_name_of("sc", "st", e1(2), txn))
        yield tseg.append(codec.encode_event(b"in-txn"), uuid.uuid4(), 1)
        self.assertEqual((yield s.commit_txn("sc", "st", txn)), "SUCCESS")
        target = yield self.segments.get("sc/st/2.#epoch.1")
        data, _, _ = yield target.read(0, 100)
        self.assertEqual(codec.split_events(data)[0], [b"in-txn"])

    @defer.inlineCallbacks
    def test_interrupted_scale_finishes_on_open(self):
        s = self.state
        layout = s.layout("sc", "st")
        _, doc = layout.plan_scale([0], [(0.0, 0.25), (0.25, 0.5)])
        # as if we crashed after recording the intent, before touching segments
        s.layouts["sc/st"]["scaling"] = {"sealed": [0], "to": doc}
        yield s._save()
        again = yield self.reopen()
        self.assertEqual([i for i, _, _ in again.layout("sc", "st").active()],
                         [e1(2), e1(3), 1])
        self.assertNotIn("scaling", again.layouts["sc/st"])
        seg = yield self.segments.get(name_of("sc", "st", 0))
        self.assertTrue(seg.sealed)
        yield self.segments.get(name_of("sc", "st", e1(3)))

    @defer.inlineCallbacks
    def test_truncation(self):
        s = self.state
        seg0 = yield self.append(0, b"one", b"two")
        yield self.append(1, b"x")
        yield s.scale("sc", "st", [1], [(0.5, 1.0)])
        first_len = len(codec.encode_event(b"one"))
        cut = {0: first_len, e1(2): 0}
        self.assertEqual((yield s.truncate_stream("sc", "st", cut)), ("SUCCESS", ""))
        self.assertEqual(seg0.info()["start_offset"], first_len)
        yield self.assertFailure(self.segments.get(name_of("sc", "st", 1)), SegmentNotFound)
        again = yield self.reopen()
        self.assertEqual(again.layout("sc", "st").head(), cut)
        # behind the head, beyond the end, or not a cut: refused, nothing changes
        for bad in ({0: 0, e1(2): 0}, {0: 10_000, e1(2): 0}, {0: first_len}):
            status, reason = yield again.truncate_stream("sc", "st", bad)
            self.assertEqual(status, "FAILURE", bad)
        self.assertEqual((yield again.truncate_stream("sc", "nope", cut))[0],
                         "STREAM_NOT_FOUND")
        self.assertEqual(again.layout("sc", "st").head(), cut)

    @defer.inlineCallbacks
    def test_update_stream_configuration(self):
        s = self.state
        config = {"scalingPolicy": {"minNumSegments": 2}, "tags": {"tag": ["a", "b"]}}
        self.assertEqual((yield s.update_stream("sc", "st", config)), "SUCCESS")
        self.assertEqual((yield s.update_stream("sc", "nope", config)), "STREAM_NOT_FOUND")
        self.assertEqual((yield s.update_stream("nope", "st", config)), "SCOPE_NOT_FOUND")
        again = yield self.reopen()
        self.assertEqual(again.layouts["sc/st"]["config"], config)
        yield again.seal_stream("sc", "st")
        self.assertEqual((yield again.update_stream("sc", "st", config)), "STREAM_SEALED")

    @defer.inlineCallbacks
    def test_state_from_before_layouts(self):
        # a document written before scaling existed: streams by count only
        import json
        log = yield self.store.get("pravega-controller")
        yield log.append([json.dumps({"scopes": {"old": {"s": {"segments": 3, "sealed": False}}},
                                      "txns": {}}).encode()])
        again = yield self.reopen()
        self.assertEqual([i for i, _, _ in again.layout("old", "s").active()], [0, 1, 2])


def event_size(data):
    return len(codec.encode_event(data))


class RetentionStateTests(ControllerStateTestBase):
    """Retention rounds on a fake clock, against the memory store."""

    def setUp(self):
        self.clock = task.Clock()
        return super().setUp()

    def policy(self, kind, param):
        return {"retentionPolicy": {"retentionType": kind, "retentionParam": str(param),
                                    "retentionMax": str(2 ** 63 - 1)}}

    @defer.inlineCallbacks
    def start_offset(self, seg_id):
        seg = yield self.segments.get(name_of("sc", "st", seg_id))
        return seg.info()["start_offset"]

    @defer.inlineCallbacks
    def test_size_keeps_at_least_the_parameter(self):
        s = self.state
        event = b"x" * 90
        size = event_size(event)
        yield s.create_stream("sc", "st", 2, self.policy("SIZE", 3 * size))
        yield self.append(0, event, event)
        # a cut at the tails is recorded; nothing after it yet: nothing goes
        self.assertEqual((yield s.apply_retention()), {})
        self.assertEqual(s.retention["sc/st"][-1]["cut"], {"0": 2 * size, "1": 0})
        yield self.append(1, event, event)
        self.assertEqual((yield s.apply_retention()), {})   # 2 events after the cut < 3
        self.assertEqual(len(s.retention["sc/st"]), 2)
        yield self.append(1, event)
        # 3 events after the first cut: truncated there, and only there
        self.assertEqual((yield s.apply_retention()), {"sc/st": {0: 2 * size, 1: 0}})
        self.assertEqual((yield self.start_offset(0)), 2 * size)
        self.assertEqual((yield self.start_offset(1)), 0)
        self.assertEqual(s.layout("sc", "st").head(), {0: 2 * size, 1: 0})
        # the stream scales; retention carries on over the successors and
        # deletes the sealed segment once a cut past it is due
        yield s.scale("sc", "st", [1], [(0.5, 1.0)])
        yield self.append(e1(2), event, event, event)
        # of the cuts recorded before the scale, the newest one keeping 3
        self.assertEqual((yield s.apply_retention()), {"sc/st": {0: 2 * size, 1: 3 * size}})
        self.assertEqual((yield self.start_offset(1)), 3 * size)
        yield self.append(e1(2), event, event, event)
        self.assertEqual((yield s.apply_retention()),
                         {"sc/st": {0: 2 * size, e1(2): 3 * size}})
        yield self.assertFailure(self.segments.get(name_of("sc", "st", 1)), SegmentNotFound)
        self.assertEqual((yield self.start_offset(e1(2))), 3 * size)
        # the recorded cuts survive a restart
        again = ControllerState(self.store, self.segments, self.clock)
        yield again.open()
        self.assertEqual(again.retention["sc/st"], s.retention["sc/st"])
        self.assertEqual(again.layout("sc", "st").head(), {0: 2 * size, e1(2): 3 * size})

    @defer.inlineCallbacks
    def test_time_truncates_what_is_older(self):
        s = self.state
        yield s.create_stream("sc", "st", 1, self.policy("TIME", 60_000))
        a = event_size(b"old")
        yield self.append(0, b"old")
        yield s.apply_retention()                       # t=0: a cut after "old"
        self.clock.advance(30)
        yield self.append(0, b"newer")
        self.assertEqual((yield s.apply_retention()), {})   # t=30 s: nothing 60 s old
        self.clock.advance(29.9)
        self.assertEqual((yield s.apply_retention()), {})   # still younger than 60 s
        self.clock.advance(0.1)
        # t=60 s: "old" was written before the cut of t=0, now 60 s old
        self.assertEqual((yield s.apply_retention()), {"sc/st": {0: a}})
        self.assertEqual((yield self.start_offset(0)), a)
        # an idle stream: once the last data is old enough, all of it goes
        self.clock.advance(30)
        b = event_size(b"newer")
        self.assertEqual((yield s.apply_retention()), {"sc/st": {0: a + b}})
        self.clock.advance(600)
        self.assertEqual((yield s.apply_retention()), {})   # nothing left to truncate

    @defer.inlineCallbacks
    def test_no_policy_no_truncation(self):
        s = self.state
        yield s.create_stream("sc", "st", 1, self.policy("SIZE", 0))
        yield self.append(0, b"a")
        yield s.create_stream("sc", "plain", 1, {"scalingPolicy": {"minNumSegments": 1}})
        seg = yield self.segments.get(name_of("sc", "plain", 0))
        yield seg.append(codec.encode_event(b"kept"), uuid.uuid4(), 1)
        self.assertEqual((yield s.apply_retention()), {"sc/st": {0: event_size(b"a")}})
        self.assertNotIn("sc/plain", s.retention)
        self.assertEqual(seg.info()["start_offset"], 0)
        # removing the policy stops it, and forgets the recorded cuts
        yield s.update_stream("sc", "st", {"scalingPolicy": {"minNumSegments": 1}})
        yield self.append(0, b"b")
        self.assertEqual((yield s.apply_retention()), {})
        self.assertNotIn("sc/st", s.retention)

    @defer.inlineCallbacks
    def test_manual_truncation_ahead_of_the_recorded_cuts(self):
        s = self.state
        yield s.create_stream("sc", "st", 1, self.policy("TIME", 1000))
        yield self.append(0, b"one")
        yield s.apply_retention()
        yield self.append(0, b"two")
        end = event_size(b"one") + event_size(b"two")
        self.assertEqual((yield s.truncate_stream("sc", "st", {0: end})), ("SUCCESS", ""))
        self.clock.advance(2)
        # the cut recorded after "one" is behind the head now: dropped, no harm
        self.assertEqual((yield s.apply_retention()), {})
        self.assertEqual(s.layout("sc", "st").head(), {0: end})
        self.assertEqual([r["cut"] for r in s.retention["sc/st"]], [{"0": end}])

    @defer.inlineCallbacks
    def test_recorded_cuts_are_bounded(self):
        s = self.state
        yield s.create_stream("sc", "st", 1, self.policy("TIME", 10 ** 12))
        seg = yield self.append(0)
        writer = uuid.uuid4()
        for n in range(1, MAX_RETENTION_CUTS + 40):
            yield seg.append(codec.encode_event(b"e"), writer, n)
            self.clock.advance(1)
            yield s.apply_retention()
        records = s.retention["sc/st"]
        self.assertLessEqual(len(records), MAX_RETENTION_CUTS)
        # the oldest and newest are kept, in order
        self.assertEqual(records[0]["t"], 1000)
        self.assertEqual(records[-1]["t"], (MAX_RETENTION_CUTS + 39) * 1000)
        self.assertEqual([r["t"] for r in records], sorted(r["t"] for r in records))


class GrpcTestBase(unittest.TestCase):
    timeout = 30
    tls = None
    retention_interval = 60.0

    @defer.inlineCallbacks
    def setUp(self):
        from streamproto.pravega import controller_pb2
        self.pb = controller_pb2
        self.store = MemoryLogStore(reactor)
        self.segments = SegmentStore(self.store)
        self.service = ControllerService(self.store, self.segments, "127.0.0.1", 0,
                                         ("store.example", 12345), tls=self.tls,
                                         retention_interval=self.retention_interval)
        self.service.startService()
        self.addCleanup(self.service.stopService)
        yield self.service.ready

    def channel(self, credentials=None):
        import grpc
        target = f"localhost:{self.service.port}"
        if credentials is None:
            channel = grpc.insecure_channel(target)
        else:
            channel = grpc.secure_channel(target, credentials)
        self.addCleanup(channel.close)
        return channel

    def call(self, method, request, response, channel=None):
        rpc = (channel or self.default_channel()).unary_unary(
            SERVICE + method, request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response.FromString)
        return threads.deferToThread(rpc, request, timeout=10)

    def default_channel(self):
        if not hasattr(self, "_channel"):
            self._channel = self.channel()
        return self._channel


class ListenTests(GrpcTestBase):
    def test_port_in_use_is_refused(self):
        # grpcio's default SO_REUSEPORT would let a second server share it
        second = ControllerService(self.store, self.segments, "127.0.0.1", self.service.port,
                                   ("store.example", 12345))
        error = self.assertRaises(OSError, second.startService)
        self.assertIn(f"127.0.0.1:{self.service.port}", str(error))
        self.assertIsNone(second._server)


class ScalingGrpcTests(GrpcTestBase):
    @defer.inlineCallbacks
    def test_scale_successors_truncate_update(self):
        pb = self.pb
        info = pb.StreamInfo(scope="sc", stream="st")
        yield self.call("createScope", pb.ScopeInfo(scope="sc"), pb.CreateScopeStatus)
        r = yield self.call("createStream", pb.StreamConfig(
            streamInfo=info, scalingPolicy=pb.ScalingPolicy(minNumSegments=2),
            tags=pb.Tags(tag=["t1"])), pb.CreateStreamStatus)
        self.assertEqual(r.status, pb.CreateStreamStatus.SUCCESS)
        seg1 = yield self.segments.get("sc/st/1.#epoch.0")
        yield seg1.append(codec.encode_event(b"e"), uuid.uuid4(), 1)
        r = yield self.call("scale", pb.ScaleRequest(
            streamInfo=info, sealedSegments=[1],
            newKeyRanges=[pb.ScaleRequest.KeyRangeEntry(start=0.5, end=0.75),
                          pb.ScaleRequest.KeyRangeEntry(start=0.75, end=1.0)]),
            pb.ScaleResponse)
        self.assertEqual(r.status, pb.ScaleResponse.STARTED)
        self.assertEqual(r.epoch, 0)
        self.assertEqual([(s.segmentId.segmentId, s.minKey, s.maxKey) for s in r.segments],
                         [(e1(2), 0.5, 0.75), (e1(3), 0.75, 1.0)])
        r = yield self.call("checkScale", pb.ScaleStatusRequest(streamInfo=info, epoch=0),
                            pb.ScaleStatusResponse)
        self.assertEqual(r.status, pb.ScaleStatusResponse.SUCCESS)
        r = yield self.call("scale", pb.ScaleRequest(
            streamInfo=info, sealedSegments=[1],
            newKeyRanges=[pb.ScaleRequest.KeyRangeEntry(start=0.5, end=1.0)]), pb.ScaleResponse)
        self.assertEqual(r.status, pb.ScaleResponse.PRECONDITION_FAILED)
        r = yield self.call("getCurrentSegments", info, pb.SegmentRanges)
        self.assertEqual([s.segmentId.segmentId for s in r.segmentRanges], [0, e1(2), e1(3)])
        r = yield self.call("getEpochSegments", pb.GetEpochSegmentsRequest(
            streamInfo=info, epoch=0), pb.SegmentRanges)
        self.assertEqual([s.segmentId.segmentId for s in r.segmentRanges], [0, 1])
        r = yield self.call("getSegmentsImmediatelyFollowing",
                            pb.SegmentId(streamInfo=info, segmentId=1), pb.SuccessorResponse)
        self.assertEqual([(e.segment.segmentId.segmentId, list(e.value)) for e in r.segments],
                         [(e1(2), [1]), (e1(3), [1])])
        r = yield self.call("getSegmentsImmediatelyFollowing",
                            pb.SegmentId(streamInfo=info, segmentId=0), pb.SuccessorResponse)
        self.assertEqual(list(r.segments), [])
        r = yield self.call("isSegmentValid", pb.SegmentId(streamInfo=info, segmentId=1),
                            pb.SegmentValidityResponse)
        self.assertFalse(r.response)
        # truncate past the scale: segment 1 goes, the head moves
        r = yield self.call("truncateStream", pb.StreamCut(
            streamInfo=info, cut={0: 0, e1(2): 0, e1(3): 0}), pb.UpdateStreamStatus)
        self.assertEqual(r.status, pb.UpdateStreamStatus.SUCCESS)
        r = yield self.call("getSegments", pb.GetSegmentsRequest(streamInfo=info),
                            pb.SegmentsAtTime)
        self.assertEqual(sorted((s.segmentId.segmentId, s.offset) for s in r.segments),
                         [(0, 0), (e1(2), 0), (e1(3), 0)])
        yield self.assertFailure(self.segments.get("sc/st/1.#epoch.0"), SegmentNotFound)
        r = yield self.call("truncateStream", pb.StreamCut(streamInfo=info, cut={0: 0}),
                            pb.UpdateStreamStatus)
        self.assertEqual(r.status, pb.UpdateStreamStatus.FAILURE)
        # the configuration as created, then as updated
        r = yield self.call("getStreamConfiguration", info, pb.StreamConfig)
        self.assertEqual((r.streamInfo.stream, r.scalingPolicy.minNumSegments, list(r.tags.tag)),
                         ("st", 2, ["t1"]))
        r = yield self.call("updateStream", pb.StreamConfig(
            streamInfo=info, scalingPolicy=pb.ScalingPolicy(minNumSegments=3),
            retentionPolicy=pb.RetentionPolicy(retentionType=pb.RetentionPolicy.SIZE,
                                               retentionParam=1000),
            tags=pb.Tags(tag=["t2"])), pb.UpdateStreamStatus)
        self.assertEqual(r.status, pb.UpdateStreamStatus.SUCCESS)
        r = yield self.call("getStreamConfiguration", info, pb.StreamConfig)
        self.assertEqual((r.scalingPolicy.minNumSegments, r.retentionPolicy.retentionParam,
                          list(r.tags.tag)), (3, 1000, ["t2"]))
        r = yield self.call("updateStream", pb.StreamConfig(
            streamInfo=pb.StreamInfo(scope="sc", stream="nope")), pb.UpdateStreamStatus)
        self.assertEqual(r.status, pb.UpdateStreamStatus.STREAM_NOT_FOUND)


class StreamCutGrpcTests(GrpcTestBase):
    @defer.inlineCallbacks
    def setUp(self):
        yield super().setUp()
        pb = self.pb
        self.info = pb.StreamInfo(scope="sc", stream="st")
        yield self.call("createScope", pb.ScopeInfo(scope="sc"), pb.CreateScopeStatus)
        yield self.call("createStream", pb.StreamConfig(
            streamInfo=self.info, scalingPolicy=pb.ScalingPolicy(minNumSegments=2)),
            pb.CreateStreamStatus)
        r = yield self.call("scale", pb.ScaleRequest(
            streamInfo=self.info, sealedSegments=[1],
            newKeyRanges=[pb.ScaleRequest.KeyRangeEntry(start=0.5, end=1.0)]),
            pb.ScaleResponse)
        self.assertEqual(r.status, pb.ScaleResponse.STARTED)

    def between(self, start, end):
        request = self.pb.StreamCutRange(streamInfo=self.info, to=end)
        getattr(request, "from").update(start)
        return self.call("getSegmentsBetween", request, self.pb.StreamCutRangeResponse)

    @defer.inlineCallbacks
    def test_segments_between(self):
        import grpc
        r = yield self.between({}, {})
        self.assertEqual(sorted(s.segmentId for s in r.segments), [0, 1, e1(2)])
        self.assertEqual({s.streamInfo.stream for s in r.segments}, {"st"})
        r = yield self.between({0: 0, e1(2): 0}, {})
        self.assertEqual(sorted(s.segmentId for s in r.segments), [0, e1(2)])
        r = yield self.between({}, {0: 0, 1: 0})
        self.assertEqual(sorted(s.segmentId for s in r.segments), [0, 1])
        for start, end in (({0: 0, e1(2): 0}, {0: 0, 1: 0}), ({0: 0}, {})):
            e = yield self.assertFailure(self.between(start, end), grpc.RpcError)
            self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT)
        e = yield self.assertFailure(self.call(
            "getSegmentsBetween", self.pb.StreamCutRange(
                streamInfo=self.pb.StreamInfo(scope="sc", stream="nope")),
            self.pb.StreamCutRangeResponse), grpc.RpcError)
        self.assertEqual(e.code(), grpc.StatusCode.NOT_FOUND)

    @defer.inlineCallbacks
    def test_stream_cut_validity(self):
        pb = self.pb

        @defer.inlineCallbacks
        def valid(cut, stream="st"):
            r = yield self.call("isStreamCutValid", pb.StreamCut(
                streamInfo=pb.StreamInfo(scope="sc", stream=stream), cut=cut),
                pb.StreamCutValidityResponse)
            return r.response
        self.assertTrue((yield valid({0: 0, 1: 0})))
        self.assertTrue((yield valid({0: 10, e1(2): 3})))
        self.assertFalse((yield valid({0: 0})))
        self.assertFalse((yield valid({0: 0, 1: 0, e1(2): 0})))
        self.assertFalse((yield valid({0: 0, 1: 0}, stream="nope")))


class RetentionGrpcTests(GrpcTestBase):
    """The service's periodic retention, with a stream configured over gRPC."""

    retention_interval = 0.05

    @defer.inlineCallbacks
    def test_size_retention_truncates(self):
        pb = self.pb
        info = pb.StreamInfo(scope="sc", stream="st")
        yield self.call("createScope", pb.ScopeInfo(scope="sc"), pb.CreateScopeStatus)
        r = yield self.call("createStream", pb.StreamConfig(
            streamInfo=info, scalingPolicy=pb.ScalingPolicy(minNumSegments=1),
            retentionPolicy=pb.RetentionPolicy(retentionType=pb.RetentionPolicy.SIZE,
                                               retentionParam=100,
                                               retentionMax=2 ** 63 - 1)),
            pb.CreateStreamStatus)
        self.assertEqual(r.status, pb.CreateStreamStatus.SUCCESS)
        seg = yield self.segments.get("sc/st/0.#epoch.0")
        writer = uuid.uuid4()
        yield seg.append(codec.encode_event(b"a" * 200), writer, 1)
        first = seg.info()["write_offset"]
        # wait for a round to record a cut after the first event
        for _ in range(200):
            if self.service.state.retention.get("sc/st"):
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        yield seg.append(codec.encode_event(b"b" * 200), writer, 2)
        for _ in range(200):
            r = yield self.call("getSegments", pb.GetSegmentsRequest(streamInfo=info),
                                pb.SegmentsAtTime)
            if r.segments[0].offset:
                break
            yield task.deferLater(reactor, 0.02, lambda: None)
        self.assertEqual([(s.segmentId.segmentId, s.offset) for s in r.segments], [(0, first)])
        self.assertEqual(seg.info()["start_offset"], first)


class AdvertisedPortTests(unittest.TestCase):
    """--port tcp:0 without --advertise: clients get the port it listens on."""

    timeout = 30

    @defer.inlineCallbacks
    def test_port_zero_is_resolved(self):
        import tempfile


        from streamproto.pravega import tap
        o = tap.Options()
        o.parseOptions(["--data", tempfile.mkdtemp(), "--port", "tcp:0:interface=127.0.0.1",
                        "--controller", "tcp:0:interface=127.0.0.1"])
        self.assertEqual(o["advertise-address"], ("127.0.0.1", 0))
        top = tap.makeService(o)
        [controller] = [s for s in top if isinstance(s, ControllerService)]
        top.startService()
        try:
            yield controller.ready
            [listener] = [s for s in top if getattr(s, "_streamproto_listener", False)]
            # listening by now: the controller waited for it
            port = listener._waitingForPort.result.getHost().port
            self.assertNotEqual(port, 0)
            r = yield get_uri(controller.port)
            self.assertEqual((r.endpoint, r.port), ("127.0.0.1", port))
        finally:
            yield top.stopService()

    def test_retention_interval_option(self):
        from streamproto.pravega import tap
        o = tap.Options()
        o.parseOptions(["--port", "tcp:7000", "--retention-interval", "0.5"])
        self.assertEqual(o["retention-interval"], 0.5)
        o = tap.Options()
        o.parseOptions(["--port", "tcp:7000"])
        self.assertEqual(o["retention-interval"], 60.0)
        self.assertRaises(usage.UsageError, tap.Options().parseOptions,
                          ["--retention-interval", "-1"])


class EndpointTests(unittest.SynchronousTestCase):
    def test_parse(self):
        c = certs()
        self.assertEqual(parse_controller_endpoint("tcp:9090"), ("0.0.0.0", 9090, None))
        self.assertEqual(parse_controller_endpoint("tcp:0:interface=127.0.0.1"),
                         ("127.0.0.1", 0, None))
        host, port, tls = parse_controller_endpoint(c.ssl_endpoint(9091))
        self.assertEqual((host, port, tls.client_ca), ("127.0.0.1", 9091, None))
        with open(c.server_cert, "rb") as f:
            self.assertEqual(tls.cert_chain, f.read())
        _, _, tls = parse_controller_endpoint(c.server_endpoint(9092))
        with open(c.ca, "rb") as f:
            self.assertEqual(tls.client_ca, f.read())
        _, _, tls = parse_controller_endpoint(c.server_endpoint(9092) + ":requireClientCert=no")
        self.assertIsNone(tls.client_ca)
        _, _, tls = parse_controller_endpoint(c.server_endpoint(9092, client_ca=False))
        self.assertIsNone(tls.client_ca)
        for bad in ("ssl:9090", "tcp:x", "tcp:9090:backlog=5", "unix:/tmp/s", "tcp:70000",
                    "ssl:1:privateKey=/nonexistent.pem", "tcp:1:caCerts=x",
                    f"ssl:1:privateKey={c.server_key}:caCerts={c.ca}"):
            self.assertRaises(ValueError, parse_controller_endpoint, bad)

    def test_pravega_server_options(self):
        from streamproto.pravega import tap
        o = tap.Options()
        o.parseOptions(["--port", "tcp:7000", "--controller", certs().server_endpoint(0),
                        "--advertise", "localhost:7000"])
        self.assertEqual(o["controller-address"], ("127.0.0.1", 0))
        self.assertIsNotNone(o["controller-tls"].client_ca)
        self.assertRaises(usage.UsageError, tap.Options().parseOptions,
                          ["--controller", "ssl:1:privateKey=/nonexistent"])


class TLSGrpcTests(GrpcTestBase):
    """Server TLS: clients that trust our CA get in, the others do not."""

    tls = parse_controller_endpoint(certs().ssl_endpoint())[2]

    def credentials(self, with_cert=False, ca=None):
        import grpc
        c = certs()
        with open(ca or c.ca, "rb") as f:
            root = f.read()
        if not with_cert:
            return grpc.ssl_channel_credentials(root_certificates=root)
        with open(c.client_key, "rb") as k, open(c.client_cert, "rb") as cert:
            return grpc.ssl_channel_credentials(root, k.read(), cert.read())

    @defer.inlineCallbacks
    def assertRefused(self, channel):
        import grpc
        pb = self.pb
        try:
            yield self.call("createScope", pb.ScopeInfo(scope="no"), pb.CreateScopeStatus,
                            channel)
        except grpc.RpcError as e:
            self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE)
        else:
            self.fail("the call went through")
        self.assertNotIn("no", self.service.state.scopes)

    @defer.inlineCallbacks
    def test_tls(self):
        pb = self.pb
        r = yield self.call("createScope", pb.ScopeInfo(scope="sc"), pb.CreateScopeStatus,
                            self.channel(self.credentials()))
        self.assertEqual(r.status, pb.CreateScopeStatus.SUCCESS)
        yield self.assertRefused(self.channel())   # plain text
        yield self.assertRefused(self.channel(self.credentials(ca=certs().other_ca)))


class MutualTLSGrpcTests(TLSGrpcTests):
    """mtls: with caCerts: a client certificate from that CA is required."""

    tls = parse_controller_endpoint(certs().server_endpoint())[2]

    @defer.inlineCallbacks
    def test_tls(self):
        pb = self.pb
        r = yield self.call("createScope", pb.ScopeInfo(scope="sc"), pb.CreateScopeStatus,
                            self.channel(self.credentials(with_cert=True)))
        self.assertEqual(r.status, pb.CreateScopeStatus.SUCCESS)
        yield self.assertRefused(self.channel(self.credentials()))   # no client certificate
        yield self.assertRefused(self.channel())


class UmbrellaTests(unittest.TestCase):
    timeout = 30

    def options(self, *extra):
        import tempfile

        from streamproto import tap
        o = tap.Options()
        o.parseOptions(["--data", tempfile.mkdtemp(), "--metrics", "none", "--only",
                        "pravega-server", "--listen",
                        "pravega-server=tcp:0:interface=127.0.0.1", *extra])
        return o

    def controllers(self, top):
        found = []

        def walk(svc):
            if isinstance(svc, ControllerService):
                found.append(svc)
            for child in getattr(svc, "services", []):
                walk(child)
        walk(top)
        return found

    @defer.inlineCallbacks
    def test_pravega_controller(self):

        from streamproto import tap
        top = tap.makeService(self.options(
            "--pravega-controller", "tcp:0:interface=127.0.0.1",
            "--pravega-advertise", "store.example:7777"))
        [controller] = self.controllers(top)
        top.startService()
        try:
            yield controller.ready
            r = yield get_uri(controller.port)
            self.assertEqual((r.endpoint, r.port), ("store.example", 7777))
        finally:
            yield top.stopService()

    def test_controller_by_default(self):
        # twistd streamproto runs every server whole: Pravega clients need it
        from streamproto import tap
        options = self.options()
        self.assertEqual(options["pravega-controller"], "tcp:9090")
        [controller] = self.controllers(tap.makeService(options))
        self.assertEqual(controller.port, 9090)

    def test_no_controller_when_none(self):
        from streamproto import tap
        self.assertEqual(self.controllers(tap.makeService(
            self.options("--pravega-controller", "none"))), [])

    def test_retention_interval_passed_on(self):
        from streamproto import tap
        [controller] = self.controllers(tap.makeService(self.options(
            "--pravega-retention-interval", "7.5")))
        self.assertEqual(controller.retention_interval, 7.5)

    def test_bad_options(self):
        for bad in (["--pravega-controller", "none", "--pravega-advertise", "h:1"],
                    ["--pravega-controller", "none", "--pravega-retention-interval", "5"],
                    ["--pravega-retention-interval", "-1"],
                    ["--pravega-controller", "tcp:x"],
                    ["--pravega-controller", "tcp:1", "--pravega-advertise", "nohost"]):
            self.assertRaises(usage.UsageError, self.options, *bad)


class SharedStateTests(ControllerStateTestBase):
    """
    Two controllers on one store (two front-ends on a JetStream store):
    each sees the other's changes, and concurrent changes are never lost.
    """

    @defer.inlineCallbacks
    def test_changes_seen_by_the_other(self):
        a = self.state
        b = ControllerState(self.store, self.segments, self.clock)
        yield b.open()
        yield a.create_scope("made-by-a")
        yield b.refresh()
        self.assertIn("made-by-a", b.scopes)
        status = yield b.create_stream("made-by-a", "s", 2)
        self.assertEqual(status, "SUCCESS")
        yield a.refresh()
        self.assertEqual(a.stream("made-by-a", "s")["segments"], 2)

    @defer.inlineCallbacks
    def test_concurrent_changes_not_lost(self):
        """
        Both controllers change the state from the same document at once:
        the second write conflicts, re-reads the first's document and applies
        its change on top; both scopes exist.
        """
        a = self.state
        b = ControllerState(self.store, self.segments, self.clock)
        yield b.open()
        results = yield defer.gatherResults([a.create_scope("x%d" % i) for i in range(5)]
                                            + [b.create_scope("y%d" % i) for i in range(5)])
        self.assertEqual(set(results), {"SUCCESS"})
        fresh = yield self.reopen()
        self.assertEqual(sorted(fresh.scopes),
                         sorted(["sc"] + ["x%d" % i for i in range(5)]
                                + ["y%d" % i for i in range(5)]))

    @defer.inlineCallbacks
    def test_stale_writer_does_not_overwrite(self):
        """
        A controller whose document is stale (it has not seen the other's
        last write yet: on JetStream the other front-end's append can land
        between its read and its write) must not overwrite that write: its
        conditional append conflicts, it re-reads and applies its change on
        the newest document.
        """
        a = self.state
        b = ControllerState(self.store, self.segments, self.clock)
        yield b.open()
        yield a.create_scope("from-a")
        real = b._catch_up
        calls = []

        def stale_once(force=False):
            calls.append(force)
            if len(calls) == 1:
                return defer.succeed(None)      # the read that missed a's write
            return real(force)
        b._catch_up = stale_once
        status = yield b.create_scope("from-b")
        self.assertEqual(status, "SUCCESS")
        self.assertEqual(calls, [False, True])
        fresh = yield self.reopen()
        self.assertEqual(sorted(fresh.scopes), ["from-a", "from-b", "sc"])
