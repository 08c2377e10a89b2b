"""
The append chain of one L{JetStreamLog}: the write side.

Appends are queued in order and sent as messages, several small appends
merged into one message and a large one split (at most C{max_message_bytes}
each), one message in flight per log: what is queued while a message waits
for its acknowledgement goes out merged in the next (a group commit).  Each
message carries the positions it was given and one expectation,
C{Nats-Expected-Last-Sequence}: the sequence of the last message the log
I{knows} is stored, so a message is stored only right after the message its
positions were computed from.

Why one message in flight: that expectation names a sequence, not a
message.  With two in flight, N (expecting S) and N+1 (expecting S+1),
another front-end's message stored at S+1 gets N refused and N+1 stored
after it, with positions (and attributes) that assumed N: acknowledging
N+1 then acknowledges N's records too, which are nowhere, and every reader
stops at N+1's broken positions.  The expected last message id would say
"after N", but nats-server replicas check that one when they apply an entry
and one caught up from a snapshot does not know it (see L{_send}).  With
one message in flight the sequence expected is always one the log learnt
from the cluster, so whatever stands at S is a message of the log.

On any error or timeout the chain stops, waits until every message sent
has an answer, has the log re-read the tail from the leader (learning which
of its messages were stored after all), and sends again, with fresh
positions, the records of those that were not.  Every append is
acknowledged within the store's C{timeout} or fails.

A message not answered "stored" is a I{ghost} until its one possible
place is taken: it expected sequence S, so it can only ever be stored at
S + 1.  Not only a timed-out one: a refusal is no proof either.  While a
stream leader is cut off, it refuses a message (its own count includes
the message it could not commit) and forwards it on a route whose TCP
connection holds it; once the partition heals, the new leader gets that
copy and stores it (CI, doc/reliability.rst finding 22: the records it
held were then sent again and stored twice).  So the chain recognises
any message of its own wherever it learns the tail, and the tail's reads
always look at the sequences where a ghost may stand.

Kept apart from the log because it is the one part with state of its own
(the queue, the messages in flight, those whose outcome is unknown): the
log decides what the acknowledged state is, the chain only proposes.
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, TypeVar, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from streamproto.log.batch import lengths_array
from streamproto.log.errors import (
    AppendConflict, CorruptLog, LogClosed, StoreUnavailable, WriteFailed, attributes_conflict,
)
from streamproto.log.jetstream.common import LogPart, _Inline, log
from streamproto.log.natsformat import (
    ATTRS, DATA, EXPECTED_LAST_SEQUENCE, MARKER, MSG_ID, BatchInfo, encode_body, encode_headers,
    split_points,
)
from streamproto.log.natsio import (
    WRONG_LAST_MSG_ID, WRONG_LAST_SEQUENCE, JetStreamError, NotAvailable, PublishOutcome,
)
from streamproto.log.result import AppendResult

if TYPE_CHECKING:
    from streamproto.log.jetstream.views import LogView as JetStreamLog

_T = TypeVar("_T")

#: how long a message not known to be stored may still turn up stored (its
#: slot taken by another message ends that sooner)
GHOST_SECONDS = 300
#: seconds: the first wait before asking again when the cluster refused a
#: message expecting the very tail it reports (two leaders for a moment);
#: each next one twice as long, at most a second
FLUX_BACKOFF = 0.01


@dataclass(slots=True, eq=False)
class _Append:
    """One L{ILog.append} (or a marker) on its way."""

    lengths: array[int]
    data: bytes
    attributes: dict[str, int] | None
    deadline: float
    kind: str = DATA
    start: tuple[int, int] | None = None
    #: a conditional append's expected first position (alone in its message)
    expected: int | None = None
    #: the attributes it expects (judged each time its first chunk is sent)
    expected_attributes: dict[str, int | None] | None = None
    deferred: Deferred[AppendResult] = field(init=False, default_factory=defer.Deferred)
    chunks: list[_Chunk] = field(init=False, default_factory=list)
    done_chunks: int = field(init=False, default=0)
    first_position: int | None = field(init=False, default=None)
    last_seq: int | None = field(init=False, default=None)
    failed: bool = field(init=False, default=False)


@dataclass(slots=True, eq=False)
class _Chunk:
    """Consecutive records of one append that go into one message."""

    append: _Append
    index: int
    lengths: array[int]
    data: bytes
    last: bool
    done: bool = field(init=False, default=False)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @property
    def size(self) -> int:
        return 4 * len(self.lengths) + len(self.data)


@dataclass(slots=True, eq=False)
class _Message:
    """One message sent: its chunks, its coordinates and what became of it."""

    chunks: list[_Chunk]
    info: BatchInfo
    body: bytes
    lengths: array[int]
    sent_at: float
    #: None until answered, then "stored", "failed" or "unknown"
    outcome: str | None = field(init=False, default=None)
    error: JetStreamError | None = field(init=False, default=None)
    #: the sequence the follower (or a fetch) saw it stored at, before
    #: its publish was answered
    seen: int | None = field(init=False, default=None)

    @property
    def msg_id(self) -> str:
        """Its C{Nats-Msg-Id} (every message this store sends has one)."""
        return cast(str, self.info.msg_id)


class AppendChain(LogPart):
    """
    The appends of one log, from L{ILog.append} to their acknowledgement.

    @ivar pending: the appends not settled yet (their Deferreds have not
        fired).
    """

    def __init__(self, log: JetStreamLog) -> None:
        super().__init__(log)
        self._queue: deque[_Chunk] = deque()        # chunks not sent yet
        # the message sent and not confirmed yet (one at most: see above);
        # kept after a failed answer until the resynchronisation has judged it
        self._inflight: _Message | None = None
        self._resyncing = False
        self._resync_running = False
        # msg id -> message whose outcome is unknown
        self._unresolved: dict[str, _Message] = {}
        # msg id -> message not answered "stored" (unknown or refused),
        # which may be stored later at its one place (info.seq)
        self._ghosts: dict[str, _Message] = {}
        # the wait before the next resynchronisation (see FLUX_BACKOFF)
        self._flux_delay = 0.0
        self._pumping = False
        self.pending: set[_Append] = set()          # appends not settled yet
        self._deadline_call: IDelayedCall | None = None
        self._unavailable_since: float | None = None
        self._msg_counter = itertools.count(1)

    # -- appending -------------------------------------------------------
    def enqueue(self, a: _Append) -> Deferred[AppendResult]:
        """Queue C{a} (cut into chunks) and send what the window allows."""
        cuts = split_points(a.lengths, self.store.max_message_bytes) if len(a.lengths) else [(0, 0)]
        offsets: list[int] | None = None
        if len(cuts) > 1:
            offsets = list(accumulate(a.lengths, initial=0))
        for i, (lo, hi) in enumerate(cuts):
            if offsets is None:
                chunk = _Chunk(a, i, a.lengths, a.data, True)
            else:
                chunk = _Chunk(a, i, a.lengths[lo:hi], a.data[offsets[lo]:offsets[hi]],
                               i == len(cuts) - 1)
            a.chunks.append(chunk)
            self._queue.append(chunk)
        self.pending.add(a)
        a.deferred.addBoth(self._settled, a)
        self._schedule_deadlines()
        self._pump()
        return a.deferred

    def _settled(self, result: _T, a: _Append) -> _T:
        self.pending.discard(a)
        return result

    def _pump(self) -> None:
        """Send queued chunks while the window allows."""
        if self._pumping:
            return
        self._pumping = True
        try:
            # one message in flight (the module docstring says why)
            while (self._queue and not self._resyncing and not self._log._closed
                   and self._log.failed is None and self._inflight is None):
                chunks = self._take_chunks()
                if chunks:
                    self._send(chunks)
        finally:
            self._pumping = False

    def _take_chunks(self) -> list[_Chunk]:
        """The next message's chunks: small appends merged, markers alone."""
        queue = self._queue
        limit = self.store.max_message_bytes
        chunks: list[_Chunk] = []
        size = 0
        while queue:
            chunk = queue[0]
            if chunk.append.failed or chunk.done:
                queue.popleft()
                continue
            if chunk.append.kind == MARKER or chunk.append.expected is not None:
                # alone in its message: a marker, or a conditional append
                # (judged against the chain's tail when it is sent)
                if not chunks:
                    chunks.append(queue.popleft())
                break
            if chunks and (size + chunk.size > limit):
                break
            chunks.append(queue.popleft())
            size += chunk.size
        return chunks

    def _send(self, chunks: list[_Chunk]) -> None:
        # nothing in flight: the message goes right after the tail the log
        # learnt from the cluster (no projection past unconfirmed messages)
        seq, position, offset, attrs = self._log._end_seq, self._log.end_position, \
            self._log.end_offset, self._log._attributes
        first = chunks[0].append
        if first.expected is not None and first.expected != position:
            self.fail_append(first, AppendConflict(
                f"log {self.name} ends at {position}, not {first.expected}"))
            return
        kind = MARKER if first.kind == MARKER else DATA
        lengths: array[int]
        data: bytes
        snapshot: dict[str, int] | None
        if kind == DATA:
            chunks = self._meeting_expectations(chunks, attrs)
            if not chunks:
                return
        if kind == MARKER:
            lengths, data, count, nbytes = lengths_array(), b"", 0, 0
            snapshot = attrs
        else:
            snapshot = None
            for chunk in chunks:
                if chunk.last and chunk.append.attributes:
                    snapshot = dict(attrs if snapshot is None else snapshot)
                    snapshot.update(chunk.append.attributes)
            if snapshot is not None:
                kind = ATTRS
            if len(chunks) == 1:
                lengths, data = chunks[0].lengths, chunks[0].data
            else:
                lengths = lengths_array()
                for chunk in chunks:
                    lengths.extend(chunk.lengths)
                data = b"".join(chunk.data for chunk in chunks)
            count, nbytes = len(lengths), len(data)
        body, crc = encode_body(lengths, data)
        msg_id = f"{self.store.writer_id}.{self._id}.{next(self._msg_counter)}"
        headers = encode_headers(position, offset, count, nbytes, crc, snapshot,
                                 first.start if kind == MARKER else None)
        headers[MSG_ID] = msg_id
        headers[EXPECTED_LAST_SEQUENCE] = str(seq)
        # the expected last sequence alone orders the chain.  Not also the
        # expected last message id: nats-server replicas check it when they
        # apply an entry, and one restarted and caught up from a snapshot
        # does not know the last id: "last msgid mismatch", a critical write
        # error, and that replica never catches up (one more node lost is
        # then no quorum).  Seen in test_jetstream_protocols.
        info = BatchInfo(seq + 1, kind, position, offset, count, nbytes, crc, snapshot,
                         first.start if kind == MARKER else None, msg_id)
        message = self._inflight = _Message(chunks, info, body, lengths, self.store.monotonic())
        self.store.bridge.call_soon(self.store.io.publish, self._log._subject(kind), headers, body,
                                    partial(self._published, message))

    def _meeting_expectations(self, chunks: list[_Chunk],
                              attrs: dict[str, int]) -> list[_Chunk]:
        """
        C{chunks} without the appends whose C{expected_attributes} do not
        hold where they now go (after the tail's C{attrs} and the chunks
        before them); those fail with L{AppendConflict}.

        Judged at every send, resends after a resynchronisation included:
        when a message whose outcome was unknown turns up stored, an append
        expecting the attributes it replaced is refused rather than stored
        a second time (a Pravega writer's resent events).
        """
        kept: list[_Chunk] = []
        current = attrs
        for chunk in chunks:
            a = chunk.append
            if chunk.index == 0 and a.expected_attributes:
                conflict = attributes_conflict(self.name, current, a.expected_attributes)
                if conflict is not None:
                    self.fail_append(a, conflict)
            if a.failed:
                continue
            kept.append(chunk)
            if chunk.last and a.attributes:
                current = dict(current)
                current.update(a.attributes)
        return kept

    def _published(self, message: _Message, outcome: PublishOutcome) -> None:
        """What JetStream answered to one of our publishes (reactor thread)."""
        if self._log._closed or message.outcome is not None:
            return
        if outcome.error is None:
            if outcome.seq != message.info.seq:
                log.error("log {name}: JetStream stored message {id} at {seq}, expected {want}",
                          name=self.name, id=message.info.msg_id, seq=outcome.seq,
                          want=message.info.seq)
                message.outcome = "unknown"
                message.error = JetStreamError(f"stored at unexpected sequence {outcome.seq}")
                self._unresolved[message.msg_id] = message
                self._begin_resync(message.error)
                return
            self._confirm(message)
            return
        error = outcome.error
        if message.seen is not None:
            # its answer was lost, or came from a leader that did not store
            # it, but it was seen stored: it is
            message.info.seq = message.seen
            self._confirm(message)
            return
        message.error = error
        # stored or not, it may still be stored at its place (module docstring)
        self._ghosts[message.msg_id] = message
        if isinstance(error, NotAvailable):
            # a timeout or a lost connection: it may be stored or not
            message.outcome = "unknown"
            self._unresolved[message.msg_id] = message
        else:
            message.outcome = "failed"
            if error.err_code not in (WRONG_LAST_SEQUENCE, WRONG_LAST_MSG_ID):
                # refused for its own sake (too large, no space...): this
                # append fails; the chain resynchronises for the others
                for chunk in message.chunks:
                    # nothing of it stored, the log goes on: as the file
                    # store's rolled-back write (a full disk)
                    self.fail_append(chunk.append, WriteFailed(
                        f"JetStream refused the append: {error}"))
        self._begin_resync(error)

    def _confirm(self, message: _Message) -> None:
        """
        C{message}, the one in flight, is stored right after the message
        its positions were computed from: its appends are acknowledged.
        Only ever this message: another one's fate is never inferred from
        it (a refused message confirmed this way is the loss the module
        docstring describes).
        """
        self._inflight = None
        self._flux_delay = 0.0
        self._unresolved.pop(message.msg_id, None)
        message.outcome = "stored"
        self._log._learn(message.info)
        self._complete(message)
        self._maybe_resync()
        self._pump()

    def _complete(self, message: _Message) -> None:
        """Fire what C{message} finishes, and keep its body for readers."""
        info = message.info
        if info.count:
            entry = self.store.cache.put((self._id, info.seq), message.lengths,
                                         memoryview(message.body)[4 * info.count:])
            del entry
        position = info.position
        for chunk in message.chunks:
            a = chunk.append
            first, position = position, position + len(chunk.lengths)
            if chunk.done:
                continue
            chunk.done = True
            if chunk.index == 0:
                a.first_position = first
            a.done_chunks += 1
            a.last_seq = info.seq
            if a.done_chunks == len(a.chunks) and not a.failed and not a.deferred.called:
                a.deferred.callback(AppendResult(cast(int, a.first_position),
                                                 self._log.end_position, self._log.end_offset))
        if self._log._truncation.due():
            self._clock.callLater(0, self.store._retain, self._log)

    def fail_append(self, a: _Append, error: BaseException) -> None:
        if a.failed or a.deferred.called:
            return
        a.failed = True
        a.deferred.errback(error)

    # -- what the log learnt is stored -------------------------------------
    def resolve(self, info: BatchInfo) -> None:
        """One of our messages whose outcome we did not know is stored."""
        if info.msg_id is None:
            return
        unresolved = self._unresolved.pop(info.msg_id, None)
        message = self._ghosts.pop(info.msg_id, None) or unresolved
        if message is None:
            if self._ghosts:
                # a ghost whose place this message took can no longer be stored
                for msg_id, ghost in list(self._ghosts.items()):
                    if ghost.info.seq == info.seq:
                        del self._ghosts[msg_id]
            # stored, and seen before its publish was answered (the
            # follower can be quicker than the ack): if that answer is then
            # lost, the message must not be sent again
            sent = self._inflight
            if sent is not None and sent.outcome is None and sent.info.msg_id == info.msg_id:
                sent.seen = info.seq
            return
        if message.outcome != "stored":
            # rare (a timeout or a refusal, then stored after all): said,
            # so that a recovery can be followed in the log
            log.info("log {name}: message {id}, answered {outcome}, is stored at {seq} "
                     "(position {position})", name=self.name, id=info.msg_id,
                     outcome=message.outcome, seq=info.seq,
                     position=info.position)
            message.outcome = "stored"
            message.info.seq = info.seq
            self._complete(message)

    def ghost_places(self, after: int, upto: int) -> list[int]:
        """
        The sequences in C{(after, upto]} where a message of ours not
        known to be stored may stand: a read of the tail that skips
        messages must still look at these.
        """
        return sorted({m.info.seq for m in self._ghosts.values() if after < m.info.seq <= upto})

    # -- recovery of the chain ------------------------------------------
    def _begin_resync(self, error: BaseException) -> None:
        if not self._resyncing:
            self._resyncing = True
            if not isinstance(error, JetStreamError) or error.err_code not in (
                    WRONG_LAST_SEQUENCE, WRONG_LAST_MSG_ID):
                log.warn("log {name}: append failed ({error}); re-reading the tail",
                         name=self.name, error=error)
        self._maybe_resync()

    def _maybe_resync(self) -> None:
        if not self._resyncing or self._resync_running or self._log._closed:
            return
        if self._inflight is not None and self._inflight.outcome is None:
            return  # wait until the message sent has an answer
        self._resync_running = True
        self._resync().addErrback(self._resync_crashed)

    def _resync_crashed(self, f: Failure) -> None:
        self._resync_running = False
        log.failure("log {name}: resynchronisation failed", f, name=self.name)

    @defer.inlineCallbacks
    def _resync(self) -> _Inline[None]:
        if self._flux_delay:
            yield _sleep(self._clock, self._flux_delay)
            self._expire()
        delay = 0.1
        while not self._log._closed:
            try:
                yield self._log._catch_up(resolving=bool(self._unresolved))
                break
            except (NotAvailable, JetStreamError) as e:
                if self._unavailable_since is None:
                    self._unavailable_since = self.store.monotonic()
                self._note_unavailable(e)
                yield _sleep(self._clock, delay)
                delay = min(delay * 2, 1.0)
                self._expire()
            except CorruptLog as e:
                self._log._fail_stop(e)
                break
        self._resync_running = False
        if self._log._closed:
            return
        self._unavailable_since = None
        if self._log.unavailable is not None:
            log.info("log {name}: JetStream answers again", name=self.name)
            self._log.unavailable = None
        # what was not stored goes again, in order, with fresh positions
        again: list[_Chunk] = []
        now = self.store.monotonic()
        # a message not known to be stored can still be stored after the
        # tail was read (then its records are not sent a third time), but
        # only at its own place: one the tail read has passed is taken (the
        # read looked there), and after GHOST_SECONDS it is given up anyway
        end_seq = self._log._end_seq
        for msg_id, m in list(self._ghosts.items()):
            if m.info.seq <= end_seq or now - m.sent_at > GHOST_SECONDS:
                del self._ghosts[msg_id]
        sent = self._inflight
        if sent is not None and sent.outcome == "failed" and sent.info.seq == end_seq + 1 \
                and sent.error is not None and sent.error.err_code in (
                    WRONG_LAST_SEQUENCE, WRONG_LAST_MSG_ID):
            # refused for expecting the very tail the cluster reports: it is
            # between leaders.  Asking again at once made thousands of
            # refusals a second (finding 22); wait a little, longer each time
            if not self._flux_delay:
                log.info("log {name}: refused for expecting sequence {seq}, which the cluster "
                         "reports as its tail (between two leaders?): trying again at "
                         "growing intervals", name=self.name, seq=end_seq)
            self._flux_delay = min(max(2 * self._flux_delay, FLUX_BACKOFF), 1.0)
        if sent is not None and sent.outcome != "stored":
            for chunk in sent.chunks:
                if not chunk.done and not chunk.append.failed and chunk.append.deadline > now:
                    again.append(chunk)
        self._unresolved.clear()
        self._inflight = None
        if sent is not None and sent.outcome == "unknown":
            # (a refusal is the usual race with another front-end: not said)
            log.info("log {name}: tail at sequence {seq} (position {position}); message {id} "
                     "{outcome}, {count} of its chunks sent again; {ghosts} may still be stored",
                     name=self.name, seq=end_seq, position=self._log.end_position,
                     id=sent.msg_id, outcome=sent.outcome, count=len(again),
                     ghosts=sorted(self._ghosts))
        self._queue.extendleft(reversed(again))
        self._resyncing = False
        self._pump()

    def _note_unavailable(self, error: BaseException) -> None:
        since = self._unavailable_since
        if since is None:
            since = self.store.monotonic()
        if self.store.monotonic() - since >= self.store.timeout and self._log.unavailable is None:
            # transient (not C{failed}, which is for good): appends fail at
            # once until the cluster answers again
            self._log.unavailable = StoreUnavailable(
                f"JetStream unavailable for {self.store.timeout:g}s: {error}")
            log.error("log {name}: {error}", name=self.name, error=self._log.unavailable)
            for a in list(self.pending):
                self.fail_append(a, StoreUnavailable(str(self._log.unavailable)))

    # -- deadlines: an append is acknowledged in time or fails ------------
    def _schedule_deadlines(self) -> None:
        if self._deadline_call is None and self.pending:
            delay = max(0.05, min(1.0, self.store.timeout / 4))
            self._deadline_call = self._clock.callLater(delay, self._check_deadlines)

    def _check_deadlines(self) -> None:
        self._deadline_call = None
        self._expire()
        self._schedule_deadlines()

    def _expire(self) -> None:
        now = self.store.monotonic()
        for a in list(self.pending):
            if a.deadline <= now:
                why = self._log.failed or self._log.unavailable or (
                    self._inflight is not None and self._inflight.error) or "no acknowledgement"
                self.fail_append(a, StoreUnavailable(
                    f"JetStream did not acknowledge within {self.store.timeout:g}s ({why})"))

    # -- closing -----------------------------------------------------------
    def close(self, reason: BaseException) -> None:
        """The log closed: every append not settled fails, nothing more is sent."""
        for a in list(self.pending):
            if not a.deferred.called:
                a.failed = True
                a.deferred.errback(LogClosed(str(reason)))
        self._queue.clear()

    def cancel_deadlines(self) -> None:
        """No more deadline checks (the log is closed)."""
        if self._deadline_call is not None and self._deadline_call.active():
            self._deadline_call.cancel()


def _sleep(clock: IReactorTime, seconds: float) -> Deferred[None]:
    d: Deferred[None] = defer.Deferred()
    clock.callLater(seconds, d.callback, None)
    return d
