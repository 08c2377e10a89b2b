"""
The Lumberjack server: a thin Protocol over L{FrameDecoder} and an
L{IEventSink}.

A batch starts with a window frame C{W n} and ends when C{n} data frames
arrived (a compressed frame counts the data frames inside).  Then:

1. the events are handed to the sink and the connection stops reading
   (C{transport.pauseProducing}) until the sink's Deferred fires;
2. the ack carries the sequence number of the batch's last event (its
   highest, barring roll-over: logstash-input-beats semantics, which every
   client accepts), with the batch's version byte;
3. reading resumes, starting with whatever was already buffered (pipelined
   batches).

A large batch is persisted in parts once C{flush_bytes} of events are
pending, each part acked on its own (a partial ack), which bounds memory
per connection.  While a batch is pending, a v2 connection gets a keepalive
C{ACK 0} every C{keepalive_interval} seconds so that the client's timeout
does not fire while storage is slow.  C{W 0} is answered with C{ACK 0}.

All connections share a memory budget (C{max_buffered}: bytes of events
received and not yet stored); past it, a connection opening a new batch
waits, not reading, until others have stored theirs.

Every bound (window, frame size, inflated size, JSON, frame types, idle
time) ends the connection with one log line saying which and why; events
not acked yet are the client's to send again.
"""

from collections import deque

from automat import MethodicalMachine
from twisted.internet.defer import maybeDeferred, succeed
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from streamproto.core.clock import default_reactor
from streamproto.core.tcp import set_no_delay
from streamproto.core.errors import log_failure
from streamproto.core import metrics
from streamproto.core.auth import ALLOW_ALL, connection_principals, denied
from streamproto.core.observer import OneShotObserver
from streamproto.core.tls import peer_identity
from streamproto.lumberjack.codec import (
    DEFAULT_MAX_DECOMPRESSED, DEFAULT_MAX_FRAME, DEFAULT_MAX_WINDOW, VERSION_2, Ack, Events,
    FrameDecoder, ProtocolError, UnexpectedFrame, Window, encode_ack,
)
from streamproto.lumberjack.sink import ConnectionInfo

DEFAULT_IDLE_TIMEOUT = 60.0
DEFAULT_KEEPALIVE_INTERVAL = 5.0
DEFAULT_FLUSH_BYTES = 4 * 1048576
DEFAULT_MAX_BUFFERED = 256 * 1048576


class LumberjackServerProtocol(Protocol):
    """
    One connection from a writer (Filebeat, go-lumber, logstash-forwarder, ...).

    The per-event work (L{_events}) is plain code; the per-batch life of the
    connection is an automat machine: between batches -> receiving ->
    storing a part (back to receiving) or the whole batch (back to between
    batches), and done after an error or the end of the connection.
    """

    log = Logger()
    _machine = MethodicalMachine()

    def __init__(self, factory):
        self.factory = factory
        self.decoder = FrameDecoder(factory.max_frame, factory.max_decompressed,
                                    factory.max_window)
        self.connection = None
        self._principals = None
        self.peer = "?"
        self._backlog = deque()     # decoded frames past the end of the current batch
        self._window = None         # None between batches
        self._version = VERSION_2
        self._received = 0          # events of the current batch received
        self._pending = []          # received, not yet handed to the sink
        self._pending_bytes = 0
        self._pending_seq = 0       # sequence number of the last pending event
        self._writing = False       # a sink write is outstanding
        self._throttled = False     # waiting for the factory's memory budget
        self._held = 0              # bytes of events counted in factory.buffered
        self._paused = False
        self._closed = False
        self._in_advance = False
        self._idle_call = None
        self._keepalive_call = None
        self._shutting_down = False
        self._gone = OneShotObserver()  # gracefulShutdown's: fired at connectionLost

    # -- Twisted's side -----------------------------------------------------------
    def connectionMade(self):
        peer = self.transport.getPeer()
        self.peer = f"{getattr(peer, 'host', peer)}:{getattr(peer, 'port', '')}"
        set_no_delay(self.transport)
        self.factory.connections.add(self)
        timeout = self.factory.idle_timeout
        if timeout:
            self._idle_call = self.factory.clock.callLater(timeout, self._idle_expired)

    def connectionLost(self, reason):
        self._lost()
        self._gone.fire()

    def gracefulShutdown(self):
        """
        The server is stopping (called by
        L{streamproto.core.ops.TrackingFactory}): read no more batches; the
        events of the current batch received so far are stored and acked
        (a partial ack, as for C{flush_bytes}), a batch already with the
        sink is acked once stored, then the connection is closed.  What was
        not acked is the client's to send again.

        @return: a Deferred firing once the connection is gone.
        """
        if self._closed:
            return succeed(None)
        d = self._gone.when_fired()
        if self._shutting_down:
            return d
        self._shutting_down = True
        if self._writing:
            pass                    # _ack closes once the sink is done
        elif self._pending and not self._throttled:
            self._part_filled()     # store and ack what arrived of this batch
        else:
            self._close_for_shutdown()
        return d

    def _close_for_shutdown(self):
        if not self._closed:
            self.log.info("lumberjack: closing {peer}: server shutting down", peer=self.peer)
            self._lose()

    def _lose(self):
        """Release everything, then close (reading again: see below)."""
        paused = self._paused or self._throttled
        self._release()
        if paused:
            # input is ignored from now on, but a TLS close completes only
            # once the peer's close_notify is read
            self._paused = False
            self.transport.resumeProducing()
        self.transport.loseConnection()

    def dataReceived(self, data):
        if self._closed:
            return
        if self._idle_call is not None:
            self._idle_call.reset(self.factory.idle_timeout)
        self.decoder.feed(data)
        self._advance()

    # -- frames -------------------------------------------------------------------
    def _advance(self):
        """Handle decoded frames until input runs out or a write is outstanding."""
        if self._in_advance:
            return
        self._in_advance = True
        try:
            self._process()
        except ProtocolError as e:
            self._bad_input(e.code, str(e))
        finally:
            self._in_advance = False

    def _process(self):
        backlog = self._backlog
        decoder = self.decoder
        while (not self._writing and not self._throttled and not self._closed
               and not self._shutting_down):
            if not backlog:
                wanted = 0 if self._window is None else self._window - self._received
                frames = decoder.decode(wanted)
                if not frames:
                    return
                backlog.extend(frames)
            frame = backlog.popleft()
            kind = type(frame)
            if kind is Events:
                self._events(frame)
            elif kind is Window:
                if not self._authorized():
                    return
                if self._received:
                    raise UnexpectedFrame(f"window frame after {self._received} of "
                                          f"{self._window} events of a batch")
                if not frame.size:
                    self._empty_window(frame)
                elif self.factory.buffered >= self.factory.max_buffered:
                    self._window_throttled(frame)
                else:
                    self._window_opened(frame)
            elif kind is Ack:
                raise UnexpectedFrame("ack frame from a writer")

    def _authorized(self):
        """
        Whether the policy lets this connection write to the sink's log,
        asked at every window (a reloaded policy applies from the next
        batch).  If not, the connection is closed before anything of the
        batch is stored or acked.
        """
        authorizer = self.factory.authorizer
        if not authorizer.enabled:
            return True
        if self._principals is None:
            self._principals = connection_principals(self.transport)
        resource = getattr(self.factory.sink, "log_name", "lumberjack")
        if authorizer.allows(self._principals, "write", resource):
            return True
        denied(self.factory.server_name, self._principals, "write", resource,
               f"closing {self.peer}")
        self._lose()
        return False

    def _events(self, run):
        if self._window is None:
            raise UnexpectedFrame("data frame before any window frame")
        room = self._window - self._received
        if len(run.payloads) > room:
            run, rest = run.split(room)
            self._backlog.appendleft(rest)
        nbytes = sum(map(len, run.payloads))
        flush_bytes = self.factory.flush_bytes
        if (self._pending_bytes + nbytes >= flush_bytes
                and self._received + len(run.payloads) < self._window):
            # persist this part of a big batch now: cut the run where it crosses the bound
            total = self._pending_bytes
            cut = 0
            for size in map(len, run.payloads):
                total += size
                cut += 1
                if total >= flush_bytes:
                    break
            if cut < len(run.payloads):
                run, rest = run.split(cut)
                self._backlog.appendleft(rest)
                nbytes = total - self._pending_bytes
        payloads = run.payloads
        self._pending += payloads
        self._pending_bytes += nbytes
        self._held += nbytes
        self.factory.buffered += nbytes
        self._pending_seq = run.seqs[-1]
        self._received += len(payloads)
        if self._received == self._window:
            self._batch_filled()
        elif self._pending_bytes >= flush_bytes:
            self._part_filled()

    # -- the machine: states ----------------------------------------------------------
    @_machine.state(initial=True)
    def _between_batches(self):
        "Waiting for a window frame."

    @_machine.state()
    def _receiving(self):
        "A window is open; events are arriving."

    @_machine.state()
    def _throttled_window(self):
        "A window is open but the factory's memory budget is spent: not reading."

    @_machine.state()
    def _storing_part(self):
        "Part of a big batch is with the sink; not reading."

    @_machine.state()
    def _storing_batch(self):
        "The end of a batch is with the sink; not reading."

    @_machine.state()
    def _done(self):
        "Closed, or closing after an error: nothing more is read or acked."

    # -- inputs -----------------------------------------------------------------------
    @_machine.input()
    def _window_opened(self, frame):
        "A window frame C{W n}, n > 0."

    @_machine.input()
    def _window_throttled(self, frame):
        "A window frame C{W n}, n > 0, while the factory is over its memory budget."

    @_machine.input()
    def _budget_freed(self):
        "Other connections stored enough: this one may read again."

    @_machine.input()
    def _empty_window(self, frame):
        "A window frame C{W 0}."

    @_machine.input()
    def _part_filled(self):
        "flush_bytes of a batch are pending."

    @_machine.input()
    def _batch_filled(self):
        "The window's last event arrived."

    @_machine.input()
    def _stored(self):
        "The sink's Deferred fired: the events are durable."

    @_machine.input()
    def _store_failed(self, failure):
        "The sink's Deferred failed."

    @_machine.input()
    def _bad_input(self, code, message):
        "A bound was crossed or the input is malformed."

    @_machine.input()
    def _idle_expired(self):
        "Nothing received for idle_timeout seconds."

    @_machine.input()
    def _keepalive_due(self):
        "keepalive_interval seconds since the last ack with a batch pending."

    @_machine.input()
    def _lost(self):
        "The connection is gone."

    # -- outputs ----------------------------------------------------------------------
    @_machine.output()
    def _begin_batch(self, frame):
        self._window = frame.size
        self._version = frame.version
        self._received = 0
        interval = self.factory.keepalive_interval
        if interval and frame.version == VERSION_2 and self._keepalive_call is None:
            self._keepalive_call = self.factory.clock.callLater(interval, self._keepalive_due)

    @_machine.output()
    def _wait_for_budget(self):
        # this connection holds no events yet, so waiting cannot deadlock:
        # the connections holding the budget are mid-batch and keep reading
        self._throttled = True
        self.factory.metric_pauses.inc()
        self.transport.pauseProducing()
        self.factory.throttled.append(self)

    @_machine.output()
    def _read_again(self):
        self._throttled = False
        self.transport.resumeProducing()
        self._advance()

    @_machine.output()
    def _end_window(self):
        self._window = None
        self._received = 0

    @_machine.output()
    def _ack_empty(self, frame):
        # an empty batch: nothing to persist, answer at once
        self.transport.write(encode_ack(0, frame.version))

    @_machine.output()
    def _store(self):
        if self.connection is None:
            # by now the TLS handshake is done, so the client certificate is known
            self.connection = ConnectionInfo(self.peer, peer_identity(self.transport))
        events, self._pending = self._pending, []
        self._acking = (self._pending_seq, self._version, len(events), self._pending_bytes)
        self._pending_bytes = 0
        self._writing = True
        d = maybeDeferred(self.factory.sink.write, self.connection, events)
        d.addCallbacks(lambda _: self._stored(), self._store_failed)
        if self._writing and not self._closed:
            # storage is slower than the network: stop reading until it catches up
            self._paused = True
            self.factory.metric_pauses.inc()
            self.transport.pauseProducing()

    @_machine.output()
    def _ack(self):
        seq, version, count, nbytes = self._acking
        self._writing = False
        factory = self.factory
        factory.events_persisted += count
        self._held -= nbytes
        factory.release(nbytes)
        factory.metric_records.inc(count)
        factory.metric_acks.inc()
        self.transport.write(encode_ack(seq, version))
        if self._shutting_down:
            # the last ack of this connection is written: goodbye
            self._close_for_shutdown()

    @_machine.output()
    def _restart_keepalive(self):
        if self._keepalive_call is not None and self._keepalive_call.active():
            self._keepalive_call.reset(self.factory.keepalive_interval)

    @_machine.output()
    def _stop_keepalive(self):
        if self._keepalive_call is not None:
            if self._keepalive_call.active():
                self._keepalive_call.cancel()
            self._keepalive_call = None

    @_machine.output()
    def _send_keepalive(self):
        self.transport.write(encode_ack(0, VERSION_2))
        self._keepalive_call = self.factory.clock.callLater(
            self.factory.keepalive_interval, self._keepalive_due)

    @_machine.output()
    def _forget_keepalive(self):
        self._keepalive_call = None

    @_machine.output()
    def _resume(self):
        if self._paused:
            self._paused = False
            if self._closed:
                return      # closed right after its last ack (shutdown)
            self.transport.resumeProducing()
            self._advance()

    @_machine.output()
    def _rearm_idle(self):
        # storage is slow, the client is waiting for us: not idle
        self._idle_call = self.factory.clock.callLater(
            self.factory.idle_timeout, self._idle_expired)

    @_machine.output()
    def _log_bad_input(self, code, message):
        metrics.ERRORS.labels(self.factory.server_name, code).inc()
        self.log.warn("lumberjack: closing {peer}: {code}: {message}",
                      peer=self.peer, code=code, message=message)

    @_machine.output()
    def _log_idle(self):
        self._idle_call = None
        metrics.ERRORS.labels(self.factory.server_name, "idle_timeout").inc()
        self.log.warn("lumberjack: closing {peer}: {code}: {message}", peer=self.peer,
                      code="idle_timeout",
                      message=f"nothing received for {self.factory.idle_timeout:g} s")

    @_machine.output()
    def _log_store_failure(self, failure):
        self._writing = False
        # the store's own errors (full, a cluster without a quorum) are one
        # line; the client sends the batch again
        log_failure(self.log, failure, "lumberjack: storing events from {peer} failed, "
                    "closing without ack", peer=self.peer)

    @_machine.output()
    def _disconnect(self):
        self._lose()

    @_machine.output()
    def _shut(self):
        self._release()

    def _release(self):
        self.factory.release(self._held, self)
        self._held = 0
        self._throttled = False
        self._closed = True
        self._writing = False
        self.factory.connections.discard(self)
        for call in (self._idle_call, self._keepalive_call):
            if call is not None and call.active():
                call.cancel()
        self._idle_call = self._keepalive_call = None
        self._pending = []
        self._backlog.clear()

    # -- transitions ----------------------------------------------------------------
    _between_batches.upon(_window_opened, enter=_receiving, outputs=[_begin_batch])
    _between_batches.upon(_empty_window, enter=_between_batches, outputs=[_ack_empty])
    _between_batches.upon(_keepalive_due, enter=_between_batches, outputs=[_forget_keepalive])
    _receiving.upon(_window_opened, enter=_receiving, outputs=[_begin_batch])
    _between_batches.upon(_window_throttled, enter=_throttled_window,
                          outputs=[_begin_batch, _wait_for_budget])
    _receiving.upon(_window_throttled, enter=_throttled_window,
                    outputs=[_begin_batch, _wait_for_budget])
    _throttled_window.upon(_budget_freed, enter=_receiving, outputs=[_read_again])
    _throttled_window.upon(_keepalive_due, enter=_throttled_window, outputs=[_send_keepalive])
    _throttled_window.upon(_idle_expired, enter=_throttled_window, outputs=[_rearm_idle])
    _receiving.upon(_empty_window, enter=_between_batches,
                    outputs=[_end_window, _stop_keepalive, _ack_empty])
    _receiving.upon(_part_filled, enter=_storing_part, outputs=[_store])
    _receiving.upon(_batch_filled, enter=_storing_batch, outputs=[_end_window, _store])
    _receiving.upon(_keepalive_due, enter=_receiving, outputs=[_send_keepalive])
    _storing_part.upon(_stored, enter=_receiving, outputs=[_ack, _restart_keepalive, _resume])
    _storing_batch.upon(_stored, enter=_between_batches,
                        outputs=[_ack, _stop_keepalive, _resume])
    for _state in (_storing_part, _storing_batch):
        _state.upon(_keepalive_due, enter=_state, outputs=[_send_keepalive])
        _state.upon(_idle_expired, enter=_state, outputs=[_rearm_idle])
        _state.upon(_store_failed, enter=_done, outputs=[_log_store_failure, _disconnect])
    for _state in (_between_batches, _receiving):
        _state.upon(_idle_expired, enter=_done, outputs=[_log_idle, _disconnect])
    for _state in (_between_batches, _receiving, _throttled_window, _storing_part,
                   _storing_batch):
        _state.upon(_bad_input, enter=_done, outputs=[_log_bad_input, _disconnect])
        _state.upon(_lost, enter=_done, outputs=[_shut])
    # after the end: storage finishing late changes nothing (no ack to a closed connection)
    _done.upon(_stored, enter=_done, outputs=[])
    _done.upon(_store_failed, enter=_done, outputs=[_log_store_failure])
    _done.upon(_lost, enter=_done, outputs=[_shut])
    _done.upon(_bad_input, enter=_done, outputs=[])
    _done.upon(_idle_expired, enter=_done, outputs=[])
    _done.upon(_keepalive_due, enter=_done, outputs=[])
    _done.upon(_budget_freed, enter=_done, outputs=[])
    del _state


class LumberjackServerFactory(Factory):
    """
    Serves Lumberjack v1 and v2 on any stream endpoint (TCP, TLS).

    @param sink: an L{IEventSink} (e.g. L{LogStoreSink}).
    @param clock: an IReactorTime for the idle and keepalive timers.
    @param max_window: largest window (batch size) accepted.
    @param max_frame: largest data frame payload, bytes.
    @param max_decompressed: largest compressed frame, compressed and inflated.
    @param idle_timeout: seconds without input before closing (0: never).
    @param keepalive_interval: seconds between C{ACK 0} while a batch is
        pending (0: none).
    @param flush_bytes: persist (and partially ack) a batch in parts of
        about this many bytes.
    @param max_buffered: memory budget shared by all connections: bytes of
        events received and not yet stored.  Past it, a connection that
        opens a new batch waits (not reading) until others have stored.
    @param server_name: the C{server} label of the Prometheus metrics.
    @param authorizer: the L{streamproto.core.auth.IAuthorizer} deciding
        who may write to the sink's log (its C{log_name}); default: everyone.
    """

    protocol = LumberjackServerProtocol

    def __init__(self, sink, clock=None, max_window=DEFAULT_MAX_WINDOW,
                 max_frame=DEFAULT_MAX_FRAME, max_decompressed=DEFAULT_MAX_DECOMPRESSED,
                 idle_timeout=DEFAULT_IDLE_TIMEOUT, keepalive_interval=DEFAULT_KEEPALIVE_INTERVAL,
                 flush_bytes=DEFAULT_FLUSH_BYTES, max_buffered=DEFAULT_MAX_BUFFERED,
                 server_name="lumberjack-server", authorizer=ALLOW_ALL):
        clock = default_reactor(clock)
        self.sink = sink
        self.authorizer = authorizer
        self.clock = clock
        self.max_window = max_window
        self.max_frame = max_frame
        self.max_decompressed = max_decompressed
        self.idle_timeout = idle_timeout
        self.keepalive_interval = keepalive_interval
        self.flush_bytes = flush_bytes
        self.max_buffered = max_buffered
        self.buffered = 0           # bytes of events received and not yet stored, all connections
        self.throttled = deque()    # connections waiting for buffered to drop
        self.connections = set()
        self.events_persisted = 0
        self.server_name = server_name
        self.metric_records = metrics.RECORDS_IN.labels(server_name)
        self.metric_acks = metrics.ACKS_SENT.labels(server_name)
        self.metric_pauses = metrics.BACKPRESSURE_PAUSES.labels(server_name)

    def buildProtocol(self, addr):
        return self.protocol(self)

    def release(self, nbytes, gone=None):
        """C{nbytes} of events were stored (or dropped): wake throttled connections."""
        self.buffered -= nbytes
        if gone is not None:
            try:
                self.throttled.remove(gone)
            except ValueError:
                pass
        while self.throttled and self.buffered < self.max_buffered:
            self.throttled.popleft()._budget_freed()
