"""The sans-IO Lumberjack frame codec: round trips, splits, bounds, fuzzing."""

import json
import struct
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from streamproto.lumberjack import codec
from streamproto.lumberjack.codec import (
    VERSION_1, VERSION_2, Ack, BadCompressedFrame, DecompressedTooLarge, Events, FrameDecoder,
    FrameTooLarge, MalformedData, MalformedJSON, ProtocolError, UnknownFrameType,
    UnsupportedVersion, Window, WindowTooLarge, encode_ack, encode_batch, encode_compressed,
    encode_json, encode_json_frames, encode_key_values, encode_window,
)


def events_of(frames):
    """(version, seq, payload) for every event in decoded frames."""
    out = []
    for f in frames:
        if type(f) is Events:
            out.extend((f.version, s, p) for s, p in zip(f.seqs, f.payloads))
    return out


def decode_all(data, **kwargs):
    d = FrameDecoder(**kwargs)
    d.feed(data)
    frames = d.decode()
    return frames, d


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10)


class RoundTripTests(SynchronousTestCase):
    def test_window_ack_json(self):
        data = encode_window(3) + encode_json(7, b'{"a":1}') + encode_ack(9, VERSION_1)
        frames, decoder = decode_all(data)
        self.assertEqual(frames, [Window(VERSION_2, 3), Events(VERSION_2, [7], [b'{"a":1}']),
                                  Ack(VERSION_1, 9)])
        self.assertEqual(decoder.buffered, 0)

    def test_wire_bytes(self):
        # the exact layout from the spec
        self.assertEqual(encode_window(0x0102), b"2W\x00\x00\x01\x02")
        self.assertEqual(encode_ack(5), b"2A\x00\x00\x00\x05")
        self.assertEqual(encode_json(1, b"{}"), b"2J\x00\x00\x00\x01\x00\x00\x00\x02{}")
        self.assertEqual(encode_key_values(2, {"k": "v"}),
                         b"1D\x00\x00\x00\x02\x00\x00\x00\x01\x00\x00\x00\x01k\x00\x00\x00\x01v")

    def test_key_values_become_json(self):
        frames, _ = decode_all(encode_key_values(4, {"line": "héllo", "file": "/var/log/x"}))
        [(version, seq, payload)] = events_of(frames)
        self.assertEqual((version, seq), (VERSION_1, 4))
        self.assertEqual(json.loads(payload), {"line": "héllo", "file": "/var/log/x"})

    def test_compressed_holds_several_frames(self):
        payloads = [json.dumps({"n": i}).encode() for i in range(50)]
        frames, _ = decode_all(encode_batch(payloads, compression_level=6))
        self.assertEqual(frames[0], Window(VERSION_2, 50))
        self.assertEqual(events_of(frames), [(VERSION_2, i + 1, p) for i, p in enumerate(payloads)])

    def test_compressed_with_mixed_frames(self):
        inner = (encode_json(1, b"[1]") + encode_key_values(2, {"a": "b"}, VERSION_2)
                 + encode_window(5) + encode_json(3, b'"x"'))
        frames, _ = decode_all(encode_compressed(inner))
        self.assertEqual([type(f) for f in frames], [Events, Events, Window, Events])
        self.assertEqual([s for _, s, _ in events_of(frames)], [1, 2, 3])

    def test_nested_compressed_frame(self):
        inner = encode_compressed(encode_json(1, b"1") + encode_json(2, b"2"))
        frames, _ = decode_all(encode_compressed(inner + encode_json(3, b"3")))
        self.assertEqual([s for _, s, _ in events_of(frames)], [1, 2, 3])

    def test_nesting_too_deep(self):
        data = encode_compressed(encode_json(1, b"1"))
        for _ in range(codec.MAX_NESTING):
            data = encode_compressed(data)
        self.assertRaises(BadCompressedFrame, decode_all, data)

    def test_byte_by_byte(self):
        payloads = [json.dumps({"n": i, "pad": "x" * i}).encode() for i in range(20)]
        data = (encode_batch(payloads[:10], compression_level=3)
                + encode_batch(payloads[10:], compression_level=0)
                + encode_window(1, VERSION_1) + encode_key_values(99, {"k" * 30: "v" * 40, "a": ""}))
        whole, _ = decode_all(data)
        decoder = FrameDecoder()
        split = []
        for i in range(len(data)):
            decoder.feed(data[i:i + 1])
            split += decoder.decode()
        self.assertEqual(events_of(split), events_of(whole))
        self.assertEqual([f for f in split if type(f) is Window],
                         [f for f in whole if type(f) is Window])
        self.assertEqual(len(events_of(split)), 21)
        self.assertEqual(decoder.buffered, 0)

    @given(st.lists(json_values, min_size=1, max_size=30), st.integers(0, 9),
           st.lists(st.integers(1, 64), max_size=20))
    @settings(max_examples=60, deadline=None)
    def test_round_trip_any_split(self, values, level, cuts):
        payloads = [json.dumps(v).encode() for v in values]
        data = encode_batch(payloads, compression_level=level, first_seq=2**32 - 5)
        decoder = FrameDecoder()
        frames = []
        pos = 0
        for cut in cuts:
            decoder.feed(data[pos:pos + cut])
            frames += decoder.decode()
            pos += cut
        decoder.feed(data[pos:])
        frames += decoder.decode()
        self.assertEqual(frames[0], Window(VERSION_2, len(payloads)))
        seqs = [(2**32 - 5 + i) % 2**32 for i in range(len(payloads))]
        self.assertEqual(events_of(frames), [(VERSION_2, s, p) for s, p in zip(seqs, payloads)])

    def test_max_events_stops_at_batch_boundary(self):
        data = encode_batch([b"1", b"2"], 0) + encode_batch([b"3"], 0)
        decoder = FrameDecoder()
        decoder.feed(data)
        self.assertEqual(decoder.decode(0), [Window(VERSION_2, 2)])
        self.assertEqual(events_of(decoder.decode(2)), [(VERSION_2, 1, b"1"), (VERSION_2, 2, b"2")])
        self.assertEqual(decoder.decode(0), [Window(VERSION_2, 1)])
        self.assertEqual(events_of(decoder.decode(1)), [(VERSION_2, 1, b"3")])
        self.assertEqual(decoder.decode(), [])


class BoundTests(SynchronousTestCase):
    def test_window_too_large(self):
        self.assertRaises(WindowTooLarge, decode_all, encode_window(10001))
        frames, _ = decode_all(encode_window(10000))
        self.assertEqual(frames, [Window(VERSION_2, 10000)])

    def test_json_frame_too_large_before_payload_arrives(self):
        header = struct.pack(">BBII", VERSION_2, codec.JSON, 1, 2000)
        decoder = FrameDecoder(max_frame=1000)
        decoder.feed(header)  # only the header: refused without buffering the payload
        self.assertRaises(FrameTooLarge, decoder.decode)

    def test_key_value_frame_too_large(self):
        data = encode_key_values(1, {"k": "v" * 2000})
        self.assertRaises(FrameTooLarge, decode_all, data, max_frame=1000)
        self.assertRaises(FrameTooLarge, decode_all,
                          struct.pack(">BBII", VERSION_1, codec.DATA, 1, 10**9))

    def test_compressed_frame_too_large(self):
        header = struct.pack(">BBI", VERSION_2, codec.COMPRESSED, 5000)
        decoder = FrameDecoder(max_decompressed=4096)
        decoder.feed(header)
        self.assertRaises(FrameTooLarge, decoder.decode)

    def test_zip_bomb(self):
        # 1 KiB of zlib that inflates to 10 MiB
        bomb = encode_json(1, b'"' + b"a" * (10 * 1048576) + b'"')
        data = encode_compressed(bomb, level=9)
        self.assertLess(len(data), 20000)
        with self.assertRaises(DecompressedTooLarge):
            decode_all(data, max_decompressed=1048576)

    def test_malformed_json(self):
        for bad in [b"{", b'{"a":1}{}', b"\xff\xfe", '"é"'.encode("utf-16"), b"", b"nope"]:
            self.assertRaises(MalformedJSON, decode_all, encode_json(1, bad))

    def test_big_integers_are_json(self):
        frames, _ = decode_all(encode_json(1, b"[123456789012345678901234567890]"))
        self.assertEqual(len(events_of(frames)), 1)

    def test_key_values_growing_past_bound_as_json(self):
        data = encode_key_values(1, {"k": "\x00" * 100})  # 110 bytes, 600+ as JSON
        self.assertRaises(FrameTooLarge, decode_all, data, max_frame=200)
        frames, _ = decode_all(data, max_frame=1000)
        self.assertEqual(json.loads(events_of(frames)[0][2]), {"k": "\x00" * 100})

    def test_key_values_not_utf8(self):
        self.assertRaises(MalformedData, decode_all, encode_key_values(1, {b"\xff": b"x"}))

    def test_unknown_type_and_version(self):
        self.assertRaises(UnknownFrameType, decode_all, b"2Z\x00\x00\x00\x00")
        self.assertRaises(UnsupportedVersion, decode_all, b"3W\x00\x00\x00\x01")

    def test_bad_compressed_frames(self):
        body = zlib.compress(encode_json(1, b"1"))
        for payload in [b"not zlib", body[:-3], body + b"junk",
                        zlib.compress(encode_json(1, b"1")[:-1])]:
            data = struct.pack(">BBI", VERSION_2, codec.COMPRESSED, len(payload)) + payload
            self.assertRaises(BadCompressedFrame, decode_all, data)

    def test_incomplete_frame_waits(self):
        data = encode_json(1, b'{"a":1}')
        frames, decoder = decode_all(data[:-1])
        self.assertEqual(frames, [])
        self.assertEqual(decoder.buffered, len(data) - 1)

    @given(st.binary(max_size=400))
    @settings(max_examples=400, deadline=None)
    def test_fuzz_arbitrary_bytes(self, data):
        decoder = FrameDecoder(max_frame=256, max_decompressed=4096, max_window=100)
        try:
            decoder.feed(data)
            decoder.decode()
        except ProtocolError:
            pass

    @given(st.lists(st.sampled_from([
        encode_window(2), encode_json(1, b'{"a":1}'), encode_ack(1), b"2C", b"2J\x00",
        encode_compressed(encode_json(1, b"1")), encode_key_values(3, {"a": "b"}), b"\x00",
        b"2D\x00\x00\x00\x01\x00\x00\x00\x02", b"\x78\x9c", b"2W\xff\xff\xff\xff"]),
        max_size=12), st.integers(1, 7))
    @settings(max_examples=300, deadline=None)
    def test_fuzz_frame_soup(self, pieces, chunk):
        data = b"".join(pieces)
        decoder = FrameDecoder(max_frame=256, max_decompressed=4096, max_window=100)
        try:
            for i in range(0, len(data), chunk):
                decoder.feed(data[i:i + chunk])
                decoder.decode(i % 3 - 1)
        except ProtocolError:
            pass

    @given(st.binary(max_size=300))
    @settings(max_examples=200, deadline=None)
    def test_fuzz_inside_compressed_frame(self, inner):
        decoder = FrameDecoder(max_frame=256, max_decompressed=4096)
        decoder.feed(encode_compressed(b"2J" + inner))
        try:
            decoder.decode()
        except ProtocolError:
            pass

    def test_json_frames_helper_numbers_from_first_seq(self):
        frames, _ = decode_all(encode_json_frames([b"1", b"2"], first_seq=10))
        self.assertEqual([s for _, s, _ in events_of(frames)], [10, 11])


def mutations():
    """JSON texts, valid or slightly broken: what the checkers must agree on."""
    texts = json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8"))

    def mutate(args):
        text, where, byte, how = args
        where = where % (len(text) + 1)
        if how == 0:
            return text
        if how == 1:
            return text[:where]
        if how == 2:
            return text[:where] + bytes([byte]) + text[where:]
        return text[:where] + text[where + 1:]
    return st.tuples(texts, st.integers(0, 1000), st.integers(0, 255), st.integers(0, 3)).map(mutate)


class ValidatorTests(SynchronousTestCase):
    BAD = [b"{", b'{"a":1}{}', b"\xff\xfe", '"é"'.encode("utf-16"), b"", b"nope", b'{"a":1,}',
           b'{"a":"\xff"}', b'["\x01"]', b"[01]", b'{"a" 1}', b"'a'", b'"\\q"']

    def test_every_checker_rejects_bad_documents(self):
        self.assertIn("stdlib", codec.CHECKERS)
        for name, check in codec.CHECKERS.items():
            for bad in self.BAD:
                try:
                    check(bad)
                except Exception:
                    continue
                self.fail(f"{name} accepted {bad!r}")

    @given(mutations())
    @settings(max_examples=300, deadline=None)
    def test_accelerators_never_accept_more_than_stdlib(self, text):
        try:
            codec.stdlib_check(text)
            valid = True
        except Exception:
            valid = False
        for name, check in codec.CHECKERS.items():
            try:
                check(text)
                accepted = True
            except Exception:
                accepted = False
            if accepted:
                self.assertTrue(valid, f"{name} accepted {text!r}, the stdlib does not")
        # and validate_json follows the stdlib exactly
        if valid:
            codec.validate_json(text)
        else:
            self.assertRaises(MalformedJSON, codec.validate_json, text)

    def test_decoder_with_stdlib_checker_only(self):
        # the path taken where no accelerator is installed
        self.patch(codec, "fast_check", codec.stdlib_check)
        frames, _ = decode_all(encode_batch([b'{"a":[1,2]}', b'"\xc3\xa9"'], 3))
        self.assertEqual(len(events_of(frames)), 2)
        self.assertRaises(MalformedJSON, decode_all, encode_batch([b"{}", b"[01]"], 3))
