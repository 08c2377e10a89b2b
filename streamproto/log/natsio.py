"""
The asyncio side of the JetStream log store: one nats-py connection and
the few JetStream operations the store needs, run on the bridge's loop
thread (L{streamproto.log.bridge}).  No log logic here: positions, the
order of appends, retries and caches live on the reactor side
(L{streamproto.log.jetstream}); this module only moves messages.

- publishes go out in the order L{NatsIO.publish} is called (one sender
  task), each with its own reply subject on one wildcard subscription;
  the outcome (an ack, a JetStream error, a timeout) is posted to the
  reactor;
- reads use the stream leader's message get API
  (C{$JS.API.STREAM.MSG.GET}), which answers only once a message is
  committed and never from a lagging replica, so what a reader gets is
  what the quorum acknowledged;
- followers (watchers) are nats-py ordered push consumers delivering
  headers only, from a given stream sequence: no polling, and a
  watcher's events are posted to the reactor in batches.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import ssl
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from twisted.logger import Logger

from streamproto.log.natsformat import parse_headers

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext

    from streamproto.log.bridge import AsyncioThreadBridge

log = Logger()

#: JetStream error codes (C{err_code}) the store tells apart
WRONG_LAST_SEQUENCE = 10071
WRONG_LAST_MSG_ID = 10070
STREAM_NOT_FOUND = 10059
NO_MESSAGE_FOUND = 10037
STREAM_NAME_IN_USE = 10058
#: "no suitable peers for placement": a peer offline (for a moment), or a
#: placement the cluster can never meet
NO_SUITABLE_PEERS = 10005


class JetStreamError(Exception):
    """An error answered by JetStream (or no answer at all)."""

    def __init__(self, description: str, code: int | None = None,
                 err_code: int | None = None) -> None:
        super().__init__(description)
        self.description = description
        self.code = code
        self.err_code = err_code


class NotAvailable(JetStreamError):
    """No answer: no server reachable, no stream leader, a timeout."""


class StoredMsg(NamedTuple):
    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes
    time: str | None


class PublishOutcome(NamedTuple):
    """
    What became of one publish: C{seq} when stored (C{duplicate} when
    JetStream had it already under the same message id), else C{error}
    (a L{JetStreamError}; L{NotAvailable} for a timeout).
    """

    seq: int = 0
    duplicate: bool = False
    error: JetStreamError | None = None


#: attempts per server of the first connection (0.25 s apart)
INITIAL_ATTEMPTS = 20
#: seconds the first connection may take in all
CONNECT_DEADLINE = 15.0


class NatsIO:
    """
    @param servers: C{nats://host:port} or C{tls://host:port} URLs.
    @param bridge: the L{streamproto.log.bridge.AsyncioThreadBridge} whose
        loop runs everything here and whose C{post} reaches the reactor.
    @param tls: an C{ssl.SSLContext}, or None.
    """

    def __init__(self, servers: list[str], bridge: AsyncioThreadBridge | None,
                 tls: ssl.SSLContext | None = None, name: str = "streamproto",
                 api_timeout: float = 5.0, publish_timeout: float = 5.0,
                 pending_size: int = 8 * 1024 * 1024) -> None:
        self.servers = list(servers)
        self.bridge = bridge
        self.tls = tls
        self.name = name
        self.api_timeout = api_timeout
        self.publish_timeout = publish_timeout
        self.pending_size = pending_size
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.connected = False
        self.last_error: str | None = None
        self.max_payload = 1048576
        self._tokens = itertools.count(1)
        # token -> (callback, timer)
        self._replies: dict[str, tuple[Callable[[PublishOutcome], object],
                                       asyncio.TimerHandle]] = {}
        # publishes to send, in order: (subject, reply, headers, body, token)
        self._outbox: deque[tuple[str, str, dict[str, str], bytes, str]] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._reply_prefix: str | None = None
        # reactor-side callable, posted on each reconnection
        self.on_reconnect: Callable[[], object] | None = None

    @property
    def _client(self) -> Client:
        """The connection (L{connect}, or a reader's own) that every call needs."""
        if self.nc is None:
            raise NotAvailable("not connected")
        return self.nc

    @property
    def _bridge(self) -> AsyncioThreadBridge:
        # only a reader (which neither publishes nor follows) runs without one
        assert self.bridge is not None, "no bridge to the reactor"
        return self.bridge

    # connection ---------------------------------------------------------
    async def connect(self) -> str | None:
        if self.nc is not None and not self.nc.is_closed:
            return None
        import nats

        # resolved when the first connection cannot succeed: a server whose
        # certificate the CA did not sign (the servers of one cluster share
        # their CA; nats-py, which would wait out the deadline, is left)
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def error_cb(e: Exception) -> None:
            # kept for problems() and the errors raised; the store logs the
            # state changes (one line, not one per reconnection attempt)
            self.last_error = f"{type(e).__name__}: {e}"
            if isinstance(e, ssl.SSLCertVerificationError) and not refused.done():
                refused.set_result(None)

        async def disconnected_cb() -> None:
            self.connected = False

        async def reconnected_cb() -> None:
            self.connected = True
            self.last_error = None
            if self.on_reconnect is not None:
                self._bridge.post(self.on_reconnect)

        options: dict[str, Any] = dict(
            servers=self.servers, name=self.name, error_cb=error_cb,
            disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb,
            # a bounded first connection (a cluster that cannot be reached
            # at start-up is an error), then reconnection for ever
            allow_reconnect=True, max_reconnect_attempts=INITIAL_ATTEMPTS,
            reconnect_time_wait=0.25,
            connect_timeout=2, ping_interval=5, max_outstanding_pings=2,
            pending_size=self.pending_size)
        if self.tls is not None:
            options["tls"] = self.tls
        try:
            # bounded as a whole too: a TLS handshake the servers refuse can
            # keep the client trying for ever
            self.nc = nc = await _first_of(nats.connect(**options), refused,
                                           CONNECT_DEADLINE)
        except asyncio.TimeoutError:
            detail = self.last_error or f"no connection within {CONNECT_DEADLINE:g} s"
            self.last_error = f"cannot connect to {', '.join(self.servers)}: {detail}"
            raise NotAvailable(self.last_error)
        except Exception as e:
            # the last attempt's own error says more than "no servers available"
            detail = self.last_error or _describe(e)
            self.last_error = f"cannot connect to {', '.join(self.servers)}: {detail}"
            raise NotAvailable(self.last_error)
        nc.options["max_reconnect_attempts"] = -1
        self.connected = True
        self.last_error = None
        self.max_payload = nc.max_payload
        self.js = nc.jetstream(timeout=self.api_timeout)
        self._outbox = deque()
        self._wake = asyncio.Event()
        self._reply_prefix = nc.new_inbox() + "."
        await nc.subscribe(self._reply_prefix + "*", cb=self._on_reply)
        self._sender = asyncio.get_running_loop().create_task(self._send_loop())
        version: str | None = getattr(nc, "connected_server_version", None)
        return version

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        for token in list(self._replies):
            self._settle(token, PublishOutcome(error=NotAvailable("store closed")))
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 5)
            except Exception:
                pass
        self.connected = False

    # JetStream API ------------------------------------------------------
    async def api(self, what: str, body: object = None,
                  timeout: float | None = None) -> dict[str, Any]:
        """
        One JetStream API request (C{$JS.API.<what>}).

        @return: the decoded JSON response.
        @raise JetStreamError: the error it answered.
        @raise NotAvailable: no answer.
        """
        import nats.errors
        payload = b"" if body is None else json.dumps(body).encode()
        try:
            msg = await self._client.request("$JS.API." + what, payload,
                                        timeout=timeout or self.api_timeout)
        except nats.errors.NoRespondersError:
            raise NotAvailable(f"{what}: no JetStream responders (is JetStream enabled?)")
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            raise NotAvailable(f"{what}: JetStream did not answer in time")
        except nats.errors.Error as e:
            raise NotAvailable(f"{what}: {_describe(e)}")
        response: dict[str, Any] = json.loads(msg.data)
        error = response.get("error")
        if error:
            raise JetStreamError(error.get("description", "error"), error.get("code"),
                                 error.get("err_code"))
        return response

    async def pause(self, seconds: float) -> None:
        """
        Wait C{seconds} on the client's loop, between two tries of a call
        the cluster could not answer yet: real time on every bridge (a
        synchronous one included, where no reactor runs).
        """
        await asyncio.sleep(seconds)

    async def stream_info(self, stream: str) -> dict[str, Any] | None:
        """@return: the info dict, or None if there is no such stream."""
        try:
            return await self.api(f"STREAM.INFO.{stream}")
        except JetStreamError as e:
            if e.err_code == STREAM_NOT_FOUND:
                return None
            raise

    async def add_stream(self, config: dict[str, Any]) -> dict[str, Any]:
        return await self.api(f"STREAM.CREATE.{config['name']}", config)

    async def delete_stream(self, stream: str) -> bool:
        try:
            await self.api(f"STREAM.DELETE.{stream}")
        except JetStreamError as e:
            if e.err_code == STREAM_NOT_FOUND:
                return False
            raise
        return True

    async def purge(self, stream: str, seq: int) -> int:
        """Remove every message below sequence C{seq}."""
        response = await self.api(f"STREAM.PURGE.{stream}", {"seq": seq})
        purged: int = response.get("purged", 0)
        return purged

    async def stream_names(self, subject_filter: str) -> list[str]:
        names: list[str] = []
        offset = 0
        while True:
            response = await self.api("STREAM.NAMES", {"offset": offset,
                                                       "subject": subject_filter})
            page = response.get("streams") or []
            names += page
            offset += len(page)
            if not page or offset >= response.get("total", 0):
                return names

    async def get(self, stream: str, seq: int | None = None, last: str | None = None,
                  next: str | None = None, start_time: str | None = None,
                  timeout: float | None = None) -> StoredMsg | None:
        """
        One message from the stream leader: by sequence, the last on a
        subject, the first at or after C{seq} on a subject (C{next}), or the
        first at or after C{start_time} (RFC 3339).

        @return: a L{StoredMsg}, or None when there is no such message.
        """
        request: dict[str, object] = {}
        if seq is not None:
            request["seq"] = seq
        if last is not None:
            request["last_by_subj"] = last
        if next is not None:
            request["next_by_subj"] = next
        if start_time is not None:
            request["start_time"] = start_time
        try:
            response = await self.api(f"STREAM.MSG.GET.{stream}", request, timeout=timeout)
        except JetStreamError as e:
            if e.err_code == NO_MESSAGE_FOUND:
                return None
            raise
        m = response["message"]
        headers = parse_headers(base64.b64decode(m["hdrs"])) if m.get("hdrs") else {}
        data = base64.b64decode(m["data"]) if m.get("data") else b""
        return StoredMsg(m["seq"], m["subject"], headers, data, m.get("time"))

    async def get_direct(self, stream: str, seq: int) -> StoredMsg | None:
        """
        Message C{seq} by JetStream's direct get: any replica answers with
        the raw message (headers and body as stored), so a large body costs
        no JSON and no base64 on either side.  A replica only stores what
        the quorum committed, so what it returns was acknowledged; one that
        lags answers "not found", and then the leader is asked
        (L{get}), which knows every committed message.

        @return: a L{StoredMsg}, or None when there is no such message.
        """
        import nats.errors
        try:
            msg = await self._client.request(f"$JS.API.DIRECT.GET.{stream}",
                                        json.dumps({"seq": seq}).encode(),
                                        timeout=self.api_timeout)
        except nats.errors.NoRespondersError:
            return await self.get(stream, seq)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            raise NotAvailable(f"DIRECT.GET.{stream}: JetStream did not answer in time")
        except nats.errors.Error as e:
            raise NotAvailable(f"DIRECT.GET.{stream}: {_describe(e)}")
        headers = msg.headers or {}
        if not msg.data and headers.get("Status"):
            # 404: this replica has not applied it yet (or it is gone)
            return await self.get(stream, seq)
        got = headers.get("Nats-Sequence")
        if got is None or int(got) != seq:
            return await self.get(stream, seq)
        return StoredMsg(seq, headers.get("Nats-Subject", ""), headers, msg.data,
                         headers.get("Nats-Time-Stamp"))

    # publishing ---------------------------------------------------------
    def publish(self, subject: str, headers: dict[str, str], body: bytes,
                callback: Callable[[PublishOutcome], object]) -> None:
        """
        Loop thread: queue one publish behind every earlier one.  Its
        outcome, a L{PublishOutcome}, is handed to C{callback} on the
        reactor thread, within C{publish_timeout} seconds.
        """
        outbox, wake, reply_prefix = self._outbox, self._wake, self._reply_prefix
        if outbox is None or wake is None or reply_prefix is None:
            raise NotAvailable("not connected")
        token = str(next(self._tokens))
        self._bridge.begin()
        timer = asyncio.get_running_loop().call_later(self.publish_timeout, self._timed_out,
                                                      token)
        self._replies[token] = (callback, timer)
        outbox.append((subject, reply_prefix + token, headers, body, token))
        wake.set()

    async def _send_loop(self) -> None:
        outbox, wake = self._outbox, self._wake
        assert outbox is not None and wake is not None  # started by connect, after them
        while True:
            await wake.wait()
            wake.clear()
            while outbox:
                subject, reply, headers, body, token = outbox.popleft()
                if token not in self._replies:
                    continue  # timed out before it could be sent
                try:
                    await self._client.publish(subject, body, reply=reply, headers=headers)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self._settle(token, PublishOutcome(error=NotAvailable(
                        f"publish failed: {_describe(e)}")))

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject[len(self._reply_prefix or ""):]
        if token not in self._replies:
            return
        outcome: PublishOutcome
        if msg.headers and msg.headers.get("Status") == "503":
            outcome = PublishOutcome(error=NotAvailable("no stream leader answered (503)"))
        else:
            try:
                response = json.loads(msg.data)
                error = response.get("error")
                if error:
                    outcome = PublishOutcome(error=JetStreamError(
                        error.get("description", "error"), error.get("code"),
                        error.get("err_code")))
                else:
                    outcome = PublishOutcome(response["seq"], bool(response.get("duplicate")))
            except (ValueError, KeyError, TypeError) as e:
                outcome = PublishOutcome(error=JetStreamError(f"bad publish ack: {e}"))
        self._settle(token, outcome)

    def _timed_out(self, token: str) -> None:
        self._settle(token, PublishOutcome(error=NotAvailable(
            f"no publish acknowledgement within {self.publish_timeout:g}s")))

    def _settle(self, token: str, outcome: PublishOutcome) -> None:
        entry = self._replies.pop(token, None)
        if entry is None:
            return
        callback, timer = entry
        timer.cancel()
        self._bridge.post(callback, outcome)
        self._bridge.end()

    def pending_publishes(self) -> int:
        return len(self._replies)

    # following ----------------------------------------------------------
    async def watch(self, stream: str, subject_filter: str, start_seq: int,
                    callback: Callable[[list[tuple[int, str, dict[str, str]]]], object]) -> Watch:
        """
        Deliver the headers of every message from C{start_seq} on, in
        order, as lists of (seq, subject, headers) to C{callback} on the
        reactor thread.

        @return: a L{Watch}: C{await watch.stop()}.
        """
        from nats.js import api
        watch = Watch(self, callback)
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                    opt_start_seq=max(1, start_seq))
        if self.js is None:
            raise NotAvailable("not connected")
        watch.sub = await self.js.subscribe(
            subject_filter, stream=stream, ordered_consumer=True, headers_only=True,
            config=config, cb=watch.on_message, idle_heartbeat=2.0)
        return watch

    async def watch_advisories(
        self, callback: Callable[[str, str], object],
    ) -> list[Subscription]:
        """C{callback(kind, stream)} on the reactor for every stream created or deleted."""
        async def on_advisory(msg: Msg) -> None:
            kind = "created" if ".CREATED." in msg.subject else "deleted"
            self._bridge.post(callback, kind, msg.subject.rsplit(".", 1)[-1])
        subs = []
        for kind in ("CREATED", "DELETED"):
            subs.append(await self._client.subscribe(f"$JS.EVENT.ADVISORY.STREAM.{kind}.*",
                                                cb=on_advisory))
        return subs


class Watch:
    """One follower: its events, batched per loop iteration."""

    def __init__(self, io: NatsIO,
                 callback: Callable[[list[tuple[int, str, dict[str, str]]]], object]) -> None:
        self.io = io
        self.callback = callback
        self.sub: Subscription | None = None
        self.events: list[tuple[int, str, dict[str, str]]] = []
        self.stopped = False

    async def on_message(self, msg: Msg) -> None:
        if self.stopped:
            return
        try:
            seq = msg.metadata.sequence.stream
        except Exception:
            return
        if not self.events:
            asyncio.get_running_loop().call_soon(self.flush)
        self.events.append((seq, msg.subject, msg.headers or {}))

    def flush(self) -> None:
        events, self.events = self.events, []
        if events and not self.stopped:
            self.io._bridge.post(self.callback, events)

    async def stop(self) -> None:
        self.stopped = True
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception:
                pass


async def _first_of(connecting: Any, refused: asyncio.Future[None], timeout: float) -> Any:
    """
    The outcome of C{connecting}, unless C{refused} is resolved first (the
    connection is then abandoned: L{asyncio.CancelledError}) or C{timeout}
    passes (L{asyncio.TimeoutError}).
    """
    task = asyncio.ensure_future(connecting)
    try:
        await asyncio.wait({task, refused}, timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not refused.done():
            refused.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    if refused.done() and not refused.cancelled():
        raise ConnectionRefusedError("the servers' certificates were not verified")
    raise asyncio.TimeoutError()


def _describe(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())
