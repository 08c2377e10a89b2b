"""
The state of one Relink link: its channels in both directions (see
L{streamproto.relink.channels} for their sequence numbers, acknowledgements
and transactions), resumption, shutdown, receive flow control and health
checks.

A L{Link} outlives its connections.  The protocol attaches it to a
connection after the handshake (L{Link.attach}) and detaches it when the
connection is lost (L{Link.detach}); what was not acknowledged is resent
after the peer's C{resume}.  The link does no I/O itself: it writes through
the callables given to C{attach} and reads what L{Link.data_received} is fed
(cut into packets by a L{codec.PacketDecoder}).
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from streamproto.core.observer import Observers
from streamproto.relink import codec
from streamproto.relink.channels import InChannel, OutChannel, message_size
from streamproto.relink.codec import (
    CHANNEL_ACK, CLOSE, CLOSED, COMMITTED, CONSUMED, GENERAL, MESSAGE, PING, PONG, RECEIVED,
    RESUME, SEQUENCE_ACK, SEQUENCE_OP, SHUTDOWN, UNCOMMITTED, ProtocolError,
)
from streamproto.relink.config import LinkConfig
from streamproto.relink.errors import LinkError, LinkLost

_MISSING = object()

_SHUTDOWN_DONE = LinkLost("link shut down")


class Link:
    """
    One link between a connector and a listener (see the module docstring).

    @ivar handler: an L{streamproto.relink.api.IChannelHandler}.
    """

    log = Logger()

    def __init__(self, handler: Any, clock: IReactorTime, *, role: str, own_id_size: int = 0,
                 peer_id_size: int = 0, own_transactions: bool = False,
                 peer_transactions: bool = False, config: LinkConfig | None = None,
                 link_id: int = 0, epoch: int = 0) -> None:
        self.handler = handler
        self.clock = clock
        self.role = role
        self.own_id_size = own_id_size
        self.peer_id_size = peer_id_size
        self.own_transactions = own_transactions
        self.peer_transactions = peer_transactions
        self.config = config or LinkConfig()
        self.link_id = link_id
        self.epoch = epoch
        self.out_channels: dict[int, OutChannel] = {}
        self.in_channels: dict[int, InChannel] = {}
        # incoming channels closed and not reopened since (an ordered set)
        self._tombstones: dict[int, None] = {}
        # outgoing channels closed on this link (to spot reopens; an ordered set)
        self._closed_out: dict[int, None] = {}
        self.attached = False
        self.messaging = False
        self.lost: LinkLost | None = None
        #: a Prometheus counter child for the acks written (the server's), or None
        self.ack_counter: Any = None
        self._acks_emitted = 0
        self.shutdown_sent = False
        self._shutdown_due = False
        self.peer_shutdown = False
        self._shutdown_d: Deferred[None] | None = None
        self.owner: object = None
        self._write: Callable[[list[bytes]], object] | None = None
        self._close_connection: Callable[[], object] | None = None
        self._pause: Callable[[bool], object] | None = None
        #: the transport asked us to stop writing (its buffer is full):
        #: messages wait (control packets still go, they are small)
        self.transmission_paused = False
        self._out: list[bytes] = []
        self._flush_call: IDelayedCall | None = None
        # (ordered sets)
        self._to_transmit: dict[OutChannel, None] = {}
        self._acks_due: dict[InChannel, None] = {}
        #: cuts the bytes of the current connection into packets
        self._decoder = self._new_decoder()
        self._total_buffered = 0
        self._paused = False
        self._over: dict[InChannel, None] = {}  # in-channels over max_unconsumed (an ordered set)
        #: how often this link stopped reading (receive backpressure)
        self.receive_pauses = 0
        #: how often a stalled paused link dropped its connection (see
        #: C{LinkConfig.stall_timeout})
        self.stall_breaks = 0
        self._consumed_total = 0    # messages consumed on every channel so far
        #: messages of ours the peer acknowledged consumed, every channel,
        #: every listener (the connector's measure of a connection's progress)
        self.peer_consumed_total = 0
        self._stall_call: IDelayedCall | None = None
        self._stall_mark = 0
        #: a resumed connection of a paused link reads up to the peer's
        #: C{resume} before it pauses (the peer's acks come first)
        self._pause_at_resume = False
        self._tell_shutdown = False   # the peer's shutdown, for the handler after the read
        self._ping_call: IDelayedCall | None = None
        self._ping_sent_at: float | None = None
        self._last_rx = 0.0
        self._idle_waiters: Observers[Link] = Observers()

    # -- connection binding ------------------------------------------------
    def attach(self, write_sequence: Callable[[list[bytes]], object],
               close_connection: Callable[[], object], resumed: bool,
               pause: Callable[[bool], object] | None = None, owner: object = None) -> None:
        """
        A connection finished its handshake for this link.

        @param write_sequence: callable(list of bytes).
        @param close_connection: callable() ending the connection.
        @param resumed: whether an old link id was agreed (then acks and
            C{resume} are sent first, and messaging waits for the peer's).
        @param pause: callable(bool) pausing/resuming reading, for backpressure.
        @param owner: the connection (protocol) this link is attached to now.
        """
        self.owner = owner
        self._write = write_sequence
        self._close_connection = close_connection
        self._pause = pause
        self.transmission_paused = False
        self.attached = True
        self._decoder = self._new_decoder()   # a new stream: no tail of the old one
        self._last_rx = self.clock.seconds()
        self._ping_sent_at = None
        if resumed:
            self.messaging = False
            for ch in self.in_channels.values():
                for ack_type in (RECEIVED, CONSUMED):
                    count = ch.received if ack_type == RECEIVED else ch.consumed
                    if count:
                        self._emit_ack(ch, ack_type, count, explicit=True)
                # both commit results, older first: every per-type pointer
                # must agree again before implicit acks may be used
                for ack_type in sorted((COMMITTED, UNCOMMITTED), key=ch.sent_ack.__getitem__):
                    if ch.sent_ack[ack_type]:
                        self._emit_ack(ch, ack_type, ch.sent_ack[ack_type], explicit=True)
            for cid in self._tombstones:
                # closed while the connection was failing: the peer may have
                # missed our closed ack (and would resend consumed messages)
                self._out.append(codec.encode_channel_packet(CHANNEL_ACK, CLOSED, (cid,),
                                                             self.peer_id_size))
            self._out.append(codec.encode_general(RESUME))
        else:
            self.messaging = True
            self._shutdown_due = self.shutdown_sent
            for out_ch in self.out_channels.values():
                self._to_transmit[out_ch] = None
        if self._paused and pause is not None:
            if resumed:
                # the peer's acknowledgements come before its resume and its
                # resent messages: read them (a few bytes a channel), they
                # may be what the handler waits for
                self._pause_at_resume = True
            else:
                pause(True)
                self._arm_stall()
        self._schedule_ping()
        self.flush()
        try:
            self.handler.link_attached(self, resumed)
        except Exception:
            self.log.failure("link_attached handler failed")

    def detach(self) -> None:
        """The connection is gone; keep the state for a resumption."""
        if not self.attached:
            return
        self.attached = False
        self.messaging = False
        self.transmission_paused = False
        self._write = self._close_connection = self._pause = self.owner = None
        self._out = []
        self._acks_due = {}
        self._pause_at_resume = False
        self._cancel_stall()
        if self._ping_call is not None and self._ping_call.active():
            self._ping_call.cancel()
        self._ping_call = None
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        for ch in self.out_channels.values():
            ch.rewind()
        self._to_transmit = {}

    def discard(self, reason: LinkLost) -> None:
        """Drop all state: every waiting Deferred fails with C{reason}."""
        if self.lost is not None:
            return
        self.lost = reason
        close = self._close_connection
        self.detach()
        out, self.out_channels, self.in_channels = self.out_channels, {}, {}
        for ch in out.values():
            ch.fail(reason)
        if self._shutdown_d is not None and not self._shutdown_d.called:
            d, self._shutdown_d = self._shutdown_d, None
            if reason is _SHUTDOWN_DONE:
                d.callback(None)
            else:
                d.errback(Failure(reason))
        self._idle_waiters.fire(self)
        try:
            self.handler.link_closed(self, reason)
        except Exception:
            self.log.failure("link_closed handler failed")
        if close is not None:
            close()

    def relink(self, epoch: int, link_id: int) -> tuple[int, int]:
        """
        Carry on as a new link, C{link_id} of listener C{epoch}: the
        listener the connector reached does not know our link (another
        front-end, or a listener that restarted or discarded it), so what
        the old link's peer held is gone.  The spec says to discard the
        state of the old link id; what is discarded here is the protocol
        state (the peer's channels, sequence numbers, resumption pointers),
        not the application's work: every message the old link had not
        seen acknowledged I{consumed} is sent again on the new link, in
        order, channel by channel, operations in their places, and the
        Deferreds waiting for them fire when the new peer acknowledges.

        The link must not be lost.  @return: (messages to be sent again,
        channels that have some).
        """
        assert self.lost is None
        close = self._close_connection if self.attached else None
        self.detach()   # a new connection linked before we saw the old one end
        if close is not None:
            close()
        self.epoch, self.link_id = epoch, link_id
        resent = channels = 0
        for ch in self.out_channels.values():
            n = ch.relink()
            if n or ch._ops:
                channels += 1
            resent += n
        # the old peer's channels end with it (it will not resend to us;
        # batches our handler still works on finish into the void: the
        # acks are for a peer that is gone)
        self.in_channels = {}
        self._over = {}
        self._tombstones = {}
        self._closed_out = {}
        self.peer_shutdown = False
        self._tell_shutdown = False
        self._flow()
        return resent, channels

    # -- sending API ---------------------------------------------------------
    def channel(self, channel_id: int) -> OutChannel:
        """The L{OutChannel} for C{channel_id}, opened if needed."""
        ch = self.out_channels.get(channel_id)
        if ch is None:
            if self.lost is not None:
                raise LinkLost(str(self.lost))
            if self.shutdown_sent:
                raise LinkError("link is shut down: no new channels")
            if not 0 <= channel_id <= codec.max_channel_id(self.own_id_size):
                raise ValueError(f"channel id {channel_id} does not fit "
                                 f"{self.own_id_size} bytes")
            if len(self.out_channels) >= self.config.max_channels:
                raise LinkError("too many open channels")
            ch = self.out_channels[channel_id] = OutChannel(
                self, channel_id, reopened=channel_id in self._closed_out)
        return ch

    def send(self, channel_id: int, parts: Sequence[bytes], ack: int | None = CONSUMED
             ) -> Deferred[int] | None:
        return self.channel(channel_id).send(parts, ack)

    def multicast(self, channel_ids: Iterable[int], parts: Sequence[bytes],
                  ack: int | None = CONSUMED) -> Deferred[None] | None:
        """
        Send one message to several channels.  It travels as one multicast
        packet when every target can transmit it at once (else, and when
        resent, as unicast).  @return: Deferred firing when every target
        acknowledged it at level C{ack}.
        """
        channels = [self.channel(c) for c in channel_ids]
        for ch in set(channels):
            ch._admit(channels.count(ch))
        parts = tuple(parts)
        size = message_size(parts)
        together = (self.messaging and not self.transmission_paused and all(
            ch.transmitted == ch.assigned and not (ch._ops_sent < len(ch._ops))
            and ch.assigned - ch.consumed + channels.count(ch) <= self.config.window
            and (ch.transactional or ch.assigned == ch.consumed
                 or ch.in_flight_bytes + size * channels.count(ch) <= self.config.window_bytes)
            for ch in channels))
        ds = []
        for ch in channels:
            ch._append(parts, size)
            ch.assigned += 1
            if together:
                ch.transmitted += 1
            else:
                self._want_transmit(ch)
            if ack is not None:
                ds.append(ch._waiter(ack, ch.assigned))
        if together:
            self._out.append(codec.encode_message(tuple(channel_ids), parts, self.own_id_size,
                                                  multicast=True))
            self._schedule_flush()
        if ack is None:
            return None
        return gatherResults(ds, consumeErrors=True).addCallback(lambda _: None)

    def shutdown(self) -> Deferred[None]:
        """
        Tell the peer this end opens no more channels.  The Deferred fires
        when both ends have sent shutdown and everything is acknowledged;
        then the link is discarded.
        """
        if self.lost is not None:
            d: Deferred[None] = Deferred()
            d.callback(None) if self.lost is _SHUTDOWN_DONE else d.errback(Failure(self.lost))
            return d
        if self._shutdown_d is None:
            self._shutdown_d = Deferred()
        d = self._shutdown_d
        if not self.shutdown_sent:
            self.shutdown_sent = True
            self._shutdown_due = True
            self._schedule_flush()
        self._check_shutdown_done()
        return d

    def when_idle(self) -> "Deferred[Link]":
        """
        A Deferred firing (with this link) once the handler has finished with every received
        message and the acknowledgements are written (for a graceful stop:
        stop reading first, or new messages keep it busy).
        """
        d = self._idle_waiters.when()
        self._check_idle()
        return d

    def _check_idle(self):
        if not any(ch.busy for ch in self.in_channels.values()):
            self.flush()
            self._idle_waiters.fire(self)

    def _check_sendable(self):
        if self.lost is not None:
            raise LinkLost(str(self.lost))

    def _check_shutdown_done(self):
        if not (self.shutdown_sent and self.peer_shutdown) or self.lost is not None:
            return
        if all(ch.idle for ch in self.out_channels.values()) and all(
                ch.idle for ch in self.in_channels.values()):
            self.flush()
            self.discard(_SHUTDOWN_DONE)

    # -- output --------------------------------------------------------------
    def pause_transmission(self, paused: bool) -> None:
        """
        The transport's buffer is full (True) or has drained (False): the
        connection calls this as the transport's streaming producer.  While
        paused no message is transmitted: C{send} still queues them (up to
        the channel's bounds) and their Deferreds fire once they got through.
        """
        self.transmission_paused = paused
        if not paused and (self._to_transmit or self._shutdown_due):
            self._schedule_flush()

    def _want_transmit(self, ch):
        if self.messaging:
            self._to_transmit[ch] = None
            self._schedule_flush()

    def _schedule_flush(self):
        if self._flush_call is None and self.attached:
            self._flush_call = self.clock.callLater(0, self.flush)

    def flush(self) -> None:
        """Write everything due (transmissions and acks) in one writeSequence."""
        self._flush_call = None
        if not self.attached:
            return
        out = self._out
        if self._acks_due:
            due, self._acks_due = self._acks_due, {}
            for in_ch in due:
                self._flush_acks(in_ch)
        if self._to_transmit and self.messaging and not self.transmission_paused:
            todo: dict[OutChannel, None]
            todo, self._to_transmit = self._to_transmit, {}
            budget = self.config.write_chunk_bytes
            for ch in todo:
                if budget <= 0:
                    self._to_transmit[ch] = None   # next time (if not paused by then)
                elif self.out_channels.get(ch.channel_id) is ch:
                    written = ch.transmit(out, budget)
                    budget -= written
                    if budget <= 0 and ch.pending:
                        self._to_transmit[ch] = None
            if self._to_transmit:
                self._schedule_flush()
        if (self._shutdown_due and self.messaging and not self.transmission_paused
                and not self._to_transmit):
            # after every message of the channels opened before it
            self._shutdown_due = False
            out.append(codec.encode_general(SHUTDOWN))
        if out:
            self._out = []
            if self._acks_emitted:
                if self.ack_counter is not None:
                    self.ack_counter.inc(self._acks_emitted)
                self._acks_emitted = 0
            write = self._write
            assert write is not None  # attached
            write(out)

    def _current(self, ch: InChannel) -> bool:
        """Whether C{ch} is a channel of the peer we are linked to now, not of
        one we moved away from (see L{relink})."""
        return self.in_channels.get(ch.channel_id) is ch

    def _ack_dirty(self, ch):
        if not self._current(ch):
            return   # a channel of a peer we moved away from (see relink)
        self._acks_due[ch] = None
        self._schedule_flush()

    def _flush_acks(self, ch: InChannel) -> None:
        if not self._current(ch):
            return
        if ch.consumed > ch.sent_ack[CONSUMED]:
            self._emit_ack(ch, CONSUMED, ch.consumed)
        if ch.received > max(ch.sent_ack[RECEIVED], ch.consumed):
            self._emit_ack(ch, RECEIVED, ch.received)

    def _emit_ack(self, ch, ack_type, count, explicit=False):
        size = self.peer_id_size
        cid = (ch.channel_id,)
        if not explicit and count == ch.sent_ack[ack_type] + 1:
            self._out.append(codec.encode_channel_packet(CHANNEL_ACK, ack_type, cid, size))
        else:
            self._out.append(codec.encode_sequence_packet(SEQUENCE_ACK, ack_type, cid,
                                                          count - 1, size))
        ch.sent_ack[ack_type] = count
        self._acks_emitted += 1

    def _send_ack(self, ch, ack_type, count):
        """A commit result, written in order before the consumed ack it implies."""
        if not self._current(ch):
            return   # a channel of a peer we moved away from (see relink)
        if self.attached:
            if self._acks_due.pop(ch, _MISSING) is not _MISSING:
                self._flush_acks(ch)
            self._emit_ack(ch, ack_type, count)
            self._schedule_flush()
        else:
            # reported with the resume acks of the next connection
            ch.sent_ack[ack_type] = count

    # -- input ---------------------------------------------------------------
    def _new_decoder(self):
        # the peer's channels carry its messages and operations, ours its acks
        return codec.PacketDecoder(self.peer_id_size, self.own_id_size, self.config.limits)

    def data_received(self, data: bytes) -> None:
        """
        Feed packet bytes.  @raise ProtocolError: the caller must log it and
        end the connection (the link is discarded).
        """
        if self.lost is not None or not self.attached:
            return  # discarded (its connection is closing) or detached
        self._last_rx = self.clock.seconds()
        self._ping_sent_at = None
        self.packets_received(self._decoder.feed(data))

    def packets_received(self, packets):
        deliveries: dict[InChannel, list[tuple[bytes, ...]]] = {}
        in_channels = self.in_channels
        max_unconsumed = self.config.max_unconsumed
        last_cid = last_ch = batch = None
        for p in packets:
            kind = p.kind
            if kind == MESSAGE and not p.multicast:
                # the hot path: runs of messages on one channel
                cid = p.channels[0]
                if cid != last_cid or last_ch is None:
                    last_ch = in_channels.get(cid)
                    if last_ch is None:
                        last_ch = self._open_in_channel(cid)
                    last_cid = cid
                    if last_ch.closing or last_ch.transactional:
                        batch = None
                    else:
                        batch = deliveries.get(last_ch)
                        if batch is None:
                            batch = deliveries[last_ch] = []
                if batch is None:
                    last_ch.message(p.parts, deliveries)
                    continue
                last_ch.received += 1
                if last_ch.received - last_ch.consumed > max_unconsumed:
                    self._overflowing(last_ch)
                batch.append(p.parts)
                continue
            last_cid = None
            if kind == MESSAGE:
                for cid in p.channels:
                    ch = in_channels.get(cid)
                    if ch is None:
                        ch = self._open_in_channel(cid)
                    ch.message(p.parts, deliveries)
            elif kind == GENERAL:
                self._general(p.ptype)
            elif kind & 1:
                wire = p.seq if kind == SEQUENCE_ACK else None
                for cid in p.channels:
                    out_ch = self.out_channels.get(cid)
                    if out_ch is None:
                        if p.ptype == CLOSED or not self.messaging:
                            # a repeated closed ack, or the resume acks of a
                            # channel we saw closed already
                            continue
                        raise ProtocolError(f"acknowledgement for unknown channel {cid}")
                    out_ch.ack(p.ptype, wire)
            else:
                wire = p.seq if kind == SEQUENCE_OP else None
                for cid in p.channels:
                    ch = in_channels.get(cid)
                    if ch is None:
                        if p.ptype == CLOSE:
                            # closed already (our ack was lost): acknowledge again
                            self._out.append(codec.encode_channel_packet(
                                CHANNEL_ACK, CLOSED, (cid,), self.peer_id_size))
                            self._schedule_flush()
                            continue
                        raise ProtocolError(f"operation on unknown channel {cid}")
                    ch.operation(p.ptype, wire)
        # handlers see a batch only once all of it parsed and applied cleanly
        for in_ch, messages in deliveries.items():
            if self.in_channels.get(in_ch.channel_id) is in_ch:
                in_ch.deliver(messages)
        if self._tell_shutdown and self.lost is None:
            self._tell_shutdown = False
            try:
                self.handler.peer_shutdown(self)
            except Exception:
                self.log.failure("peer_shutdown handler failed")
        self.flush()
        self._check_shutdown_done()

    def _open_in_channel(self, cid):
        if self.peer_shutdown:
            raise ProtocolError("peer opened a channel after its shutdown")
        if len(self.in_channels) >= self.config.max_channels:
            raise ProtocolError("too many channels")
        self._tombstones.pop(cid, None)
        ch = self.in_channels[cid] = InChannel(self, cid)
        return ch

    def _general(self, ptype):
        if ptype == PING:
            self._out.append(codec.encode_general(PONG))
        elif ptype == RESUME:
            if self.messaging:
                # a peer sends resume once, and only after an old link id was
                # agreed (spec 3.5); any other is garbage, e.g. payload bytes
                # of a misframed message (the Go writer's odd-id-size bug)
                raise ProtocolError("resume without a resumption in progress")
            self.messaging = True
            for ch in self.out_channels.values():
                ch.transmitted = max(ch.received, ch.consumed)
                self._to_transmit[ch] = None
            self._shutdown_due = self.shutdown_sent
            if self._pause_at_resume:
                self._pause_at_resume = False
                if self._paused and self._pause is not None:
                    self._pause(True)
                    self._arm_stall()
        elif ptype == SHUTDOWN:
            # the handler hears of it after the messages that came before it
            # (packets_received delivers them at the end of the read)
            self.peer_shutdown = True
            self._tell_shutdown = True
        # NOP and PONG: receiving anything already proved the peer alive

    def _in_channel_closed(self, ch: InChannel) -> None:
        if not self._current(ch):
            return
        del self.in_channels[ch.channel_id]
        self._acks_due.pop(ch, None)
        if self._over.pop(ch, _MISSING) is not _MISSING:
            self._flow()
        self._tombstones[ch.channel_id] = None
        if len(self._tombstones) > self.config.max_channels:
            del self._tombstones[next(iter(self._tombstones))]
        try:
            self.handler.channel_closed(self, ch.channel_id)
        except Exception:
            self.log.failure("channel_closed handler failed")
        if self.attached:
            self._flush_acks(ch)
            self._out.append(codec.encode_channel_packet(CHANNEL_ACK, CLOSED, (ch.channel_id,),
                                                         self.peer_id_size))
            self._schedule_flush()
        self._check_shutdown_done()

    def _out_channel_closed(self, ch: OutChannel) -> None:
        if self.out_channels.get(ch.channel_id) is ch:
            del self.out_channels[ch.channel_id]
            self._closed_out[ch.channel_id] = None
            if len(self._closed_out) > self.config.max_channels:
                del self._closed_out[next(iter(self._closed_out))]
        self._check_shutdown_done()

    def _handler_failed(self, failure):
        if self.lost is not None:
            return  # the link is gone already: its handler's work fails with it
        from streamproto.core.auth import AuthorizationDenied
        if failure.check(AuthorizationDenied):
            # the policy's refusal, logged where it was decided: no traceback
            self.discard(LinkLost(f"forbidden: {failure.getErrorMessage()}"))
            return
        from streamproto.log.errors import StoreUnavailable
        if failure.check(StoreUnavailable):
            # the store's backend did not answer (no quorum, no leader):
            # expected in operation, one line; the connector sends again on
            # a new link once it reconnects
            self.log.warn("relink link {link_id}: the store is unavailable ({error}); "
                          "discarding the link (nothing of it acknowledged that is not "
                          "stored)", link_id=self.link_id, error=failure.getErrorMessage())
            self.discard(LinkLost(f"store unavailable: {failure.getErrorMessage()}"))
            return
        self.log.failure("channel handler failed; discarding the link", failure)
        self.discard(LinkLost(f"handler failed: {failure.getErrorMessage()}"))

    # -- receive flow control -------------------------------------------------
    # The spec has no receive window: a peer may keep any number of messages
    # in flight, and more unconsumed than we like is not its fault.  A
    # receiver that cannot keep up stops reading (backpressure) and reads
    # again once the handler has drained half of it.  Everything already
    # read is still parsed and applied, the peer's acks included: a paused
    # link only stops taking more bytes from the socket.

    def _buffered(self, delta):
        self._total_buffered += delta
        self._flow()

    def _overflowing(self, ch):
        """C{ch} has more than C{max_unconsumed} messages unconsumed."""
        self._over[ch] = None
        self._flow()

    def _drained(self, ch):
        """C{ch} consumed some: it may be back under half the bound."""
        if ch in self._over and (ch.received - ch.consumed
                                 <= self.config.max_unconsumed // 2):
            del self._over[ch]
            self._flow()

    def _flow(self):
        limit = self.config.max_buffered_bytes
        if not self._paused:
            if self._total_buffered > limit or self._over:
                self._paused = True
                self.receive_pauses += 1
                if self._pause is not None and not self._pause_at_resume:
                    self._pause(True)
                    self._arm_stall()
        elif self._total_buffered <= limit // 2 and not self._over:
            self._paused = False
            self._cancel_stall()
            if self._pause is not None and not self._pause_at_resume:
                self._pause(False)
                # silence while we did not read proves nothing about the peer
                self._last_rx = self.clock.seconds()
                self._ping_sent_at = None

    # A paused reader can deadlock: a handler that answers on our channels
    # (echo) consumes only when the channel has room, room comes with the
    # peer's acknowledgements, and those travel behind the peer's data,
    # which we no longer read.  The bounds are meant to be larger than what
    # a peer keeps in flight; when they are not, the link would wait for
    # ever.  Nothing read can be dropped, so the way out is the resumption:
    # drop the connection (the link stays), and on the next one the peer
    # sends its acknowledgements first (spec 3.5), then resends only what
    # we had not received.

    def _arm_stall(self):
        if (self._stall_call is None and self.attached
                and self.config.stall_timeout > 0):
            self._stall_mark = self._consumed_total
            self._stall_call = self.clock.callLater(self.config.stall_timeout,
                                                    self._stall_check)

    def _cancel_stall(self):
        call, self._stall_call = self._stall_call, None
        if call is not None and call.active():
            call.cancel()

    def _stall_check(self):
        self._stall_call = None
        if not (self._paused and self.attached) or self._pause_at_resume:
            return
        if self._consumed_total != self._stall_mark or not self._waiting_for_acks():
            # the handler makes progress, or waits for something the peer's
            # acknowledgements would not bring: look again later
            self._arm_stall()
            return
        self.stall_breaks += 1
        self.log.warn(
            "relink link {link_id}: reading paused for {timeout} s with nothing consumed "
            "while our channel(s) {channels} wait for acknowledgements queued behind the "
            "peer's unread data; dropping the connection (the link is kept: on resumption "
            "the acknowledgements come first).  Receive bounds (max_buffered_bytes, "
            "max_unconsumed) above what the peer keeps in flight avoid this",
            link_id=self.link_id, timeout=self.config.stall_timeout,
            channels=", ".join(str(c) for c in self._blocked_channels()))
        close = self._close_connection
        if close is not None:
            close()

    def _blocked_channels(self):
        return [ch.channel_id for ch in self.out_channels.values()
                if ch._writable and not ch.writable and ch.transmitted > ch.consumed]

    def _waiting_for_acks(self):
        """
        Whether a sender of ours waits for room that only the peer's
        acknowledgements can make, while the peer reads what we send (if
        it does not, its acknowledgements are not coming anyway).
        """
        return not self.transmission_paused and bool(self._blocked_channels())

    @property
    def reading_paused(self) -> bool:
        """Whether the link asked its connection to stop reading."""
        return self._paused

    # -- health check --------------------------------------------------------
    def _schedule_ping(self):
        if self._ping_call is None or not self._ping_call.active():
            self._ping_call = self.clock.callLater(self.config.ping_interval, self._ping_check)

    def _ping_check(self):
        self._ping_call = None
        if not self.attached:
            return
        now = self.clock.seconds()
        if self._paused and not self._pause_at_resume:
            # we do not read: the peer's pong would wait unread behind its
            # data, so silence proves nothing (see _flow)
            self._ping_sent_at = None
            self._last_rx = now
        if self._ping_sent_at is not None:
            if now - self._ping_sent_at >= self.config.pong_timeout:
                self.log.warn("link {link_id}: no pong in {timeout}s; dropping the connection",
                              link_id=self.link_id, timeout=self.config.pong_timeout)
                close = self._close_connection
                if close is not None:
                    close()
                return
            delay = self._ping_sent_at + self.config.pong_timeout - now
        else:
            idle = now - self._last_rx
            if idle >= self.config.ping_interval:
                self._ping_sent_at = now
                self._out.append(codec.encode_general(PING))
                self.flush()
                delay = self.config.pong_timeout
            else:
                delay = self.config.ping_interval - idle
        self._ping_call = self.clock.callLater(delay, self._ping_check)


__all__ = ["Link"]
