"""Length-prefixed framing: the C accelerator and the pure-Python fallback agree."""

import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from streamproto.core import framing
from streamproto.log.batch import RecordBatch

records = st.lists(st.binary(max_size=40), max_size=20)
prefixes = st.sampled_from([b"", b"\x00\x01", b"AB"])


def implementations():
    impls = [("python", framing.frame_records_py, framing.scan_frames_py)]
    if framing._speedups is not None:
        impls.append(("c", framing._speedups.frame_records, framing._speedups.scan_frames))
    return impls


class FramingTests(unittest.SynchronousTestCase):
    def test_accelerator_built(self):
        """CI builds the extension; if it stops building, say so loudly."""
        self.assertIsNotNone(framing._speedups, "streamproto._speedups did not build")

    def test_lengths_and_data_must_match(self):
        """
        The C functions taking (lengths, data) refuse a pair that does not
        match (they would read past the buffer otherwise), with ValueError.
        """
        from array import array
        c = framing._speedups
        for lengths, data, why in [(array("I", [3]).tobytes(), b"ab", "do not add up"),
                                   (b"abc", b"ab", "uint32 values")]:
            for name, args in [("frame_records", (lengths, data, b"")),
                               ("splice", (lengths, data, b"", b"", b"", b""))]:
                with self.assertRaises(ValueError, msg=name) as caught:
                    getattr(c, name)(*args)
                self.assertIn(why, str(caught.exception), name)

    @given(records, prefixes)
    @settings(max_examples=200)
    def test_frame_matches_struct(self, recs, prefix):
        batch = RecordBatch.from_records(0, recs)
        expected = b"".join(prefix + struct.pack(">I", len(r)) + r for r in recs)
        for name, frame, _ in implementations():
            self.assertEqual(frame(batch.lengths, batch.data, prefix), expected, name)
        self.assertEqual(framing.frame_batch(batch, prefix), expected)

    @given(records, prefixes, st.integers(0, 30), st.binary(max_size=8))
    @settings(max_examples=300)
    def test_scan_round_trip_with_truncation_and_trailer(self, recs, prefix, cut, trailer):
        framed = b"".join(prefix + struct.pack(">I", len(r)) + r for r in recs)
        buf = b"junk" + framed[:max(0, len(framed) - cut)] + (trailer if not cut else b"")
        results = []
        for _name, _, scan in implementations():
            results.append(scan(buf, 4, prefix, 1 << 20, -1))
        self.assertEqual(len({repr(r) for r in results}), 1, results)
        lengths, data, end, status = framing.scan_frames(buf, 4, prefix, 1 << 20)
        got = RecordBatch(0, lengths, data).records()
        self.assertEqual(got, recs[:len(got)])
        self.assertLessEqual(end, len(buf))
        if not cut and not trailer:
            self.assertEqual((got, end, status), (recs, len(buf), framing.NEED_MORE))

    def test_too_large_and_other(self):
        buf = b"\x00\x01" + struct.pack(">I", 3) + b"abc" + b"\x00\x01" + struct.pack(">I", 99)
        for name, _, scan in implementations():
            lens, data, end, status = scan(buf, 0, b"\x00\x01", 10, -1)
            self.assertEqual((data, end, status), (b"abc", 9, framing.TOO_LARGE), name)
            lens, data, end, status = scan(b"\x00\x02rest", 0, b"\x00\x01", 10, -1)
            self.assertEqual((data, end, status), (b"", 0, framing.OTHER), name)
            lens, data, end, status = scan(b"\x00", 0, b"\x00\x01", 10, -1)
            self.assertEqual((end, status), (0, framing.NEED_MORE), name)

    def test_max_records(self):
        buf = b"".join(struct.pack(">I", 1) + bytes([i]) for i in range(5))
        for name, _, scan in implementations():
            lens, data, end, status = scan(buf, 0, b"", 10, 2)
            self.assertEqual((data, end), (b"\x00\x01", 10), name)

    def test_bad_lengths(self):
        for _name, frame, _ in implementations():
            batch = RecordBatch.from_records(0, [b"abc"])
            self.assertRaises(ValueError, frame, batch.lengths, b"ab", b"")
