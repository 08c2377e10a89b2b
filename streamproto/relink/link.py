"""
The state of one Relink link: channels in both directions, sequence numbers,
acknowledgements, transactions, resumption, shutdown and health checks.

A L{Link} outlives its connections.  The protocol attaches it to a
connection after the handshake (L{Link.attach}) and detaches it when the
connection is lost (L{Link.detach}); what was not acknowledged is resent
after the peer's C{resume}.  The link does no I/O itself: it writes through
the callables given to C{attach} and reads what L{Link.data_received} is fed.

Counting: internally every channel counts messages with unbounded ints
(C{count} = number of messages so far, the last one having sequence number
C{(count - 1) mod 2^32}); the wire carries u32 sequence numbers, unwrapped
against the sender's count, so wrap-around needs no special case.

Sequence numbers in acknowledgements and operations are cumulative and
inclusive: C{consumed 41} means messages up to and including 41.  The
implicit channel forms target "the message after the one the same packet
type targeted last", so both ends keep one pointer per packet type.
"""

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

from twisted.internet.defer import Deferred, gatherResults, maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from streamproto.relink import codec
from streamproto.relink.codec import (
    CHANNEL_ACK, CHANNEL_OP, CLOSE, CLOSED, COMMIT, COMMITTED, CONSUMED, GENERAL, MESSAGE,
    PING, PONG, RECEIVED, RESUME, ROLLBACK, SEQ_MASK, SEQUENCE_ACK, SEQUENCE_OP, SHUTDOWN,
    UNCOMMITTED, ProtocolError,
)

_MISSING = object()

#: bytes a received message counts for beyond its payload, so that a flood
#: of empty messages is bounded in memory too (its list and bytes objects)
MESSAGE_OVERHEAD = 64


@dataclass(frozen=True)
class LinkConfig:
    """
    Bounds and timers of a link (both ends should use the same window).

    @ivar window: most messages this end transmits before it sees them
        consumed, per channel (the send window).  The spec has no receive
        window: a peer may keep any number in flight, so a receiver never
        treats many unconsumed messages as an error; it stops reading
        instead (C{max_unconsumed}, C{max_buffered_bytes}).
    @ivar window_bytes: most payload bytes a sender has transmitted but not
        seen consumed, per channel (a message bigger than this is still
        transmitted, alone, so nothing deadlocks).  Channels with
        transactions are bounded by C{window} only: a transaction's messages
        stay unconsumed until its commit, which must get through.
    @ivar max_queued: messages accepted by C{send} beyond the window, per
        channel; beyond that C{send} fails with L{ChannelBusy} (wait for
        L{OutChannel.when_writable}).
    @ivar max_queued_bytes: payload bytes accepted by C{send} beyond
        C{window_bytes}, per channel (the batch that crosses it is still
        accepted whole).
    @ivar write_chunk_bytes: payload bytes written to the transport in one
        go before the link checks again whether the transport asked it to
        pause (it stops transmitting while the transport's buffer is full).
    @ivar max_channels: open channels per direction.
    @ivar max_buffered_bytes: unconsumed incoming bytes per link (payload
        plus L{MESSAGE_OVERHEAD} a message) before the connection stops
        reading (producer pause); it reads again below half of it.  Also the
        most bytes a transaction may stage before its commit (a commit behind
        a paused stream could never arrive: a bigger transaction is a
        protocol error, not a hang).
    @ivar shutdown_timeout: seconds a connector's L{Connector.shutdown} waits
        for the peer's shutdown and last acknowledgements before it gives
        up (the link is discarded, the Deferred fails with L{LinkLost}).
    @ivar max_unconsumed: unconsumed incoming messages per channel before the
        connection stops reading; it reads again below half of it.  Also the
        most messages a transaction may stage before its commit.
    @ivar stall_timeout: seconds reading may stay paused with nothing
        consumed while one of our channels has a sender waiting for room
        (for the peer's acknowledgements, which wait unread behind the
        peer's data) and the peer reads what we send.  Then the connection
        is dropped and the link kept: on the resumption the peer sends its
        acknowledgements first (spec 3.5), which breaks the wait.  0 turns
        this off.
    """
    window: int = 4096
    window_bytes: int = 4 * 1024 * 1024
    max_queued: int = 4096
    max_queued_bytes: int = 4 * 1024 * 1024
    write_chunk_bytes: int = 1024 * 1024
    max_channels: int = 1024
    max_buffered_bytes: int = 32 * 1024 * 1024
    max_unconsumed: int = 262144
    stall_timeout: float = 0.5
    shutdown_timeout: float = 30.0
    ping_interval: float = 11.0
    pong_timeout: float = 7.0
    handshake_timeout: float = 10.0
    link_timeout: float = 60.0
    max_links: int = 10000
    limits: codec.Limits = codec.DEFAULT_LIMITS


class LinkError(Exception):
    """Base of the errors a link reports to its users."""


class LinkLost(LinkError):
    """The link state was discarded (new link id or epoch, protocol error, shutdown)."""


_SHUTDOWN_DONE = LinkLost("link shut down")


class ChannelBusy(LinkError):
    """The channel's window and queue are full: wait for C{when_writable()}."""


class ChannelClosing(LinkError):
    """The channel is being closed; it can be reopened once the close is acknowledged."""


class CommitOutcomeUnknown(LinkError):
    """Acknowledgements of this commit were lost with a connection and cannot be told apart."""


def _message_size(parts):
    return sum(map(len, parts))


def _unwrap(wire, count):
    """The message count whose last sequence number is C{wire}, nearest at or below C{count}."""
    return count - ((count - 1 - wire) & SEQ_MASK)


def _ahead(wire, count):
    """Whether C{wire} names a message after the first C{count} (within half the space)."""
    return 0 < ((wire - (count - 1)) & SEQ_MASK) < 1 << 31


class _Op:
    __slots__ = ("pos", "op", "deferreds")

    def __init__(self, pos, op, deferred):
        self.pos = pos
        self.op = op
        self.deferreds = [deferred]   # more when the same operation is asked again

    def fire(self, result):
        for d in self.deferreds:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)


class OutChannel:
    """
    A channel this end sends on.  Obtained from L{Link.channel}.

    Messages get their sequence numbers when C{send} accepts them; at most
    C{window} of them are transmitted and unconsumed at a time, at most
    C{max_queued} more wait here (the sender "blocks": C{send} fails with
    L{ChannelBusy} and L{when_writable} says when to go on).
    """

    def __init__(self, link, channel_id, reopened=False):
        self.link = link
        self.channel_id = channel_id
        self.reopened = reopened
        self.transactional = link.own_transactions
        self.assigned = 0       # messages accepted (seq numbers handed out)
        self.transmitted = 0    # messages written on the current connection
        self.consumed = 0       # consumed by the peer
        self.received = 0       # received by the peer
        self._entries = []      # payload parts of messages consumed.. assigned
        self._head = 0          # index in _entries of message number `consumed`
        # payload bytes: _ends[i] is the total of every message up to and
        # including _entries[i]; _base the total before _entries[0]
        self._ends = []
        self._base = 0
        self._total_bytes = 0   # payload bytes of every message accepted
        self._ops = []          # unresolved _Op, in order
        self._ops_sent = 0      # how many of _ops are written on this connection
        self._recv_waiters = []
        self._cons_waiters = []
        self._writable = []
        self._ack_ptr = [0, 0, 0, 0]   # per ack type: count targeted last
        self.closing = False
        self._tx_start = 0      # transactions: position of the last commit/rollback
        self._encoder = None
        self._limit = link.config.window + link.config.max_queued

    # -- sending -----------------------------------------------------------
    @property
    def writable(self):
        return self.room > 0

    @property
    def room(self):
        """How many more messages C{send} accepts now."""
        if self.closing:
            return 0
        room = self._limit - (self.assigned - self.consumed)
        config = self.link.config
        if (self._total_bytes - self._bytes_before(self._head)
                >= config.window_bytes + config.max_queued_bytes):
            return 0
        if self.transactional:
            # a transaction must fit the window, or its commit could never
            # be transmitted (the receiver holds it all unconsumed)
            room = min(room, self.link.config.window - (self.assigned - self._tx_start))
        return room

    def when_writable(self):
        """A Deferred firing when C{send} would accept a message."""
        if self.writable:
            d = Deferred()
            d.callback(self)
            return d
        d = Deferred()
        self._writable.append(d)
        return d

    def _admit(self, count):
        if self.closing:
            raise ChannelClosing(f"channel {self.channel_id} is closing")
        self.link._check_sendable()
        if count > self.room:
            raise ChannelBusy(f"channel {self.channel_id} is full")

    def send(self, parts, ack=CONSUMED):
        """
        Send one message (a sequence of bytes parts).

        @param ack: L{codec.RECEIVED}, L{codec.CONSUMED} or None.
        @return: Deferred firing with the message's count when the peer
            acknowledges it at level C{ack} (None: no Deferred, returns None).
        @raise ChannelBusy: window and queue full.
        """
        self._admit(1)
        parts = tuple(parts)
        self._append(parts, _message_size(parts))
        self.assigned += 1
        self.link._want_transmit(self)
        if ack is not None:
            return self._waiter(ack, self.assigned)
        return None

    def send_many(self, messages, ack=CONSUMED):
        """
        Send many messages with one Deferred (the bulk path): it fires when the
        last of them is acknowledged at level C{ack}.  C{messages} is a list of
        part sequences; all are accepted or none (L{ChannelBusy}).
        """
        messages = [tuple(m) for m in messages]
        self._admit(len(messages))
        self._extend(messages, map(_message_size, messages))
        self.assigned += len(messages)
        self.link._want_transmit(self)
        if ack is not None:
            return self._waiter(ack, self.assigned)
        return None

    def send_payloads(self, payloads, ack=CONSUMED):
        """
        The fastest bulk path: one-part messages given as a list of bytes
        (nothing is copied or wrapped per message).  Like L{send_many}.
        """
        self._admit(len(payloads))
        self._extend(payloads, map(len, payloads))
        self.assigned += len(payloads)
        self.link._want_transmit(self)
        if ack is not None:
            return self._waiter(ack, self.assigned)
        return None

    def _append(self, entry, size):
        self._entries.append(entry)
        self._total_bytes += size
        self._ends.append(self._total_bytes)

    def _extend(self, entries, sizes):
        if not entries:
            return
        self._entries.extend(entries)
        ends = accumulate(sizes, initial=self._total_bytes)
        next(ends)
        self._ends.extend(ends)
        self._total_bytes = self._ends[-1]

    def _bytes_before(self, index):
        """Payload bytes of every message before C{_entries[index]}."""
        return self._ends[index - 1] if index else self._base

    @property
    def unconsumed_bytes(self):
        """Payload bytes accepted by C{send} and not yet consumed by the peer."""
        return self._total_bytes - self._bytes_before(self._head)

    @property
    def in_flight_bytes(self):
        """Payload bytes transmitted and not yet consumed by the peer."""
        head = self._head
        return (self._bytes_before(head + self.transmitted - self.consumed)
                - self._bytes_before(head))

    def _byte_limit(self):
        """The message count C{window_bytes} lets us transmit up to."""
        head = self._head
        end = head + self.assigned - self.consumed
        if end == head:
            return self.assigned
        allowed = self._bytes_before(head) + self.link.config.window_bytes
        ends = self._ends
        if ends[end - 1] <= allowed:
            return self.assigned
        # a message bigger than the window goes alone
        cut = max(bisect_right(ends, allowed, head, end), head + 1)
        return self.consumed + cut - head

    def _waiter(self, level, count):
        d = Deferred()
        if level == CONSUMED:
            if self.consumed >= count:
                d.callback(count)
            else:
                self._cons_waiters.append((count, d))
        elif level == RECEIVED:
            if self.received >= count:
                d.callback(count)
            else:
                self._recv_waiters.append((count, d))
        else:
            raise ValueError("ack level must be RECEIVED or CONSUMED")
        return d

    def _op(self, op):
        if op != CLOSE and not self.transactional:
            raise LinkError("this link's channels do not use transactions")
        if self.closing:
            raise ChannelClosing(f"channel {self.channel_id} is closing")
        self.link._check_sendable()
        d = Deferred()
        if op != CLOSE and self.assigned == self._tx_start:
            # nothing sent since the last commit or rollback: the peer would
            # take the operation for a repeat and never answer it
            last = self._ops[-1] if self._ops else None
            if last is not None and last.pos == self.assigned and last.op == op:
                last.deferreds.append(d)
            else:
                d.callback(True if op == COMMIT else None)
            return d
        self._ops.append(_Op(self.assigned, op, d))
        self._tx_start = self.assigned
        if op == CLOSE:
            self.closing = True
        self.link._want_transmit(self)
        self._wake_writable()
        return d

    def commit(self):
        """
        Ask the peer to process every message sent since the last commit or
        rollback.  @return: Deferred firing True (committed) or False
        (uncommitted).
        """
        return self._op(COMMIT)

    def rollback(self):
        """Ask the peer to drop the messages since the last commit or rollback."""
        return self._op(ROLLBACK)

    def close(self):
        """Close the channel; the Deferred fires when the peer acknowledges it."""
        return self._op(CLOSE)

    # -- transmission ------------------------------------------------------
    def transmit(self, out, budget):
        """
        Append to C{out} what the window allows, operations and messages in
        order, stopping once about C{budget} payload bytes are out (at least
        one message goes).  @return: the payload bytes appended; the caller
        calls again later when L{pending} says more is due.
        """
        limit = min(self.assigned, self.consumed + self.link.config.window)
        if not self.transactional and limit > self.transmitted:
            limit = min(limit, self._byte_limit())
        written = 0
        ops = self._ops
        size = self.link.own_id_size
        cid = (self.channel_id,)
        while True:
            while self._ops_sent < len(ops) and ops[self._ops_sent].pos <= self.transmitted:
                op = ops[self._ops_sent]
                if op.op == CLOSE and self.reopened and self.received == 0 and self.assigned:
                    # until the peer confirms the reopening, a closed ack for
                    # this channel may be a stale one of the previous instance
                    break
                self._ops_sent += 1
                if op.op == CLOSE:
                    out.append(codec.encode_channel_packet(CHANNEL_OP, CLOSE, cid, size))
                else:
                    # always explicit: the peer may have missed earlier operations
                    out.append(codec.encode_sequence_packet(SEQUENCE_OP, op.op, cid,
                                                            op.pos - 1, size))
            if self.transmitted >= limit or written >= budget:
                break
            stop = limit
            if self._ops_sent < len(ops):
                stop = min(stop, ops[self._ops_sent].pos)
            if stop <= self.transmitted:
                break   # an operation is held at this position (see above)
            start = self._head + self.transmitted - self.consumed
            end = start + stop - self.transmitted
            ends = self._ends
            base = self._bytes_before(start)
            room = budget - written
            if ends[end - 1] - base > room:
                # cut at the budget (after at least one message)
                end = max(bisect_right(ends, base + room, start, end), start + 1)
                stop = self.transmitted + end - start
            written += ends[end - 1] - base
            batch = self._entries[start:end]
            self.transmitted = stop
            if self._encoder is None:
                self._encoder = codec.UnicastMessageEncoder(self.channel_id, size)
            self._encoder.encode(batch, out)
        return written

    @property
    def pending(self):
        """Whether something is due that the window would let us transmit now."""
        if self._ops_sent < len(self._ops):
            return True
        limit = min(self.assigned, self.consumed + self.link.config.window)
        if not self.transactional and limit > self.transmitted:
            limit = min(limit, self._byte_limit())
        return limit > self.transmitted

    def rewind(self):
        """The connection is gone: what the peer did not confirm must be resent."""
        self.transmitted = max(self.received, self.consumed)
        self._ops_sent = 0

    # -- acknowledgements --------------------------------------------------
    def ack(self, ack_type, wire_seq):
        """Apply an acknowledgement (C{wire_seq} None for the implicit form)."""
        if ack_type == CLOSED:
            self._closed_ack()
            return
        ptr = self._ack_ptr[ack_type]
        if wire_seq is None:
            count = ptr + 1
        elif _ahead(wire_seq, self.assigned):
            count = self.assigned + 1
        else:
            count = _unwrap(wire_seq, self.assigned)
        if count > self.assigned or count < ptr:
            if not self.link.messaging:
                return  # resume acks of an earlier instance of a reopened channel
            raise ProtocolError(f"{codec.ACK_TYPES[ack_type]} acknowledgement of sequence "
                                f"{(count - 1) & SEQ_MASK} out of range")
        self._ack_ptr[ack_type] = count
        if ack_type == RECEIVED:
            self._advance_received(count)
        elif ack_type == CONSUMED:
            self._advance_consumed(count)
        else:
            self._resolve_ops()

    def _advance_received(self, count):
        if count <= self.received:
            return
        if self.reopened and not self.received and self._ops:
            self.link._want_transmit(self)   # a held close may go now
        self.received = count
        if self.transmitted < count:
            # after a reconnection: the peer has these already, go on after them
            self.transmitted = count
        waiters = self._recv_waiters
        while waiters and waiters[0][0] <= count:
            c, d = waiters.pop(0)
            d.callback(c)

    def _advance_consumed(self, count):
        if count <= self.consumed:
            return
        self._advance_received(count)
        self._head += count - self.consumed
        self.consumed = count
        if self.transmitted < count:
            self.transmitted = count
        if self._head > 4096 and self._head * 2 > len(self._entries):
            self._base = self._ends[self._head - 1]
            del self._entries[:self._head]
            del self._ends[:self._head]
            self._head = 0
        waiters = self._cons_waiters
        i = 0
        while i < len(waiters) and waiters[i][0] <= count:
            i += 1
        if i:
            fire = waiters[:i]
            del waiters[:i]
            for c, d in fire:
                d.callback(c)
        # rollbacks resolve when the peer consumed (dropped) their messages
        self._resolve_ops()
        if self.assigned > self.transmitted:
            self.link._want_transmit(self)
        self._wake_writable()

    def _wake_writable(self):
        if self._writable and self.writable:
            writable, self._writable = self._writable, []
            for d in writable:
                d.callback(self)

    def _resolve_ops(self):
        ops = self._ops
        committed, uncommitted = self._ack_ptr[COMMITTED], self._ack_ptr[UNCOMMITTED]
        while ops:
            op = ops[0]
            if op.op == COMMIT:
                if committed == op.pos and uncommitted != op.pos:
                    result = True
                elif uncommitted == op.pos and committed != op.pos:
                    result = False
                elif committed > op.pos or uncommitted > op.pos:
                    # a later commit was answered; this one's answer was lost
                    if committed >= op.pos > uncommitted:
                        result = True
                    elif uncommitted >= op.pos > committed:
                        result = False
                    else:
                        result = Failure(CommitOutcomeUnknown(op.pos - 1))
                else:
                    break
            elif op.op == ROLLBACK:
                if self.consumed < op.pos:
                    break
                result = None
            else:
                break   # close: resolved by the closed ack
            ops.pop(0)
            if self._ops_sent:
                self._ops_sent -= 1
            op.fire(result)

    def _closed_ack(self):
        if self.reopened and self.received == 0 and self.assigned:
            # our close is held until the peer confirms the reopening (see
            # transmit), so this is the previous instance's closed ack again
            return
        if not self.closing:
            if not self.link.messaging:
                return  # resume acks of an earlier instance of a reopened channel
            raise ProtocolError(f"closed acknowledgement for open channel {self.channel_id}")
        # the peer consumed everything before acknowledging the close
        self._advance_consumed(self.assigned)
        self._resolve_ops()
        self.link._out_channel_closed(self)
        for op in self._ops:
            op.fire(None if op.op == CLOSE else Failure(CommitOutcomeUnknown(op.pos - 1)))
        self._ops = []

    def fail(self, reason):
        """The link is gone: fail everything waiting."""
        waiting = [d for _, d in self._recv_waiters + self._cons_waiters]
        waiting += [d for op in self._ops for d in op.deferreds] + self._writable
        self._recv_waiters, self._cons_waiters, self._ops, self._writable = [], [], [], []
        for d in waiting:
            d.errback(Failure(reason))

    @property
    def idle(self):
        return self.consumed == self.assigned and not self._ops


class InChannel:
    """A channel the peer sends on: what was received, consumed, staged."""

    def __init__(self, link, channel_id):
        self.link = link
        self.channel_id = channel_id
        self.transactional = link.peer_transactions
        self.received = 0
        self.consumed = 0
        self.resolved = 0       # transactions: messages committed or rolled back
        self.op_target = 0      # highest count targeted by a commit/rollback
        self._op_ptr = [0, 0]   # per op type, for implicit operations
        self._staged = []       # transactions: messages resolved.. received
        self._pending_ops = []  # (op, count) waiting for an earlier commit
        self._committing = False
        self.staged_bytes = 0   # bytes of _staged, as counted by _stage
        self._batches = []      # [end_count, done] of handler calls in flight
        self.sent_ack = [0, 0, 0, 0]   # per ack type: count last acknowledged
        self.closing = False
        self.buffered = 0

    def message(self, parts, deliveries):
        if self.closing:
            raise ProtocolError(f"message on channel {self.channel_id} after close")
        self.received += 1
        if self.transactional:
            self._stage(parts)
            self.link._ack_dirty(self)
        else:
            batch = deliveries.get(self)
            if batch is None:
                deliveries[self] = [parts]
            else:
                batch.append(parts)

    def _stage(self, parts):
        """
        Keep a message of an open transaction until its commit or rollback.
        Reading must go on until the commit arrives (pausing would wait for
        ever), so a transaction is bounded by an error instead.
        """
        config = self.link.config
        self._staged.append(parts)
        self.staged_bytes += sum(map(len, parts)) + MESSAGE_OVERHEAD
        if (self.received - self.resolved > config.max_unconsumed
                or self.staged_bytes > config.max_buffered_bytes):
            raise ProtocolError(
                f"channel {self.channel_id}: a transaction of more than "
                f"{config.max_unconsumed} messages or {config.max_buffered_bytes} bytes "
                "before its commit")

    def deliver(self, messages):
        """Hand a batch of received messages to the handler."""
        link = self.link
        size = MESSAGE_OVERHEAD * len(messages)
        for m in messages:
            for p in m:
                size += len(p)
        self.buffered += size
        link._buffered(size)
        link._acks_due[self] = None
        end = self.received
        try:
            result = link.handler.messages_received(link, self.channel_id, messages)
        except Exception:
            result = Failure()
        if result is None:
            if self._batches:
                # consumed, but only after the earlier batches still in flight
                self._batches.append([end, True])
                self._done(None, size)
            else:
                self._done(end, size)
            return
        if isinstance(result, Failure):
            link._handler_failed(result)
            return
        batch = [end, False]
        self._batches.append(batch)

        def done(_):
            batch[1] = True
            self._done(None, size)

        def failed(f):
            link._handler_failed(f)

        result.addCallbacks(done, failed)

    def _done(self, end, size):
        self.buffered -= size
        self.link._buffered(-size)
        if end is not None and not self._batches:
            self._consume(end)
            return
        batches = self._batches
        n = 0
        while n < len(batches) and batches[n][1]:
            n += 1
        if n:
            end = batches[n - 1][0]
            del batches[:n]
            self._consume(end)

    def _consume(self, count):
        if count > self.consumed:
            self.link._consumed_total += count - self.consumed
            self.consumed = count
            self.link._ack_dirty(self)
            if self.link._over:
                self.link._drained(self)
        self._maybe_closed()
        if self.link.peer_shutdown:
            self.link._check_shutdown_done()
        if self.link._idle_waiters:
            self.link._check_idle()

    # -- transactions ------------------------------------------------------
    def operation(self, op, wire_seq):
        if op == CLOSE:
            self.closing = True
            if self.transactional and self.resolved < self.received and not self._committing:
                # uncommitted messages of a closed channel are rolled back
                self._pending_ops.append((ROLLBACK, self.received))
                self._run_ops()
            self._maybe_closed()
            return
        if not self.transactional:
            raise ProtocolError(f"{codec.OP_TYPES[op]} on a channel without transactions")
        if wire_seq is None:
            count = self._op_ptr[op] + 1
        elif _ahead(wire_seq, self.received):
            count = self.received + 1
        else:
            count = _unwrap(wire_seq, self.received)
        if count > self.received:
            raise ProtocolError(f"{codec.OP_TYPES[op]} of sequence {(count - 1) & SEQ_MASK} "
                                "beyond the received messages")
        self._op_ptr[op] = max(self._op_ptr[op], count)
        if count <= self.op_target:
            return  # a resent operation already seen (after a reconnection)
        self.op_target = count
        self._pending_ops.append((op, count))
        self._run_ops()

    def _run_ops(self):
        while self._pending_ops and not self._committing:
            op, count = self._pending_ops.pop(0)
            n = count - self.resolved
            messages, self._staged = self._staged[:n], self._staged[n:]
            self.staged_bytes -= sum(sum(map(len, m)) for m in messages) + MESSAGE_OVERHEAD * n
            if op == ROLLBACK:
                self._resolve(count, None)
                continue
            self._committing = True
            link = self.link
            d = maybeDeferred(link.handler.commit_received, link, self.channel_id, messages)

            def decided(ok, count=count):
                self._committing = False
                self._resolve(count, COMMITTED if ok else UNCOMMITTED)
                self._run_ops()

            def failed(f, count=count):
                self.link.log.failure("commit handler failed on channel {channel}", f,
                                      channel=self.channel_id)
                self._committing = False
                self._resolve(count, UNCOMMITTED)
                self._run_ops()

            d.addCallbacks(decided, failed)

    def _resolve(self, count, ack_type):
        self.resolved = count
        if ack_type is not None:
            self.link._send_ack(self, ack_type, count)
        self._consume(count)

    def _maybe_closed(self):
        if (self.closing and self.consumed == self.received and not self._committing
                and not self._pending_ops and not self._batches):
            self.link._in_channel_closed(self)

    @property
    def idle(self):
        return self.consumed == self.received and not self._committing and not self._batches

    @property
    def busy(self):
        """Whether the handler is working on messages of this channel."""
        return bool(self._committing or self._batches or self._pending_ops)


class Link:
    """
    One link between a connector and a listener (see the module docstring).

    @ivar handler: an L{streamproto.relink.api.IChannelHandler}.
    """

    log = Logger()

    def __init__(self, handler, clock, *, role, own_id_size=0, peer_id_size=0,
                 own_transactions=False, peer_transactions=False, config=None,
                 link_id=0, epoch=0):
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
        self.out_channels = {}
        self.in_channels = {}
        self._tombstones = {}   # incoming channels closed and not reopened since
        self._closed_out = {}   # outgoing channels closed on this link (to spot reopens)
        self.attached = False
        self.messaging = False
        self.lost = None
        #: a Prometheus counter child for the acks written (the server's), or None
        self.ack_counter = None
        self._acks_emitted = 0
        self.shutdown_sent = False
        self._shutdown_due = False
        self.peer_shutdown = False
        self._shutdown_d = None
        self.owner = None
        self._write = None
        self._close_connection = None
        self._pause = None
        #: the transport asked us to stop writing (its buffer is full):
        #: messages wait (control packets still go, they are small)
        self.transmission_paused = False
        self._out = []
        self._flush_call = None
        self._to_transmit = {}
        self._acks_due = {}
        self._buffer = bytearray()
        self._rpos = 0
        self._total_buffered = 0
        self._paused = False
        self._over = {}         # in-channels over max_unconsumed (an ordered set)
        #: how often this link stopped reading (receive backpressure)
        self.receive_pauses = 0
        #: how often a stalled paused link dropped its connection (see
        #: C{LinkConfig.stall_timeout})
        self.stall_breaks = 0
        self._consumed_total = 0    # messages consumed on every channel so far
        self._stall_call = None
        self._stall_mark = 0
        #: a resumed connection of a paused link reads up to the peer's
        #: C{resume} before it pauses (the peer's acks come first)
        self._pause_at_resume = False
        self._tell_shutdown = False   # the peer's shutdown, for the handler after the read
        self._ping_call = None
        self._ping_sent_at = None
        self._last_rx = 0.0
        self._idle_waiters = []

    # -- connection binding ------------------------------------------------
    def attach(self, write_sequence, close_connection, resumed, pause=None, owner=None):
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
        self._buffer = bytearray()
        self._rpos = 0
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
            for ch in self.out_channels.values():
                self._to_transmit[ch] = None
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

    def detach(self):
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

    def discard(self, reason):
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
        waiters, self._idle_waiters = self._idle_waiters, []
        for d in waiters:
            d.callback(self)
        try:
            self.handler.link_closed(self, reason)
        except Exception:
            self.log.failure("link_closed handler failed")
        if close is not None:
            close()

    # -- sending API ---------------------------------------------------------
    def channel(self, channel_id):
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

    def send(self, channel_id, parts, ack=CONSUMED):
        return self.channel(channel_id).send(parts, ack)

    def multicast(self, channel_ids, parts, ack=CONSUMED):
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
        size = _message_size(parts)
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

    def shutdown(self):
        """
        Tell the peer this end opens no more channels.  The Deferred fires
        when both ends have sent shutdown and everything is acknowledged;
        then the link is discarded.
        """
        if self.lost is not None:
            d = Deferred()
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

    def when_idle(self):
        """
        A Deferred firing once the handler has finished with every received
        message and the acknowledgements are written (for a graceful stop:
        stop reading first, or new messages keep it busy).
        """
        d = Deferred()
        self._idle_waiters.append(d)
        self._check_idle()
        return d

    def _check_idle(self):
        if not any(ch.busy for ch in self.in_channels.values()):
            self.flush()
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(self)

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
    def pause_transmission(self, paused):
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

    def flush(self):
        """Write everything due (transmissions and acks) in one writeSequence."""
        self._flush_call = None
        if not self.attached:
            return
        out = self._out
        if self._acks_due:
            due, self._acks_due = self._acks_due, {}
            for ch in due:
                self._flush_acks(ch)
        if self._to_transmit and self.messaging and not self.transmission_paused:
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
            self._write(out)

    def _ack_dirty(self, ch):
        self._acks_due[ch] = None
        self._schedule_flush()

    def _flush_acks(self, ch):
        if self.in_channels.get(ch.channel_id) is not ch:
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
        if self.attached:
            if self._acks_due.pop(ch, _MISSING) is not _MISSING:
                self._flush_acks(ch)
            self._emit_ack(ch, ack_type, count)
            self._schedule_flush()
        else:
            # reported with the resume acks of the next connection
            ch.sent_ack[ack_type] = count

    # -- input ---------------------------------------------------------------
    def data_received(self, data):
        """
        Feed packet bytes.  @raise ProtocolError: the caller must log it and
        end the connection (the link is discarded).
        """
        if self.lost is not None or not self.attached:
            return  # discarded (its connection is closing) or detached
        self._last_rx = self.clock.seconds()
        self._ping_sent_at = None
        buf = self._buffer
        if buf and len(buf) - self._rpos < 262144:
            # a small incomplete tail: joining it to this read (one memcpy)
            # lets the decoder slice bytes directly; big tails (a large
            # message arriving in pieces) keep growing in place instead
            data = bytes(memoryview(buf)[self._rpos:]) + data
            del buf[:]
            self._rpos = 0
        if not buf and type(data) is bytes:
            # the usual case, whole packets: decode the read itself, keep
            # only an incomplete tail
            packets, pos = codec.decode_packets(data, 0, len(data), self.peer_id_size,
                                                self.own_id_size, self.config.limits)
            if pos < len(data):
                buf += memoryview(data)[pos:]
                self._rpos = 0
                self._check_buffer_bound()
            self.packets_received(packets)
            return
        buf += data
        packets, pos = codec.decode_packets(buf, self._rpos, len(buf), self.peer_id_size,
                                            self.own_id_size, self.config.limits)
        if pos == len(buf):
            del buf[:]
            self._rpos = 0
        elif pos > 65536:
            del buf[:pos]
            self._rpos = 0
        else:
            self._rpos = pos
        self._check_buffer_bound()
        self.packets_received(packets)

    def _check_buffer_bound(self):
        if len(self._buffer) - self._rpos > self.config.limits.max_message_size + 65536:
            raise ProtocolError("packet too large")

    def packets_received(self, packets):
        deliveries = {}
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
                    ch = self.out_channels.get(cid)
                    if ch is None:
                        if p.ptype == CLOSED or not self.messaging:
                            # a repeated closed ack, or the resume acks of a
                            # channel we saw closed already
                            continue
                        raise ProtocolError(f"acknowledgement for unknown channel {cid}")
                    ch.ack(p.ptype, wire)
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
        for ch, messages in deliveries.items():
            if self.in_channels.get(ch.channel_id) is ch:
                ch.deliver(messages)
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

    def _in_channel_closed(self, ch):
        if self.in_channels.get(ch.channel_id) is not ch:
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

    def _out_channel_closed(self, ch):
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
    def reading_paused(self):
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


__all__ = [
    "ChannelBusy", "ChannelClosing", "CommitOutcomeUnknown", "InChannel", "Link",
    "LinkConfig", "LinkError", "LinkLost", "OutChannel",
]
