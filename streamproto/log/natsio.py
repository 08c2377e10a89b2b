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

import asyncio
import base64
import itertools
import json
from typing import NamedTuple

from twisted.logger import Logger

from streamproto.log.natsformat import parse_headers

log = Logger()

#: JetStream error codes (C{err_code}) the store tells apart
WRONG_LAST_SEQUENCE = 10071
WRONG_LAST_MSG_ID = 10070
STREAM_NOT_FOUND = 10059
NO_MESSAGE_FOUND = 10037
STREAM_NAME_IN_USE = 10058


class JetStreamError(Exception):
    """An error answered by JetStream (or no answer at all)."""

    def __init__(self, description, code=None, err_code=None):
        super().__init__(description)
        self.description = description
        self.code = code
        self.err_code = err_code


class NotAvailable(JetStreamError):
    """No answer: no server reachable, no stream leader, a timeout."""


class StoredMsg(NamedTuple):
    seq: int
    subject: str
    headers: dict
    data: bytes
    time: str


class PublishOutcome(NamedTuple):
    """
    What became of one publish: C{seq} when stored (C{duplicate} when
    JetStream had it already under the same message id), else C{error}
    (a L{JetStreamError}; L{NotAvailable} for a timeout).
    """

    seq: int = 0
    duplicate: bool = False
    error: Exception = None


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

    def __init__(self, servers, bridge, tls=None, name="streamproto", api_timeout=5.0,
                 publish_timeout=5.0, pending_size=8 * 1024 * 1024):
        self.servers = list(servers)
        self.bridge = bridge
        self.tls = tls
        self.name = name
        self.api_timeout = api_timeout
        self.publish_timeout = publish_timeout
        self.pending_size = pending_size
        self.nc = None
        self.js = None
        self.connected = False
        self.last_error = None
        self.max_payload = 1048576
        self._tokens = itertools.count(1)
        self._replies = {}         # token -> (callback, timer)
        self._outbox = None        # deque of publishes to send, in order
        self._sender = None
        self._wake = None
        self._reply_prefix = None
        self.on_reconnect = None   # reactor-side callable, posted on each reconnection

    # connection ---------------------------------------------------------
    async def connect(self):
        if self.nc is not None and not self.nc.is_closed:
            return None
        import nats

        from collections import deque

        async def error_cb(e):
            # kept for problems() and the errors raised; the store logs the
            # state changes (one line, not one per reconnection attempt)
            self.last_error = f"{type(e).__name__}: {e}"

        async def disconnected_cb():
            self.connected = False

        async def reconnected_cb():
            self.connected = True
            self.last_error = None
            if self.on_reconnect is not None:
                self.bridge.post(self.on_reconnect)

        options = dict(
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
            self.nc = await asyncio.wait_for(nats.connect(**options), CONNECT_DEADLINE)
        except asyncio.TimeoutError:
            detail = self.last_error or f"no connection within {CONNECT_DEADLINE:g} s"
            self.last_error = f"cannot connect to {', '.join(self.servers)}: {detail}"
            raise NotAvailable(self.last_error)
        except Exception as e:
            # the last attempt's own error says more than "no servers available"
            detail = self.last_error or _describe(e)
            self.last_error = f"cannot connect to {', '.join(self.servers)}: {detail}"
            raise NotAvailable(self.last_error)
        self.nc.options["max_reconnect_attempts"] = -1
        self.connected = True
        self.last_error = None
        self.max_payload = self.nc.max_payload
        self.js = self.nc.jetstream(timeout=self.api_timeout)
        self._outbox = deque()
        self._wake = asyncio.Event()
        self._reply_prefix = self.nc.new_inbox() + "."
        await self.nc.subscribe(self._reply_prefix + "*", cb=self._on_reply)
        self._sender = asyncio.get_running_loop().create_task(self._send_loop())
        return self.nc.connected_server_version if hasattr(self.nc, "connected_server_version") \
            else None

    async def close(self):
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
    async def api(self, what, body=None, timeout=None):
        """
        One JetStream API request (C{$JS.API.<what>}).

        @return: the decoded JSON response.
        @raise JetStreamError: the error it answered.
        @raise NotAvailable: no answer.
        """
        import nats.errors
        payload = b"" if body is None else json.dumps(body).encode()
        try:
            msg = await self.nc.request("$JS.API." + what, payload,
                                        timeout=timeout or self.api_timeout)
        except nats.errors.NoRespondersError:
            raise NotAvailable(f"{what}: no JetStream responders (is JetStream enabled?)")
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            raise NotAvailable(f"{what}: JetStream did not answer in time")
        except nats.errors.Error as e:
            raise NotAvailable(f"{what}: {_describe(e)}")
        response = json.loads(msg.data)
        error = response.get("error")
        if error:
            raise JetStreamError(error.get("description", "error"), error.get("code"),
                                 error.get("err_code"))
        return response

    async def stream_info(self, stream):
        """@return: the info dict, or None if there is no such stream."""
        try:
            return await self.api(f"STREAM.INFO.{stream}")
        except JetStreamError as e:
            if e.err_code == STREAM_NOT_FOUND:
                return None
            raise

    async def add_stream(self, config):
        return await self.api(f"STREAM.CREATE.{config['name']}", config)

    async def delete_stream(self, stream):
        try:
            await self.api(f"STREAM.DELETE.{stream}")
        except JetStreamError as e:
            if e.err_code == STREAM_NOT_FOUND:
                return False
            raise
        return True

    async def purge(self, stream, seq):
        """Remove every message below sequence C{seq}."""
        response = await self.api(f"STREAM.PURGE.{stream}", {"seq": seq})
        return response.get("purged", 0)

    async def stream_names(self, subject_filter):
        names = []
        offset = 0
        while True:
            response = await self.api("STREAM.NAMES", {"offset": offset,
                                                       "subject": subject_filter})
            page = response.get("streams") or []
            names += page
            offset += len(page)
            if not page or offset >= response.get("total", 0):
                return names

    async def get(self, stream, seq=None, last=None, next=None, start_time=None, timeout=None):
        """
        One message from the stream leader: by sequence, the last on a
        subject, the first at or after C{seq} on a subject (C{next}), or the
        first at or after C{start_time} (RFC 3339).

        @return: a L{StoredMsg}, or None when there is no such message.
        """
        request = {}
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

    async def get_direct(self, stream, seq):
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
            msg = await self.nc.request(f"$JS.API.DIRECT.GET.{stream}",
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
    def publish(self, subject, headers, body, callback):
        """
        Loop thread: queue one publish behind every earlier one.  Its
        outcome, a L{PublishOutcome}, is handed to C{callback} on the
        reactor thread, within C{publish_timeout} seconds.
        """
        token = str(next(self._tokens))
        self.bridge.begin()
        timer = asyncio.get_running_loop().call_later(self.publish_timeout, self._timed_out,
                                                      token)
        self._replies[token] = (callback, timer)
        self._outbox.append((subject, self._reply_prefix + token, headers, body, token))
        self._wake.set()

    async def _send_loop(self):
        outbox = self._outbox
        while True:
            await self._wake.wait()
            self._wake.clear()
            while outbox:
                subject, reply, headers, body, token = outbox.popleft()
                if token not in self._replies:
                    continue  # timed out before it could be sent
                try:
                    await self.nc.publish(subject, body, reply=reply, headers=headers)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self._settle(token, PublishOutcome(error=NotAvailable(
                        f"publish failed: {_describe(e)}")))

    async def _on_reply(self, msg):
        token = msg.subject[len(self._reply_prefix):]
        if token not in self._replies:
            return
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

    def _timed_out(self, token):
        self._settle(token, PublishOutcome(error=NotAvailable(
            f"no publish acknowledgement within {self.publish_timeout:g}s")))

    def _settle(self, token, outcome):
        entry = self._replies.pop(token, None)
        if entry is None:
            return
        callback, timer = entry
        timer.cancel()
        self.bridge.post(callback, outcome)
        self.bridge.end()

    def pending_publishes(self):
        return len(self._replies)

    # following ----------------------------------------------------------
    async def watch(self, stream, subject_filter, start_seq, callback):
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
        watch.sub = await self.js.subscribe(
            subject_filter, stream=stream, ordered_consumer=True, headers_only=True,
            config=config, cb=watch.on_message, idle_heartbeat=2.0)
        return watch

    async def watch_advisories(self, callback):
        """C{callback(kind, stream)} on the reactor for every stream created or deleted."""
        async def on_advisory(msg):
            kind = "created" if ".CREATED." in msg.subject else "deleted"
            self.bridge.post(callback, kind, msg.subject.rsplit(".", 1)[-1])
        subs = []
        for kind in ("CREATED", "DELETED"):
            subs.append(await self.nc.subscribe(f"$JS.EVENT.ADVISORY.STREAM.{kind}.*",
                                                cb=on_advisory))
        return subs


class Watch:
    """One follower: its events, batched per loop iteration."""

    def __init__(self, io, callback):
        self.io = io
        self.callback = callback
        self.sub = None
        self.events = []
        self.stopped = False

    async def on_message(self, msg):
        if self.stopped:
            return
        try:
            seq = msg.metadata.sequence.stream
        except Exception:
            return
        if not self.events:
            asyncio.get_running_loop().call_soon(self.flush)
        self.events.append((seq, msg.subject, msg.headers or {}))

    def flush(self):
        events, self.events = self.events, []
        if events and not self.stopped:
            self.io.bridge.post(self.callback, events)

    async def stop(self):
        self.stopped = True
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception:
                pass


def _describe(error):
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())
