"""
The reliable-stream server: one port, both modes, chosen by the first line.

L{ReliableStreamFactory} is the public entry point::

    from twisted.internet.endpoints import serverFromString
    store = MemorySessionStore()
    serverFromString(reactor, "tcp:7300").listen(ReliableStreamFactory(store))

The protocol is thin: the codec parses lines, the session store keeps the
stateful streams, L{sequence} makes the values.  Any line that is invalid,
out of protocol or that the store refuses gets C{{"error": "..."}} and the
connection is closed (the spec; the reference server kept some of them open).
"""

import random
from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer, IReactorTime, ISSLTransport
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.core.clock import SteadyCall, default_reactor
from streamproto.core import metrics
from streamproto.core.auth import ALLOW_ALL, IAuthorizer, connection_principals, denied
from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.observer import OneShotObserver
from streamproto.core.tcp import set_no_delay
from streamproto.reliable import codec
from streamproto.reliable.errors import ProtocolError, ReliableError, StoreUnavailable
from streamproto.reliable.session import ISessionStore
from streamproto.reliable.sequence import (
    DoublingSequence,
    IStatelessSequence,
    StreamFinished,
    initial_state,
    next_message,
)

#: how long a closing connection waits for the client to close its side
LINGER_SECONDS = 10

#: puts a stateful connection keeps in flight: lets the durable store commit
#: many messages of a session in one transaction
DEFAULT_WINDOW = 128
#: messages generated per connection per reactor turn (fairness)
DEFAULT_TURN_BATCH = 64
#: seconds a new connection may take to send its first message
DEFAULT_INITIAL_TIMEOUT = 30.0
#: seconds a peer may leave the stream paused (not reading) before it is cut
DEFAULT_STALL_TIMEOUT = 300.0
#: the error line every connection gets when the server stops
SHUTDOWN_ERROR = codec.SHUTDOWN_ERROR
#: the C{server} label of the suite-wide Prometheus metrics
SERVER_NAME = "reliable-stream-server"
#: messages a connection may send behind its C{params}/C{state} while that
#: first message is still being handled; reading stops meanwhile, so only
#: what one read brought can pile up, and this bounds even that
MAX_HELD_MESSAGES = 1024


@implementer(IPushProducer, IGracefulShutdown)
class ReliableStreamServerProtocol(Protocol):
    """
    One connection.  Phases: C{initial} (waiting for the first line),
    C{waiting} (for an earlier connection of the same session to let go),
    C{stateless}, C{stateful}, C{closed}.
    """

    log = Logger()
    #: a TCP or TLS transport, also a producer and consumer
    #: (registerProducer, pauseProducing): no one Twisted interface says all that
    transport: Any

    def __init__(self):
        self.phase = "initial"
        self.uuid = None
        self.released: OneShotObserver[None] = OneShotObserver()   # fired once this connection let go of its session
        self._claimed = False        # in factory.active (stateful)
        self._session_taken = False  # got past the previous connection: owns the session
        self._paused = False
        self._out = []
        self._flush_call = None
        self._pump_call = None
        self._close_after_flush = False
        self._linger_call = None
        self._in_flight = 0
        self._generating = False
        self._pumping = False
        self._drained = None
        self._sent_id = 0
        self._acked = 0
        self._cursor = None
        self._tokens = 0.0
        self._tokens_at = None
        self._stall_timer: SteadyCall | None = None
        self._initial_timer: SteadyCall | None = None
        self._shutting_down = False
        self._gone: OneShotObserver[None] = OneShotObserver()  # fired when the connection is gone (gracefulShutdown)
        self._unsent_count = 0       # messages queued since the last flush (metrics)
        self._stored_count = 0       # messages stored since the last flush (metrics)
        # messages read but not yet in effect (see _drain)
        self._inbox: deque[Any] = deque()
        # the first message (params/state) is still being handled
        self._busy = False
        self._reading_paused = False

    # Connection

    def connectionMade(self):
        set_no_delay(self.transport)
        f = self.factory
        self._decoder = codec.LineDecoder(f.max_line)
        self._clock = f.clock
        # steady: a step of the wall clock must not cut a connection that
        # has just sent its first line (doc/reliability.rst, finding 13)
        self._initial_timer = SteadyCall(self._clock, f.initial_timeout, self._initial_timeout,
                                         monotonic=f.monotonic)
        self.transport.registerProducer(self, True)

    def _initial_timeout(self):
        self._initial_timer = None
        self._fail("no initial message in time")

    def dataReceived(self, data):
        if self.phase == "closed":
            return
        try:
            lines = self._decoder.feed(data)
        except ProtocolError as e:
            self._fail(str(e))
            return
        # every message of this read goes into the inbox before any takes
        # effect: a resume handled at once (a memory store) must still find
        # the ack that came behind it there, not generate past it first
        inbox = self._inbox
        for line in lines:
            if codec.is_blank(line):
                continue
            try:
                inbox.append(codec.parse_client_message(line))
            except ProtocolError as e:
                inbox.append(e)     # takes effect in its turn: the error
                break
        self._drain()

    # Order: a message takes effect only after the ones before it

    def _drain(self):
        """
        Let the messages in the inbox take effect, in order, while no
        earlier one is still being handled.  A client resuming sends
        C{state} and, in the same write, the C{ack} it could not deliver
        before its connection broke: that ack must be judged after the
        resume (the takeover, the store's ack, the replay) has happened,
        against what the session has sent, never against a connection that
        has sent nothing yet.  Meanwhile reading stops (backpressure, not a
        buffer): only what one read brought can wait, at most
        L{MAX_HELD_MESSAGES}.
        """
        inbox = self._inbox
        while inbox and not self._busy:
            if self.phase == "closed" or self._close_after_flush:
                inbox.clear()
                return
            item = inbox.popleft()
            if isinstance(item, ProtocolError):
                self._fail(str(item))
                inbox.clear()
                return
            self._dispatch(item)
        if self.phase == "closed":
            return
        if inbox:
            if len(inbox) > MAX_HELD_MESSAGES:
                inbox.clear()
                self._fail("too many messages before the session was ready")
            elif not self._reading_paused:
                self._reading_paused = True
                self.transport.pauseProducing()
        elif self._reading_paused:
            self._reading_paused = False
            self.transport.resumeProducing()

    def _dispatch(self, message):
        if self.phase == "initial":
            if self._initial_timer is not None:
                self._initial_timer.cancel()
                self._initial_timer = None
            if not self._authorized(message):
                return
            if isinstance(message, codec.StatelessStart):
                self._start_stateless(self.factory.sequence.start())
            elif isinstance(message, codec.StatelessResume):
                try:
                    cursor = self.factory.sequence.resume(message.state)
                except ProtocolError as e:
                    self._fail(str(e))
                    return
                self._start_stateless(cursor)
            elif isinstance(message, codec.StatefulOpen):
                self._start_stateful(message.uuid, self._open, message.count)
            elif isinstance(message, codec.StatefulResume):
                self._start_stateful(message.uuid, self._resume, message.last_id)
            else:
                self._fail("the first message must carry params or state, not an ack")
        elif self.phase == "stateful" and isinstance(message, codec.Ack):
            self._ack(message)
        else:
            self._fail(f"unexpected message in {self.phase} mode")

    def _authorized(self, message):
        """
        Whether the policy lets this connection read the stream its first
        message asks for: C{reliable:stateless}, or C{reliable:session:UUID}
        for a stateful session.  If not, it gets the protocol's error line
        (C{forbidden: ...}) and is closed; no session is touched.
        """
        authorizer = self.factory.authorizer
        if not authorizer.enabled:
            return True
        uuid = getattr(message, "uuid", None)
        resource = "reliable:stateless" if uuid is None else f"reliable:session:{uuid}"
        principals = connection_principals(self.transport)
        if authorizer.allows(principals, "read", resource):
            return True
        denied(self.factory.server_name, principals, "read", resource)
        self._fail(f"forbidden: read on {resource}")
        return False

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        was = self.phase
        self.phase = "closed"
        for call in (self._initial_timer, self._flush_call, self._pump_call, self._stall_timer,
                     self._linger_call):
            if call is not None and call.active():
                call.cancel()
        self._initial_timer = self._flush_call = self._pump_call = self._stall_timer = None
        if self._claimed:
            self._let_go()
        else:
            self.released.fire()
        self._unsent_count = 0      # queued, never written
        self._count_flushed()
        self.log.debug("reliable-stream connection closed ({phase})", phase=was)
        self._gone.fire()

    def gracefulShutdown(self) -> defer.Deferred[None]:
        """
        The server is stopping (called by
        L{streamproto.core.ops.TrackingFactory}): generate nothing more, let
        the messages being stored finish and go out, then send
        C{{"error": "server shutting down"}} and close.  A stateful session
        is disconnected, not ended: the client resumes it (C{state}) once
        the server is back, and every message it did not ack is replayed.

        @return: a Deferred firing once the connection is gone.
        """
        if self.phase == "closed":
            return defer.succeed(None)
        d = self._gone.when_fired()
        self._shutting_down = True
        self._generating = False
        if self._in_flight == 0:
            self._fail(SHUTDOWN_ERROR)
        # else: _generated / _put_failed send it once the last put is done
        return d

    # Output

    def _send(self, line):
        if self._close_after_flush:
            return      # after the error or the last message: nothing more
        self._out.append(line)
        self._schedule_flush()

    def _schedule_flush(self):
        if self._flush_call is None and self.phase != "closed":
            self._flush_call = self._clock.callLater(0, self._flush)

    def _flush(self):
        self._flush_call = None
        if self._out and self.phase != "closed":
            out, self._out = self._out, []
            self.transport.writeSequence(out)
            self._count_flushed()
        if self._close_after_flush and self.phase != "closed" and self._linger_call is None:
            self._close()

    def _close(self):
        """
        Close after the last message or an error.  Over plain TCP only our
        side is closed first (as the reference's Node server does with
        C{end()}): a client still acknowledging what it reads would get a
        TCP reset, and "broken pipe" on its next ack, if the socket were
        gone.  The client closes its side once it has read everything (or
        the linger timer does it).
        """
        half_close = getattr(self.transport, "loseWriteConnection", None)
        if half_close is not None and not ISSLTransport.providedBy(self.transport):
            half_close()
            self._linger_call = self._clock.callLater(LINGER_SECONDS,
                                                      self.transport.loseConnection)
        else:
            self.transport.loseConnection()

    def _count_flushed(self):
        """Feed the metrics once per write, not once per message."""
        f = self.factory
        if self._unsent_count:
            f.metrics.records_out.inc(self._unsent_count)
            self._unsent_count = 0
        if self._stored_count:
            f.metrics.records_in.inc(self._stored_count)
            self._stored_count = 0

    def _fail(self, text, failure=None):
        """Send the error after whatever was queued, then close."""
        if self.phase == "closed" or self._close_after_flush:
            return
        if text != SHUTDOWN_ERROR:
            self.factory.metrics.error(_error_code(text))
        if failure is not None:
            self.log.failure("reliable-stream: {text}", failure, text=text)
        else:
            self.log.info("reliable-stream error to {peer}: {text}",
                          peer=self.transport.getPeer(), text=text)
        self._end_after_queued(codec.encode_error(text))

    def _errback(self, failure):
        if failure.check(StoreUnavailable):
            self._drop(failure.getErrorMessage())
        elif failure.check(ReliableError):
            self._fail(str(failure.value))
        else:
            self._fail("internal error", failure)

    def _drop(self, why):
        """
        Send what was queued (stored already), then close without an error
        line: the session store did not answer, the session itself is
        intact, and a client resumes it after a dropped connection (an
        error line would end the stream for good).
        """
        if self.phase == "closed" or self._close_after_flush:
            return
        self.factory.metrics.error("store_unavailable")
        self.log.warn("reliable-stream: closing {peer} for it to resume later: {why}",
                      peer=self.transport.getPeer(), why=why)
        self._end_after_queued()

    def _end_after_queued(self, last_line=None):
        """Generate nothing more; send what is queued (then C{last_line}), then close."""
        if last_line is not None:
            self._out.append(last_line)
        self._close_after_flush = True
        self._generating = False
        self._flush()

    # IPushProducer: the transport pauses us when the peer reads slowly

    def pauseProducing(self) -> None:
        self._paused = True
        timeout = self.factory.stall_timeout
        if timeout and self._stall_timer is None and self.phase != "closed":
            self._stall_timer = SteadyCall(self._clock, timeout, self._stalled,
                                           monotonic=self.factory.monotonic)

    def resumeProducing(self) -> None:
        self._paused = False
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._schedule_pump()

    def _stalled(self):
        self._stall_timer = None
        self.log.info("reliable-stream: {peer} read nothing for {timeout} s; closing",
                      peer=self.transport.getPeer(), timeout=self.factory.stall_timeout)
        self.transport.abortConnection()

    def stopProducing(self) -> None:
        self._paused = True

    def _schedule_pump(self, delay=0):
        if self._pump_call is None and self.phase in ("stateless", "stateful"):
            self._pump_call = self._clock.callLater(delay, self._pump_now)

    def _pump_now(self):
        self._pump_call = None
        if self.phase == "stateless":
            self._pump_stateless()
        elif self.phase == "stateful":
            self._pump_stateful()

    def _take_tokens(self, wanted):
        """How many of C{wanted} messages the send rate allows now (all without a rate)."""
        rate = self.factory.rate
        if not rate:
            return wanted
        now = self._clock.seconds()
        if self._tokens_at is None:
            self._tokens = 1.0
        else:
            # at most one second of burst
            self._tokens = min(float(rate), self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        n = min(wanted, int(self._tokens))
        self._tokens -= n
        if n < wanted:
            self._schedule_pump((1.0 - (self._tokens - int(self._tokens))) / rate)
        return n

    # Stateless mode

    def _start_stateless(self, cursor):
        self.phase = "stateless"
        self._cursor = cursor
        self._schedule_pump()

    def _pump_stateless(self):
        if self._paused or self._close_after_flush:
            return
        n = self._take_tokens(self.factory.turn_batch)
        if n:
            values, self._cursor = self.factory.sequence.take(self._cursor, n)
            self.transport.write(codec.encode_stateless_values(values))
            self.factory.metrics.records_out.inc(len(values))
            self._schedule_pump()

    # Stateful mode

    def _start_stateful(self, uuid, then, argument):
        self.phase = "waiting"
        self._busy = True
        self.uuid = uuid
        self._claimed = True
        previous = self.factory.claim(uuid, self)
        d = previous.when_fired()
        d.addCallback(self._took_session, then, argument)
        d.addErrback(self._errback)

    def _took_session(self, _, then, argument):
        if self.phase == "closed":
            return
        self._session_taken = True
        self.phase = "stateful"
        return then(argument)

    def _open(self, count):
        d = self.factory.store.register(self.uuid, initial_state(count, rng=self.factory.rng))
        d.addCallback(lambda _: self._ready())
        d.addErrback(self._errback)

    def _ready(self):
        """The session's first message is done: the ones held behind it, then new messages."""
        self._busy = False
        self._drain()
        self._generate()

    @defer.inlineCallbacks
    def _resume(self, last_id):
        store = self.factory.store
        try:
            # the reference's rule: state N acknowledges N, then replays after it
            yield store.ack(self.uuid, last_id)
            self._acked = self._sent_id = last_id
            while self.phase == "stateful":
                message = yield store.after(self.uuid, self._sent_id)
                if message is None:
                    break
                self._deliver(message)
        except Exception:
            self._errback(Failure())
            return
        if self.phase == "stateful" and not self._close_after_flush:
            self._ready()

    def _deliver(self, message):
        self._sent_id = message.id
        self._unsent_count += 1
        self._send(codec.encode_stateful(message.id, message.data))
        if isinstance(message.data, dict) and "crc" in message.data:
            # the last message: the spec has the server close after it
            self._generating = False
            self._close_after_flush = True

    def _generate(self):
        if self.phase == "stateful" and not self._close_after_flush:
            self._generating = True
            self._pump_stateful()

    def _pump_stateful(self):
        if self._pumping:
            return
        self._pumping = True
        try:
            f = self.factory
            issued = 0
            while (self._generating and not self._paused and self._in_flight < f.window
                   and issued < f.turn_batch):
                if not self._take_tokens(1):
                    break
                issued += 1
                self._in_flight += 1
                d = f.store.put(self.uuid, next_message)
                d.addCallbacks(self._generated, self._put_failed)
            if issued >= f.turn_batch and self._generating:
                self._schedule_pump()
        finally:
            self._pumping = False

    def _generated(self, message):
        self._in_flight -= 1
        if self.phase == "closed":
            self.factory.metrics.records_in.inc()   # stored after the connection ended
        else:
            self._stored_count += 1
        if self.phase == "stateful" and not self._close_after_flush:
            self._deliver(message)
            self._pump_stateful()
        self._check_drained()
        self._maybe_shut()

    def _maybe_shut(self):
        if self._shutting_down and self._in_flight == 0:
            self._fail(SHUTDOWN_ERROR)

    def _put_failed(self, failure):
        self._in_flight -= 1
        if failure.check(StreamFinished):
            # every message exists already (more puts were in flight than
            # messages left, or the client resumed after the last one)
            self._generating = False
            if self._in_flight == 0 and self.phase == "stateful":
                self._close_after_flush = True
                self._schedule_flush()
        elif self.phase == "stateful":
            self._errback(failure)
        elif failure.check(ReliableError):
            # the session store said why (closed, unreachable): one line
            self.log.warn("reliable-stream put failed after disconnect: {error}",
                          error=failure.getErrorMessage())
        else:
            self.log.failure("reliable-stream put failed after disconnect", failure)
        self._check_drained()
        self._maybe_shut()

    def _ack(self, message):
        if message.uuid != self.uuid:
            self._fail("ack for another session")
            return
        if message.message_id > self._sent_id:
            self._fail("Unknown message ID")
            return
        if message.message_id < self._acked:
            self._fail("Out-of-order ACK")
            return
        self._acked = message.message_id
        d = self.factory.store.ack(self.uuid, message.message_id)
        d.addErrback(self._errback)

    # Leaving a session

    def _check_drained(self):
        if self._in_flight == 0 and self._drained is not None:
            d, self._drained = self._drained, None
            d.callback(None)

    def _let_go(self):
        """After the connection is lost: finish the puts in flight, disconnect, release."""
        if not self._session_taken:
            # never got the session: release once the previous holder has
            previous = self.factory.previous_of(self)
            previous.when_fired().addBoth(lambda _: self._release())
            return
        self._drained = defer.Deferred()
        d = self._drained
        self._check_drained()
        d.addCallback(lambda _: self.factory.store.disconnect(self.uuid))
        d.addErrback(lambda f: self.log.info(
            "disconnect of session {uuid}: {error}", uuid=self.uuid, error=f.getErrorMessage()))
        d.addBoth(lambda _: self._release())

    def _release(self):
        self.factory.release(self.uuid, self)
        self.released.fire()


class ReliableStreamFactory(Factory):
    """
    Serves both modes on one port.

    @param store: an L{ISessionStore} for the stateful mode.
    @param sequence: the stateless L{IStatelessSequence} (default: doubling).
    @param rate: messages per second per connection (None: unlimited).
    @param max_line: bound of an incoming line, in bytes.
    @param window: puts a stateful connection keeps in flight.
    @param initial_timeout: seconds allowed for the first line.
    @param stall_timeout: seconds a peer may leave the stream paused (its
        socket buffer full) before the connection is cut; None: forever.
    @param clock: IReactorTime (default: the reactor).
    @param server_name: the C{server} label of the Prometheus metrics.
    @param authorizer: the L{streamproto.core.auth.IAuthorizer} deciding who
        may read which stream (default: everyone).
    """

    protocol = ReliableStreamServerProtocol
    log = Logger()

    def __init__(self, store: ISessionStore, sequence: IStatelessSequence | None = None,
                 rate: float | None = None, max_line: int = codec.DEFAULT_MAX_LINE,
                 window: int = DEFAULT_WINDOW, turn_batch: int = DEFAULT_TURN_BATCH,
                 initial_timeout: float = DEFAULT_INITIAL_TIMEOUT,
                 stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
                 clock: IReactorTime | None = None, rng: random.Random | None = None,
                 server_name: str = SERVER_NAME, authorizer: IAuthorizer = ALLOW_ALL,
                 monotonic: Callable[[], float] | None = None) -> None:
        clock = default_reactor(clock)
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive")
        self.store = store
        self.authorizer = authorizer
        self.sequence = sequence or DoublingSequence(rng or random)
        self.rate = rate
        self.max_line = max_line
        self.window = window
        self.turn_batch = turn_batch
        self.initial_timeout = initial_timeout
        self.stall_timeout = stall_timeout
        self.clock = clock
        #: what the initial and stall timeouts are measured on (None: the
        #: clock's monotonic time, L{SteadyCall})
        self.monotonic = monotonic
        self.rng = rng or random.SystemRandom()
        self.server_name = server_name
        self.metrics = metrics.ServerMetrics(server_name)
        # uuid -> the newest connection of that session
        self.active: dict[str, ReliableStreamServerProtocol] = {}
        # connection -> the connection it waits for
        self._previous: dict[ReliableStreamServerProtocol, OneShotObserver[None]] = {}

    def claim(self, uuid: str, proto: ReliableStreamServerProtocol) -> OneShotObserver[None]:
        """
        Make C{proto} the session's connection; an older one is cut (the
        client only reconnects once it thinks the old one is gone).  Returns
        the L{_Released} to wait for before touching the session.
        """
        previous = self.active.get(uuid)
        self.active[uuid] = proto
        if previous is None:
            done = _fired()
            self._previous[proto] = done
            return done
        self.log.info("session {uuid}: a new connection takes over", uuid=uuid)
        self._previous[proto] = previous.released
        if previous.transport is not None and previous.phase != "closed":
            previous.transport.abortConnection()
        return previous.released

    def previous_of(self, proto: ReliableStreamServerProtocol) -> OneShotObserver[None]:
        return self._previous.get(proto) or _fired()

    def release(self, uuid: str, proto: ReliableStreamServerProtocol) -> None:
        self._previous.pop(proto, None)
        if self.active.get(uuid) is proto:
            del self.active[uuid]


def _error_code(text):
    """A short, bounded label for an error line (the metrics' C{code})."""
    if text.startswith("line longer than"):
        return "line_too_long"
    if text.startswith("forbidden:"):
        return "forbidden"
    known = {"Unknown client": "unknown_client", "Unknown message ID": "unknown_message_id",
             "Out-of-order ACK": "out_of_order_ack", "internal error": "internal_error",
             "no initial message in time": "initial_timeout",
             "ack for another session": "ack_for_another_session"}
    return known.get(text, "protocol_error")


def _fired() -> OneShotObserver[None]:
    released: OneShotObserver[None] = OneShotObserver()
    released.fire()
    return released
