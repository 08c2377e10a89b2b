"""
The channels of a Relink link: L{OutChannel} (this end sends) and
L{InChannel} (the peer sends).  Each keeps its own sequence numbers,
acknowledgements and transactions; the L{streamproto.relink.link.Link} they
belong to does the writing, the reading and the bounds shared by all of them.

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
from itertools import accumulate

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.python.failure import Failure

from streamproto.core.observer import Observers
from streamproto.relink import codec
from streamproto.relink.codec import (
    CHANNEL_OP, CLOSE, CLOSED, COMMIT, COMMITTED, CONSUMED, RECEIVED, ROLLBACK, SEQ_MASK,
    SEQUENCE_OP, UNCOMMITTED, ProtocolError,
)
from streamproto.relink.config import MESSAGE_OVERHEAD
from streamproto.relink.errors import ChannelBusy, ChannelClosing, CommitOutcomeUnknown, LinkError


def message_size(parts):
    return sum(map(len, parts))


def _unwrap(wire, count):
    """The message count whose last sequence number is C{wire}, nearest at or below C{count}."""
    return count - ((count - 1 - wire) & SEQ_MASK)


def _ahead(wire, count):
    """Whether C{wire} names a message after the first C{count} (within half the space)."""
    return 0 < ((wire - (count - 1)) & SEQ_MASK) < 1 << 31


class _Op:
    __slots__ = ("pos", "op", "deferreds", "written")

    def __init__(self, pos, op, deferred):
        self.pos = pos
        self.op = op
        self.deferreds = [deferred]   # more when the same operation is asked again
        self.written = False          # transmitted to this link's listener (ever)

    def fire(self, result):
        for d in self.deferreds:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)


class OutChannel:
    """
    A channel this end sends on.  Obtained from
    L{streamproto.relink.link.Link.channel}.

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
        self._writable: Observers[OutChannel] = Observers()
        self._ack_ptr = [0, 0, 0, 0]   # per ack type: count targeted last
        self.closing = False
        self._tx_start = 0      # transactions: position of the last commit/rollback
        self._encoder = None
        self._limit = link.config.window + link.config.max_queued
        # the count the wire's sequence numbers start from: 0, or the
        # messages consumed before the link moved to a new listener (whose
        # channel starts at sequence 0 again; see L{relink})
        self._wire_base = 0

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
        return self._writable.when()

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
        self._append(parts, message_size(parts))
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
        return self._send_all(messages, map(message_size, messages), ack)

    def send_payloads(self, payloads, ack=CONSUMED):
        """
        The fastest bulk path: one-part messages given as a list of bytes
        (nothing is copied or wrapped per message).  Like L{send_many}.
        """
        return self._send_all(payloads, map(len, payloads), ack)

    def _send_all(self, entries, sizes, ack):
        """
        The bulk paths' one way in: admit every entry or none, queue them,
        and wait (at level C{ack}, unless None) for the last one only.
        """
        self._admit(len(entries))
        self._extend(entries, sizes)
        self.assigned += len(entries)
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
                op.written = True
                if op.op == CLOSE:
                    out.append(codec.encode_channel_packet(CHANNEL_OP, CLOSE, cid, size))
                else:
                    # always explicit: the peer may have missed earlier operations
                    out.append(codec.encode_sequence_packet(
                        SEQUENCE_OP, op.op, cid, op.pos - self._wire_base - 1, size))
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

    def relink(self):
        """
        The link moved to a listener that never saw this channel (another
        front-end, or one that lost the link): everything not acknowledged
        I{consumed} is sent again, operations (commits, rollbacks, a close)
        in their places, on a channel whose wire sequence numbers start at
        0 again.  Counts (C{consumed}, the Deferreds' counts) go on from
        where they were: only the wire numbering is shifted.

        A transaction whose commit the old listener may have carried out is
        not sent again: see L{_forget_unknown_commits}.

        @return: how many messages will be sent again.
        """
        if self.transactional:
            self._forget_unknown_commits()
        base = self.consumed
        self._wire_base = base
        self.received = base
        self.transmitted = base
        self._ack_ptr = [base] * 4
        self._ops_sent = 0
        self.reopened = False       # the new listener knows no earlier instance
        self._encoder = None
        return self.assigned - base

    def _forget_unknown_commits(self):
        """
        Commits the old listener was sent and never answered may have been
        carried out (stored, then the answer lost with the listener); the
        new listener cannot tell, so sending them again could carry them
        out twice, and a transaction is exactly once.  Each such commit
        fails with L{CommitOutcomeUnknown} (the application decides), and
        its messages, with everything before the last of them, are not
        sent again: they count as consumed.  Operations never written are
        sent to the new listener in their places.
        """
        last = None
        for i, op in enumerate(self._ops):
            if op.written and op.op == COMMIT:
                last = i
        if last is None:
            for op in self._ops:
                op.written = False
            return
        done, self._ops = self._ops[:last + 1], self._ops[last + 1:]
        for op in self._ops:
            op.written = False
        self._advance_consumed(max(self.consumed, done[-1].pos))
        for op in done:
            op.fire(Failure(CommitOutcomeUnknown(op.pos - 1)) if op.op == COMMIT else None)

    # -- acknowledgements --------------------------------------------------
    def ack(self, ack_type, wire_seq):
        """Apply an acknowledgement (C{wire_seq} None for the implicit form)."""
        if ack_type == CLOSED:
            self._closed_ack()
            return
        ptr = self._ack_ptr[ack_type]
        if wire_seq is None:
            count = ptr + 1
        else:
            base = self._wire_base
            if _ahead(wire_seq, self.assigned - base):
                count = self.assigned + 1
            else:
                count = base + _unwrap(wire_seq, self.assigned - base)
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
        self.link.peer_consumed_total += count - self.consumed
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
            self._writable.fire(self)

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
        waiting += [d for op in self._ops for d in op.deferreds]
        self._recv_waiters, self._cons_waiters, self._ops = [], [], []
        for d in waiting:
            d.errback(Failure(reason))
        self._writable.fail(reason)

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


__all__ = ["InChannel", "OutChannel"]
