"""
Runs of Lumberjack events as one buffer (streamproto.lumberjack.runs): the
C accelerator and the pure-Python fallback agree byte for byte, a run is
validated in one parse exactly as payload by payload, and the decoder gives
the same frames either way.
"""

import json
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from streamproto.lumberjack import codec, runs
from streamproto.lumberjack.codec import (
    VERSION_1, VERSION_2, Events, FrameDecoder, FrameTooLarge, MalformedJSON, ProtocolError,
    encode_batch, encode_json, encode_json_frames, encode_window,
)
from streamproto.lumberjack.runs import PayloadRun

from test.lumberjack.test_lumberjack_codec import json_values, mutations

SCANNERS = [("python", runs.scan_json_py)]
SPLICERS = [("python", runs.splice_py)]
if runs._speedups is not None:
    SCANNERS.append(("c", runs._speedups.lumberjack_json))
    SPLICERS.append(("c", runs._speedups.splice))

# JSON frames, of either version, mixed with other frames and junk
frame_pieces = st.lists(st.one_of(
    st.tuples(st.sampled_from([VERSION_1, VERSION_2]), st.integers(0, 2**32 - 1),
              st.binary(max_size=40)).map(lambda t: encode_json(t[1], t[2], t[0])),
    st.sampled_from([encode_window(3), b"2A\x00\x00\x00\x01", b"2", b"2J", b"2J\x00\x00",
                     b"1J\x00\x00\x00\x01\x00\x00\x00\x09", b"\xff", b"2J\x00\x00\x00\x01\xff"
                     b"\xff\xff\xff"])), max_size=10)


class AcceleratorTests(SynchronousTestCase):
    def test_accelerator_built(self):
        # the figures in doc/performance.rst are with it: a build that lost it must fail here
        self.assertIsNotNone(runs._speedups, "streamproto._speedups did not build")

    @given(frame_pieces, st.integers(0, 20), st.sampled_from([VERSION_1, VERSION_2]),
           st.integers(0, 64), st.integers(-1, 5))
    @settings(max_examples=400, deadline=None)
    def test_scan_agrees(self, pieces, start, version, max_frame, max_events):
        buf = b"".join(pieces)
        start = min(start, len(buf))
        results = {name: scan(buf, start, version, max_frame, max_events)
                   for name, scan in SCANNERS}
        self.assertEqual(len(set(results.values())), 1, results)
        seqs, lengths, data, end, status, need = results["python"]
        # and what it found is what was there
        self.assertEqual(len(data), sum(array("I", lengths)))
        if lengths:
            self.assertEqual(buf[start:start + 2], bytes([version, 0x4A]))
        else:
            self.assertEqual(end, start)

    def test_scan_statuses(self):
        frames = encode_json_frames([b"1", b"22"], 5) + encode_window(1)
        for name, scan in SCANNERS:
            self.assertEqual(scan(frames, 0, VERSION_2, 10, -1),
                             (array("I", [5, 6]).tobytes(), array("I", [1, 2]).tobytes(),
                              b"122", 23, runs.OTHER, 0), name)
            self.assertEqual(scan(frames, 0, VERSION_2, 10, 1)[3:], (11, runs.OTHER, 0), name)
            self.assertEqual(scan(frames[:22], 0, VERSION_2, 10, -1)[3:],
                             (11, runs.INCOMPLETE, 23), name)
            self.assertEqual(scan(frames[:22], 11, VERSION_2, 10, -1)[3:],
                             (11, runs.INCOMPLETE, 23), name)
            self.assertEqual(scan(frames[:20], 11, VERSION_2, 10, -1)[3:],
                             (11, runs.INCOMPLETE, -1), name)
            self.assertEqual(scan(frames, 0, VERSION_2, 1, -1)[3:], (11, runs.TOO_LARGE, 2), name)
            self.assertEqual(scan(frames, 0, VERSION_1, 10, -1)[3:], (0, runs.OTHER, 0), name)
            self.assertEqual(scan(bytearray(frames), 0, VERSION_2, 10, -1)[2], b"122", name)

    @given(st.lists(st.binary(max_size=30), max_size=20), st.binary(max_size=3),
           st.binary(max_size=5), st.binary(max_size=3), st.binary(max_size=3))
    @settings(max_examples=300, deadline=None)
    def test_splice_agrees(self, payloads, head, prefix, suffix, tail):
        run = PayloadRun.of(payloads)
        results = {name: splice(run.lengths, run.data, head, prefix, suffix, tail)
                   for name, splice in SPLICERS}
        self.assertEqual(len(set(results.values())), 1, results)
        data, lengths = results["python"]
        self.assertEqual(data, head + b"".join(prefix + p + suffix for p in payloads) + tail)
        self.assertEqual(list(array("I", lengths)),
                         [len(p) + len(prefix) + len(suffix) for p in payloads])

    @given(st.lists(st.binary(max_size=30), max_size=20), st.binary(max_size=5))
    @settings(max_examples=100, deadline=None)
    def test_scanned_runs_splice_the_same_either_way(self, payloads, prefix):
        # the pure-Python scan keeps its pieces for splicing: they must be the run's
        frames = encode_json_frames(payloads)
        accelerated = runs.scan_json(frames, 0, VERSION_2, 64, -1)
        self.patch(runs, "_speedups", None)
        seqs, run, end, status, need = runs.scan_json(frames, 0, VERSION_2, 64, -1)
        self.assertEqual((seqs, run, end, status, need), accelerated)
        spliced = runs.splice(run, b"[", prefix, b"}", b"]")
        self.assertEqual(spliced[0], b"[" + b"".join(prefix + p + b"}" for p in payloads) + b"]")
        self.assertEqual(spliced, runs.splice(PayloadRun(run.data, run.lengths), b"[", prefix,
                                              b"}", b"]"))

    def test_splice_refuses_lengths_not_matching(self):
        for name, splice in SPLICERS:
            self.assertRaises(ValueError, splice, array("I", [3]), b"ab", b"", b"", b"", b"")
            if name == "c":
                self.assertRaises(ValueError, splice, b"abc", b"abc", b"", b"", b"", b"")

    @given(frame_pieces, st.integers(1, 9))
    @settings(max_examples=200, deadline=None)
    def test_decoder_same_frames_without_the_accelerator(self, pieces, chunk):
        data = encode_window(3) + b"".join(pieces)

        def decode():
            decoder = FrameDecoder(max_frame=30, validate=False)
            frames = []
            try:
                for i in range(0, len(data), chunk):
                    decoder.feed(data[i:i + chunk])
                    frames += decoder.decode()
            except ProtocolError as e:
                frames.append(type(e))
            return frames
        accelerated = decode()
        self.patch(runs, "_speedups", None)
        self.assertEqual(decode(), accelerated)


class PayloadRunTests(SynchronousTestCase):
    def test_sequence(self):
        run = PayloadRun.of([b"a", b"", b"bcd"])
        self.assertEqual(len(run), 3)
        self.assertEqual(list(run), [b"a", b"", b"bcd"])
        self.assertEqual(run[2], b"bcd")
        self.assertEqual(run[-3], b"a")
        self.assertRaises(IndexError, lambda: run[3])
        self.assertEqual(run, [b"a", b"", b"bcd"])
        self.assertEqual(run[1:], PayloadRun.of([b"", b"bcd"]))
        self.assertEqual(run.split(1), ([b"a"], [b"", b"bcd"]))
        self.assertEqual(run.nbytes, 4)
        self.assertNotEqual(run, [b"a"])

    def test_join(self):
        self.assertEqual(PayloadRun.join([PayloadRun.of([b"x"]), PayloadRun.of([b"yz", b"w"])]),
                         [b"x", b"yz", b"w"])
        self.assertEqual(PayloadRun.join([]), [])

    def test_count_to_reach(self):
        run = PayloadRun.of([b"aa", b"bb", b"cc"])
        self.assertEqual([run.count_to_reach(n) for n in (1, 2, 3, 6, 7)], [1, 1, 2, 3, 3])

    def test_events_hold_a_run(self):
        events = Events(VERSION_2, [4, 5], [b"1", b"2"])
        self.assertIsInstance(events.payloads, PayloadRun)
        first, rest = events.split(1)
        self.assertEqual((list(first.seqs), list(first.payloads)), ([4], [b"1"]))
        self.assertEqual((list(rest.seqs), list(rest.payloads)), ([5], [b"2"]))


def valid(payload):
    try:
        codec.validate_json(payload)
        return True
    except MalformedJSON:
        return False


class ValidateRunTests(SynchronousTestCase):
    """One parse of the whole run decides exactly as one per payload."""

    def assertSameVerdict(self, payloads):
        run = PayloadRun.of(payloads)
        if all(map(valid, payloads)):
            codec.validate_run(run)
        else:
            self.assertRaises(MalformedJSON, codec.validate_run, run)

    def test_payloads_spanning_each_other(self):
        # the array text [[1,2],3,4,0] parses, with as many elements as
        # payloads and the same total size: only the sizes one by one tell
        self.assertRaises(MalformedJSON, codec.validate_run, PayloadRun.of([b"[1", b"2]",
                                                                             b"3,4"]))
        self.assertRaises(MalformedJSON, codec.validate_run, PayloadRun.of([b'"a', b'b"']))
        self.assertRaises(MalformedJSON, codec.validate_run, PayloadRun.of([b"1,", b"2"]))
        self.assertRaises(MalformedJSON, codec.validate_run, PayloadRun.of([b"{}", b""]))
        self.assertRaises(MalformedJSON, codec.validate_run, PayloadRun.of([b"1", b"]"]))

    def test_whitespace_and_utf8(self):
        codec.validate_run(PayloadRun.of([b' {"a": 1} ', b"\t[]\n", '"é"'.encode()]))
        self.assertRaises(MalformedJSON, codec.validate_run,
                          PayloadRun.of([b"1", b'"\xff"']))
        self.assertRaises(MalformedJSON, codec.validate_run,
                          PayloadRun.of([b'"\xc3', b'\xa9"']))

    def test_long_runs_in_parts(self):
        self.patch(codec, "VALIDATE_CHUNK", 3)
        codec.validate_run(PayloadRun.of([b"1"] * 10))
        for bad in range(10):
            payloads = [b"1"] * 10
            payloads[bad] = b"[1"
            self.assertRaises(MalformedJSON, codec.validate_run, PayloadRun.of(payloads))

    def test_stdlib_extensions_accepted(self):
        # NaN is the stdlib's (msgspec refuses it): the stdlib has the last word
        codec.validate_run(PayloadRun.of([b"1", b"NaN", b"[Infinity]"]))

    @given(st.lists(mutations(), max_size=6))
    @settings(max_examples=400, deadline=None)
    def test_same_verdict_as_each_payload(self, payloads):
        self.assertSameVerdict(payloads)

    @given(st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b",", b"1", b'"', b":", b" ",
                                     b"[1", b"2]", b'"a"', b"{}", b"null", b"\\"]),
                    min_size=1, max_size=4), st.integers(1, 5))
    @settings(max_examples=500, deadline=None)
    def test_same_verdict_for_fragments(self, pieces, n):
        # payloads made of fragments, so that neighbours can close each other
        self.assertSameVerdict([b"".join(pieces[i::n]) for i in range(n)])

    def test_decoder_refuses_a_bad_payload_in_a_compressed_batch(self):
        good = [json.dumps({"n": i}).encode() for i in range(50)]
        for bad in (b"[1", b"", b"1 2", b'"\xff"'):
            decoder = FrameDecoder()
            decoder.feed(encode_batch(good[:20] + [bad] + good[20:], 3))
            self.assertRaises(MalformedJSON, decoder.decode)

    def test_decoder_refuses_too_large_frame(self):
        decoder = FrameDecoder(max_frame=4)
        decoder.feed(encode_json(1, b"12345"))
        self.assertRaises(FrameTooLarge, decoder.decode)

    @given(st.lists(json_values, min_size=1, max_size=20), st.integers(0, 9))
    @settings(max_examples=100, deadline=None)
    def test_valid_batches_decode(self, values, level):
        payloads = [json.dumps(v, ensure_ascii=False).encode() for v in values]
        decoder = FrameDecoder()
        decoder.feed(encode_batch(payloads, level))
        events = [p for f in decoder.decode() if type(f) is Events for p in f.payloads]
        self.assertEqual(events, payloads)


class RecordTests(SynchronousTestCase):
    """The log records a sink makes of a run: JSON documents, the event spliced in whole."""

    @given(st.lists(json_values, max_size=8), st.booleans(), st.booleans())
    @settings(max_examples=100, deadline=None)
    def test_records_are_the_documents(self, values, as_run, pure):
        from streamproto.lumberjack.sink import ConnectionInfo, make_records
        if pure:
            self.patch(runs, "_speedups", None)
        payloads = [json.dumps(v, ensure_ascii=False).encode() for v in values]
        connection = ConnectionInfo("10.0.0.7:5", {"cn": "beat\u00e9"})
        batch = make_records(connection, PayloadRun.of(payloads) if as_run else payloads)
        self.assertEqual([json.loads(r) for r in batch.records()],
                         [{"peer": "10.0.0.7:5", "tls": {"cn": "beat\u00e9"}, "event": v}
                          for v in values])
