"""
Relink codec: byte vectors drawn from the spec's diagrams, round trips,
fuzzing and every malformed input.
"""

import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from streamproto.relink import codec
from streamproto.relink.codec import (
    CHANNEL_ACK, CHANNEL_OP, GENERAL, LARGE, LONG, MESSAGE, SEQUENCE_ACK, SEQUENCE_OP,
    ConnectorHandshake, Packet, ProtocolError,
)


def h(text):
    return bytes.fromhex(text.replace(" ", "").replace("\n", ""))


def decode_all(data, forward=0, reverse=0, limits=codec.DEFAULT_LIMITS):
    packets, offset = codec.decode_packets(data, 0, len(data), forward, reverse, limits)
    return packets, offset


class HandshakeVectors(SynchronousTestCase):
    def test_version_block(self):
        self.assertEqual(codec.encode_version(), bytes(8))
        self.assertEqual(codec.encode_version(3), h("03 00000000000000"))
        # padding is ignored on receipt
        self.assertEqual(codec.decode_version(h("00 ffffffffffffff")), 0)

    def test_connector_six_byte_name(self):
        # the spec's diagram: name length, 6 name bytes, the two sizes and the
        # flags end at byte 10, then 6 padding bytes align the epoch to 16
        hs = ConnectorHandshake("abcdef", 1, 2, True, True, True, 0x0102030405060708, 5)
        wire = h("06 616263646566 01 02 07 000000000000"
                 "0807060504030201"
                 "0500000000000000")
        self.assertEqual(codec.encode_connector_handshake(hs), wire)
        self.assertEqual(codec.decode_connector_handshake(wire), (hs, 32))

    def test_connector_padding_depends_on_name(self):
        for name, pad in [("", 4), ("abcd", 0), ("abcde", 7), ("é", 2)]:
            hs = ConnectorHandshake(name)
            wire = codec.encode_connector_handshake(hs)
            head = 1 + len(name.encode()) + 3
            self.assertEqual(len(wire), head + pad + 16)
            self.assertEqual(wire[head:head + pad], bytes(pad))
            self.assertEqual(codec.decode_connector_handshake(wire), (hs, len(wire)))

    def test_flags(self):
        for flags in range(8):
            hs = ConnectorHandshake("x", 0, 8, bool(flags & 1), bool(flags & 2),
                                    bool(flags & 4))
            wire = codec.encode_connector_handshake(hs)
            self.assertEqual(wire[4], flags)
            self.assertEqual(codec.decode_connector_handshake(wire)[0], hs)

    def test_unused_flag_bits_and_padding_ignored(self):
        wire = bytearray(codec.encode_connector_handshake(ConnectorHandshake("ab", 2, 2, True)))
        wire[5] = 0xF8 | wire[5]
        wire[6:8] = b"\xff\xff"
        hs, used = codec.decode_connector_handshake(bytes(wire))
        self.assertEqual(hs, ConnectorHandshake("ab", 2, 2, True))

    def test_incomplete(self):
        wire = codec.encode_connector_handshake(ConnectorHandshake("abcdef", 1, 1, epoch=9,
                                                                   link_id=3))
        for n in range(len(wire)):
            self.assertIsNone(codec.decode_connector_handshake(wire[:n]))

    def test_listener_reply(self):
        wire = h("0807060504030201 2a00000000000000")
        self.assertEqual(codec.encode_listener_reply(0x0102030405060708, 42), wire)
        self.assertEqual(codec.decode_listener_reply(wire), (0x0102030405060708, 42))

    def test_malformed_handshakes(self):
        good = codec.encode_connector_handshake(ConnectorHandshake("ab", 1, 1))
        cases = {
            "bad utf-8": h("02 ff fe 01 01 00 00 00") + bytes(16),
            "id size 9": h("02 6162 09 01 00 00 00") + bytes(16),
            "listener id size 200": h("02 6162 01 c8 00 00 00") + bytes(16),
            "epoch >= 2^63": good[:8] + h("0000000000000080") + bytes(8),
            "link id >= 2^63": good[:16] + h("ffffffffffffffff"),
        }
        for why, wire in cases.items():
            with self.assertRaises(ProtocolError, msg=why):
                codec.decode_connector_handshake(wire)
        self.assertRaises(ProtocolError, codec.decode_listener_reply,
                          h("0000000000000080") + bytes(8))
        self.assertRaises(ProtocolError, codec.decode_version, bytes(7))
        limits = codec.Limits(max_endpoint_name=1)
        self.assertRaises(ProtocolError, codec.decode_connector_handshake, good, limits)

    @given(st.text(max_size=40).filter(lambda s: len(s.encode()) < 256),
           st.integers(0, 8), st.integers(0, 8), st.booleans(), st.booleans(), st.booleans(),
           st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1))
    def test_round_trip(self, name, cs, ls, ct, lt, req, epoch, link_id):
        hs = ConnectorHandshake(name, cs, ls, ct, lt, req, epoch, link_id)
        wire = codec.encode_connector_handshake(hs)
        self.assertEqual((8 + len(wire)) % 8, 0)
        self.assertEqual(codec.decode_connector_handshake(wire + b"extra"), (hs, len(wire)))

    @given(st.binary(max_size=300))
    def test_fuzz(self, data):
        try:
            codec.decode_connector_handshake(data)
        except ProtocolError:
            pass


class PacketVectors(SynchronousTestCase):
    def check(self, packet, wire, forward=0, reverse=0):
        self.assertEqual(len(wire) % 8, 0)
        self.assertEqual(codec.encode_packet(packet, forward, reverse), wire)
        self.assertEqual(decode_all(wire, forward, reverse), ([packet], len(wire)))

    def test_general(self):
        for ptype, first in enumerate([0x00, 0x20, 0x40, 0x60, 0x80]):
            self.check(Packet(GENERAL, ptype), bytes([first]) + bytes(7))

    def test_nop_is_eight_zero_bytes(self):
        self.assertEqual(codec.encode_general(codec.NOP), bytes(8))
        packets, end = decode_all(bytes(24))
        self.assertEqual([p.ptype for p in packets], [codec.NOP] * 3)

    def test_channel_op_two_byte_id(self):
        # c=1, m=0, format 0, type close (2): 0x01 | 2 << 5
        self.check(Packet(CHANNEL_OP, codec.CLOSE, (0x1234,)), h("41 00 3412 00000000"),
                   forward=2)
        self.check(Packet(CHANNEL_OP, codec.COMMIT, (0x1234,)), h("01 00 3412 00000000"),
                   forward=2)
        self.check(Packet(CHANNEL_OP, codec.ROLLBACK, (0x1234,)), h("21 00 3412 00000000"),
                   forward=2)

    def test_channel_ack_id_sizes(self):
        # acks use the reverse id size
        self.check(Packet(CHANNEL_ACK, codec.CONSUMED, (0,)), h("25 00 000000000000"))
        self.check(Packet(CHANNEL_ACK, codec.RECEIVED, (0xAB,)), h("05 00 ab 0000000000"),
                   forward=8, reverse=1)
        self.check(Packet(CHANNEL_ACK, codec.CLOSED, (0x0102,)), h("85 00 0201 00000000"),
                   reverse=2)
        self.check(Packet(CHANNEL_ACK, codec.UNCOMMITTED, (0x0102030405060708,)),
                   h("65 00 0807060504030201 000000000000"), reverse=8)
        self.check(Packet(CHANNEL_ACK, codec.COMMITTED, (5,)), h("45 00 05 0000000000"),
                   reverse=1)

    def test_sequence_ack_eight_byte_id(self):
        # the spec's diagram: id in bytes 2..9, padding 10..11, sequence 12..15
        self.check(Packet(SEQUENCE_ACK, codec.CONSUMED, (0x0102030405060708,), False,
                          0xDEADBEEF),
                   h("2d 00 0807060504030201 0000 efbeadde"), reverse=8)

    def test_sequence_op_sizes(self):
        self.check(Packet(SEQUENCE_OP, codec.ROLLBACK, (0,), False, 7), h("29 00 0000 07000000"))
        self.check(Packet(SEQUENCE_OP, codec.COMMIT, (9,), False, 5), h("09 00 09 00 05000000"),
                   forward=1)
        self.check(Packet(SEQUENCE_OP, codec.COMMIT, (0x0201,), False, 1),
                   h("09 00 0102 01000000"), forward=2)
        self.check(Packet(SEQUENCE_ACK, codec.UNCOMMITTED, (0x030201,), False, 2**32 - 1),
                   h("6d 00 010203 000000 ffffffff 00000000"), reverse=3)

    def test_multicast_channel_packets(self):
        self.check(Packet(CHANNEL_ACK, codec.CLOSED, (1, 2), True),
                   h("87 00 0000 02000000 0100 0200 00000000"), reverse=2)
        self.check(Packet(SEQUENCE_OP, codec.COMMIT, (1, 2, 3), True, 9),
                   h("0b 00 0000 03000000 01 02 03 00 09000000"), forward=1)
        # id size 0: the count alone says how many times
        self.check(Packet(CHANNEL_OP, codec.CLOSE, (0, 0, 0), True), h("43 00 0000 03000000"))
        # a multicast to one channel stays multicast
        self.check(Packet(CHANNEL_OP, codec.CLOSE, (7,), True),
                   h("43 00 0000 01000000 07 0000000000000000000000")[:16], forward=1)

    def test_message_three_part_example(self):
        # the spec's short, small example: 1-byte id, parts of 3, 0 and 5 bytes
        wire = h("11 03 2a 00 0300 0000 0500 000000000000"
                 "616263 0000000000"
                 "68656c6c6f 000000")
        self.assertEqual(len(wire), 32)
        self.check(Packet(MESSAGE, 0, (42,), False, None, (b"abc", b"", b"hello")), wire,
                   forward=1)

    def test_message_id_sizes(self):
        one = (b"xyz",)
        data = h("78797a 0000000000")
        self.check(Packet(MESSAGE, 0, (0,), False, None, one), h("11 01 0300 00000000") + data)
        self.check(Packet(MESSAGE, 0, (5,), False, None, one),
                   h("11 01 05 00 0300 0000") + data, forward=1)
        self.check(Packet(MESSAGE, 0, (0x0201,), False, None, one),
                   h("11 01 0102 0300 0000") + data, forward=2)
        # an odd id size is padded to 2 before the sizes (the Go writer
        # omitted this pad: the spec wins)
        self.check(Packet(MESSAGE, 0, (0x07060504030201,), False, None, one),
                   h("11 01 01020304050607 00 0300 00000000") + data, forward=7)
        self.check(Packet(MESSAGE, 0, (0x0807060504030201,), False, None, one),
                   h("11 01 0102030405060708 0300 00000000") + data, forward=8)

    def test_message_long_large_multicast_example(self):
        # the spec's long, large example: multicast to 2 channels with 4-byte
        # ids, 2 parts
        parts = (b"a" * 9, b"b")
        head = h("73 00 0000 02000000 0a000000 0b000000 02000000 00000000"
                 "0900000000000000 0100000000000000")
        wire = head + b"a" * 9 + bytes(7) + b"b" + bytes(7)
        self.check(Packet(MESSAGE, LONG | LARGE, (10, 11), True, None, parts), wire, forward=4)

    def test_message_long_small_and_short_large(self):
        parts = (b"12",)
        self.check(Packet(MESSAGE, LONG, (3,), False, None, parts),
                   h("31 00 03 00 01000000 0200 000000000000") + b"12" + bytes(6), forward=1)
        self.check(Packet(MESSAGE, LARGE, (0x0403,), False, None, parts),
                   h("51 01 0304 00000000 0200000000000000") + b"12" + bytes(6), forward=2)

    def test_empty_message(self):
        self.check(Packet(MESSAGE, 0, (1,), False, None, ()), h("11 00 01 00 00000000"),
                   forward=1)

    def test_automatic_long_and_large(self):
        wire = codec.encode_message((1,), [b"x"] * 256, 1)
        self.assertEqual(wire[0], 0x31)
        wire = codec.encode_message((1,), [b"x" * 65536], 1)
        self.assertEqual(wire[0], 0x51)
        self.assertRaises(ValueError, codec.encode_message, (1,), [b"x"] * 256, 1, long=False)
        self.assertRaises(ValueError, codec.encode_message, (1,), [b"x" * 65536], 1,
                          large=False)
        self.assertRaises(ValueError, codec.encode_message, (256,), [b"x"], 1)
        self.assertRaises(ValueError, codec.encode_message, (1,), [b"x"], 0)

    def test_padding_ignored_on_receipt(self):
        wire = bytearray(h("11 03 2a ff 0300 0000 0500 ffffffffffff"
                           "616263 ffffffffff 68656c6c6f ffffff"))
        packets, _ = decode_all(bytes(wire), 1)
        self.assertEqual(packets[0].parts, (b"abc", b"", b"hello"))
        # the short length byte of non-message packets is unused
        packets, _ = decode_all(h("41 ff 3412 ffffffff"), 2)
        self.assertEqual(packets, [Packet(CHANNEL_OP, codec.CLOSE, (0x1234,))])
        # the third message flag bit is unused
        packets, _ = decode_all(h("91 01 0300 00000000 78797a 0000000000"))
        self.assertEqual(packets, [Packet(MESSAGE, 0, (0,), False, None, (b"xyz",))])
        # general packets: every bit but the type is unused
        packets, _ = decode_all(h("9e ffffffffffffff"))
        self.assertEqual(packets, [Packet(GENERAL, codec.SHUTDOWN)])

    def test_unicast_encoder_matches(self):
        for size in range(9):
            out = []
            payloads = [b"", b"a", b"hello world!", b"x" * 70000, (b"a", b"bc"), (),
                        (b"x" * 70000, b"y"), (b"p",) * 300, (b"one",), (b"", b"", b"")]
            codec.UnicastMessageEncoder(min(200, codec.max_channel_id(size)), size).encode(
                payloads, out)
            expected = b"".join(codec.encode_message(
                (min(200, codec.max_channel_id(size)),),
                (p,) if isinstance(p, bytes) else p, size) for p in payloads)
            self.assertEqual(b"".join(out), expected)


class MalformedPackets(SynchronousTestCase):
    def test_unknown_general_types(self):
        for ptype in (5, 6, 7):
            self.assertRaises(ProtocolError, decode_all, bytes([ptype << 5]) + bytes(7))

    def test_unknown_channel_formats(self):
        for fmt in (5, 6, 7):
            self.assertRaises(ProtocolError, decode_all, bytes([1 | fmt << 2]) + bytes(7))

    def test_unknown_operation_and_ack_types(self):
        for kind, first_bad in [(CHANNEL_OP, 3), (CHANNEL_ACK, 5), (SEQUENCE_OP, 2),
                                (SEQUENCE_ACK, 4)]:
            for ptype in range(first_bad, 8):
                wire = bytes([1 | kind << 2 | ptype << 5]) + bytes(7)
                self.assertRaises(ProtocolError, decode_all, wire)

    def test_limits(self):
        limits = codec.Limits(max_parts=2, max_part_size=10, max_message_size=24,
                              max_multicast=2)
        too_many = codec.encode_message((0,), [b"a"] * 3, 1)
        too_big = codec.encode_message((0,), [b"a" * 11], 1)
        too_much = codec.encode_message((0,), [b"a" * 10, b"b" * 10], 1)
        too_wide = codec.encode_channel_packet(CHANNEL_OP, codec.CLOSE, (1, 2, 3), 1)
        for wire in (too_many, too_big, too_much, too_wide):
            self.assertRaises(ProtocolError, decode_all, wire, 1, 1, limits)
        # the limits are checked before the bytes arrive: no waiting for 4 GiB
        huge = h("31 00 01 00 ffffffff")
        self.assertRaises(ProtocolError, decode_all, huge, 1)
        huge = h("51 01 01 00 00000000 ffffffffffffffff")
        self.assertRaises(ProtocolError, decode_all, huge, 1)

    def test_incomplete_is_not_an_error(self):
        wire = codec.encode_message((7,), (b"abc", b"", b"hello"), 1)
        for n in range(len(wire)):
            self.assertEqual(decode_all(wire[:n], 1), ([], 0))


def packet_strategy(forward, reverse):
    def ids(size):
        return st.integers(0, codec.max_channel_id(size))

    def channels(size):
        return st.one_of(
            st.tuples(ids(size)).map(lambda c: (c, False)),
            st.lists(ids(size), max_size=5).map(lambda cs: (tuple(cs), True)))

    general = st.integers(0, 4).map(lambda t: Packet(GENERAL, t))

    def channel_packet(kind, types, with_seq):
        size = reverse if kind & 1 else forward
        return st.builds(
            lambda t, c, s: Packet(kind, t, c[0], c[1], s if with_seq else None),
            st.integers(0, types - 1), channels(size), st.integers(0, 2**32 - 1))

    def message(flags_parts):
        flags, parts = flags_parts
        return channels(forward).map(lambda c: Packet(MESSAGE, flags, c[0], c[1], None, parts))

    parts = st.lists(st.binary(max_size=40), max_size=6).map(tuple)
    messages = st.tuples(st.integers(0, 3), parts).flatmap(message)
    return st.one_of(general, channel_packet(CHANNEL_OP, 3, False),
                     channel_packet(CHANNEL_ACK, 5, False),
                     channel_packet(SEQUENCE_OP, 2, True),
                     channel_packet(SEQUENCE_ACK, 4, True), messages)


@st.composite
def packet_stream(draw):
    forward = draw(st.integers(0, 8))
    reverse = draw(st.integers(0, 8))
    packets = draw(st.lists(packet_strategy(forward, reverse), max_size=8))
    return forward, reverse, packets


class RoundTrips(SynchronousTestCase):
    @settings(max_examples=300)
    @given(packet_stream(), st.data())
    def test_round_trip_and_any_split(self, stream, data):
        forward, reverse, packets = stream
        wire = b"".join(codec.encode_packet(p, forward, reverse) for p in packets)
        self.assertEqual(len(wire) % 8, 0)
        self.assertEqual(decode_all(wire, forward, reverse), (packets, len(wire)))
        # fed in two arbitrary pieces, an incremental decoder gets the same
        cut = data.draw(st.integers(0, len(wire)))
        buf = bytearray(wire[:cut])
        first, offset = codec.decode_packets(buf, 0, len(buf), forward, reverse)
        buf += wire[cut:]
        rest, end = codec.decode_packets(buf, offset, len(buf), forward, reverse)
        self.assertEqual((first + rest, end), (packets, len(wire)))

    @settings(max_examples=500)
    @given(st.binary(max_size=200), st.integers(0, 8), st.integers(0, 8))
    def test_fuzz_only_protocol_errors(self, data, forward, reverse):
        try:
            packets, offset = decode_all(data, forward, reverse)
        except ProtocolError:
            return
        self.assertLessEqual(offset, len(data))
        # what decodes re-encodes to something that decodes the same
        again = b"".join(codec.encode_packet(p, forward, reverse) for p in packets)
        self.assertEqual(decode_all(again, forward, reverse)[0], packets)

    @given(st.lists(st.one_of(st.binary(max_size=100),
                              st.lists(st.binary(max_size=30), max_size=5).map(tuple)),
                    max_size=20), st.integers(0, 8))
    def test_unicast_encoder(self, payloads, size):
        out = []
        codec.UnicastMessageEncoder(codec.max_channel_id(size), size).encode(payloads, out)
        packets, _ = decode_all(b"".join(out), size)
        self.assertEqual([p.parts for p in packets],
                         [(p,) if isinstance(p, bytes) else p for p in payloads])
        self.assertEqual({p.channels for p in packets} or {(codec.max_channel_id(size),)},
                         {(codec.max_channel_id(size),)})


class SequencePacking(SynchronousTestCase):
    def test_struct_layout_assumptions(self):
        # sizes are little-endian u16 / u64, sequence numbers u32
        wire = codec.encode_sequence_packet(SEQUENCE_ACK, codec.RECEIVED, (1,), 0x01020304, 4)
        self.assertEqual(struct.unpack_from("<I", wire, 8)[0], 0x01020304)


@st.composite
def chunked(draw, wire):
    """C{wire} cut at arbitrary points, each piece as bytes, bytearray or memoryview."""
    cuts = sorted(draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    kinds = (bytes, bytearray, memoryview)
    pieces = []
    for start, end in zip([0] + cuts, cuts + [len(wire)]):
        pieces.append(draw(st.sampled_from(kinds))(wire[start:end]))
    return pieces


def feed_all(decoder, pieces):
    packets = []
    for piece in pieces:
        packets += decoder.feed(piece)
    return packets


class Decoder(SynchronousTestCase):
    """
    L{codec.PacketDecoder}: the packets of a stream do not depend on how it
    is cut into reads, and it holds at most C{max_length} bytes of an
    incomplete packet.
    """

    @settings(max_examples=300)
    @given(packet_stream(), st.data())
    def test_any_chunking_gives_the_whole_stream_packets(self, stream, data):
        forward, reverse, packets = stream
        wire = b"".join(codec.encode_packet(p, forward, reverse) for p in packets)
        whole = codec.PacketDecoder(forward, reverse)
        self.assertEqual(whole.feed(wire), packets)
        self.assertEqual(whole.buffered, 0)
        decoder = codec.PacketDecoder(forward, reverse)
        self.assertEqual(feed_all(decoder, data.draw(chunked(wire))), packets)
        self.assertEqual(decoder.buffered, 0)

    @settings(max_examples=200)
    @given(packet_stream(), st.data())
    def test_incomplete_tail_is_held(self, stream, data):
        forward, reverse, packets = stream
        wires = [codec.encode_packet(p, forward, reverse) for p in packets]
        wire = b"".join(wires)
        cut = data.draw(st.integers(0, len(wire)))
        decoder = codec.PacketDecoder(forward, reverse)
        got = feed_all(decoder, data.draw(chunked(wire[:cut])))
        # the packets that end at or before the cut
        complete = whole = 0
        while whole < len(wires) and complete + len(wires[whole]) <= cut:
            complete += len(wires[whole])
            whole += 1
        self.assertEqual(got, packets[:whole])
        self.assertEqual(decoder.buffered, cut - complete)
        # the rest completes the stream
        self.assertEqual(got + decoder.feed(wire[cut:]), packets)

    def test_large_messages_in_small_reads(self):
        # tails past 256 KiB grow in place (and are cut past 64 KiB decoded)
        # instead of being joined to every read
        messages = [(b"a" * 300000,), (b"b" * 7, b"c" * 70000), (b"",), (b"d" * 600001,)]
        wire = b"".join(codec.encode_message((3,), m, 2) for m in messages)
        for size in (1, 8, 4096, 65537, 262144, 300017, len(wire)):
            decoder = codec.PacketDecoder(2, 2)
            pieces = [wire[i:i + size] for i in range(0, len(wire), size)]
            if size == 1:
                pieces = pieces[:4096] + [wire[4096:]]   # enough to cross every path
            got = feed_all(decoder, pieces)
            self.assertEqual([p.parts for p in got], messages, size)
            self.assertEqual(decoder.buffered, 0)

    def test_default_bound(self):
        limits = codec.Limits(max_message_size=1000)
        decoder = codec.PacketDecoder(1, 2, limits)
        self.assertEqual(decoder.max_length, 1000 + codec.HEADER_SLACK)
        self.assertEqual((decoder.forward_id_size, decoder.reverse_id_size), (1, 2))

    @settings(max_examples=200)
    @given(st.lists(st.binary(max_size=60), min_size=1, max_size=12), st.integers(16, 64),
           st.data())
    def test_bound_in_bytes(self, payloads, max_length, data):
        wires = [codec.encode_message((1,), (p,), 1) for p in payloads]
        # packets of at most max_length bytes pass, however they are cut
        fitting = b"".join(w for w in wires if len(w) <= max_length)
        decoder = codec.PacketDecoder(1, 1, max_length=max_length)
        got = feed_all(decoder, data.draw(chunked(fitting)))
        self.assertEqual(len(got), sum(len(w) <= max_length for w in wires))
        # more than max_length bytes of one packet are refused, however cut
        big = codec.encode_message((1,), (bytes(max_length),), 1)
        decoder = codec.PacketDecoder(1, 1, max_length=max_length)
        pieces = data.draw(chunked(fitting + big[:max_length + 1]))
        self.assertRaises(ProtocolError, feed_all, decoder, pieces)

    @settings(max_examples=100)
    @given(st.integers(0, 3), st.data())
    def test_over_the_limits_refused_however_cut(self, which, data):
        limits = codec.Limits(max_parts=2, max_part_size=10, max_message_size=24,
                              max_multicast=2)
        wire = [codec.encode_message((0,), [b"a"] * 3, 1),
                codec.encode_message((0,), [b"a" * 11], 1),
                codec.encode_message((0,), [b"a" * 10, b"b" * 10], 1),
                codec.encode_channel_packet(CHANNEL_OP, codec.CLOSE, (1, 2, 3), 1)][which]
        ok = codec.encode_message((0,), [b"ok"], 1)
        decoder = codec.PacketDecoder(1, 1, limits)
        self.assertRaises(ProtocolError, feed_all, decoder, data.draw(chunked(ok + wire)))
