"""
Reliable-stream sessions carried along by C{streamproto store copy}: they
are not logs (SQLite under C{--data}, or the JetStream bucket
C{PREFIX_reliable}), so the copy reads and writes them here.

A session travels as the document the bucket stores
(L{streamproto.reliable.natsessions}): state, last id, acknowledged id,
the unacknowledged messages, when it was registered and when its
connection went away.  Both sides read it without changing the source: the
SQLite file opened read-only (a running server's WAL is fine), the bucket
read without creating it or sweeping it.  A destination holding a session
of the same uuid with other content is refused; the same content is
skipped (a copy run again).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred

#: a session as the bucket stores it
Doc = dict[str, Any]


class SessionConflict(Exception):
    """The destination holds another session of the same uuid."""


def same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two documents are the same session (when it registered aside: SQLite forgets it)."""
    keys = ("state", "last_id", "acked", "messages", "left")
    return all(a.get(k) == b.get(k) for k in keys)


class SQLiteSessions:
    """The sessions of a data directory (C{reliable-sessions.sqlite})."""

    def __init__(self, directory: str) -> None:
        from streamproto.reliable.tap import SQLITE_FILE
        self.path = os.path.join(directory, SQLITE_FILE)

    def read(self) -> Deferred[dict[str, Doc]]:
        return defer.maybeDeferred(self._read)

    def _read(self) -> dict[str, Doc]:
        if not os.path.exists(self.path):
            return {}
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            from streamproto.log.versions import SESSION_VERSION, check
            (version,), = db.execute("PRAGMA user_version").fetchall()
            check(f"session store {self.path}", version, SESSION_VERSION)
            docs: dict[str, Doc] = {}
            for uuid, state, last_id, acked, left in db.execute(
                    "SELECT uuid, state, last_id, acked, disconnected_at FROM sessions"):
                docs[uuid] = {"state": json.loads(state), "last_id": last_id, "acked": acked,
                              "messages": [], "since": None, "left": left}
            for uuid, message_id, data in db.execute(
                    "SELECT uuid, id, data FROM messages ORDER BY uuid, id"):
                if uuid in docs:
                    docs[uuid]["messages"].append([message_id, json.loads(data)])
            return docs
        finally:
            db.close()

    def write(self, docs: Mapping[str, Doc]) -> Deferred[int]:
        return defer.maybeDeferred(self._write, docs)

    def _write(self, docs: Mapping[str, Doc]) -> int:
        from streamproto.reliable.session import _SCHEMA
        present = self._read()
        for uuid, doc in docs.items():
            if uuid in present and not same(present[uuid], doc):
                raise SessionConflict(f"session {uuid}: the destination holds another "
                                      "session with this uuid")
        new = {uuid: doc for uuid, doc in docs.items() if uuid not in present}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            db.execute("BEGIN")
            db.executemany(
                "INSERT INTO sessions (uuid, state, last_id, acked, disconnected_at) "
                "VALUES (?, ?, ?, ?, ?)",
                [(uuid, json.dumps(d["state"]), d["last_id"], d["acked"], d.get("left"))
                 for uuid, d in new.items()])
            db.executemany(
                "INSERT INTO messages (uuid, id, data) VALUES (?, ?, ?)",
                [(uuid, m[0], json.dumps(m[1])) for uuid, d in new.items()
                 for m in d["messages"]])
            db.execute("COMMIT")
        finally:
            db.close()
        return len(new)

    def close(self) -> Deferred[None]:
        return defer.succeed(None)


class BucketSessions:
    """
    The sessions of a JetStream store's bucket C{PREFIX_reliable}.

    @param call: runs a coroutine function on the NATS client's loop (a
        bridge's C{call}).
    @param io: a L{streamproto.log.natsio.NatsIO}.
    @param bridge: the bridge to stop once closed (None: the caller's).
    """

    def __init__(self, io: Any, call: Callable[..., Deferred[Any]], prefix: str,
                 replicas: int, bridge: Any = None) -> None:
        self.io = io
        self._call = call
        self.bridge = bridge
        self.bucket = f"{prefix}_reliable"
        self.replicas = replicas

    async def _kv(self, create: bool) -> Any:
        import nats.js.errors
        if self.io.js is None:
            await self.io.connect()
        try:
            return await self.io.js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            if not create:
                return None
            from nats.js.api import KeyValueConfig, StorageType
            return await self.io.js.create_key_value(KeyValueConfig(
                bucket=self.bucket, history=1, replicas=self.replicas,
                storage=StorageType.FILE))

    async def _read(self) -> dict[str, Doc]:
        import nats.js.errors
        kv = await self._kv(create=False)
        if kv is None:
            return {}
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return {}
        docs: dict[str, Doc] = {}
        for key in keys:
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue
            if entry.value:
                docs[_uuid(key)] = json.loads(entry.value)
        return docs

    def read(self) -> Deferred[dict[str, Doc]]:
        return self._call(self._read)

    async def _write(self, docs: Mapping[str, Doc]) -> int:
        import nats.js.errors

        from streamproto.reliable.natsessions import _key
        kv = await self._kv(create=True)
        written = 0
        for uuid, doc in docs.items():
            value = json.dumps(doc, separators=(",", ":")).encode()
            try:
                await kv.create(_key(uuid), value)
                written += 1
            except nats.js.errors.KeyWrongLastSequenceError:
                entry = await kv.get(_key(uuid))
                if not same(json.loads(entry.value), doc):
                    raise SessionConflict(f"session {uuid}: the destination holds another "
                                          "session with this uuid")
        return written

    def write(self, docs: Mapping[str, Doc]) -> Deferred[int]:
        return self._call(self._write, dict(docs))

    @defer.inlineCallbacks
    def close(self) -> Any:
        try:
            yield self._call(self.io.close)
        finally:
            if self.bridge is not None:
                self.bridge.stop()


def _uuid(key: str) -> str:
    """The uuid of a bucket key (the inverse of C{natsessions._key})."""
    if key.startswith("x."):
        return bytes.fromhex(key[2:]).decode("utf-8")
    return key


@defer.inlineCallbacks
def copy_sessions(src: Any, dst: Any) -> Any:
    """
    Copy every session of C{src} to C{dst} (L{SQLiteSessions} or
    L{BucketSessions}).  @return: Deferred firing with (found, written).
    """
    docs = yield src.read()
    if not docs:
        return 0, 0
    written = yield dst.write(docs)
    return len(docs), written
