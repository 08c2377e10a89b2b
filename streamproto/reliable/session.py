"""
Session storage for the stateful mode: the spec's Session API as a zope
interface, L{ISessionStore}, with an in-memory and a durable (SQLite)
implementation.

State is opaque to the stores (any JSON-encodable value); messages are
L{Message}C{(id, data)} with ids 1, 2, 3... per session.  Every method
returns a Deferred; errors are L{SessionError}s whose text the server sends
as C{{"error": ...}}.

Expiry: a session is deleted C{expiry} seconds after L{disconnect}, unless a
connection takes it up again before (any other method on it cancels the
timer).  The default, 120 s, outlasts the backoff of a reconnecting client:
the reference client waits 5 s after a refused connect and 5 s more after
each further refusal, so three refusals in a row keep it away 30 s (the
spec's "may be lost after 30 s" allows expiring then; it does not ask for it).  Every disconnect arms its own timer (the reference only ever armed
the first one), timed with an C{IReactorTime} so tests drive a fake clock.
"""

import json
import os
import sqlite3
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

from twisted.internet import defer, threads
from twisted.internet.interfaces import IDelayedCall, IReactorCore, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from zope.interface import Attribute, Interface, implementer

from streamproto.core.clock import SteadyCall, default_reactor, monotonic_seconds, wall_seconds
from streamproto.base.durable import DirectoryIO, make_dirs
from streamproto.log.versions import SESSION_VERSION, NewerFormat, check
from streamproto.reliable.errors import (
    OutOfOrderAck,
    SessionFull,
    StoreFailed,
    UnknownMessageID,
    UnknownSession,
)

DEFAULT_EXPIRY = 120.0
MAX_ID = 0xFFFFFFFF

# one encoder for every row: json.dumps with options builds a new one per call
_encode_json = json.JSONEncoder(separators=(",", ":")).encode


def _encode_data(data):
    """
    JSON of a message's data.  The hot case, a small flat object of integers
    (this server's C{{"value"[, "crc"]}}), is formatted directly: the json
    module costs ~10 us a call for it.  Anything else goes through json.
    """
    if type(data) is dict and len(data) <= 4:
        parts = []
        for key, value in data.items():
            if type(value) is not int or type(key) is not str or not key.isidentifier() \
                    or not key.isascii():
                return _encode_json(data)
            parts.append('"%s":%d' % (key, value))
        return "{" + ",".join(parts) + "}"
    return _encode_json(data)


class Message(NamedTuple):
    """C{Message<T>}: what the server sends, C{{"id": id, "data": data}}."""
    id: int
    data: Any


#: C{transformer(state) -> (data, new_state)}, see L{ISessionStore.put}
Transformer = Callable[[Any], tuple[Any, Any]]


class ISessionStore(Interface):
    """The spec's Session API.  Every method returns a Deferred."""

    expiry = Attribute("Seconds after disconnect() before a session is deleted.")
    closed = Attribute("True once the store is closed: it serves no more calls.")
    failure = Attribute(
        "The StoreFailed that stopped the store (a commit that failed: every call is "
        "refused until it is opened again), or None while it works.  /ready reports both.")

    def register(uuid: str, state: Any) -> defer.Deferred[None]:
        """
        Store a new session with its initial application C{state}; a session
        already stored under C{uuid} is replaced (a client that lost its
        first connection before any message re-sends its params).
        Fires with None once stored.
        """

    def disconnect(uuid: str) -> defer.Deferred[None]:
        """The session's connection is gone: arm its expiry.  Fires with None."""

    def put(uuid: str, transformer: Transformer) -> defer.Deferred[Message]:
        """
        Atomically: load the state, call C{transformer(state) -> (data,
        new_state)} (pure, may be called more than once), give the data the
        next id, store the message and the new state.  Fires with the new
        L{Message} once both are stored (durably, for a durable store).  If
        the transformer raises, nothing is stored and the Deferred fails with
        its exception.
        """

    def after(uuid: str, message_id: int) -> defer.Deferred[Message | None]:
        """
        The stored message right after C{message_id}, or None when
        C{message_id} is the last one generated (the server then calls put).
        Fails with L{UnknownMessageID} beyond the last id, L{OutOfOrderAck}
        when the message was acknowledged (deleted) already.
        """

    def ack(uuid: str, message_id: int) -> defer.Deferred[None]:
        """
        Every message up to C{message_id} was delivered: delete them.  Fails
        with L{UnknownMessageID} beyond the last id and L{OutOfOrderAck}
        below a previous ack.  Fires with None.
        """


class _Session:
    """The in-memory image of one session (both stores keep one)."""

    __slots__ = ("state", "last_id", "acked", "messages", "timer", "since", "left")

    def __init__(self, state, last_id=0, acked=0, messages=(), since=None):
        self.state = state
        self.last_id = last_id
        self.acked = acked
        # unacknowledged messages, ids acked+1 .. last_id, in order
        self.messages = deque(messages)
        self.timer = None
        #: when the session was registered (or recovered), for the expiry log
        self.since = since
        #: when its last connection went away (wall clock: logged, persisted)
        self.left = None


def log_expiry(logger, now, uuid, session):
    """The line every store logs when a session expires: its age, time away, counts."""
    since = session.since if session.since is not None else now
    left = session.left if session.left is not None else now
    logger.info(
        "session {uuid} expired: {age:.1f} s old, {away:.1f} s without a connection, "
        "{messages} sent, {acked} acknowledged",
        uuid=uuid, age=now - since, away=now - left, messages=session.last_id,
        acked=session.acked)


class _SessionTable:
    """
    The Session API's semantics on in-memory sessions, synchronous.  The
    stores wrap it: the memory store returns its results at once, the
    durable one after the changes are committed.
    """

    log = Logger()

    def __init__(self, clock, expiry, on_expire=None, monotonic=None):
        self.clock = clock
        # the reactor's timers follow the wall clock, which may step: each
        # expiry is a SteadyCall, its deadline on this clock
        self.monotonic = monotonic or monotonic_seconds(clock)
        self.expiry = expiry
        self.sessions = {}
        self._on_expire = on_expire

    def _get(self, uuid):
        session = self.sessions.get(uuid)
        if session is None:
            raise UnknownSession(uuid)
        # in use again: whatever expiry was armed no longer applies
        if session.timer is not None:
            if session.timer.active():
                session.timer.cancel()
            session.timer = None
        return session

    def register(self, uuid, state):
        old = self.sessions.get(uuid)
        if old is not None and old.timer is not None and old.timer.active():
            old.timer.cancel()
        session = self.sessions[uuid] = _Session(state, since=wall_seconds(self.clock)())
        return session

    def disconnect(self, uuid, delay=None):
        session = self._get(uuid)
        delay = self.expiry if delay is None else max(0.0, delay)
        session.left = wall_seconds(self.clock)()
        session.timer = SteadyCall(self.clock, delay, self._expire, uuid, session,
                                   monotonic=self.monotonic)
        return session

    def _expire(self, uuid: str, session: _Session) -> None:
        if self.sessions.get(uuid) is not session:
            return
        del self.sessions[uuid]
        log_expiry(self.log, wall_seconds(self.clock)(), uuid, session)
        if self._on_expire is not None:
            self._on_expire(uuid)

    def put(self, uuid, transformer):
        session = self._get(uuid)
        if session.last_id >= MAX_ID:
            raise SessionFull("the session has used every message id")
        data, state = transformer(session.state)
        session.state = state
        session.last_id += 1
        message = Message(session.last_id, data)
        session.messages.append(message)
        return session, message

    def _get_at(self, uuid, message_id):
        """
        Session C{uuid}, where C{message_id} may be acknowledged or read
        after: not past its last message, not before its acknowledged one.

        @raise UnknownMessageID: C{message_id} was never sent.
        @raise OutOfOrderAck: C{message_id} is before the acknowledged one.
        """
        session = self._get(uuid)
        if message_id > session.last_id:
            raise UnknownMessageID(message_id)
        if message_id < session.acked:
            raise OutOfOrderAck(message_id)
        return session

    def after(self, uuid, message_id):
        session = self._get_at(uuid, message_id)
        if message_id == session.last_id:
            return None
        return session.messages[message_id - session.acked]

    def ack(self, uuid, message_id):
        session = self._get_at(uuid, message_id)
        messages = session.messages
        while messages and messages[0].id <= message_id:
            messages.popleft()
        session.acked = message_id
        return session

    def cancel_timers(self):
        for session in self.sessions.values():
            if session.timer is not None and session.timer.active():
                session.timer.cancel()


def _call(f, *args):
    try:
        return defer.succeed(f(*args))
    except Exception:
        return defer.fail()


@implementer(ISessionStore)
class MemorySessionStore:
    """Sessions in memory: lost with the process."""

    def __init__(self, clock: IReactorTime | None = None, expiry: float = DEFAULT_EXPIRY,
                 monotonic: Callable[[], float] | None = None) -> None:
        """
        @param monotonic: the clock expiry deadlines are measured on
            (default: L{monotonic_seconds} of C{clock}); a test's stand-in.
        """
        clock = default_reactor(clock)
        self._table = _SessionTable(clock, expiry, monotonic=monotonic)
        self.closed = False
        #: memory never fails a commit
        self.failure: StoreFailed | None = None

    @property
    def expiry(self) -> float:
        return self._table.expiry

    def register(self, uuid: str, state: Any) -> defer.Deferred[None]:
        return _call(self._register, uuid, state)

    def _register(self, uuid, state):
        self._table.register(uuid, state)

    def disconnect(self, uuid: str) -> defer.Deferred[None]:
        return _call(self._disconnect, uuid)

    def _disconnect(self, uuid):
        self._table.disconnect(uuid)

    def put(self, uuid: str, transformer: Transformer) -> defer.Deferred[Message]:
        return _call(self._put, uuid, transformer)

    def _put(self, uuid, transformer):
        return self._table.put(uuid, transformer)[1]

    def after(self, uuid: str, message_id: int) -> defer.Deferred[Message | None]:
        return _call(self._table.after, uuid, message_id)

    def ack(self, uuid: str, message_id: int) -> defer.Deferred[None]:
        return _call(self._ack, uuid, message_id)

    def _ack(self, uuid, message_id):
        self._table.ack(uuid, message_id)

    def __contains__(self, uuid: str) -> bool:
        return uuid in self._table.sessions

    def close(self) -> defer.Deferred[None]:
        self.closed = True
        self._table.cancel_timers()
        return defer.succeed(None)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    uuid TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    last_id INTEGER NOT NULL,
    acked INTEGER NOT NULL,
    disconnected_at REAL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS messages (
    uuid TEXT NOT NULL,
    id INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (uuid, id)
) WITHOUT ROWID;
"""


class _Batch:
    """
    The changes queued during one reactor turn, committed as one SQLite
    transaction.  Several puts of many sessions coalesce: messages are
    inserted, but each session's row is written once with its latest image.
    """

    def __init__(self):
        self.resets = set()       # sessions whose stored messages all go first
        self.inserts = []         # (uuid, id, data json)
        self.acks = {}            # uuid -> delete messages with id <= this
        self.rows = {}            # uuid -> _Session (write its row) or None (delete it)
        self.disconnected = {}    # uuid -> disconnected_at (None: connected)
        self.waiters = []         # (Deferred, result) fired after the commit

    def __bool__(self):
        return bool(self.waiters or self.rows)


@implementer(ISessionStore)
class SQLiteSessionStore:
    """
    Durable sessions in SQLite (WAL, synchronous=FULL): a session survives a
    crash and restart of the server and continues exactly.

    The store keeps every live session in memory as well (it serves
    L{after} without touching the disk) and writes changes behind, but
    never ahead: no Deferred fires before the transaction holding its change
    has committed.  The changes of one reactor turn, for every session, go
    into one transaction on a dedicated single database thread (group
    commit); while it commits the next batch accumulates.  A put's message
    row and its session's new state are in the same transaction.

    A failed commit leaves the disk behind the memory image, so the store
    then fails every call with L{StoreFailed}; reopening it recovers what
    was committed.
    """

    log = Logger()

    def __init__(self, path: str, clock: IReactorTime | None = None,
                 expiry: float = DEFAULT_EXPIRY, reactor: IReactorCore | None = None,
                 io: DirectoryIO | None = None,
                 monotonic: Callable[[], float] | None = None) -> None:
        """
        @param clock: IReactorTime for expiry (a fake clock in tests).
        @param monotonic: the clock expiry deadlines are measured on within
            this process (default: L{monotonic_seconds} of C{clock}).  The
            disconnection time written to the database stays wall time
            (a monotonic clock means nothing to the next process).
        @param reactor: the reactor that runs the database thread and the
            per-turn flush (default: the global reactor).
        @param io: how directories are made and fsynced (tests record it).
        """
        # (also IReactorTime and IReactorFromThreads: no one interface says all that)
        the_reactor = default_reactor(reactor)
        self.path = path
        self._reactor = the_reactor
        self._clock = clock or the_reactor
        self._table = _SessionTable(self._clock, expiry, on_expire=self._expired,
                                    monotonic=monotonic)
        self._pending = _Batch()
        self._flush_call: IDelayedCall | None = None
        # the transaction in progress
        self._committing: defer.Deferred[Any] | None = None
        self._failure: StoreFailed | None = None
        self._closed = False
        directory = os.path.dirname(os.path.abspath(path))
        io = io or DirectoryIO()
        # the directories made for it survive a power loss (SQLite makes
        # its own files durable, never the directories above them)
        make_dirs(directory, io)
        # opened and recovered synchronously: this happens once, at startup
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # today's schema is version 1 (0: written before versions were kept)
        (version,), = self._db.execute("PRAGMA user_version").fetchall()
        try:
            check(f"session store {path}", version, SESSION_VERSION)
        except NewerFormat as e:
            self._db.close()
            raise StoreFailed(str(e))
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        # the database's own name, whatever SQLite syncs of it
        io.fsync_dir(directory)
        self._recover()
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name="reliable-sessions")
        self._pool.start()
        # a non-daemon thread left running would keep the process alive
        self._shutdown_trigger = the_reactor.addSystemEventTrigger(
            "during", "shutdown", self._stop_pool)

    @property
    def expiry(self) -> float:
        return self._table.expiry

    def _recover(self):
        now = wall_seconds(self._clock)()
        messages: dict[str, list[Message]] = {}
        for uuid, message_id, data in self._db.execute(
                "SELECT uuid, id, data FROM messages ORDER BY uuid, id"):
            messages.setdefault(uuid, []).append(Message(message_id, json.loads(data)))
        count = 0
        for uuid, state, last_id, acked, disconnected_at in self._db.execute(
                "SELECT uuid, state, last_id, acked, disconnected_at FROM sessions"):
            session = _Session(json.loads(state), last_id, acked, messages.get(uuid, ()),
                               since=now)
            self._table.sessions[uuid] = session
            # every recovered session is disconnected now; one that was still
            # connected when the server stopped gets a full expiry from now
            start = now if disconnected_at is None else min(disconnected_at, now)
            self._table.disconnect(uuid, delay=start + self._table.expiry - now)
            session.left = start
            count += 1
        if count:
            self.log.info("recovered {count} reliable-stream sessions from {path}",
                          count=count, path=self.path)

    # The write-behind queue

    def _queue(self, result):
        """A Deferred firing with C{result} after the current batch commits."""
        d: defer.Deferred[Any] = defer.Deferred()
        self._pending.waiters.append((d, result))
        self._schedule()
        return d

    def _schedule(self):
        if self._flush_call is None and self._committing is None:
            self._flush_call = self._reactor.callLater(0, self._flush)

    def _flush(self):
        self._flush_call = None
        batch, self._pending = self._pending, _Batch()
        if not batch:
            return
        rows = []
        for uuid, session in batch.rows.items():
            if session is not None:
                rows.append((uuid, _encode_json(session.state), session.last_id, session.acked,
                             batch.disconnected.get(uuid)))
        deleted = [(uuid,) for uuid, session in batch.rows.items() if session is None]
        self._committing = threads.deferToThreadPool(
            self._reactor, self._pool, self._commit, batch, rows, deleted)
        self._committing.addBoth(self._committed, batch)

    def _commit(self, batch, rows, deleted):
        """In the database thread: one transaction for the whole batch."""
        db = self._db
        db.execute("BEGIN")
        try:
            if batch.resets:
                db.executemany("DELETE FROM messages WHERE uuid = ?",
                               [(u,) for u in batch.resets])
            if batch.inserts:
                db.executemany("INSERT INTO messages (uuid, id, data) VALUES (?, ?, ?)",
                               batch.inserts)
            if batch.acks:
                db.executemany("DELETE FROM messages WHERE uuid = ? AND id <= ?",
                               list(batch.acks.items()))
            if rows:
                db.executemany(
                    "INSERT OR REPLACE INTO sessions (uuid, state, last_id, acked, "
                    "disconnected_at) VALUES (?, ?, ?, ?, ?)", rows)
            if deleted:
                db.executemany("DELETE FROM sessions WHERE uuid = ?", deleted)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _committed(self, outcome, batch):
        self._committing = None
        if isinstance(outcome, Failure):
            self.log.failure("reliable-stream session commit failed; store stops",
                             outcome)
            self._failure = StoreFailed(f"session store failed: {outcome.value}")
            for d, _ in batch.waiters:
                d.errback(StoreFailed(str(self._failure)))
            pending, self._pending = self._pending, _Batch()
            for d, _ in pending.waiters:
                d.errback(StoreFailed(str(self._failure)))
            return
        for d, result in batch.waiters:
            d.callback(result)
        if self._pending:
            self._schedule()

    def _check(self):
        if self._failure is not None:
            raise StoreFailed(str(self._failure))
        if self._closed:
            raise StoreFailed("session store closed")

    # ISessionStore

    def register(self, uuid: str, state: Any) -> defer.Deferred[None]:
        try:
            self._check()
            _encode_json(state)  # refuse what could not be stored, before changing anything
            session = self._table.register(uuid, state)
        except Exception:
            return defer.fail()
        batch = self._pending
        batch.resets.add(uuid)
        batch.inserts = [row for row in batch.inserts if row[0] != uuid]
        batch.acks.pop(uuid, None)
        batch.rows[uuid] = session
        batch.disconnected[uuid] = None
        return self._queue(None)

    def disconnect(self, uuid: str) -> defer.Deferred[None]:
        try:
            self._check()
            session = self._table.disconnect(uuid)
        except Exception:
            return defer.fail()
        self._pending.rows[uuid] = session
        self._pending.disconnected[uuid] = wall_seconds(self._clock)()
        return self._queue(None)

    def put(self, uuid: str, transformer: Transformer) -> defer.Deferred[Message]:
        try:
            self._check()
            session, message = self._table.put(uuid, transformer)
            data = _encode_data(message.data)
        except Exception:
            return defer.fail()
        batch = self._pending
        batch.inserts.append((uuid, message.id, data))
        batch.rows[uuid] = session
        batch.disconnected[uuid] = None
        return self._queue(message)

    def after(self, uuid: str, message_id: int) -> defer.Deferred[Message | None]:
        try:
            self._check()
            message = self._table.after(uuid, message_id)
        except Exception:
            return defer.fail()
        if not self._pending and self._committing is None:
            return defer.succeed(message)
        # the message may still be on its way to the disk: answer after it is there
        return self._queue(message)

    def ack(self, uuid: str, message_id: int) -> defer.Deferred[None]:
        try:
            self._check()
            session = self._table.ack(uuid, message_id)
        except Exception:
            return defer.fail()
        batch = self._pending
        batch.acks[uuid] = max(batch.acks.get(uuid, 0), message_id)
        batch.rows[uuid] = session
        batch.disconnected[uuid] = None
        return self._queue(None)

    def _expired(self, uuid):
        if self._failure is not None or self._closed:
            return
        batch = self._pending
        batch.resets.add(uuid)
        batch.inserts = [row for row in batch.inserts if row[0] != uuid]
        batch.acks.pop(uuid, None)
        batch.rows[uuid] = None
        self._schedule()

    def __contains__(self, uuid: str) -> bool:
        return uuid in self._table.sessions

    @property
    def closed(self) -> bool:
        """True once L{close} completed (or the reactor shut the thread down)."""
        return self._closed

    @property
    def failure(self) -> StoreFailed | None:
        """The L{StoreFailed} a failed commit left, or None while the store works."""
        return self._failure

    @defer.inlineCallbacks
    def close(self) -> Generator[defer.Deferred[Any], Any, None]:
        """Commit what is queued, then close the database and its thread."""
        if self._closed:
            return
        while self._pending or self._committing is not None or self._flush_call is not None:
            if self._flush_call is not None:
                self._flush_call.cancel()
                self._flush()
            if self._committing is not None:
                yield self._committing
        self._closed = True
        self._table.cancel_timers()
        yield threads.deferToThreadPool(self._reactor, self._pool, self._db.close)
        self._reactor.removeSystemEventTrigger(self._shutdown_trigger)
        self._pool.stop()

    def _stop_pool(self):
        self._closed = True
        self._pool.stop()
