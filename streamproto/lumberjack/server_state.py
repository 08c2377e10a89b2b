"""
The life of one Lumberjack server connection, without a transport: an
object fed bytes and connection events, whose every effect on the world
(writing an ack, pausing reading, closing, storing events, the server's
shared memory budget) is a call on an L{ILumberjackConnection} that the
Twisted protocol implements.  The shape of magic-wormhole-transit-relay's
C{TransitServerState}; tests drive it with a fake clock and a recorder.

A batch starts with a window frame C{W n} and ends when C{n} data frames
arrived (a compressed frame counts the data frames inside).  Then:

1. the events are handed to the sink and the connection stops reading
   until the sink's Deferred fires;
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
"""

from collections import deque

from automat import MethodicalMachine
from twisted.logger import Logger
from zope.interface import Interface

from streamproto.core import metrics as core_metrics
from streamproto.core.errors import log_failure
from streamproto.core.machine import ignore
from streamproto.core.idle import IdleTimeout
from streamproto.lumberjack.codec import VERSION_2, Ack, Events, ProtocolError, UnexpectedFrame, Window
from streamproto.lumberjack.runs import PayloadRun

__all__ = ["ILumberjackConnection", "LumberjackServerState"]


class ILumberjackConnection(Interface):
    """
    What a L{LumberjackServerState} does to the world: its connection's
    transport, the event sink, the authorization policy and the memory
    budget that all connections of a server share.
    """

    def send_ack(seq, version):
        """
        Write an ack frame.

        @param seq: the sequence number acked (0: a keepalive, or the answer
            to an empty window).
        @param version: the version byte of the frame.
        """

    def pause_reading():
        """Stop reading from the peer (storage, or the shared budget, is behind)."""

    def resume_reading():
        """Read from the peer again."""

    def close():
        """Close the connection (once what was written is sent)."""

    def may_write():
        """
        Whether the policy lets this connection's peer write to the sink,
        asked at every window frame.  A refusal is logged here; the
        connection is then closed.

        @return: a bool.
        """

    def store(events):
        """
        Hand events to the sink.

        @param events: the JSON documents, a L{PayloadRun} (a sequence of
            bytes kept as one buffer).
        @return: a Deferred firing once they are durable.
        """

    def admit():
        """
        Whether a new batch may start now, the shared memory budget having
        room.  If not, the connection waits in line and its state's
        L{LumberjackServerState.budget_freed} is called when it is its turn.

        @return: a bool.
        """

    def hold(nbytes):
        """
        C{nbytes} more of events were received and are not stored yet: they
        count against the shared memory budget.
        """

    def events_stored(count, nbytes):
        """
        C{count} events (C{nbytes} of the bytes held) are durable: the
        budget gets them back, the metrics count them; their ack follows.
        """

    def finished(nbytes):
        """
        The connection is done: C{nbytes} still held are given back to the
        budget, and the connection leaves its line (and the server's list of
        connections).  May be called more than once (then with 0).
        """


class LumberjackServerState:
    """
    One connection from a writer (Filebeat, go-lumber, logstash-forwarder, ...).

    The per-event work (L{_events}) is plain code that sees whole runs of
    events; the per-batch life of the connection is an automat machine:
    between batches -> receiving -> storing a part (back to receiving) or
    the whole batch (back to between batches), and done after an error or
    the end of the connection.

    @ivar peer: the peer's address, for the log.
    """

    log = Logger()
    _machine = MethodicalMachine()
    _INPUTS = ("budget_freed", "connection_lost", "_window_opened", "_window_throttled",
               "_empty_window", "_denied", "_part_filled", "_batch_filled", "_stored",
               "_store_failed", "_bad_input", "_idle_expired", "_keepalive_due")

    def __init__(self, connection, decoder, clock, idle_timeout=60.0, keepalive_interval=5.0,
                 flush_bytes=4 * 1048576, metrics=None):
        """
        @param connection: the L{ILumberjackConnection} carrying out the effects.
        @param decoder: the L{streamproto.lumberjack.codec.FrameDecoder} the
            bytes go through.
        @param clock: an IReactorTime for the idle and keepalive timers.
        @param idle_timeout: seconds without input before closing (0: never).
        @param keepalive_interval: seconds between C{ACK 0} while a batch
            is pending (0: none).
        @param flush_bytes: persist (and partially ack) a batch in parts of
            about this many bytes.
        @param metrics: the server's L{streamproto.core.metrics.ServerMetrics}
            (errors are counted there; default: C{lumberjack-server}'s).
        """
        self._connection = connection
        self._decoder = decoder
        self._clock = clock
        self._keepalive_interval = keepalive_interval
        self._flush_bytes = flush_bytes
        self._metrics = metrics or core_metrics.ServerMetrics("lumberjack-server")
        self.peer = "?"
        self._backlog = deque()     # decoded frames past the end of the current batch
        self._window = None         # None between batches
        self._version = VERSION_2
        self._received = 0          # events of the current batch received
        self._pending = []          # runs received, not yet handed to the sink
        self._pending_count = 0     # events in them
        self._pending_bytes = 0
        self._pending_seq = 0       # sequence number of the last pending event
        self._acking = None         # (seq, version, count, nbytes) of the store outstanding
        self._writing = False       # a sink write is outstanding
        self._throttled = False     # waiting for the shared memory budget
        self._held = 0              # bytes of events counted in the budget
        self._paused = False        # reading paused until the sink is done
        self._closed = False
        self._in_advance = False
        self._idle = IdleTimeout(clock, idle_timeout, self._idle_expired)
        self._keepalive_call = None
        self._shutting_down = False
        # automat builds a new function (copying its code object) at every
        # access to an input: bound once here, several per batch cost a
        # tenth of the server's Python time per batch
        for name in self._INPUTS:
            setattr(self, name, getattr(self, name))

    @property
    def closed(self):
        """Whether the connection is finished (closed or closing): input is ignored."""
        return self._closed

    @property
    def pending_events(self):
        """How many events were received and not handed to the sink yet."""
        return self._pending_count

    # -- fed by the protocol ------------------------------------------------------
    def connection_made(self, peer):
        """
        The connection is up: the idle timeout starts.

        @param peer: the peer's address, for the log.
        """
        self.peer = peer
        self._idle.start()

    def data_received(self, data):
        """Bytes from the peer: decode and handle what is complete."""
        if self._closed:
            return
        self._idle.reset()
        self._decoder.feed(data)
        self._advance()

    def shutdown(self):
        """
        The server is stopping: read no more batches; the events of the
        current batch received so far are stored and acked (a partial ack,
        as for C{flush_bytes}), a batch already with the sink is acked once
        stored, then the connection is closed.  What was not acked is the
        client's to send again.
        """
        if self._closed or self._shutting_down:
            return
        self._shutting_down = True
        if self._writing:
            pass                    # _ack closes once the sink is done
        elif self._pending and not self._throttled:
            self._part_filled()     # store and ack what arrived of this batch
        else:
            self._close_for_shutdown()

    def _close_for_shutdown(self):
        if not self._closed:
            self.log.info("lumberjack: closing {peer}: server shutting down", peer=self.peer)
            self._close()

    def _close(self):
        """Release everything, then close (reading again: see below)."""
        paused = self._paused or self._throttled
        self._release()
        if paused:
            # input is ignored from now on, but a TLS close completes only
            # once the peer's close_notify is read
            self._paused = False
            self._connection.resume_reading()
        self._connection.close()

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
        decoder = self._decoder
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
                if not self._connection.may_write():
                    # a reloaded policy applies from the next batch: nothing
                    # of this one is stored or acked
                    self._denied()
                    return
                if self._received:
                    raise UnexpectedFrame(f"window frame after {self._received} of "
                                          f"{self._window} events of a batch")
                if not frame.size:
                    self._empty_window(frame)
                elif self._connection.admit():
                    self._window_opened(frame)
                else:
                    self._window_throttled(frame)
            elif kind is Ack:
                raise UnexpectedFrame("ack frame from a writer")

    def _events(self, run):
        if self._window is None:
            raise UnexpectedFrame("data frame before any window frame")
        room = self._window - self._received
        if len(run) > room:
            run, rest = run.split(room)
            self._backlog.appendleft(rest)
        payloads = run.payloads
        nbytes = payloads.nbytes
        flush_bytes = self._flush_bytes
        if (self._pending_bytes + nbytes >= flush_bytes
                and self._received + len(payloads) < self._window):
            # persist this part of a big batch now: cut the run where it crosses the bound
            cut = payloads.count_to_reach(flush_bytes - self._pending_bytes)
            if cut < len(payloads):
                run, rest = run.split(cut)
                self._backlog.appendleft(rest)
                payloads = run.payloads
                nbytes = payloads.nbytes
        # runs, not payloads: the window's events go to the sink as one buffer
        self._pending.append(payloads)
        self._pending_count += len(payloads)
        self._pending_bytes += nbytes
        self._held += nbytes
        self._connection.hold(nbytes)
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
        "A window is open but the shared memory budget is spent: not reading."

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
    def budget_freed(self):
        "Other connections stored enough: this one may read again."

    @_machine.input()
    def connection_lost(self):
        "The connection is gone."

    @_machine.input()
    def _window_opened(self, frame):
        "A window frame C{W n}, n > 0."

    @_machine.input()
    def _window_throttled(self, frame):
        "A window frame C{W n}, n > 0, while the shared memory budget is spent."

    @_machine.input()
    def _empty_window(self, frame):
        "A window frame C{W 0}."

    @_machine.input()
    def _denied(self):
        "The policy does not let this peer write."

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

    # -- outputs ----------------------------------------------------------------------
    @_machine.output()
    def _begin_batch(self, frame):
        self._window = frame.size
        self._version = frame.version
        self._received = 0
        interval = self._keepalive_interval
        if interval and frame.version == VERSION_2 and self._keepalive_call is None:
            self._keepalive_call = self._clock.callLater(interval, self._keepalive_due)

    @_machine.output()
    def _wait_for_budget(self):
        # this connection holds no events yet, so waiting cannot deadlock:
        # the connections holding the budget are mid-batch and keep reading
        self._throttled = True
        self._connection.pause_reading()

    @_machine.output()
    def _read_again(self):
        self._throttled = False
        self._connection.resume_reading()
        self._advance()

    @_machine.output()
    def _end_window(self):
        self._window = None
        self._received = 0

    @_machine.output()
    def _ack_empty(self, frame):
        # an empty batch: nothing to persist, answer at once
        self._connection.send_ack(0, frame.version)

    @_machine.output()
    def _store(self):
        events = PayloadRun.join(self._pending)
        self._pending = []
        self._pending_count = 0
        self._acking = (self._pending_seq, self._version, len(events), self._pending_bytes)
        self._pending_bytes = 0
        self._writing = True
        d = self._connection.store(events)
        d.addCallbacks(lambda _: self._stored(), self._store_failed)
        if self._writing and not self._closed:
            # storage is slower than the network: stop reading until it catches up
            self._paused = True
            self._connection.pause_reading()

    @_machine.output()
    def _ack(self):
        seq, version, count, nbytes = self._acking
        self._writing = False
        self._held -= nbytes
        self._connection.events_stored(count, nbytes)
        self._connection.send_ack(seq, version)
        if self._shutting_down:
            # the last ack of this connection is written: goodbye
            self._close_for_shutdown()

    @_machine.output()
    def _restart_keepalive(self):
        if self._keepalive_call is not None and self._keepalive_call.active():
            self._keepalive_call.reset(self._keepalive_interval)

    @_machine.output()
    def _stop_keepalive(self):
        if self._keepalive_call is not None:
            if self._keepalive_call.active():
                self._keepalive_call.cancel()
            self._keepalive_call = None

    @_machine.output()
    def _send_keepalive(self):
        self._connection.send_ack(0, VERSION_2)
        self._keepalive_call = self._clock.callLater(self._keepalive_interval,
                                                     self._keepalive_due)

    @_machine.output()
    def _forget_keepalive(self):
        self._keepalive_call = None

    @_machine.output()
    def _resume(self):
        if self._paused:
            self._paused = False
            if self._closed:
                return      # closed right after its last ack (shutdown)
            self._connection.resume_reading()
            self._advance()

    @_machine.output()
    def _rearm_idle(self):
        # storage is slow, the client is waiting for us: not idle
        self._idle.start()

    @_machine.output()
    def _log_bad_input(self, code, message):
        self._metrics.error(code)
        self.log.warn("lumberjack: closing {peer}: {code}: {message}",
                      peer=self.peer, code=code, message=message)

    @_machine.output()
    def _log_idle(self):
        self._metrics.error("idle_timeout")
        self.log.warn("lumberjack: closing {peer}: {code}: {message}", peer=self.peer,
                      code="idle_timeout",
                      message=f"nothing received for {self._idle.seconds:g} s")

    @_machine.output()
    def _log_store_failure(self, failure):
        self._writing = False
        # the store's own errors (full, a cluster without a quorum) are one
        # line; the client sends the batch again
        log_failure(self.log, failure, "lumberjack: storing events from {peer} failed, "
                    "closing without ack", peer=self.peer)

    @_machine.output()
    def _disconnect(self):
        self._close()

    @_machine.output()
    def _shut(self):
        self._release()

    def _release(self):
        held, self._held = self._held, 0
        self._connection.finished(held)
        self._throttled = False
        self._closed = True
        self._writing = False
        self._idle.cancel()
        if self._keepalive_call is not None and self._keepalive_call.active():
            self._keepalive_call.cancel()
        self._keepalive_call = None
        self._pending = []
        self._pending_count = 0
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
    _throttled_window.upon(budget_freed, enter=_receiving, outputs=[_read_again])
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
        _state.upon(_denied, enter=_done, outputs=[_disconnect])
    for _state in (_between_batches, _receiving, _throttled_window, _storing_part,
                   _storing_batch):
        _state.upon(_bad_input, enter=_done, outputs=[_log_bad_input, _disconnect])
        _state.upon(connection_lost, enter=_done, outputs=[_shut])
    # after the end: storage finishing late changes nothing (no ack to a closed connection)
    _done.upon(_store_failed, enter=_done, outputs=[_log_store_failure])
    _done.upon(connection_lost, enter=_done, outputs=[_shut])
    ignore(_done, _stored, _bad_input, _idle_expired, _keepalive_due, budget_freed)
    del _state
