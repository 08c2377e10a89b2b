"""The styx/0 codec: wire vectors, round trips, fuzzing."""

import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from streamproto.log.batch import RecordBatch
from streamproto.styx import codec
from streamproto.styx.codec import (
    HEARTBEAT, HEARTBEAT_BYTES, Ack, ErrorCode, ErrorMessage, StyxDecoder, StyxProtocolError,
    decode_all, encode_ack, encode_batch, encode_error, encode_message, encode_record,
    encode_records,
)

_ACCELERATOR = codec._speedups


def accelerator_modes():
    """The C accelerator (when built) and the pure-Python twin."""
    return [None] + ([_ACCELERATOR] if _ACCELERATOR is not None else [])


# Wire bytes written out by hand from the spec (big-endian everywhere).
VECTORS = [
    (b"hello", b"\x00\x01\x00\x00\x00\x05hello"),
    (b"", b"\x00\x01\x00\x00\x00\x00"),
    (Ack(258, 3), b"\x00\x02" + b"\x00" * 6 + b"\x01\x02" + b"\x00" * 7 + b"\x03"),
    (Ack(-1, 0), b"\x00\x02" + b"\xff" * 8 + b"\x00" * 8),
    (HEARTBEAT, b"\x00\x03"),
    (ErrorMessage(0), b"\x00\x04\x00\x00"),
    (ErrorMessage(ErrorCode.EARLY_DATA), b"\x00\x04\x00\x05"),
]

records = st.lists(st.binary(max_size=300), max_size=60)
messages = st.lists(st.one_of(
    st.binary(max_size=200),
    st.builds(Ack, st.integers(-2**63, 2**63 - 1), st.integers(-2**63, 2**63 - 1)),
    st.just(HEARTBEAT),
    st.builds(ErrorMessage, st.integers(-2**15, 2**15 - 1)),
), max_size=40)


def chunked(data, cuts):
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, start = [], 0
    for p in points + [len(data)]:
        pieces.append(data[start:p])
        start = p
    return pieces


class VectorTests(SynchronousTestCase):
    def test_encode(self):
        for message, wire in VECTORS:
            self.assertEqual(encode_message(message), wire, message)

    def test_decode(self):
        for message, wire in VECTORS:
            self.assertEqual(decode_all(wire), [message])

    def test_heartbeat_bytes(self):
        self.assertEqual(HEARTBEAT_BYTES, b"\x00\x03")
        self.assertEqual(encode_ack(1, 2), encode_message(Ack(1, 2)))
        self.assertEqual(encode_error(4), b"\x00\x04\x00\x04")

    def test_error_codes_are_stable(self):
        """The codes are part of the wire contract (doc/styx-stream.rst)."""
        self.assertEqual(
            {c.name: int(c) for c in ErrorCode},
            {"UNKNOWN": 0, "UNKNOWN_MESSAGE_TYPE": 1, "INVALID_RECORD_SIZE": 2,
             "RECORD_TOO_LARGE": 3, "UNEXPECTED_MESSAGE": 4, "EARLY_DATA": 5, "TIMEOUT": 6,
             "LOG_NOT_FOUND": 7, "LOG_NOT_AVAILABLE": 8, "POSITION_OUT_OF_RANGE": 9,
             "SHUTDOWN": 10, "UNAUTHORIZED": 11, "FORBIDDEN": 12})


class DecoderTests(SynchronousTestCase):
    def test_many_messages_per_feed(self):
        data = encode_records([b"a", b"bb"]) + HEARTBEAT_BYTES + encode_ack(3, 4)
        self.assertEqual(StyxDecoder().feed(data), [b"a", b"bb", HEARTBEAT, Ack(3, 4)])

    def test_uniform_run_then_other_sizes(self):
        """The strided fast path for same-size runs hands over correctly to
        the general loop, including a partial record at the end."""
        same = [bytes([i]) * 10 for i in range(50)]
        data = encode_records(same + [b"odd", b"x" * 10]) + HEARTBEAT_BYTES
        decoder = StyxDecoder()
        out = decoder.feed(data + encode_record(b"partial")[:5])
        self.assertEqual(out, same + [b"odd", b"x" * 10, HEARTBEAT])
        self.assertEqual(decoder.buffered, 5)
        self.assertEqual(decoder.feed(encode_record(b"partial")[5:]), [b"partial"])

    def test_uniform_run_with_a_heartbeat_inside(self):
        recs = [b"%06d" % i for i in range(40)]
        data = encode_records(recs[:20]) + HEARTBEAT_BYTES + encode_records(recs[20:])
        self.assertEqual(decode_all(data), recs[:20] + [HEARTBEAT] + recs[20:])

    def test_large_record_in_small_pieces(self):
        record = bytes(range(256)) * 400
        decoder = StyxDecoder()
        wire = encode_record(record)
        out = []
        for i in range(0, len(wire), 1000):
            out += decoder.feed(wire[i:i + 1000])
        self.assertEqual(out, [record])
        self.assertEqual(decoder.buffered, 0)

    def test_unknown_type(self):
        decoder = StyxDecoder()
        with self.assertRaises(StyxProtocolError) as cm:
            decoder.feed(encode_record(b"ok") + b"\x00\x05\x00\x00")
        self.assertEqual(cm.exception.code, ErrorCode.UNKNOWN_MESSAGE_TYPE)
        self.assertEqual(cm.exception.messages, [b"ok"])
        # the decoder stays failed
        with self.assertRaises(StyxProtocolError):
            decoder.feed(HEARTBEAT_BYTES)

    def test_negative_size(self):
        with self.assertRaises(StyxProtocolError) as cm:
            StyxDecoder().feed(struct.pack(">hi", 1, -1))
        self.assertEqual(cm.exception.code, ErrorCode.INVALID_RECORD_SIZE)

    def test_too_large_found_from_the_header(self):
        """An oversized record fails on its header: nothing is buffered."""
        with self.assertRaises(StyxProtocolError) as cm:
            StyxDecoder(max_record_size=100).feed(struct.pack(">hi", 1, 101))
        self.assertEqual(cm.exception.code, ErrorCode.RECORD_TOO_LARGE)
        self.assertEqual(StyxDecoder(max_record_size=100).feed(
            encode_record(b"x" * 100)), [b"x" * 100])

    def test_too_large_inside_uniform_run(self):
        with self.assertRaises(StyxProtocolError) as cm:
            StyxDecoder(max_record_size=5).feed(encode_records([b"123456"] * 20))
        self.assertEqual(cm.exception.code, ErrorCode.RECORD_TOO_LARGE)

    def test_unexpected_type(self):
        decoder = StyxDecoder(accept=(codec.RECORD, codec.HEARTBEAT_TYPE))
        with self.assertRaises(StyxProtocolError) as cm:
            decoder.feed(encode_ack(0, 0))
        self.assertEqual(cm.exception.code, ErrorCode.UNEXPECTED_MESSAGE)
        decoder = StyxDecoder(accept=(codec.HEARTBEAT_TYPE,))
        with self.assertRaises(StyxProtocolError) as cm:
            decoder.feed(encode_records([b"r"] * 20))
        self.assertEqual(cm.exception.code, ErrorCode.UNEXPECTED_MESSAGE)

    def test_truncated_decode_all(self):
        with self.assertRaises(StyxProtocolError) as cm:
            decode_all(encode_record(b"abc")[:-1])
        self.assertEqual(cm.exception.code, ErrorCode.UNKNOWN)

    def test_feed_split(self):
        for mode in accelerator_modes():
            self.patch(codec, "_speedups", mode)
            decoder = StyxDecoder()
            data = encode_record(b"a") + HEARTBEAT_BYTES + encode_record(b"b") + encode_error(3)
            self.assertEqual(decoder.feed_split(data),
                             ([b"a", b"b"], [HEARTBEAT, ErrorMessage(3)]))
            self.assertEqual(decoder.feed_split(b""), ([], []))
            with self.assertRaises(StyxProtocolError) as cm:
                decoder.feed_split(encode_records([b"c"] * 70 + [b"dd"]) + b"\x00\x00")
            self.assertEqual(cm.exception.messages, [b"c"] * 70 + [b"dd"])

    def test_error_message_name(self):
        self.assertEqual(ErrorMessage(9).name, "POSITION_OUT_OF_RANGE")
        self.assertEqual(ErrorMessage(999).name, "code 999")


class EncoderTests(SynchronousTestCase):
    def test_encode_records_mixed_and_uniform(self):
        for recs in ([b"a", b"bcd", b""], [b"xy"] * 30, [b""] * 3, [bytearray(b"q")]):
            self.assertEqual(encode_records(recs),
                             b"".join(encode_record(bytes(r)) for r in recs))
        self.assertEqual(encode_records([]), b"")

    def test_encode_batch(self):
        for recs in ([b"a", b"bcd", b""], [b"xy"] * 30, [b""] * 3, [b"one"]):
            batch = RecordBatch.from_records(5, recs)
            self.assertEqual(encode_batch(batch), encode_records(recs))
            batch.data = memoryview(batch.data)
            self.assertEqual(encode_batch(batch), encode_records(recs))
        self.assertEqual(encode_batch(RecordBatch.from_records(0, [])), b"")

    def test_encode_batch_strided_small_records(self):
        """Many same-size small records take the strided copy; same bytes."""
        for size in (0, 2, 10, 32, 34):
            recs = [bytes([i % 251, (i * 7) % 256]) * (size // 2) for i in range(300)]
            batch = RecordBatch.from_records(0, recs)
            self.assertEqual(encode_batch(batch),
                             b"".join(encode_record(r) for r in recs), size)

    def test_encode_message_rejects_others(self):
        self.assertRaises(TypeError, encode_message, 5)


def feed_batches(decoder, pieces):
    """Records (split from the batches) and others from feed_batch."""
    records, others = [], []
    for piece in pieces:
        lengths, payload, more = decoder.feed_batch(piece)
        assert sum(lengths) == len(payload)
        offset = 0
        for size in lengths:
            records.append(payload[offset:offset + size])
            offset += size
        others += more
    return records, others


class BatchDecodeTests(SynchronousTestCase):
    """feed_batch, with the C accelerator (if built) and without."""

    def tearDown(self):
        codec._speedups = _ACCELERATOR

    def test_accelerator_built(self):
        """The package builds its accelerator; the fast path is the one in use."""
        if _ACCELERATOR is None:
            raise SkipTest("streamproto._speedups is not built on this machine")
        self.assertTrue(hasattr(_ACCELERATOR, "scan_frames"))

    @settings(max_examples=150, deadline=None)
    @given(messages, st.lists(st.integers(0, 20000), max_size=8))
    def test_batch_round_trip(self, msgs, cuts):
        wire = b"".join(encode_message(m) for m in msgs)
        for mode in accelerator_modes():
            codec._speedups = mode
            records, others = feed_batches(StyxDecoder(max_record_size=1000),
                                           chunked(wire, cuts))
            self.assertEqual(records, [m for m in msgs if type(m) is bytes])
            self.assertEqual(others, [m for m in msgs if type(m) is not bytes])

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=6))
    def test_batch_garbage(self, data, cuts):
        """Same verdict as the list decoder on arbitrary bytes."""
        expected = []
        try:
            decoder = StyxDecoder(max_record_size=64)
            for piece in chunked(data, cuts):
                expected += decoder.feed(piece)
            expected_error = None
        except StyxProtocolError as e:
            expected_error = e.code
        for mode in accelerator_modes():
            codec._speedups = mode
            try:
                records, others = feed_batches(StyxDecoder(max_record_size=64),
                                               chunked(data, cuts))
                error = None
            except StyxProtocolError as e:
                error = e.code
            self.assertEqual(error, expected_error)
            if error is None:
                self.assertEqual(records, [m for m in expected if type(m) is bytes])
                self.assertEqual(others, [m for m in expected if type(m) is not bytes])

    def test_batch_errors(self):
        for mode in accelerator_modes():
            codec._speedups = mode
            for data, code in ((struct.pack(">hi", 1, -1), ErrorCode.INVALID_RECORD_SIZE),
                               (struct.pack(">hi", 1, 101), ErrorCode.RECORD_TOO_LARGE),
                               (b"\x00\x09", ErrorCode.UNKNOWN_MESSAGE_TYPE)):
                with self.assertRaises(StyxProtocolError) as cm:
                    StyxDecoder(max_record_size=100).feed_batch(encode_record(b"ok") + data)
                self.assertEqual(cm.exception.code, code)
                self.assertEqual(cm.exception.messages, [b"ok"])
            decoder = StyxDecoder(accept=(codec.HEARTBEAT_TYPE,))
            with self.assertRaises(StyxProtocolError) as cm:
                decoder.feed_batch(encode_record(b"x"))
            self.assertEqual(cm.exception.code, ErrorCode.UNEXPECTED_MESSAGE)

    def test_record_across_reads_then_error(self):
        """A record completed by the next read comes first in the batch,
        and is among the records decoded before an error in that read."""
        first, second = encode_record(b"straddles"), encode_record(b"next")
        for mode in accelerator_modes():
            codec._speedups = mode
            decoder = StyxDecoder(max_record_size=100)
            lengths, payload, _ = decoder.feed_batch(first[:4])
            self.assertEqual((list(lengths), payload), ([], b""))
            lengths, payload, others = decoder.feed_batch(first[4:] + second + codec.HEARTBEAT_BYTES)
            self.assertEqual(list(lengths), [9, 4])
            self.assertEqual(payload, b"straddlesnext")
            self.assertEqual(others, [codec.HEARTBEAT])
            decoder = StyxDecoder(max_record_size=100)
            decoder.feed_batch(first[:7])
            with self.assertRaises(StyxProtocolError) as cm:
                decoder.feed_batch(first[7:] + struct.pack(">hi", 1, 101))
            self.assertEqual(cm.exception.code, ErrorCode.RECORD_TOO_LARGE)
            self.assertEqual(cm.exception.messages, [b"straddles"])

    def test_scan_frames_head(self):
        """The accelerator's scan_frames puts C{head} before the payloads
        it copies (a straddling record's, joined without a second copy)."""
        if _ACCELERATOR is None:
            raise SkipTest("streamproto._speedups is not built on this machine")
        wire = encode_record(b"abc") + encode_record(b"de")
        raw, payload, end, status = _ACCELERATOR.scan_frames(wire, 0, b"\x00\x01", 100, -1,
                                                             b"head")
        self.assertEqual((payload, end, status), (b"headabcde", len(wire), 0))
        self.assertEqual(len(raw), 8)

    def test_encode_batch_both_paths(self):
        recs = [b"a", b"bcd", b""] + [b"xy"] * 100
        for mode in accelerator_modes():
            codec._speedups = mode
            for batch in (RecordBatch.from_records(0, recs),
                          RecordBatch.from_records(0, [b"q" * 7] * 100)):
                self.assertEqual(encode_batch(batch),
                                 b"".join(encode_record(r) for r in batch.records()))


class PropertyTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(messages, st.lists(st.integers(0, 20000), max_size=8))
    def test_round_trip_any_chunking(self, msgs, cuts):
        wire = b"".join(encode_message(m) for m in msgs)
        decoder = StyxDecoder(max_record_size=1000)
        out = []
        for piece in chunked(wire, cuts):
            out += decoder.feed(piece)
        self.assertEqual(out, msgs)
        self.assertEqual(decoder.buffered, 0)

    @settings(max_examples=200, deadline=None)
    @given(records, st.lists(st.integers(0, 20000), max_size=5))
    def test_records_round_trip(self, recs, cuts):
        wire = encode_records(recs)
        self.assertEqual(wire, encode_batch(RecordBatch.from_records(0, recs)))
        decoder = StyxDecoder(max_record_size=300)
        out = []
        for piece in chunked(wire, cuts):
            out += decoder.feed(piece)
        self.assertEqual(out, recs)

    @settings(max_examples=100, deadline=None)
    @given(st.integers(0, 300), st.integers(0, 300), st.binary(max_size=20),
           st.lists(st.integers(0, 100000), max_size=5))
    def test_long_same_size_runs(self, size, count, tail, cuts):
        """Runs of same-size records (the block-cutting fast path) then a
        different record, in any chunking."""
        recs = [bytes([i % 256]) * size for i in range(count)] + [tail]
        wire = encode_records(recs) + HEARTBEAT_BYTES
        decoder = StyxDecoder(max_record_size=300)
        out = []
        for piece in chunked(wire, cuts):
            out += decoder.feed(piece)
        self.assertEqual(out, recs + [HEARTBEAT])
        for mode in accelerator_modes():
            codec._speedups = mode
            try:
                decoder = StyxDecoder(max_record_size=300)
                records, others = [], []
                for piece in chunked(wire, cuts):
                    more_records, more_others = decoder.feed_split(piece)
                    records += more_records
                    others += more_others
            finally:
                codec._speedups = _ACCELERATOR
            self.assertEqual((records, others), (recs, [HEARTBEAT]))

    @settings(max_examples=500, deadline=None)
    @given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=6))
    def test_garbage_only_raises_protocol_error(self, data, cuts):
        """Arbitrary bytes: messages or StyxProtocolError, nothing else, and
        never a record above the bound."""
        decoder = StyxDecoder(max_record_size=64)
        try:
            for piece in chunked(data, cuts):
                for m in decoder.feed(piece):
                    if type(m) is bytes:
                        self.assertLessEqual(len(m), 64)
        except StyxProtocolError as e:
            self.assertIsInstance(e.code, ErrorCode)

    @settings(max_examples=300, deadline=None)
    @given(records, st.integers(0, 5), st.binary(min_size=1, max_size=50))
    def test_valid_prefix_then_garbage(self, recs, chunks, garbage):
        """Records before the bad bytes are all delivered (on the exception
        if need be) and in order."""
        wire = encode_records(recs) + garbage
        decoder = StyxDecoder(max_record_size=300)
        out = []
        try:
            out += decoder.feed(wire)
        except StyxProtocolError as e:
            out += e.messages
        self.assertEqual(out[:len(recs)], recs)
