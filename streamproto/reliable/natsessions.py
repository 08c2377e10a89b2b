"""
L{JetStreamSessionStore}: reliable-stream sessions in a JetStream key-value
bucket, so that a session resumes on whichever front-end its client reaches
next (C{reliable-stream-server --store nats://...}, doc/scale-out.rst).

One key per session (its uuid, hex-encoded when it holds characters a key
may not), whose value is the whole session as JSON: the application state,
the last message id, the acknowledged id, the unacknowledged messages, and
when its last connection went away.  Every change is a compare-and-set on
the entry's revision (C{kv.update(..., last=revision)}), so two front-ends
never overwrite each other: the loser reads the newer entry and applies its
change again (transformers are pure, as L{ISessionStore} says).  A change is
acknowledged once the bucket's stream (its replicas: a quorum) stored it.

Each front-end keeps the entries it touched, with their revisions: a change
to a session connected here costs one round trip (the compare-and-set
catches any other writer: then it reads and applies the change again); a
session whose connection here went away is read again before it is used,
since its client may have gone on through another front-end.

Expiry: C{disconnect} records the time in the entry and arms a timer here;
when it fires, the entry is deleted (compare-and-set again) unless a
connection took the session up since.  A front-end that dies with armed
timers leaves them to the others: each sweeps the bucket every C{expiry}
seconds and deletes what has been disconnected longer than C{expiry}.  Any
call on such a session finds it expired too.  A disconnection this
front-end saw expires at a deadline on its own monotonic clock (a timer
that a forward step of the wall clock fires early re-arms); one it did not
see is judged on the wall times in the entry, so front-ends' clocks must
agree to within a fraction of C{expiry}.

The NATS client is asyncio: it runs on the bridge's loop thread
(L{streamproto.log.bridge.AsyncioThreadBridge}); the reactor never waits.
"""

import asyncio
import json
import random
import re

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.core.clock import SteadyCall, default_reactor, monotonic_seconds, wall_seconds
from streamproto.core.interfaces import IReadiness
from streamproto.core.observer import SharedCall
from streamproto.log.interfaces import IStartingStore
from streamproto.log.versions import SESSION_VERSION, check_mapping
from streamproto.reliable.errors import StoreFailed, StoreUnavailable, UnknownSession
from streamproto.reliable.session import (
    DEFAULT_EXPIRY, ISessionStore, Message, _Session, _SessionTable, log_expiry,
)

_KEY = re.compile(r"^[-_=.a-zA-Z0-9]{1,200}$")
#: attempts of one change against other front-ends' changes
ATTEMPTS = 8
#: seconds: the first retry after a conflict waits up to this, each next one twice as long
CONFLICT_BACKOFF = 0.005


def _key(uuid):
    if _KEY.match(uuid) and not uuid.startswith("x."):
        return uuid
    return "x." + uuid.encode("utf-8").hex()


class _Conflict(Exception):
    """Another front-end changed the entry first."""


@implementer(ISessionStore, IReadiness, IStartingStore)
class JetStreamSessionStore:
    """
    @param servers: C{nats://}/C{tls://} URLs of the cluster.
    @param prefix: the store's prefix: the bucket is C{PREFIX_reliable}.
    @param replicas: of the bucket (default 3 with three or more servers).
    @param tls: an C{ssl.SSLContext} for C{tls://}.
    """

    log = Logger()

    def __init__(self, servers, clock=None, expiry=DEFAULT_EXPIRY, prefix="streamproto",
                 replicas=None, tls=None, bridge=None, timeout=10.0, monotonic=None):
        from streamproto.log.bridge import AsyncioThreadBridge
        from streamproto.log.natsio import NatsIO
        clock = default_reactor(clock)
        self.clock = clock
        self.expiry = expiry
        self.servers = list(servers)
        self.bucket = f"{prefix}_reliable"
        self.replicas = replicas or (3 if len(self.servers) >= 3 else 1)
        # the real reactor: results come back with its callFromThread (the clock
        # may be a test's Clock, which only times the expiry)
        self.bridge = bridge or AsyncioThreadBridge()
        self.io = NatsIO(self.servers, self.bridge, tls=tls, name="streamproto-reliable",
                         api_timeout=min(5.0, timeout))
        self._kv = None
        # start() while connecting waits for that one attempt
        self._starting = SharedCall(self._start_once)
        # the entries this front-end touched: uuid -> (revision, _Session)
        self._known = {}
        # sessions whose connection here went away: re-read before use
        self._away = set()
        self._queues = {}
        self._busy = set()
        self._timers = {}
        # uuid -> (left, deadline): the disconnections this front-end saw,
        # each expiring at a deadline on this process's monotonic clock
        # (the wall clock the bucket holds may step; ours does not)
        self._deadlines = {}
        self._monotonic = monotonic or monotonic_seconds(clock)
        self._sweep = None
        self.closed = False
        self.failure = None
        # the Session API's semantics, on one session image at a time
        self._table = _SessionTable(clock, expiry)

    # -- the connection ------------------------------------------------------
    def start(self):
        """Connect and open (or create) the bucket (once; again after a failure)."""
        if self._kv is not None:
            return defer.succeed(None)
        return self._starting()

    def _start_once(self):
        return self._call(self._open).addCallbacks(self._open_done, self._open_failed)

    def _open_failed(self, failure):
        raise StoreUnavailable(f"session store {self.bucket} on {','.join(self.servers)}: "
                          f"{failure.getErrorMessage()}")

    def _open_done(self, _):
        if self._sweep is None and not self.closed:
            from twisted.internet.task import LoopingCall
            self._sweep = LoopingCall(self._sweep_expired)
            self._sweep.clock = self.clock
            self._sweep.start(self.expiry, now=False)

    def _call(self, coroutine_function, *args):
        return self.bridge.call(coroutine_function, *args)

    async def _open(self):
        import nats.js.errors
        await self.io.connect()
        try:
            self._kv = await self.io.js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            from nats.js.api import KeyValueConfig, StorageType
            try:
                self._kv = await self.io.js.create_key_value(KeyValueConfig(
                    bucket=self.bucket, history=1, replicas=self.replicas,
                    storage=StorageType.FILE))
            except nats.js.errors.BadRequestError:
                # another front-end created it a moment ago
                self._kv = await self.io.js.key_value(self.bucket)

    async def _get(self, uuid):
        import nats.js.errors
        try:
            entry = await self._kv.get(_key(uuid))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if entry.value is None:
            return None
        return entry.revision, entry.value

    async def _write(self, uuid, revision, value):
        """Store C{value} if the entry is still at C{revision} (None: absent)."""
        import nats.js.errors
        key = _key(uuid)
        try:
            if revision is None:
                return await self._kv.create(key, value)
            return await self._kv.update(key, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _Conflict(uuid)

    async def _delete(self, uuid, revision):
        import nats.js.errors
        try:
            await self._kv.delete(_key(uuid), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _Conflict(uuid)

    async def _keys(self):
        import nats.js.errors
        try:
            return await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return []

    # -- changes: queued per session, applied in batches ---------------------
    def _submit(self, uuid, op):
        """
        Queue C{op(image) -> (result, image)} for session C{uuid}.  Every op
        queued while the previous batch was being written goes into the next
        one: one read-modify-write (one round trip) for many puts, and the
        Deferreds fire in a loop (no recursion however many wait).
        """
        if self.closed:
            return defer.fail(StoreFailed("session store closed"))
        d = defer.Deferred()
        self._queues.setdefault(uuid, []).append((op, d))
        if uuid not in self._busy:
            self._run(uuid)
        return d

    @defer.inlineCallbacks
    def _run(self, uuid):
        self._busy.add(uuid)
        try:
            while self._queues.get(uuid):
                batch = self._queues.pop(uuid)
                try:
                    outcomes = yield self._apply(uuid, [op for op, _ in batch])
                except Exception as e:  # noqa: BLE001 - the batch fails as one
                    if not isinstance(e, (StoreFailed, UnknownSession)):
                        # the cluster did not answer (or not in time)
                        e = StoreUnavailable(f"session store: {e}")
                    outcomes = [(False, e)] * len(batch)
                for (_, d), (ok, value) in zip(batch, outcomes):
                    if ok:
                        d.callback(value)
                    else:
                        d.errback(value)
        finally:
            self._busy.discard(uuid)

    @defer.inlineCallbacks
    def _apply(self, uuid, ops):
        """
        Apply C{ops} in order to the newest image and store the result with
        a compare-and-set (or delete the entry when it ends as None); again
        from a fresh read when another front-end wrote first.
        @return: [(ok, result or exception)] per op.
        """
        yield self.start()
        for attempt in range(ATTEMPTS):
            revision, session = yield self._load(uuid, fresh=attempt > 0)
            image = _copy(session) if session is not None else None
            changed = False
            outcomes = []
            for op in ops:
                try:
                    result, new = op(image)
                except Exception as e:  # noqa: BLE001 - that op fails, the others go on
                    outcomes.append((False, e))
                    continue
                if new is not image or new is None or op.writes:
                    changed = True
                image = new
                outcomes.append((True, result))
            if not changed:
                return outcomes
            try:
                if image is None:
                    if revision is not None:
                        yield self._call(self._delete, uuid, revision)
                    self._forget(uuid)
                else:
                    new_revision = yield self._call(self._write, uuid, revision,
                                                    _encode(image))
                    self._known[uuid] = (new_revision, image)
            except _Conflict:
                # another front-end wrote first.  Wait a random moment
                # before reading again: two front-ends that keep racing in
                # step would otherwise keep the one that must re-read losing.
                # The wait is on the bridge's loop, in real time: self.clock
                # times the expiry and may be a test's Clock nobody advances
                yield self._call(asyncio.sleep,
                                 random.uniform(0, CONFLICT_BACKOFF * 2 ** attempt))
                continue
            return outcomes
        raise StoreUnavailable(f"session {uuid}: {ATTEMPTS} conflicting changes in a row")

    @defer.inlineCallbacks
    def _load(self, uuid, fresh=False):
        """
        (revision, image) of the session: the one held here, else the
        bucket's; (None, None) when it has none.  Expired entries are gone.
        """
        known = self._known.get(uuid)
        if known is not None and not fresh and uuid not in self._away:
            return known
        if uuid in self._away:
            self._away.discard(uuid)
        found = yield self._call(self._get, uuid)
        if found is None:
            self._known.pop(uuid, None)
            return None, None
        revision, value = found
        session = _decode(value)
        if self._expired(uuid, session, wall_seconds(self.clock)()):
            # expired while nobody was here to see it
            yield self._call(self._delete, uuid, revision).addErrback(lambda f: None)
            self._forget(uuid)
            return None, None
        self._known[uuid] = (revision, session)
        return revision, session

    def _with_table(self, session, uuid, method, *args):
        """Run a L{_SessionTable} method on C{session} alone."""
        if session is None:
            raise UnknownSession(uuid)
        table = self._table
        table.sessions = {uuid: session}
        try:
            return method(uuid, *args)
        finally:
            table.sessions = {}

    # -- ISessionStore --------------------------------------------------------
    def register(self, uuid, state):
        self._disarm(uuid)
        now = wall_seconds(self.clock)()

        def register(image):
            return None, _Session(state, since=now)
        return self._submit(uuid, _op(register, writes=True))

    def disconnect(self, uuid):
        now = wall_seconds(self.clock)()

        def left(image):
            if image is None:
                raise UnknownSession(uuid)
            image.left = now
            return None, image

        def armed(result):
            self._arm(uuid, now)
            # its client may come back through another front-end: the image
            # held here is read again before it is used
            self._away.add(uuid)
            return result
        return self._submit(uuid, _op(left, writes=True)).addCallback(armed)

    def put(self, uuid, transformer):
        def put(image):
            _, message = self._with_table(image, uuid, self._table.put, transformer)
            image.left = None
            return message, image
        return self._in_use(uuid, put, writes=True)

    def after(self, uuid, message_id):
        def after(image):
            result = self._with_table(image, uuid, self._table.after, message_id)
            if image.left is not None:
                image = _copy(image)       # taken up again: the bucket says so too
                image.left = None
            return result, image
        return self._in_use(uuid, after, writes=False)

    def ack(self, uuid, message_id):
        def ack(image):
            self._with_table(image, uuid, self._table.ack, message_id)
            image.left = None
            return None, image
        return self._in_use(uuid, ack, writes=True)

    def _in_use(self, uuid, op, writes):
        """
        Queue C{op} for session C{uuid}, which its client is using: it does
        not expire meanwhile (its timer is disarmed before the op runs).
        """
        self._disarm(uuid)
        return self._submit(uuid, _op(op, writes=writes))

    def __contains__(self, uuid):
        return uuid in self._known

    # -- expiry ----------------------------------------------------------------
    def _expired(self, uuid, session, now):
        """
        Has C{session}, read from the bucket, been away C{expiry} seconds?
        On the monotonic deadline when this front-end saw it go; else
        (another front-end's) on the wall times the bucket holds.
        """
        if session.left is None:
            return False
        mine = self._deadlines.get(uuid)
        if mine is not None and mine[0] == session.left:
            return self._monotonic() >= mine[1]
        return now - session.left >= self.expiry

    def _arm(self, uuid, left):
        self._disarm(uuid)
        self._deadlines[uuid] = (left, self._monotonic() + self.expiry)
        self._timers[uuid] = SteadyCall(self.clock, self.expiry, self._expire, uuid, left,
                                        monotonic=self._monotonic)

    def _disarm(self, uuid):
        timer = self._timers.pop(uuid, None)
        if timer is not None and timer.active():
            timer.cancel()

    def _expire(self, uuid, left):
        self._timers.pop(uuid, None)
        known = self._known.get(uuid)
        if known is None or known[1].left != left:
            return
        session = known[1]
        self._forget(uuid)
        self._log_expiry(uuid, session)
        # fresh from the bucket: deleted unless taken up again elsewhere since
        self._away.add(uuid)

        def expire(image):
            if image is None or image.left != left:
                return None, image
            return None, None
        self._submit(uuid, _op(expire, writes=False)).addErrback(
            lambda f: self.log.warn("session {uuid}: expiry not written yet ({error}); the "
                                    "sweep will", uuid=uuid, error=f.getErrorMessage()))

    def _log_expiry(self, uuid, session):
        log_expiry(self.log, wall_seconds(self.clock)(), uuid, session)

    def _forget(self, uuid):
        self._known.pop(uuid, None)
        self._deadlines.pop(uuid, None)
        self._away.discard(uuid)
        self._disarm(uuid)

    @defer.inlineCallbacks
    def _sweep_expired(self):
        """Delete what a vanished front-end left disconnected for longer than C{expiry}."""
        try:
            keys = yield self._call(self._keys)
            now = wall_seconds(self.clock)()
            for key in keys:
                uuid = bytes.fromhex(key[2:]).decode() if key.startswith("x.") else key
                found = yield self._call(self._get, uuid)
                if found is None:
                    continue
                revision, value = found
                session = _decode(value)
                if self._expired(uuid, session, now):
                    yield self._call(self._delete, uuid, revision).addErrback(
                        lambda f: None)
                    if uuid in self._known:
                        self._forget(uuid)
                    self._log_expiry(uuid, session)
        except Exception as e:  # noqa: BLE001 - a sweep that fails runs again later
            self.log.warn("session store sweep: {error}", error=e)

    # -- the rest ----------------------------------------------------------------
    def open_logs(self):
        return []

    def problems(self):
        if self.closed:
            return ["session store closed"]
        if self._kv is not None and not self.io.connected:
            return [f"session store {self.bucket}: disconnected"
                    + (f" ({self.io.last_error})" if self.io.last_error else "")]
        return []

    @defer.inlineCallbacks
    def close(self):
        if self.closed:
            return
        self.closed = True
        for uuid in list(self._timers):
            self._disarm(uuid)
        if self._sweep is not None and self._sweep.running:
            self._sweep.stop()
        try:
            yield self._call(self.io.close)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self.bridge.stop()


def _op(function, writes):
    """An operation on a session image; C{writes}: it changes the entry."""
    function.writes = writes
    return function


def _encode(session):
    return json.dumps({
        "state": session.state, "last_id": session.last_id, "acked": session.acked,
        "messages": [[m.id, m.data] for m in session.messages],
        "since": session.since, "left": session.left,
    }, separators=(",", ":")).encode()


def _decode(value):
    doc = json.loads(value)
    check_mapping("a reliable-stream session entry", doc, SESSION_VERSION)
    session = _Session(doc["state"], doc["last_id"], doc["acked"],
                       [Message(i, data) for i, data in doc["messages"]], doc.get("since"))
    session.left = doc.get("left")
    return session


def _copy(session):
    return _decode(_encode(session))
