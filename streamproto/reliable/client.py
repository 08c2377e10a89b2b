"""
The reliable-stream client, both modes.

L{StatefulClient} asks for C{count} values under a random UUID and returns
them with the verified CRC; L{StatelessClient} takes C{count} values of the
endless stream.  Both survive dropped connections::

    endpoint = client_endpoint(reactor, "127.0.0.1", 7300, tls_options_or_None)
    result = yield StatefulClient(endpoint, count=1000).run()
    print(result.crc, len(result.values), result.reconnects)

Reconnection (the spec's rules, on L{streamproto.core.reconnect.Reconnector}):
after an established connection drops the client reconnects at once; after
a failed connection attempt it waits (C{retry_delay}, default 5 s, may grow
with C{backoff}; each wait drawn up to C{jitter} (half) longer, never
shorter) and gives up once C{give_up_after} (30 s) have passed since the
connection was lost, because the server may have dropped the session by
then.  An C{{"error"}} from the server ends the run at once (no resume).
"""

import random
import uuid as uuid_module
import zlib
from struct import Struct
from typing import NamedTuple

from twisted.internet import defer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from streamproto.core.clock import default_reactor
from streamproto.core.errors import describe
from streamproto.core.idle import IdleTimeout, timeout_seconds
from streamproto.core.reconnect import DEFAULT_JITTER, Reconnector, backoff_policy
from streamproto.core.tcp import set_no_delay
from streamproto.reliable import codec
from streamproto.reliable.errors import (
    CRCMismatch,
    ProtocolError,
    RemoteError,
    StreamGaveUp,
)

DEFAULT_RETRY_DELAY = 5.0
DEFAULT_GIVE_UP_AFTER = 30.0
DEFAULT_ACK_EVERY = 16
#: seconds without a byte from the server before the connection is dropped
#: (and resumed): a half-open connection would otherwise hang the client
DEFAULT_IDLE_TIMEOUT = 60.0

_pack_u32 = Struct(">I").pack


class StreamResult(NamedTuple):
    """What a client run returns."""
    values: list
    crc: int | None      # the verified final CRC (stateful), None (stateless)
    reconnects: int
    uuid: str | None = None


class _StatefulSession:
    """The client side of one stateful stream, independent of connections."""

    stateful = True

    def __init__(self, count, uuid, ack_every):
        self.count = count
        self.uuid = uuid
        self.ack_every = ack_every
        self.last_id = 0
        self.values = []
        self.crc = 0
        self.final_crc = None

    def initial_message(self):
        if self.last_id == 0:
            # nothing received yet: ask again (what the reference client
            # does; the reference server also mistakes state 0 for absent)
            return codec.encode_open(self.uuid, self.count)
        return codec.encode_resume(self.uuid, self.last_id)

    def receive(self, message):
        """
        One server message -> (lines to send back, finished?).  Raises
        L{ProtocolError} / L{CRCMismatch} on a message that cannot be right.
        """
        if not isinstance(message, codec.StatefulMessage):
            raise ProtocolError("expected a stateful message")
        if message.message_id != self.last_id + 1:
            raise ProtocolError(
                f"message id {message.message_id} after {self.last_id}: not the next one")
        self.last_id = message.message_id
        self.values.append(message.value)
        self.crc = zlib.crc32(_pack_u32(message.value), self.crc)
        if message.crc is not None:
            if message.message_id != self.count:
                raise ProtocolError(f"final message at id {message.message_id}, "
                                    f"expected {self.count}")
            if message.crc != self.crc:
                raise CRCMismatch(f"server CRC {message.crc} != computed {self.crc}")
            self.final_crc = self.crc
            return [], True
        if message.message_id >= self.count:
            raise ProtocolError("more messages than requested")
        if self.ack_every and message.message_id % self.ack_every == 0:
            return [codec.encode_ack(self.uuid, message.message_id)], False
        return [], False

    def result(self, reconnects):
        return StreamResult(self.values, self.final_crc, reconnects, self.uuid)


class _StatelessSession:
    """
    The client side of a stateless stream: resumes from the last value.
    Values grow without bound (the default stream doubles), so with
    C{keep=False} only the last one is kept.
    """

    stateful = False

    def __init__(self, count, keep=True):
        self.count = count
        self.keep = keep
        self.received = 0
        self.last = None
        self.values = []

    def initial_message(self):
        if self.last is None:
            return codec.encode_stateless_start()
        return codec.encode_stateless_resume(self.last)

    def receive(self, message):
        if not isinstance(message, codec.StatelessValue):
            raise ProtocolError("expected a stateless value")
        self.last = message.value
        self.received += 1
        if self.keep:
            self.values.append(message.value)
        return [], self.received >= self.count

    def result(self, reconnects):
        return StreamResult(self.values if self.keep else [self.last], None, reconnects)


class ReliableStreamClientProtocol(Protocol):
    """One connection: feeds lines to the session, reports to the reconnector."""

    def __init__(self, session, reconnector):
        self.session = session
        self.reconnector = reconnector
        self._done = False
        # a server silent this long is dropped (and reconnected to)
        self._idle = IdleTimeout(reconnector.clock, reconnector.idle_timeout,
                                 self._idle_expired)
        self.received = False
        self._server_leaving = False

    def connectionMade(self):
        set_no_delay(self.transport)
        self._decoder = codec.LineDecoder(self.reconnector.max_line)
        self.transport.write(self.session.initial_message())
        self._idle.start()

    def _idle_expired(self):
        # said for the give-up line: an aborted connection alone reads as our fault
        self.reconnector.silent_for = self.reconnector.idle_timeout
        self.transport.abortConnection()

    def dataReceived(self, data):
        if self._done or self._server_leaving:
            return
        self._idle.reset()
        if not self.received:
            self.received = True
            self.reconnector.established()
        try:
            replies = []
            finished = False
            for line in self._decoder.feed(data):
                if codec.is_blank(line):
                    continue
                message = codec.parse_server_message(line, self.session.stateful)
                if isinstance(message, codec.ErrorMessage):
                    if message.text == codec.SHUTDOWN_ERROR:
                        # the server is stopping, the session stays: this is
                        # a dropped connection (reconnect and resume), not
                        # the end of the stream
                        self._server_leaving = True
                        break
                    raise RemoteError(message.text)
                more, finished = self.session.receive(message)
                replies += more
                if finished:
                    break
        except Exception as e:
            self._stop()
            self.transport.loseConnection()
            self.reconnector.failed(e)
            return
        if replies:
            self.transport.writeSequence(replies)
        if self._server_leaving:
            self.transport.loseConnection()
            return
        if finished:
            self._stop()
            self.transport.loseConnection()
            self.reconnector.finished()

    def _stop(self):
        self._done = True
        self._idle.cancel()

    def connectionLost(self, reason):
        was_done = self._done
        self._stop()
        self.reconnector.connection_lost(was_done, self.received, reason)


class _Reconnector:
    """
    Connections of one stream, on a L{Reconnector}: connect, reconnect at
    once after a drop, wait after a failed attempt, give up after
    C{give_up_after} seconds without a connection.
    """

    log = Logger()

    def __init__(self, endpoint, session, clock, retry_delay, backoff, max_retry_delay,
                 give_up_after, idle_timeout, max_line, jitter, rng):
        self.session = session
        self.clock = clock
        self.give_up_after = give_up_after
        # checked now (a negative value is a ValueError here, not at connect)
        self.idle_timeout = timeout_seconds(idle_timeout)
        self.max_line = max_line
        self.result = defer.Deferred()
        self.reconnects = 0
        self.silent_for = None     # the last connection dropped for its silence (seconds)
        self._connections = 0
        factory = Factory.forProtocol(lambda: ReliableStreamClientProtocol(session, self))
        self._connection = Reconnector(
            lambda: endpoint.connect(factory), clock,
            backoff_policy(retry_delay, max_retry_delay, backoff, jitter, rng),
            connected=self._count_connection, cannot_connect=self._retrying,
            gave_up=self._gave_up, give_up_after=give_up_after)

    def start(self):
        self._connection.start()

    def _count_connection(self, protocol):
        # the failure count and the give-up clock are reset by the first
        # data from the server (established()), not by a mere TCP connect
        if self._connections:
            self.reconnects += 1
        self._connections += 1

    def _retrying(self, reason, delay):
        if delay is not None:
            self.log.info("reliable-stream connect failed ({why}); retry in {delay:g} s",
                          why=reason.getErrorMessage(), delay=delay)

    def _gave_up(self, reason):
        why = (f"the server said nothing for {self.silent_for:g} s" if self.silent_for
               else describe(reason))
        self.result.errback(StreamGaveUp(
            f"no connection for {self.give_up_after:g} s ({why}); "
            "the server may have dropped the stream"))

    def _end(self, outcome):
        """The stream is complete (outcome: None) or failed (outcome: exception)."""
        # delivered once the connection has closed
        self._connection.stop().addCallback(lambda _: self._fire(outcome))

    def _fire(self, outcome):
        if isinstance(outcome, Exception):
            self.result.errback(outcome)
        else:
            self.result.callback(self.session.result(self.reconnects))

    # what the protocol reports

    def finished(self):
        self._end(None)

    def failed(self, exception):
        self._end(exception)

    def established(self):
        """The server answered: the connection counts as re-established."""
        self.silent_for = None
        self._connection.progress()

    def connection_lost(self, was_done, received, reason):
        if was_done:
            # the end of the stream (or its error): not reconnecting
            self._connection.lost(reason, reconnect=False)
        elif received:
            self.log.info("reliable-stream connection lost; reconnecting")
            self._connection.lost(reason, failed=False)
        else:
            # before the server said anything (TLS refusal, reset...): as a
            # failed attempt
            self._retrying(reason, self._connection.lost(reason))


class _Client:
    """
    @param retry_delay: the wait after a failed attempt (at least 5 s),
        multiplied by C{backoff} after each, up to C{max_retry_delay}.
    @param jitter: each wait is drawn up to this fraction longer (never
        shorter); 0 for exact waits.  See
        L{streamproto.core.reconnect.backoff_policy}.
    @param rng: the random source of the jitter (C{random()} in [0, 1)).
    @param give_up_after: seconds without a connection before the run fails
        with L{StreamGaveUp}.
    """

    log = Logger()

    def __init__(self, endpoint, clock=None, retry_delay=DEFAULT_RETRY_DELAY, backoff=1.0,
                 max_retry_delay=DEFAULT_GIVE_UP_AFTER, give_up_after=DEFAULT_GIVE_UP_AFTER,
                 idle_timeout=DEFAULT_IDLE_TIMEOUT, max_line=codec.DEFAULT_MAX_LINE,
                 jitter=DEFAULT_JITTER, rng=random):
        clock = default_reactor(clock)
        if retry_delay < DEFAULT_RETRY_DELAY:
            # the spec: wait at least 5 s after a failed connect
            raise ValueError("retry_delay must be at least 5 seconds")
        self.endpoint = endpoint
        self.clock = clock
        self._options = dict(retry_delay=retry_delay, backoff=backoff,
                             max_retry_delay=max(max_retry_delay, retry_delay),
                             give_up_after=give_up_after, idle_timeout=idle_timeout,
                             max_line=max_line, jitter=jitter, rng=rng)

    def run(self):
        """Fires with a L{StreamResult}, or fails (L{RemoteError}, L{StreamGaveUp}...)."""
        reconnector = _Reconnector(self.endpoint, self._session(), self.clock, **self._options)
        reconnector.start()
        return reconnector.result


class StatefulClient(_Client):
    """
    Receive C{count} (1..65535) values of a stateful stream and verify the
    final CRC.  C{uuid} defaults to a random UUID4; C{ack_every} acks every
    Nth id (16, as the reference client; 0 never acks).
    """

    def __init__(self, endpoint, count, uuid=None, ack_every=DEFAULT_ACK_EVERY, **kwargs):
        if not 1 <= count <= codec.MAX_COUNT:
            raise ValueError(f"count must be in 1..{codec.MAX_COUNT}")
        super().__init__(endpoint, **kwargs)
        self.count = count
        self.uuid = uuid or str(uuid_module.uuid4())
        self.ack_every = ack_every

    def _session(self):
        return _StatefulSession(self.count, self.uuid, self.ack_every)


class StatelessClient(_Client):
    """
    Receive the first C{count} values of a stateless stream (decimal
    strings); with C{keep=False} the result holds only the last one.
    """

    def __init__(self, endpoint, count, keep=True, **kwargs):
        if count < 1:
            raise ValueError("count must be positive")
        super().__init__(endpoint, **kwargs)
        self.count = count
        self.keep = keep

    def _session(self):
        return _StatelessSession(self.count, self.keep)

