"""
An in-memory stand-in for the asyncio side of the JetStream store
(L{streamproto.log.natsio.NatsIO}): the same coroutine methods, a stream
model with JetStream's expectation checks and de-duplication, and knobs
to hold acknowledgements, lose them, refuse publishes or be unreachable.
With L{InlineBridge} the store runs synchronously on it, so the chain's
corner cases (windows, conflicts, timeouts, outages) are tested
deterministically; the real cluster tests cover the real client.  No
tests here.
"""

import json
import time
from collections import deque

from twisted.internet.defer import fail, succeed

from streamproto.log.natsformat import EXPECTED_LAST_MSG_ID, EXPECTED_LAST_SEQUENCE, MSG_ID
from streamproto.log.natsio import (
    NO_MESSAGE_FOUND, STREAM_NAME_IN_USE, WRONG_LAST_MSG_ID, WRONG_LAST_SEQUENCE,
    JetStreamError, NotAvailable, PublishOutcome, StoredMsg,
)


class InlineBridge:
    """Runs the fake's coroutines inline (they never suspend)."""

    def call(self, coroutine_function, *args, **kwargs):
        coroutine = coroutine_function(*args, **kwargs)
        try:
            coroutine.send(None)
        except StopIteration as e:
            return succeed(e.value)
        except Exception as e:
            return fail(e)
        coroutine.close()
        raise AssertionError("a fake coroutine suspended")

    def call_soon(self, f, *args):
        f(*args)

    def post(self, f, *args):
        f(*args)

    def begin(self):
        pass

    def end(self):
        pass

    def stop(self):
        pass


def _rfc3339(seconds):
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(seconds)))
    return f"{whole}.{int((seconds % 1) * 1e9):09d}Z"


class FakeStream:
    def __init__(self, config):
        self.config = config
        self.messages = {}       # seq -> (subject, headers, body)
        self.first_seq = 1
        self.last_seq = 0
        self.last_msg_id = ""
        self.dedup = {}
        self.watchers = []

    def state(self):
        return {"first_seq": self.first_seq, "last_seq": self.last_seq,
                "messages": len(self.messages)}


class FakeWatch:
    def __init__(self, stream, callback, start_seq):
        self.stream = stream
        self.callback = callback
        self.next_seq = start_seq
        self.stopped = False

    async def stop(self):
        self.stopped = True
        if self in self.stream.watchers:
            self.stream.watchers.remove(self)


class FakeJetStream:
    """
    @ivar down: every call fails with L{NotAvailable}.
    @ivar hold: publish outcomes wait in C{held} until L{release}.
    @ivar faults: per publish, in order: C{"lose-ack"} (stored, then a
        timeout), C{"timeout"} (not stored, a timeout), C{"late"} (a
        timeout, then stored when L{apply_late} is called, as a new leader
        applies what the old one had replicated: its expectations are
        checked then), C{"refused-late"} (refused as a stale leader does,
        with a wrong last sequence, and stored when L{apply_late} is
        called, as the new leader stores the copy a route held through a
        partition), or a JetStream C{err_code} (refused with it).
    @ivar deliver: watchers get new messages at once (else on L{deliver_now}).
    """

    def __init__(self, max_payload=1 << 20):
        self.max_payload = max_payload
        self.streams = {}
        self.connected = True
        self.last_error = None
        self.on_reconnect = None
        self.down = False
        self.hold = False
        self.held = deque()
        self.faults = deque()
        self.deliver = True
        self.published = []       # (subject, headers, body) in the order received
        self.late = deque()       # publishes timed out, to be applied later
        self.paused = []          # the seconds of each pause between two tries
        self.wall = None          # the leader's clock (stream ages) when a test sets one
        self.added = []           # the stream names of every add_stream asked
        self.add_stream_faults = deque()  # err_codes the next add_streams are refused with
        self.info_unavailable = 0  # how many next stream_infos find no meta leader

    def _check(self):
        if self.down:
            raise NotAvailable("fake cluster down")

    async def connect(self):
        self._check()

    async def close(self):
        pass

    async def pause(self, seconds):
        """Instant: the seconds are counted in C{paused}."""
        self.paused.append(seconds)

    async def stream_info(self, name):
        self._check()
        if self.info_unavailable:
            self.info_unavailable -= 1
            raise NotAvailable("no meta leader (fake)")
        s = self.streams.get(name)
        if s is None:
            return None
        info = {"config": s.config, "state": s.state()}
        if self.wall is not None:
            info.update(created=_rfc3339(s.created), ts=_rfc3339(self.wall()))
        return info

    async def add_stream(self, config):
        self._check()
        self.added.append(config["name"])
        if self.add_stream_faults:
            raise JetStreamError("refused", 400, self.add_stream_faults.popleft())
        if config["name"] in self.streams:
            raise JetStreamError("stream name already in use", 400, STREAM_NAME_IN_USE)
        self.streams[config["name"]] = stream = FakeStream(json.loads(json.dumps(config)))
        stream.created = self.wall() if self.wall is not None else 0.0
        return {"config": config}

    async def delete_stream(self, name):
        self._check()
        return self.streams.pop(name, None) is not None

    async def purge(self, name, seq):
        self._check()
        s = self.streams[name]
        purged = [q for q in s.messages if q < seq]
        for q in purged:
            del s.messages[q]
        s.first_seq = max(s.first_seq, seq)
        return len(purged)

    async def stream_names(self, subject_filter):
        self._check()
        prefix = subject_filter.split(".")[0] + "."
        return sorted(n for n, s in self.streams.items()
                      if s.config["subjects"][0].startswith(prefix))

    async def get_direct(self, stream, seq):
        return await self.get(stream, seq)

    async def get(self, stream, seq=None, last=None, next=None, start_time=None, timeout=None):
        self._check()
        s = self.streams.get(stream)
        if s is None:
            raise JetStreamError("stream not found", 404, 10059)
        found = None
        if last is not None:
            for q in sorted(s.messages, reverse=True):
                if _matches(s.messages[q][0], last):
                    found = q
                    break
        elif next is not None:
            for q in sorted(s.messages):
                if q >= (seq or 1) and _matches(s.messages[q][0], next):
                    found = q
                    break
        elif seq in s.messages:
            found = seq
        if found is None:
            return None
        subject, headers, body = s.messages[found]
        return StoredMsg(found, subject, dict(headers), body, None)

    def _stream_of(self, subject):
        for s in self.streams.values():
            if _matches(subject, s.config["subjects"][0]):
                return s
        return None

    def store(self, subject, headers, body):
        """Apply a publish as JetStream would: dedup, expectations, then store."""
        s = self._stream_of(subject)
        if s is None:
            return PublishOutcome(error=NotAvailable("no responders"))
        msg_id = headers.get(MSG_ID)
        if msg_id in s.dedup:
            return PublishOutcome(s.dedup[msg_id], True)
        expected = headers.get(EXPECTED_LAST_SEQUENCE)
        if expected is not None and int(expected) != s.last_seq:
            return PublishOutcome(error=JetStreamError(
                f"wrong last sequence: {s.last_seq}", 400, WRONG_LAST_SEQUENCE))
        expected_id = headers.get(EXPECTED_LAST_MSG_ID)
        if expected_id is not None and expected_id != s.last_msg_id:
            return PublishOutcome(error=JetStreamError(
                f"wrong last msg ID: {s.last_msg_id}", 400, WRONG_LAST_MSG_ID))
        s.last_seq += 1
        s.messages[s.last_seq] = (subject, dict(headers), bytes(body))
        s.last_msg_id = msg_id or ""
        if msg_id:
            s.dedup[msg_id] = s.last_seq
        if self.deliver:
            self.deliver_now()
        return PublishOutcome(s.last_seq)

    def publish(self, subject, headers, body, callback):
        self.published.append((subject, dict(headers), bytes(body)))
        fault = self.faults.popleft() if self.faults else None
        if fault == "late":
            self.late.append((subject, dict(headers), bytes(body)))
            outcome = PublishOutcome(error=NotAvailable("no publish acknowledgement"))
        elif fault == "refused-late":
            self.late.append((subject, dict(headers), bytes(body)))
            outcome = PublishOutcome(error=JetStreamError(
                "wrong last sequence", 400, WRONG_LAST_SEQUENCE))
        elif self.down or fault == "timeout":
            outcome = PublishOutcome(error=NotAvailable("no publish acknowledgement"))
        elif fault == "lose-ack":
            self.store(subject, headers, body)
            outcome = PublishOutcome(error=NotAvailable("no publish acknowledgement"))
        elif isinstance(fault, int):
            outcome = PublishOutcome(error=JetStreamError("refused", 400, fault))
        else:
            outcome = self.store(subject, headers, body)
        if self.hold:
            self.held.append((callback, outcome))
        else:
            callback(outcome)

    def apply_late(self):
        """
        Apply the C{"late"} publishes now.

        @return: their outcomes (a late message that no longer meets its
            expectations is not stored).
        """
        outcomes = []
        while self.late:
            outcomes.append(self.store(*self.late.popleft()))
        return outcomes

    def release(self, n=None):
        """Hand over C{n} held outcomes (all by default), oldest first."""
        count = 0
        while self.held and (n is None or count < n):
            callback, outcome = self.held.popleft()
            callback(outcome)
            count += 1

    async def watch(self, stream, subject_filter, start_seq, callback):
        self._check()
        s = self.streams[stream]
        w = FakeWatch(s, callback, start_seq)
        s.watchers.append(w)
        self._deliver(s, w)
        return w

    def deliver_now(self):
        for s in self.streams.values():
            for w in list(s.watchers):
                self._deliver(s, w)

    def _deliver(self, s, w):
        events = []
        while w.next_seq <= s.last_seq:
            if w.next_seq in s.messages:
                subject, headers, _body = s.messages[w.next_seq]
                events.append((w.next_seq, subject, dict(headers)))
            w.next_seq += 1
        if events and not w.stopped:
            w.callback(events)

    async def watch_advisories(self, callback):
        return []


def _matches(subject, pattern):
    if pattern.endswith(".*"):
        head = pattern[:-1]
        return subject.startswith(head) and "." not in subject[len(head):]
    if pattern.endswith(".>"):
        return subject.startswith(pattern[:-1])
    return subject == pattern


__all__ = ["FakeJetStream", "InlineBridge", "NO_MESSAGE_FOUND"]
