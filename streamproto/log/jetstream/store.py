"""
L{JetStreamLogStore}: the L{ILogStore} of logs kept as streams of a NATS
JetStream cluster.

The store's concern is the cluster and the set of logs on it: connecting
(once, shared by concurrent callers), the advisories that tell it of logs
created and deleted by other front-ends, creating, opening (one open shared
by concurrent callers), deleting, and the periodic retention round.  What a
log does once open is L{streamproto.log.jetstream.log.JetStreamLog}'s.
"""

from __future__ import annotations

import json
import ssl
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.base.clock import default_reactor, monotonic_seconds
from streamproto.base.observer import SharedCall
from streamproto.log.config import LogConfig, name_checked, validate_name
from streamproto.log.errors import CorruptLog, LogClosed, LogExists, LogNotFound
from streamproto.log.interfaces import ILog, ILogStore, IStartingStore, StoreHealth
from streamproto.log.jetstream.common import Patience, _Inline, _store_errors, log
from streamproto.log.jetstream.log import JetStreamLog
from streamproto.log.msgindex import BodyCache
from streamproto.log.natsformat import (
    DEFAULT_PREFIX, HEADER_OVERHEAD, MAX_STREAM_NAME, check_prefix, log_name, stream_name,
    subjects_filter,
)
from streamproto.log.natsio import (
    NO_SUITABLE_PEERS, STREAM_NAME_IN_USE, JetStreamError, NatsIO, NotAvailable,
)
from streamproto.log.versions import JETSTREAM_VERSION
from streamproto.log.versions import check as check_version

if TYPE_CHECKING:
    from streamproto.log.bridge import AsyncioThreadBridge

_T = TypeVar("_T")
_P = ParamSpec("_P")

#: stream metadata keys
CONFIG_KEY = "streamproto_config"
FORMAT_KEY = "streamproto_format"
FORMAT_VERSION = str(JETSTREAM_VERSION)


#: Seconds within which an append is acknowledged or fails.  A stream
#: leader's death must not fail the appends in flight: nats-server elects
#: the next leader after a randomised timeout of up to 9 s, and an append
#: sent just before the death first waits its publish timeout (3 s), then
#: the election, then its resend.  With 10 s, CI once saw one such append
#: fail (8.6 s without an acknowledgement); 20 s covers the worst case.
#: Without a quorum appends still fail, after this long.
DEFAULT_TIMEOUT = 20.0


@implementer(ILogStore, IStartingStore)
class JetStreamLogStore(StoreHealth):
    """
    Logs as streams of a NATS JetStream cluster.

    @param servers: C{nats://host:port} (or C{tls://}) URLs of the cluster's
        servers (any subset: the client discovers the others).
    @param replicas: stream replicas for logs created here; default 3 when
        three or more servers are listed, else 1.
    @param prefix: letters and digits; this store's logs are the streams
        C{PREFIX_NAME} on subjects C{PREFIX.NAME.*}.
    @param tls: an C{ssl.SSLContext} for C{tls://} servers.
    @param timeout: seconds within which an append is acknowledged or
        fails with L{LogFailed} (and how long the cluster may be unreachable
        before logs report C{failed}); default L{DEFAULT_TIMEOUT}.
    @param clock: IReactorTime for timers (waits, deadlines, retention).
    @param bridge: the reactor/asyncio bridge (tests pass a
        L{streamproto.log.bridge.SynchronousBridge}).
    @param cache_bytes: bound of the message body cache, all logs together.
    @param max_message_bytes: body bound of one message (appends are merged
        up to it or split at it); never above the servers' C{max_payload}.
    @param retention_interval: seconds between retention rounds (None: only
        after appends).
    @param io: the asyncio-side client (default a L{NatsIO}; tests pass a
        fake with the same coroutine methods).
    @param monotonic: seconds on a clock no step of the wall clock moves,
        for durations (default L{monotonic_seconds} of C{clock}).
    @param monitor: the servers' monitoring URLs (C{http://host:8222}),
        where start-up checks C{sync_interval} (L{safety}).
    """

    def __init__(self, servers: str | Iterable[str], replicas: int | None = None,
                 prefix: str = DEFAULT_PREFIX, tls: ssl.SSLContext | None = None,
                 timeout: float = DEFAULT_TIMEOUT, clock: IReactorTime | None = None,
                 bridge: AsyncioThreadBridge | None = None, cache_bytes: int = 64 << 20,
                 max_message_bytes: int = 1 << 20, retention_interval: float | None = 60.0,
                 read_ahead: int = 16, publish_timeout: float | None = None,
                 connection_name: str = "streamproto", io: NatsIO | None = None,
                 monotonic: Callable[[], float] | None = None,
                 monitor: Iterable[str] = ()) -> None:
        from streamproto.log.bridge import AsyncioThreadBridge
        if isinstance(servers, str):
            servers = [servers]
        self.servers = list(servers)
        self.prefix = check_prefix(prefix)
        self.replicas = replicas if replicas is not None else (3 if len(self.servers) >= 3 else 1)
        self.clock = cast(IReactorTime, default_reactor(clock))
        #: durations (append deadlines, ages, rate limits) are measured on
        #: this, never on the wall clock that a clock step moves
        self.monotonic = monotonic or monotonic_seconds(self.clock)
        self.monitor = list(monitor)
        # the reactor is also the IReactorFromThreads the bridge posts to
        self.bridge = bridge or AsyncioThreadBridge(cast(Any, self.clock))
        self.timeout = timeout
        self.io = io or NatsIO(self.servers, self.bridge, tls=tls, name=connection_name,
                               api_timeout=min(5.0, timeout),
                               publish_timeout=publish_timeout or min(3.0, timeout))
        self.cache = BodyCache(cache_bytes)
        self._max_message_bytes = max_message_bytes
        self.read_ahead = read_ahead
        self.retention_interval = retention_interval
        self.writer_id = uuid.uuid4().hex[:12]
        self.closed = False
        self._logs: dict[str, JetStreamLog] = {}
        self._opening: SharedCall[JetStreamLog] = SharedCall(self._open)
        self._names: set[str] = set()
        self._connected = False
        # start() while connecting waits for that one attempt
        self._connecting: SharedCall[None] = SharedCall(self._connect_once)
        self._retention_call: IDelayedCall | None = None

    @property
    def max_message_bytes(self) -> int:
        return max(1024, min(self._max_message_bytes, self.io.max_payload - HEADER_OVERHEAD))

    def __repr__(self) -> str:
        return f"<JetStreamLogStore {','.join(self.servers)} prefix={self.prefix}>"

    def _call(self, coroutine_function: Callable[_P, Coroutine[Any, Any, _T]],
              *args: _P.args, **kwargs: _P.kwargs) -> Deferred[_T]:
        return self.bridge.call(coroutine_function, *args, **kwargs)

    # -- connection ------------------------------------------------------
    def start(self) -> Deferred[None]:
        """Connect (once; again after a failure).  @return: Deferred firing when ready."""
        if self.closed:
            return fail(LogClosed("store closed"))
        if self._connected:
            return succeed(None)
        return self._connecting()

    def _connect_once(self) -> Deferred[None]:
        return self._connect().addCallbacks(self._connect_done, self._connect_failed)

    def _connect_done(self, _: None) -> None:
        self._connected = True

    def _connect_failed(self, failure: Failure) -> Failure:
        log.warn("JetStream store {servers}: {error}", servers=",".join(self.servers),
                 error=failure.getErrorMessage())
        return failure

    @defer.inlineCallbacks
    def _connect(self) -> _Inline[None]:
        yield self._call(self.io.connect)
        self.io.on_reconnect = self._reconnected
        names = yield self._call(self.io.stream_names, f"{self.prefix}.>")
        self._names = {n for n in (log_name(self.prefix, s) for s in names) if n}
        yield self._call(self.io.watch_advisories, self._advisory)
        yield self._warn_risks()
        if self.retention_interval and self._retention_call is None:
            self._retention_call = self.clock.callLater(self.retention_interval,
                                                        self._retention_round)

    @defer.inlineCallbacks
    def _warn_risks(self) -> _Inline[None]:
        """One warning per way the cluster can lose acknowledged records (L{safety})."""
        from streamproto.log.jetstream import safety
        where = ",".join(self.servers)
        try:
            found = yield self._call(safety.risks, self.io, self.prefix, self.replicas,
                                     self.monitor)
        except Exception as e:  # noqa: BLE001 - a check that fails never stops the store
            found = [f"the cluster's settings could not be checked: {e}"]
        for risk in found:
            log.warn("JetStream store {servers}: {risk}", servers=where, risk=risk)
        if not self.monitor:
            log.info("JetStream store {servers}: the nodes' sync_interval is not checked "
                     "(the client protocol does not show it; ?monitor=HOST:PORT,... names "
                     "their monitoring endpoints); without sync_interval: always a power "
                     "loss of the nodes at once loses acknowledged records", servers=where)

    def _reconnected(self) -> None:
        for log_ in list(self._logs.values()):
            log_._refresh().addErrback(lambda f: None)

    def _advisory(self, kind: str, stream: str) -> None:
        name = log_name(self.prefix, stream)
        if name is None:
            return
        if kind == "created":
            self._names.add(name)
        else:
            self._names.discard(name)
            log_ = self._logs.pop(name, None)
            if log_ is not None:
                log_._close(LogClosed(f"log {name!r} was deleted"))

    def _when_ready(self, f: Callable[..., Deferred[Any]], *args: Any) -> Deferred[Any]:
        if self.closed:
            return fail(LogClosed("store closed"))
        return self.start().addCallback(lambda _: f(*args))

    @defer.inlineCallbacks
    def _patiently(self, f: Callable[..., Deferred[_T]], *args: Any) -> _Inline[_T]:
        """
        C{f(*args)}, asked again while the cluster does not answer (a meta
        leader being elected, a loaded machine), for up to C{timeout}
        seconds: for the calls that may be repeated (opening a log).
        """
        patience = Patience(self)
        while True:
            try:
                result: _T = yield f(*args)
                return result
            except NotAvailable as e:
                refused = e
            if not (yield patience.pause()):
                raise refused

    # -- ILogStore -------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._names)

    @_store_errors
    @name_checked(lambda self, name: self._check_name(name))
    def create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        return self._when_ready(self._create, name, config or LogConfig(), True)

    @_store_errors
    @name_checked(lambda self, name: self._check_name(name))
    def get(self, name: str) -> Deferred[ILog]:
        return self._when_ready(self._patiently, self._get, name)

    @_store_errors
    @name_checked(lambda self, name: self._check_name(name))
    def get_or_create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        return self._when_ready(self._patiently, self._get_or_create, name,
                                config or LogConfig())

    def _check_name(self, name: str) -> None:
        validate_name(name)
        if len(stream_name(self.prefix, name)) > MAX_STREAM_NAME:
            from streamproto.log.errors import InvalidLogName
            raise InvalidLogName(f"log name {name!r} too long for prefix {self.prefix!r}")

    def _stream_config(self, name: str, config: LogConfig) -> dict[str, Any]:
        return {
            "name": stream_name(self.prefix, name),
            "subjects": [subjects_filter(self.prefix, name)],
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "discard": "old",
            "max_msgs": -1,
            "max_bytes": -1,
            "max_age": 0,
            "duplicate_window": 120 * 10**9,
            "allow_direct": True,
            "deny_delete": True,
            "metadata": {CONFIG_KEY: config.to_json(), FORMAT_KEY: FORMAT_VERSION},
        }

    @defer.inlineCallbacks
    def _create(self, name: str, config: LogConfig, must_be_new: bool) -> _Inline[JetStreamLog]:
        stream = stream_name(self.prefix, name)
        info = yield self._call(self.io.stream_info, stream)
        if info is not None and must_be_new:
            raise LogExists(f"log {name!r} exists")
        if info is not None and not (info.get("state") or {}).get("last_seq"):
            # another creator's stream, its marker not written yet: as a
            # creator too (get_or_create), write it (whichever is first)
            yield JetStreamLog(self, name, config)._write_init()
        if info is None:
            try:
                yield self._add_stream(name, config)
            except JetStreamError as e:
                if e.err_code != STREAM_NAME_IN_USE:
                    raise
                if must_be_new:
                    raise LogExists(f"log {name!r} exists")
            log_ = JetStreamLog(self, name, config)
            outcome = yield log_._write_init()
            # a duplicate is our own marker stored by a try whose answer
            # was lost; a wrong last sequence is another writer's marker
            # (front-ends creating the same log at once: add_stream of
            # the same configuration succeeds for both)
            if must_be_new and outcome.error is not None:
                raise LogExists(f"log {name!r} exists")
            self._names.add(name)
        result: JetStreamLog = yield self._get(name)
        return result

    @defer.inlineCallbacks
    def _add_stream(self, name: str, config: LogConfig) -> _Inline[None]:
        """
        Add the log's stream, asked again while the cluster answers "no
        suitable peers for placement": a peer the meta leader sees offline
        for a moment (a loaded machine, a node restarting; seen in CI) or
        not yet joined (a cluster just started).  The same answer for a
        placement that can never be met (more replicas than nodes) comes
        back after the store's timeout.  Not on a timeout, which may have
        added it (then asked again it would be "in use": another's log).
        """
        patience = Patience(self)
        while True:
            try:
                yield self._call(self.io.add_stream, self._stream_config(name, config))
                return
            except JetStreamError as e:
                if e.err_code != NO_SUITABLE_PEERS or not (yield patience.pause()):
                    raise

    @defer.inlineCallbacks
    def _get(self, name: str) -> _Inline[JetStreamLog]:
        existing = self._logs.get(name)
        if existing is not None:
            try:
                yield existing._refresh()
            except (NotAvailable, JetStreamError):
                # the cluster does not answer: the log as this front-end
                # knows it still reads; its appends fail on their own terms
                pass
            return existing
        # callers while it opens share that one open
        log_: JetStreamLog = yield self._opening(name)
        return log_

    @defer.inlineCallbacks
    def _open(self, name: str) -> _Inline[JetStreamLog]:
        stream = stream_name(self.prefix, name)
        info = yield self._call(self.io.stream_info, stream)
        if info is None:
            self._names.discard(name)
            raise LogNotFound(f"log {name!r} not found")
        metadata = (info.get("config") or {}).get("metadata") or {}
        check_version(f"JetStream stream {stream}", metadata.get(FORMAT_KEY, "1"),
                      JETSTREAM_VERSION)
        try:
            config = LogConfig.from_mapping(json.loads(metadata[CONFIG_KEY]))
        except (KeyError, ValueError) as e:
            raise CorruptLog(f"stream {stream} is not a streamproto log ({e})")
        log_ = JetStreamLog(self, name, config)
        yield log_._recover(info)
        if self.closed:
            raise LogClosed("store closed")
        self._logs[name] = log_
        self._names.add(name)
        yield log_._start_watch()
        return log_

    @defer.inlineCallbacks
    def _get_or_create(self, name: str, config: LogConfig) -> _Inline[JetStreamLog]:
        result: JetStreamLog
        try:
            result = yield self._get(name)
        except LogNotFound:
            result = yield self._create(name, config, False)
        return result

    @_store_errors
    @name_checked(lambda self, name: self._check_name(name))
    def delete(self, name: str) -> Deferred[None]:
        return self._when_ready(self._delete, name)

    @defer.inlineCallbacks
    def _delete(self, name: str) -> _Inline[None]:
        deleted = yield self._call(self.io.delete_stream, stream_name(self.prefix, name))
        self._names.discard(name)
        log_ = self._logs.pop(name, None)
        if log_ is not None:
            log_._close(LogClosed(f"log {name!r} was deleted"))
        if not deleted:
            raise LogNotFound(f"log {name!r} not found")

    def _store_problems(self) -> list[str]:
        found: list[str] = []
        if not self._connected:
            found.append(f"JetStream {','.join(self.servers)}: "
                         f"{self.io.last_error or 'connecting'}")
        elif not self.io.connected:
            found.append(f"JetStream {','.join(self.servers)}: disconnected"
                         + (f" ({self.io.last_error})" if self.io.last_error else ""))
        return found

    # -- retention -------------------------------------------------------
    def _retention_round(self) -> None:
        self._retention_call = None
        if self.closed:
            return
        for log_ in list(self._logs.values()):
            c = log_.config
            if c.log_max_count > 0 or c.log_max_size > 0 or c.log_max_age > 0:
                self._retain(log_)
        self._retention_call = self.clock.callLater(cast(float, self.retention_interval),
                                                    self._retention_round)

    def _retain(self, log_: JetStreamLog) -> None:
        if log_._closed:
            return
        log_.retain().addErrback(lambda f: log.warn(
            "log {name}: retention: {error}", name=log_.name, error=f.getErrorMessage()))

    # -- closing ---------------------------------------------------------
    @defer.inlineCallbacks
    def close(self) -> _Inline[None]:
        if self.closed:
            return
        self.closed = True
        if self._retention_call is not None and self._retention_call.active():
            self._retention_call.cancel()
        logs = list(self._logs.values())
        for log_ in logs:
            if log_._chain.pending and log_.failed is None:
                try:
                    yield log_.sync()
                except Exception:
                    pass
        for log_ in logs:
            log_._close(LogClosed("store closed"))
        self._logs.clear()
        if self._connected or self._connecting.running:
            try:
                yield self.bridge.call(self.io.close)
            except Exception:
                pass
        self.bridge.stop()
