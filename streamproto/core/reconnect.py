"""
Reconnecting clients: the one mechanism behind every client of the suite
that keeps a connection up and comes back after failures (Lumberjack's
L{LumberjackClient<streamproto.lumberjack.client.LumberjackClient>},
Pravega's L{SegmentWriter<streamproto.pravega.client.SegmentWriter>}, the
reliable-stream clients).

  - L{backoff_policy}: how long to wait before the next attempt, with
    jitter.
  - L{Reconnector}: connect; after a failed attempt or a lost connection
    wait, connect again; give up when a limit says so; stop on request.

Twisted's C{ClientService} does this for a service.  It does not fit the
suite's clients (the Lumberjack, reliable, Pravega and relink clients all
use L{Reconnector}):

  - here the client says when a connection has worked (events
    acknowledged, a session resumed): ClientService starts its failure
    count over at every TCP connect, so a server that accepts and then
    drops (a TLS refusal, a store that fail-stopped) would be retried at the
    shortest delay for ever;
  - a connection lost is a failure for one client and for another (the
    reliable stream's spec, after data arrived) a reason to reconnect at
    once, without waiting;
  - these clients give up: after C{max_retries} failures in a row (Pravega)
    or once C{give_up_after} seconds passed without a working connection
    (reliable: the server drops the session by then);
  - a client may connect only while it has work (Lumberjack goes idle once
    everything is acknowledged);
  - stopping waits until the attempt or the connection has ended, so that
    the client then fails its pending work (closing Lumberjack, reliable's
    result).

Like every clock-driven class of the suite the clock is injected; the
reactor is never imported here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

from automat import MethodicalMachine
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from streamproto.core.observer import OneShotObserver

__all__ = ["DEFAULT_JITTER", "Reconnector", "backoff_policy"]

#: the default spread of a wait: up to this fraction longer than the
#: nominal delay
DEFAULT_JITTER = 0.5


class _Random(Protocol):
    def random(self) -> float: ...


#: attempt (0, 1, ...) -> seconds
Policy = Callable[[int], float]


def backoff_policy(initial: float, maximum: float, factor: float = 2.0,
                   jitter: float = DEFAULT_JITTER, rng: _Random = random) -> Policy:
    """
    Exponential backoff with jitter.

    The nominal delay of retry C{attempt} (0 for the first) is
    C{min(maximum, initial * factor ** attempt)}; the wait is drawn
    uniformly between it and C{jitter} times more, never above C{maximum}::

        nominal <= wait <= min(maximum, nominal * (1 + jitter))

    The nominal delay is a floor, not a mean, so that a protocol's minimum
    wait holds (the reliable stream's spec: at least 5 s after a failed
    connect), and the maximum stays the maximum.  Clients dropped together
    by one server restart draw different waits and come back spread out
    instead of all at once; once at C{maximum} they keep the spread they
    drew on the way (a constant wait keeps their phases apart).

    This is Twisted's C{backoffPolicy} with the jitter in proportion to the
    delay: that one adds up to 1 s whatever the delay (too much for
    Pravega's 50 ms, too little to matter at 60 s) and goes past its
    maximum.

    @param initial: the nominal delay of the first retry, in seconds.
    @param maximum: the longest wait.
    @param factor: the nominal delay grows by this much per retry (1: constant).
    @param jitter: the spread: 0 for exact nominal delays (tests that count
        seconds), 0.5 for waits up to half as long again.
    @param rng: the random source, anything with C{random()} in [0, 1)
        (the L{random} module, a seeded L{random.Random} in tests).
    @return: a callable, attempt (0, 1, ...) -> seconds: the shape of
        C{ClientService}'s C{retryPolicy}, so it can serve there too.
    """
    if jitter < 0:
        raise ValueError("jitter must not be negative")

    def policy(attempt: int) -> float:
        try:
            nominal = min(maximum, initial * factor ** attempt)
        except OverflowError:
            nominal = maximum
        if not jitter:
            return nominal
        return min(maximum, nominal * (1 + jitter * rng.random()))
    return policy


class Reconnector:
    """
    The connection of one client: connect; after a failed attempt or a lost
    connection wait (the C{policy}'s delay) and connect again; give up when
    a limit says so; L{stop} on request.

    The client makes the connections (C{connect}) and is handed each that
    succeeds (C{connected}); it reports when one is lost (L{lost}), and when
    one has worked (L{progress}): only then does the failure count start
    over.  A connection that has been made is no proof that the server
    works: it may take it and drop it.

    @ivar failures: failed attempts and connections lost as failures since
        the last L{progress}.
    @ivar protocol: the current connection's protocol, or None.
    @ivar delay: the wait before the next attempt, as last decided (None:
        giving up).
    """

    _machine = MethodicalMachine()  # type: ignore[no-untyped-call]

    def __init__(self, connect: Callable[[], Deferred[Any]], clock: IReactorTime, policy: Policy,
                 connected: Callable[[Any], object],
                 cannot_connect: Callable[[Failure, float | None], object] | None = None,
                 gave_up: Callable[[Failure], object] | None = None,
                 max_retries: int | None = None, give_up_after: float | None = None) -> None:
        """
        @param connect: one connection attempt: a callable returning a
            Deferred that fires with the connected protocol, or fails.
            E.g. C{lambda: endpoint.connect(factory)}; with a
            L{streamproto.core.failover.FailoverEndpoint} one attempt tries
            every address once.
        @param clock: L{IReactorTime<twisted.internet.interfaces.IReactorTime>}.
        @param policy: attempt (0 for the wait after the first failure) ->
            seconds, e.g. L{backoff_policy}.
        @param connected: called with the protocol of each successful
            attempt (never after L{stop}).
        @param cannot_connect: called with the reason and the wait before
            the next attempt (None: giving up) after a failed attempt: for
            the client's log.
        @param gave_up: called with the last failure's reason once a limit
            is reached; the reconnector is stopped by then.
        @param max_retries: failures in a row after which the next one
            gives up (None: never).
        @param give_up_after: seconds without a working connection (since
            the first failure or loss after the last L{progress}) beyond
            which no attempt is made: it gives up instead (None: never).
        """
        self._connect_once = connect
        self.clock = clock
        self.policy = policy
        self._connected = connected
        self._cannot_connect = cannot_connect
        self._gave_up = gave_up
        self.max_retries = max_retries
        self.give_up_after = give_up_after
        self.failures = 0
        self.protocol: Any = None
        self.delay: float | None = None
        self._down_since: float | None = None
        self._attempt: Deferred[Any] | None = None
        self._call: IDelayedCall | None = None
        self._stopped: OneShotObserver[None] = OneShotObserver()

    # -- what the client calls ---------------------------------------------

    def lost(self, reason: Failure, failed: bool = True, reconnect: bool = True) -> float | None:
        """
        The current connection is gone.

        @param reason: why (a L{Failure<twisted.python.failure.Failure>}).
        @param failed: it counts as a failure: wait, longer after each, and
            maybe give up.  False: it had worked, connect again at once.
        @param reconnect: False: do not connect again until L{start} (a
            client with nothing to send).
        @return: the wait before the next attempt (0 at once; None when
            giving up or not reconnecting).
        """
        if not reconnect:
            self.delay = None
            self._lost_resting(reason)
        elif failed:
            self._lost_failing(reason)
        else:
            self.delay = 0
            self._lost_working(reason)
        return self.delay

    def progress(self) -> None:
        """The connection works: the next failure is the first again."""
        self.failures = 0
        self._down_since = None

    # -- states ---------------------------------------------------------------

    @_machine.state(initial=True)
    def _idle(self) -> None:
        "Not connected, and not trying."

    @_machine.state()
    def _connecting(self) -> None:
        "An attempt is under way."

    @_machine.state()
    def _connected_state(self) -> None:
        "The client has a connection."

    @_machine.state()
    def _waiting(self) -> None:
        "Waiting before the next attempt (or before giving up, at once)."

    @_machine.state()
    def _cancelling(self) -> None:
        "Stopped during an attempt: waiting for it to end."

    @_machine.state()
    def _disconnecting(self) -> None:
        "Stopped with a connection: waiting for the client to report it lost."

    @_machine.state()
    def _done(self) -> None:
        "Stopped (or given up) for good."

    # -- inputs ---------------------------------------------------------------

    @_machine.input()
    def start(self) -> None:
        "Connect, unless connecting or connected already."

    @_machine.input()
    def stop(self) -> None:
        """
        Stop: cancel the attempt or the wait, or close the connection.

        @return: a Deferred firing once no attempt nor connection is left
            (once the client reported the connection lost).
        """

    @_machine.input()
    def _attempt_succeeded(self, protocol: Any) -> None:
        "The attempt connected."

    @_machine.input()
    def _attempt_failed(self, reason: Failure) -> None:
        "The attempt failed."

    @_machine.input()
    def _wait_over(self) -> None:
        "Time for the next attempt."

    @_machine.input()
    def _give_up(self, reason: Failure) -> None:
        "A limit was reached."

    @_machine.input()
    def _lost_failing(self, reason: Failure) -> None:
        "The connection ended as a failure."

    @_machine.input()
    def _lost_working(self, reason: Failure) -> None:
        "The connection ended after it had worked."

    @_machine.input()
    def _lost_resting(self, reason: Failure) -> None:
        "The connection ended, and the client has nothing to do."

    # -- outputs --------------------------------------------------------------

    @_machine.output()
    def _connect(self) -> None:
        self._call = None
        self._attempt = self._connect_once()
        self._attempt.addCallbacks(self._attempt_succeeded, self._attempt_failed)

    @_machine.output()
    def _adopt(self, protocol: Any) -> None:
        self._attempt = None
        self.protocol = protocol
        self._connected(protocol)

    @_machine.output()
    def _count_failure(self) -> None:
        self._attempt = None
        self.protocol = None
        self.failures += 1

    @_machine.output()
    def _wait_or_give_up(self, reason: Failure) -> None:
        now = self.clock.seconds()
        if self._down_since is None:
            self._down_since = now
        if self.max_retries is not None and self.failures > self.max_retries:
            delay = None
        else:
            delay = self.policy(self.failures - 1)
            if (self.give_up_after is not None
                    and now + delay - self._down_since > self.give_up_after):
                delay = None
        self.delay = delay
        if delay is None:
            # from the clock, not from within the client's own call
            self._call = self.clock.callLater(0, self._give_up, reason)
        else:
            self._call = self.clock.callLater(delay, self._wait_over)

    @_machine.output()
    def _tell_cannot_connect(self, reason: Failure) -> None:
        if self._cannot_connect is not None:
            self._cannot_connect(reason, self.delay)

    @_machine.output()
    def _forget(self) -> None:
        self.protocol = None

    @_machine.output()
    def _note_down(self) -> None:
        if self._down_since is None:
            self._down_since = self.clock.seconds()

    @_machine.output()
    def _cancel_attempt(self) -> None:
        if self._attempt is not None:
            self._attempt.cancel()

    @_machine.output()
    def _cancel_wait(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    @_machine.output()
    def _disconnect(self) -> None:
        self.protocol.transport.loseConnection()

    @_machine.output()
    def _drop_late(self, protocol: Any) -> None:
        # the attempt could not be cancelled in time
        self._attempt = None
        protocol.transport.loseConnection()

    @_machine.output()
    def _clear_attempt(self) -> None:
        self._attempt = None

    @_machine.output()
    def _finish(self) -> None:
        self.protocol = None
        self._stopped.fire()

    @_machine.output()
    def _when_stopped(self) -> Deferred[None]:
        return self._stopped.when_fired()

    @_machine.output()
    def _tell_gave_up(self, reason: Failure) -> None:
        self._call = None
        if self._gave_up is not None:
            self._gave_up(reason)

    _idle.upon(start, enter=_connecting, outputs=[_connect])
    _idle.upon(stop, enter=_done, outputs=[_finish, _when_stopped], collector=list.pop)

    _connecting.upon(start, enter=_connecting, outputs=[])
    _connecting.upon(_attempt_succeeded, enter=_connected_state, outputs=[_adopt])
    _connecting.upon(_attempt_failed, enter=_waiting,
                     outputs=[_count_failure, _wait_or_give_up, _tell_cannot_connect])
    _connecting.upon(stop, enter=_cancelling, outputs=[_when_stopped, _cancel_attempt],
                     collector=lambda results: results[0])

    _connected_state.upon(start, enter=_connected_state, outputs=[])
    _connected_state.upon(_lost_failing, enter=_waiting,
                          outputs=[_count_failure, _wait_or_give_up])
    _connected_state.upon(_lost_working, enter=_connecting, outputs=[_forget, _note_down,
                                                                     _connect])
    _connected_state.upon(_lost_resting, enter=_idle, outputs=[_forget])
    _connected_state.upon(stop, enter=_disconnecting, outputs=[_when_stopped, _disconnect],
                          collector=lambda results: results[0])

    _waiting.upon(start, enter=_waiting, outputs=[])
    _waiting.upon(_wait_over, enter=_connecting, outputs=[_connect])
    _waiting.upon(_give_up, enter=_done, outputs=[_finish, _tell_gave_up])
    _waiting.upon(stop, enter=_done, outputs=[_cancel_wait, _finish, _when_stopped],
                  collector=list.pop)

    _cancelling.upon(start, enter=_cancelling, outputs=[])
    _cancelling.upon(_attempt_failed, enter=_done, outputs=[_clear_attempt, _finish])
    _cancelling.upon(_attempt_succeeded, enter=_done, outputs=[_drop_late, _finish])
    _cancelling.upon(stop, enter=_cancelling, outputs=[_when_stopped], collector=list.pop)

    _disconnecting.upon(start, enter=_disconnecting, outputs=[])
    for _lost in (_lost_failing, _lost_working, _lost_resting):
        _disconnecting.upon(_lost, enter=_done, outputs=[_finish])
        _done.upon(_lost, enter=_done, outputs=[])
    del _lost
    _disconnecting.upon(stop, enter=_disconnecting, outputs=[_when_stopped],
                        collector=list.pop)

    _done.upon(start, enter=_done, outputs=[])
    _done.upon(stop, enter=_done, outputs=[_when_stopped], collector=list.pop)
