"""
Sans-IO codec for the Relink protocol, version 0.

Bytes in, packets out, and back; no I/O, no clock, no Twisted.  Everything is
little-endian; padding is written as zero and ignored when read; unknown
enumeration values raise L{ProtocolError}, which is the only exception
arbitrary input can raise.

Channel id spaces: the ids in message, channel operation and sequence
operation packets (even channel formats) belong to the channel's sender;
acknowledgements (odd formats) name the same channel, so they travel in the
opposite direction.  A packet stream therefore has two id sizes: the
I{forward} size (channels whose messages flow in this stream's direction)
and the I{reverse} size (channels acknowledged in this stream).  For the
stream a connector writes, forward is the connector's channel id size and
reverse the listener's.

Decoded packets are L{Packet} tuples (built with C{tuple.__new__} on the hot
path, so decoding a message costs one tuple, not an object graph).
"""

import struct
from dataclasses import dataclass
from typing import NamedTuple

PROTOCOL_VERSION = 0
MAX_ID_SIZE = 8
SEQ_MASK = 0xFFFFFFFF

# Packet kinds: the channel packet formats 0..4, and general packets.
CHANNEL_OP = 0
CHANNEL_ACK = 1
SEQUENCE_OP = 2
SEQUENCE_ACK = 3
MESSAGE = 4
GENERAL = 5

KIND_NAMES = {
    CHANNEL_OP: "channel-op", CHANNEL_ACK: "channel-ack", SEQUENCE_OP: "sequence-op",
    SEQUENCE_ACK: "sequence-ack", MESSAGE: "message", GENERAL: "general",
}

# General packet types.
NOP, PING, PONG, RESUME, SHUTDOWN = range(5)
GENERAL_TYPES = ("nop", "ping", "pong", "resume", "shutdown")

# Operation types (channel and sequence operations share values).
COMMIT, ROLLBACK, CLOSE = range(3)
OP_TYPES = ("commit", "rollback", "close")

# Acknowledgement types (channel and sequence acks share values).
RECEIVED, CONSUMED, COMMITTED, UNCOMMITTED, CLOSED = range(5)
ACK_TYPES = ("received", "consumed", "committed", "uncommitted", "closed")

# How many packet types each kind allows; anything above is a protocol error.
_TYPE_COUNT = {GENERAL: 5, CHANNEL_OP: 3, CHANNEL_ACK: 5, SEQUENCE_OP: 2, SEQUENCE_ACK: 4}

# Message flags (packet format-specific data of message packets).
LONG = 1
LARGE = 2

# Handshake flags.
CONNECTOR_TRANSACTIONS = 1
LISTENER_TRANSACTIONS = 2
REQUIRE_OLD_LINK = 4

_ZERO = bytes(8)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HDR_U32 = struct.Struct("<BBxxI")        # multicast: header, padding, id count
_HS_TAIL = struct.Struct("<QQ")            # epoch, link id


class ProtocolError(Exception):
    """The peer broke the protocol; the connection must be terminated."""


class Packet(NamedTuple):
    """
    One decoded packet.

    @ivar kind: L{GENERAL}, L{CHANNEL_OP}, L{CHANNEL_ACK}, L{SEQUENCE_OP},
        L{SEQUENCE_ACK} or L{MESSAGE}.
    @ivar ptype: the packet type (general, operation or acknowledgement
        type), or the message flags (L{LONG}, L{LARGE}) of a message.
    @ivar channels: tuple of channel ids (ints); empty for general packets.
    @ivar multicast: whether the packet used the multicast layout.
    @ivar seq: the u32 sequence number of sequence packets, else None.
    @ivar parts: tuple of payload parts (bytes) of a message, else None.
    """
    kind: int
    ptype: int
    channels: tuple = ()
    multicast: bool = False
    seq: int | None = None
    parts: tuple | None = None


_new = tuple.__new__


@dataclass(frozen=True)
class Limits:
    """Bounds on what a decoder accepts (the spec's theoretical maxima are huge)."""
    max_parts: int = 1024
    max_part_size: int = 16 * 1024 * 1024
    max_message_size: int = 16 * 1024 * 1024
    max_multicast: int = 4096
    max_endpoint_name: int = 255


DEFAULT_LIMITS = Limits()


def _pad(n, align):
    return -n % align


# -- channel ids -------------------------------------------------------------

_ID_STRUCTS = {1: struct.Struct("<B"), 2: struct.Struct("<H"), 4: struct.Struct("<I"),
               8: struct.Struct("<Q")}


def check_id_size(size):
    if not 0 <= size <= MAX_ID_SIZE:
        raise ProtocolError(f"channel id size {size} not in 0..8")


def encode_channel_id(channel, size):
    if not 0 <= channel <= max_channel_id(size):
        raise ValueError(f"channel id {channel} does not fit in {size} bytes")
    return channel.to_bytes(size, "little")


def max_channel_id(size):
    return (1 << (8 * size)) - 1


# -- handshake ---------------------------------------------------------------

def encode_version(version=PROTOCOL_VERSION):
    """The 8-byte version transmission of either peer."""
    return struct.pack("<B7x", version)


def decode_version(data):
    """The version from an 8-byte version transmission (padding ignored)."""
    if len(data) != 8:
        raise ProtocolError("version transmission must be 8 bytes")
    return data[0]


@dataclass(frozen=True)
class ConnectorHandshake:
    """What the connector sends after the version exchange."""
    endpoint: str
    connector_id_size: int = 0
    listener_id_size: int = 0
    connector_transactions: bool = False
    listener_transactions: bool = False
    require_old_link: bool = False
    epoch: int = 0
    link_id: int = 0

    @property
    def flags(self):
        return (CONNECTOR_TRANSACTIONS * self.connector_transactions
                | LISTENER_TRANSACTIONS * self.listener_transactions
                | REQUIRE_OLD_LINK * self.require_old_link)


def encode_connector_handshake(hs):
    """
    The connector's transmission after the version exchange.  The epoch is
    aligned to 8 bytes counted from the stream start; the version block is 8
    bytes, so counting from here gives the same padding.
    """
    name = hs.endpoint.encode("utf-8")
    if len(name) > 255:
        raise ValueError("endpoint name longer than 255 bytes")
    for size in (hs.connector_id_size, hs.listener_id_size):
        if not 0 <= size <= MAX_ID_SIZE:
            raise ValueError("channel id size must be 0..8")
    if not (0 <= hs.epoch < 1 << 63 and 0 <= hs.link_id < 1 << 63):
        raise ValueError("epoch and link id must be in [0, 2^63[")
    head = bytes((len(name),)) + name + bytes((hs.connector_id_size, hs.listener_id_size,
                                               hs.flags))
    return head + bytes(_pad(len(head), 8)) + _HS_TAIL.pack(hs.epoch, hs.link_id)


def decode_connector_handshake(buf, limits=DEFAULT_LIMITS):
    """
    Parse the connector's handshake from the start of C{buf} (the bytes
    after the version block).

    @return: C{(ConnectorHandshake, consumed)}, or None if C{buf} holds too
        little yet.
    """
    if not buf:
        return None
    n = buf[0]
    head = 1 + n + 3
    total = head + _pad(head, 8) + 16
    if len(buf) < total:
        return None
    if n > limits.max_endpoint_name:
        raise ProtocolError("endpoint name too long")
    try:
        name = bytes(buf[1:1 + n]).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("endpoint name is not valid UTF-8")
    csize, lsize, flags = buf[1 + n], buf[2 + n], buf[3 + n]
    check_id_size(csize)
    check_id_size(lsize)
    epoch, link_id = _HS_TAIL.unpack_from(buf, total - 16)
    if epoch >= 1 << 63 or link_id >= 1 << 63:
        raise ProtocolError("epoch or link id out of range")
    hs = ConnectorHandshake(name, csize, lsize, bool(flags & CONNECTOR_TRANSACTIONS),
                            bool(flags & LISTENER_TRANSACTIONS), bool(flags & REQUIRE_OLD_LINK),
                            epoch, link_id)
    return hs, total


def encode_listener_reply(epoch, link_id):
    """The listener's 16-byte transmission after the version exchange."""
    return _HS_TAIL.pack(epoch, link_id)


def decode_listener_reply(data):
    """@return: C{(epoch, link_id)} from 16 bytes."""
    if len(data) != 16:
        raise ProtocolError("listener reply must be 16 bytes")
    epoch, link_id = _HS_TAIL.unpack_from(data, 0)
    if epoch >= 1 << 63 or link_id >= 1 << 63:
        raise ProtocolError("epoch or link id out of range")
    return epoch, link_id


# -- packet encoding ---------------------------------------------------------

def _channel_block(channels, id_size, multicast):
    """The bytes after the 2-byte header that name the channel(s)."""
    if multicast:
        ids = b"".join(encode_channel_id(c, id_size) for c in channels)
        return b"\0\0" + _U32.pack(len(channels)) + ids
    if len(channels) != 1:
        raise ValueError("unicast needs exactly one channel")
    return encode_channel_id(channels[0], id_size)


def _multicast(channels, multicast):
    return len(channels) != 1 if multicast is None else multicast


def encode_general(ptype):
    if not 0 <= ptype < 5:
        raise ValueError("unknown general packet type")
    return bytes((ptype << 5,)) + bytes(7)


def encode_channel_packet(kind, ptype, channels, id_size, multicast=None):
    """A channel operation or acknowledgement packet."""
    if kind not in (CHANNEL_OP, CHANNEL_ACK) or not 0 <= ptype < _TYPE_COUNT[kind]:
        raise ValueError("bad channel packet kind or type")
    mc = _multicast(channels, multicast)
    body = bytes((1 | mc << 1 | kind << 2 | ptype << 5, 0)) + _channel_block(channels, id_size, mc)
    return body + _ZERO[:_pad(len(body), 8)]


def encode_sequence_packet(kind, ptype, channels, seq, id_size, multicast=None):
    """A sequence operation or acknowledgement packet."""
    if kind not in (SEQUENCE_OP, SEQUENCE_ACK) or not 0 <= ptype < _TYPE_COUNT[kind]:
        raise ValueError("bad sequence packet kind or type")
    mc = _multicast(channels, multicast)
    body = bytes((1 | mc << 1 | kind << 2 | ptype << 5, 0)) + _channel_block(channels, id_size, mc)
    body += _ZERO[:_pad(len(body), 4)] + _U32.pack(seq & SEQ_MASK)
    return body + _ZERO[:_pad(len(body), 8)]


def encode_message(channels, parts, id_size, multicast=None, long=None, large=None):
    """
    A message packet.  Short/long and small/large are chosen to fit unless
    forced (a short message can have at most 255 parts, a small one parts of
    at most 65535 bytes).
    """
    n = len(parts)
    sizes = [len(p) for p in parts]
    if long is None:
        long = n > 255
    elif not long and n > 255:
        raise ValueError("a short message has at most 255 parts")
    if large is None:
        large = bool(sizes) and max(sizes) > 0xFFFF
    elif not large and sizes and max(sizes) > 0xFFFF:
        raise ValueError("a small message has parts of at most 65535 bytes")
    mc = _multicast(channels, multicast)
    out = [bytes((1 | mc << 1 | MESSAGE << 2 | (long | large << 1) << 5, 0 if long else n)),
           _channel_block(channels, id_size, mc)]
    length = 2 + len(out[1])
    if length & 1:
        out.append(b"\0")
        length += 1
    if long:
        out.append(_U32.pack(n))
        length += 4
    if large:
        p = _pad(length, 8)
        out.append(_ZERO[:p] + struct.pack(f"<{n}Q", *sizes))
        length += p + 8 * n
    else:
        out.append(struct.pack(f"<{n}H", *sizes))
        length += 2 * n
        out.append(_ZERO[:_pad(length, 8)])
    for part, size in zip(parts, sizes):
        out.append(part)
        out.append(_ZERO[:-size % 8])
    return b"".join(out)


def encode_packet(packet, forward_id_size, reverse_id_size):
    """Encode a L{Packet} exactly as described (used for round trips)."""
    kind = packet.kind
    if kind == GENERAL:
        return encode_general(packet.ptype)
    size = reverse_id_size if kind & 1 else forward_id_size
    if kind in (CHANNEL_OP, CHANNEL_ACK):
        return encode_channel_packet(kind, packet.ptype, packet.channels, size, packet.multicast)
    if kind in (SEQUENCE_OP, SEQUENCE_ACK):
        return encode_sequence_packet(kind, packet.ptype, packet.channels, packet.seq, size,
                                      packet.multicast)
    if kind == MESSAGE:
        return encode_message(packet.channels, packet.parts, size, packet.multicast,
                              bool(packet.ptype & LONG), bool(packet.ptype & LARGE))
    raise ValueError("unknown packet kind")


class UnicastMessageEncoder:
    """
    Encodes runs of single-part small messages to one channel: the hot path
    of a bulk send.  The header and channel id bytes are computed once.
    """

    def __init__(self, channel, id_size):
        self.channel = channel
        self.id_size = id_size
        self.prefix_base = bytes((1 | MESSAGE << 2, 1)) + encode_channel_id(channel, id_size)
        # after header + id: pad to 2, then one u16 size, then pad to 8
        self.size_offset = len(self.prefix_base) + (len(self.prefix_base) & 1)
        self.data_offset = self.size_offset + 2 + _pad(self.size_offset + 2, 8)
        self._multi = {}

    def _multi_head(self, n):
        """For a short, small message of n parts: header, size packer, padding."""
        head = bytes((1 | MESSAGE << 2, n)) + self.prefix_base[2:]
        head += bytes(len(head) & 1)
        pad = bytes(_pad(len(head) + 2 * n, 8))
        return head, struct.Struct(f"<{n}H").pack, pad

    def encode(self, payloads, out):
        """
        Append the encoded packets for C{payloads} to list C{out}: each is
        bytes (a one-part message) or a tuple of parts.
        """
        base = self.prefix_base + bytes(self.size_offset - len(self.prefix_base))
        tail_pad = bytes(self.data_offset - self.size_offset - 2)
        pack = _U16.pack
        zero = _ZERO
        append = out.append
        multi = self._multi
        for p in payloads:
            if type(p) is not bytes:
                if len(p) != 1:
                    n = len(p)
                    sizes = [len(x) for x in p]
                    if n > 255 or (sizes and max(sizes) > 0xFFFF):
                        append(encode_message((self.channel,), p, self.id_size))
                        continue
                    head = multi.get(n)
                    if head is None:
                        head = multi[n] = self._multi_head(n)
                    append(head[0])
                    append(head[1](*sizes))
                    append(head[2])
                    for x, size in zip(p, sizes):
                        append(x)
                        pad = -size & 7
                        if pad:
                            append(zero[:pad])
                    continue
                p = p[0]
            size = len(p)
            if size > 0xFFFF:
                append(encode_message((self.channel,), (p,), self.id_size))
                continue
            append(base + pack(size) + tail_pad)
            append(p)
            pad = -size & 7
            if pad:
                append(zero[:pad])


# -- packet decoding ---------------------------------------------------------

def _read_id(buf, offset, size, _structs=_ID_STRUCTS):
    if size == 0:
        return 0
    s = _structs.get(size)
    if s is not None:
        return s.unpack_from(buf, offset)[0]
    return int.from_bytes(buf[offset:offset + size], "little")


def _fast_message_layout(size):
    """
    For unicast, short, small, one-part messages (the common case): one
    struct reading the channel id and the part size, and the data offset.
    """
    idfmt = {0: "", 1: "B", 2: "H", 4: "I", 8: "Q"}.get(size)
    if idfmt is None:
        return None
    size_at = 2 + size + ((2 + size) & 1)
    data_at = size_at + 2 + _pad(size_at + 2, 8)
    fmt = "<2x" + idfmt + "x" * (size_at - 2 - size) + "H"
    return struct.Struct(fmt).unpack_from, data_at


_FAST = {size: _fast_message_layout(size) for size in range(MAX_ID_SIZE + 1)}


_U16_VECTORS = {}
_U64_VECTORS = {}


def _vector(cache, code, n):
    """The unpacker of C{n} little-endian C{code}s (cached for the usual sizes)."""
    f = cache.get(n)
    if f is None:
        f = struct.Struct(f"<{n}{code}").unpack_from
        if n <= 1024:
            cache[n] = f
    return f


def _u16_vector(n):
    return _U16_VECTORS.get(n) or _vector(_U16_VECTORS, "H", n)


def _u64_vector(n):
    return _U64_VECTORS.get(n) or _vector(_U64_VECTORS, "Q", n)


def decode_packets(buf, offset, end, forward_id_size, reverse_id_size, limits=DEFAULT_LIMITS,
                   max_packets=1 << 30):
    """
    Decode every whole packet in C{buf[offset:end]}.

    @param buf: bytes, bytearray or memoryview.
    @return: C{(packets, offset)}: a list of L{Packet} and the offset of the
        first byte not consumed (the start of an incomplete packet).
    @raise ProtocolError: on any malformed packet (packets decoded before it
        are lost with it: the connection is going down anyway).
    """
    packets = []
    append = packets.append
    u32 = _U32.unpack_from
    fsize, rsize = forward_id_size, reverse_id_size
    max_parts = limits.max_parts
    max_part = limits.max_part_size
    max_msg = limits.max_message_size
    fast = _FAST[fsize]
    if fast is not None:
        fast_unpack, fast_data = fast
        fast_id = fsize != 0
    else:
        fast_unpack = None
    is_bytes = type(buf) is bytes
    last_cid = last_channels = None
    mv = memoryview(buf)
    try:
        while end - offset >= 8 and len(packets) < max_packets:
            b0 = buf[offset]
            if b0 == 0x11 and fast_unpack is not None and buf[offset + 1] == 1:
                # unicast, short, small message of one part: one unpack
                o = offset + fast_data
                if o > end:
                    break
                if fast_id:
                    cid, s = fast_unpack(buf, offset)
                else:
                    cid = 0
                    s = fast_unpack(buf, offset)[0]
                if s > max_part or s > max_msg:
                    raise ProtocolError(f"message part of {s} bytes exceeds the limit")
                nxt = o + s + (-s & 7)
                if nxt > end:
                    break
                if cid != last_cid:
                    last_cid = cid
                    last_channels = (cid,)
                # slicing bytes copies once; a bytearray goes through the view
                part = buf[o:o + s] if is_bytes else bytes(mv[o:o + s])
                append(_new(Packet, (MESSAGE, 0, last_channels, False, None, (part,))))
                offset = nxt
                continue
            if not b0 & 1:
                ptype = b0 >> 5
                if ptype > 4:
                    raise ProtocolError(f"unknown general packet type {ptype}")
                append(_new(Packet, (GENERAL, ptype, (), False, None, None)))
                offset += 8
                continue
            kind = (b0 >> 2) & 7
            if kind > 4:
                raise ProtocolError(f"unknown channel packet format {kind}")
            size = rsize if kind & 1 else fsize
            ptype = b0 >> 5
            o = offset + 2
            if b0 & 2:
                count = u32(buf, offset + 4)[0]
                if count > limits.max_multicast:
                    raise ProtocolError(f"multicast to {count} channels exceeds the limit")
                o = offset + 8 + count * size
                if o > end:
                    break
                if size:
                    channels = tuple(_read_id(buf, offset + 8 + i * size, size)
                                     for i in range(count))
                else:
                    channels = (0,) * count
                multicast = True
            else:
                # at least 8 bytes are present, and 2 + size <= 10: only an
                # 7- or 8-byte id can reach past the first 8 bytes
                o = offset + 2 + size
                if o > end:
                    break
                channels = (_read_id(buf, offset + 2, size),)
                multicast = False
            if kind == MESSAGE:
                ptype &= LONG | LARGE    # the third flag bit is unused
                o += o & 1
                if ptype & LONG:
                    if o + 4 > end:
                        break
                    n = u32(buf, o)[0]
                    o += 4
                else:
                    n = buf[offset + 1]
                if n > max_parts:
                    raise ProtocolError(f"message of {n} parts exceeds the limit")
                if ptype & LARGE:
                    o += -o & 7
                    if o + 8 * n > end:
                        break
                    sizes = _u64_vector(n)(buf, o)
                    o += 8 * n
                else:
                    if o + 2 * n > end:
                        break
                    sizes = _u16_vector(n)(buf, o)
                    o += 2 * n
                    o += -o & 7
                total = 0
                for s in sizes:
                    if s > max_part:
                        raise ProtocolError(f"message part of {s} bytes exceeds the limit")
                    total += s + (-s & 7)
                if total > max_msg:
                    raise ProtocolError(f"message of {total} bytes exceeds the limit")
                if o + total > end:
                    break
                src = buf if is_bytes else mv
                plist = []
                for s in sizes:
                    plist.append(bytes(src[o:o + s]) if not is_bytes else src[o:o + s])
                    o += s + (-s & 7)
                parts = tuple(plist)
                append(_new(Packet, (MESSAGE, ptype, channels, multicast, None, parts)))
                offset = o
                continue
            if ptype >= _TYPE_COUNT[kind]:
                raise ProtocolError(
                    f"unknown {KIND_NAMES[kind]} type {ptype}")
            if kind >= SEQUENCE_OP:
                o += -o & 3
                if o + 4 > end:
                    break
                seq = u32(buf, o)[0]
                o += 4
            else:
                seq = None
            o += -o & 7
            if o > end:
                break
            append(_new(Packet, (kind, ptype, channels, multicast, seq, None)))
            offset = o
    finally:
        mv.release()
    return packets, offset


#: bytes allowed above C{Limits.max_message_size} in an incomplete packet: its
#: header (channel ids of a multicast, part sizes of a long message)
HEADER_SLACK = 65536

#: an incomplete tail shorter than this is joined to the next read (one copy)
#: so that the decoder slices bytes; a longer one grows in place instead
_JOIN_TAIL = 262144


class PacketDecoder:
    """
    Split one direction of a packet stream into L{Packet}s, whatever the
    sizes of the pieces it arrives in: bytes in, whole packets out (the
    framing half of Twisted's C{IntNStringReceiver}, without the dispatch,
    the transport or the callbacks).

    The usual read holds whole packets and is decoded where it lies, only
    an incomplete tail is kept.  A small tail is joined to the next read so
    that part payloads are sliced from bytes; a large one (a big message
    arriving in pieces) keeps growing in one bytearray, of which the decoded
    head is cut once it passes 64 KiB.

    @ivar forward_id_size: the channel id size of messages and operations
        in this stream (the sender's).
    @ivar reverse_id_size: the channel id size of acknowledgements in this
        stream (the receiver's).
    @ivar limits: the L{Limits} packets are checked against.
    @ivar max_length: the most bytes of an incomplete packet held between
        reads (Twisted's C{MAX_LENGTH}); holding more is a L{ProtocolError}.
    """

    def __init__(self, forward_id_size, reverse_id_size, limits=DEFAULT_LIMITS,
                 max_length=None):
        """
        @param max_length: defaults to C{limits.max_message_size} plus
            L{HEADER_SLACK}.
        """
        self.forward_id_size = forward_id_size
        self.reverse_id_size = reverse_id_size
        self.limits = limits
        if max_length is None:
            max_length = limits.max_message_size + HEADER_SLACK
        self.max_length = max_length
        self._buffer = bytearray()
        self._rpos = 0          # the start of the first undecoded byte in _buffer

    @property
    def buffered(self):
        """Bytes of an incomplete packet held for the next L{feed}."""
        return len(self._buffer) - self._rpos

    def feed(self, data):
        """
        The packets completed by C{data} (bytes, bytearray or memoryview),
        in stream order.

        @return: a list of L{Packet} (empty while a packet is incomplete).
        @raise ProtocolError: a malformed packet, or more than C{max_length}
            bytes of an incomplete one; the stream cannot go on (packets
            decoded in the same call are lost with it).
        """
        buf = self._buffer
        if buf and len(buf) - self._rpos < _JOIN_TAIL:
            # a small incomplete tail: joining it to this read (one memcpy)
            # lets the decoder slice bytes directly; big tails (a large
            # message arriving in pieces) keep growing in place instead
            data = bytes(memoryview(buf)[self._rpos:]) + data
            del buf[:]
            self._rpos = 0
        if not buf and type(data) is bytes:
            # the usual case, whole packets: decode the read itself, keep
            # only an incomplete tail
            packets, pos = decode_packets(data, 0, len(data), self.forward_id_size,
                                          self.reverse_id_size, self.limits)
            if pos < len(data):
                buf += memoryview(data)[pos:]
                self._rpos = 0
                self._check_length()
            return packets
        buf += data
        packets, pos = decode_packets(buf, self._rpos, len(buf), self.forward_id_size,
                                      self.reverse_id_size, self.limits)
        if pos == len(buf):
            del buf[:]
            self._rpos = 0
        elif pos > 65536:
            del buf[:pos]
            self._rpos = 0
        else:
            self._rpos = pos
        self._check_length()
        return packets

    def _check_length(self):
        if len(self._buffer) - self._rpos > self.max_length:
            raise ProtocolError("packet too large")


def describe(packet):
    """A short human-readable form of a packet, for logs."""
    kind = packet.kind
    if kind == GENERAL:
        return GENERAL_TYPES[packet.ptype]
    if kind == MESSAGE:
        return f"message{list(packet.channels)} parts={len(packet.parts)}"
    names = ACK_TYPES if kind & 1 else OP_TYPES
    seq = "" if packet.seq is None else f" seq={packet.seq}"
    return f"{KIND_NAMES[kind]} {names[packet.ptype]}{list(packet.channels)}{seq}"
