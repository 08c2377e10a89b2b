"""
Mutation fuzzing of every protocol's sans-IO decoder (each protocol's own
tests feed arbitrary bytes; random bytes rarely get past a header, so here
valid streams of every message type are mutated: bit flips, byte
overwrites with boundary values, truncations, duplicated and dropped
slices), fed in arbitrary chunks.  The only exception allowed out of a
decoder is its protocol's own error.
"""

import struct
import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

BOUNDARY = [0x00, 0x01, 0x7F, 0x80, 0xFF]


@st.composite
def mutated(draw, valid):
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "poke", "cut", "dup", "drop", "u32"]))
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "poke":
            data[i] = draw(st.sampled_from(BOUNDARY))
        elif op == "cut":
            del data[i:]
        elif op == "dup":
            j = draw(st.integers(i, len(data)))
            data[j:j] = data[i:j]
        elif op == "drop":
            j = draw(st.integers(i, min(len(data), i + 16)))
            del data[i:j]
        else:
            data[i:i + 4] = struct.pack(">I", draw(st.sampled_from(
                [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x00FFFFFF])))
    splits = draw(st.lists(st.integers(0, len(data)), max_size=6))
    cuts = sorted(set([0, len(data)] + splits))
    return [bytes(data[a:b]) for a, b in zip(cuts, cuts[1:])]


def styx_stream():
    from streamproto.styx.codec import HEARTBEAT, encode_ack, encode_error, encode_message, \
        encode_records
    return (encode_records([b"one", b"", b"three" * 20]) + encode_ack(5, 3) +
            encode_message(HEARTBEAT) + encode_error(3))


def lumberjack_stream():
    from streamproto.lumberjack.codec import (
        encode_ack, encode_batch, encode_key_values, encode_window,
    )
    return (encode_window(3) + encode_batch([b'{"a":1}', b'{"b":[1,2]}'], compression_level=0) +
            encode_batch([b'{"c":"x"}'], compression_level=3) + encode_ack(2) +
            encode_window(1, version=0x31) + encode_key_values(1, {"k": "v"}))


def pravega_stream():
    import uuid

    from streamproto.pravega import codec
    w = uuid.UUID(int=1)
    cmds = [codec.Hello(codec.WIRE_VERSION, codec.OLDEST_COMPATIBLE_VERSION),
            codec.SetupAppend(1, w, "a/b/0.#epoch.0", ""),
            codec.AppendBlock(w, struct.pack(">ii", 0, 3) + b"abc"),
            codec.ReadSegment("a/b/0.#epoch.0", 0, 100, "", 2),
            codec.GetStreamSegmentInfo(3, "a/b/0.#epoch.0", ""),
            codec.KeepAlive()]
    return b"".join(codec.encode(c) for c in cmds)


def relink_stream():
    from streamproto.relink import codec
    return (codec.encode_message([1], [b"hello", b"world"], 4) +
            codec.encode_message([2], [b"x" * 300], 4) +
            codec.encode_general(codec.PING) +
            codec.encode_channel_packet(codec.CHANNEL_OP, codec.CLOSE, [1], 4) +
            codec.encode_sequence_packet(codec.SEQUENCE_ACK, codec.CONSUMED, [1], 7, 4))


def reliable_stream():
    from streamproto.reliable import codec
    return (codec.encode_open("u-1", 10) + codec.encode_ack("u-1", 3) +
            codec.encode_resume("u-1", 4) + codec.encode_stateless_start() +
            codec.encode_stateless_resume("123"))


class MutationFuzz(unittest.SynchronousTestCase):
    def test_unmutated_streams_are_valid(self):
        """The seeds of the mutations decode cleanly (so mutations start from valid input)."""
        from streamproto.lumberjack.codec import FrameDecoder
        from streamproto.pravega.codec import Decoder
        from streamproto.relink.codec import decode_packets
        from streamproto.reliable import codec as rcodec
        from streamproto.styx.codec import StyxDecoder
        self.assertTrue(StyxDecoder(max_record_size=1024).feed(styx_stream()))
        lj = FrameDecoder(max_frame=4096, max_decompressed=8192)
        lj.feed(lumberjack_stream())
        self.assertGreaterEqual(len(lj.decode()), 5)
        self.assertEqual(len(Decoder().feed(pravega_stream())), 6)
        buf = relink_stream()
        packets, used = decode_packets(buf, 0, len(buf), 4, 4)
        self.assertEqual((len(packets), used), (5, len(buf)))
        lines = rcodec.LineDecoder(256).feed(reliable_stream())
        self.assertEqual(len([rcodec.parse_client_message(x) for x in lines]), 5)

    @SETTINGS
    @given(st.data())
    def test_styx(self, data):
        from streamproto.styx.codec import StyxDecoder, StyxProtocolError
        chunks = data.draw(mutated(styx_stream()))
        decoder = StyxDecoder(max_record_size=1024)
        try:
            for c in chunks:
                decoder.feed(c)
        except StyxProtocolError:
            pass

    @SETTINGS
    @given(st.data())
    def test_lumberjack(self, data):
        from streamproto.lumberjack.codec import FrameDecoder, ProtocolError
        chunks = data.draw(mutated(lumberjack_stream()))
        decoder = FrameDecoder(max_frame=4096, max_decompressed=8192)
        try:
            for c in chunks:
                decoder.feed(c)
                decoder.decode()
        except ProtocolError:
            pass

    @SETTINGS
    @given(st.data())
    def test_lumberjack_compressed_payload_mutations(self, data):
        """Mutations inside the zlib stream: inflate errors are protocol errors too."""
        from streamproto.lumberjack.codec import FrameDecoder, ProtocolError, encode_json
        inner = encode_json(1, b'{"m":"' + b"z" * 500 + b'"}')
        body = zlib.compress(inner)
        mutated_body = b"".join(data.draw(mutated(body)))
        frame = b"2W\x00\x00\x00\x01" + b"2C" + struct.pack(">I", len(mutated_body)) + \
            mutated_body
        decoder = FrameDecoder(max_frame=4096, max_decompressed=8192)
        try:
            decoder.feed(frame)
            decoder.decode()
        except ProtocolError:
            pass

    @SETTINGS
    @given(st.data())
    def test_pravega(self, data):
        from streamproto.pravega.codec import Decoder, ProtocolError
        chunks = data.draw(mutated(pravega_stream()))
        decoder = Decoder()
        try:
            for c in chunks:
                decoder.feed(c)
        except ProtocolError:
            pass

    @SETTINGS
    @given(st.data())
    def test_relink(self, data):
        from streamproto.relink.codec import ProtocolError, decode_packets
        buf = b"".join(data.draw(mutated(relink_stream())))
        try:
            packets, used = decode_packets(buf, 0, len(buf), 4, 4)
            self.assertLessEqual(used, len(buf))
        except ProtocolError:
            pass

    @SETTINGS
    @given(st.data())
    def test_reliable(self, data):
        from streamproto.reliable import codec
        from streamproto.reliable.errors import ProtocolError
        chunks = data.draw(mutated(reliable_stream()))
        decoder = codec.LineDecoder(max_line=256)
        try:
            for c in chunks:
                for line in decoder.feed(c):
                    if not codec.is_blank(line):
                        codec.parse_client_message(line)
        except ProtocolError:
            pass
