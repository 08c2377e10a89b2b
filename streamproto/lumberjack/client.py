"""
Lumberjack v2 clients with Filebeat's sending behaviour (its
C{output.logstash}), in Filebeat's two modes for several hosts:

- L{LumberjackClient}: one connection at a time (Filebeat's
  C{loadbalance: false}, the default).  With several hosts behind a
  L{streamproto.core.failover.FailoverEndpoint} it moves to the next when
  the one it uses fails.
- L{LoadBalancingLumberjackClient}: a connection to every host (C{worker}
  connections each, as Filebeat's C{loadbalance: true}), all sending
  batches from one queue: each batch goes to a connection with room for it,
  a batch not acked on one host (connection lost, timeout, error) goes to
  another, a host that is down is retried with backoff while the others
  carry the load.

Both have the same API (L{send}, L{close}, L{pending}), so that a caller
switches with one flag; both are built of the same parts
(L{streamproto.lumberjack.sender}: the queue, and one
L{HostSender<streamproto.lumberjack.sender.HostSender>} per connection
with its batching, pipelining, slow start, ack timeout and reconnection).
Events are sent at least once: nothing acknowledged is lost, and a batch
whose acknowledgement was lost is sent again.
"""

import random

from twisted.internet.defer import gatherResults
from twisted.logger import Logger

from streamproto.core.clock import default_reactor
from streamproto.core.observer import OneShotObserver
from streamproto.core.reconnect import DEFAULT_JITTER, backoff_policy
from streamproto.lumberjack.sender import (
    ClientClosed, EventQueue, HostSender, _Request, encode_event,
)

__all__ = ["ClientClosed", "LoadBalancingLumberjackClient", "LumberjackClient",
           "encode_event"]


class _Client:
    """
    What both clients are: an L{EventQueue} and the L{HostSender}s taking
    batches from it; C{send}, C{close}, C{pending}.

    @param targets: [(endpoint, name)], one per connection (name None: the
        only one).
    """

    log = Logger()

    def __init__(self, targets, clock, bulk_max_size, compression_level, pipelining, timeout,
                 slow_start, initial_window, backoff_initial, backoff_max, jitter, rng):
        clock = default_reactor(clock)
        self.clock = clock
        self.bulk_max_size = bulk_max_size
        self.compression_level = compression_level
        self.pipelining = max(1, pipelining)
        self.timeout = timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        window = min(initial_window, bulk_max_size) if slow_start else bulk_max_size
        self._queue = EventQueue()
        self.senders = [
            HostSender(endpoint, self._queue, name, clock,
                       backoff_policy(backoff_initial, backoff_max, 2.0, jitter, rng),
                       bulk_max_size, compression_level, self.pipelining, timeout, window,
                       log=self.log, returned=self._returned)
            for endpoint, name in targets]
        # the sender woken first by the next send(): the one after the last
        # woken first, so that small sends go round the hosts
        self._next = 0
        self._closed_event = OneShotObserver()
        self._stopped = False

    @property
    def pending(self):
        """Events not acked yet (queued or in flight)."""
        return self._queue.queued + sum(s.unacked for s in self.senders)

    @property
    def events_acked(self):
        return sum(s.events_acked for s in self.senders)

    @property
    def connections_made(self):
        return sum(s.connections_made for s in self.senders)

    # -- public API -------------------------------------------------------------
    def send(self, events):
        """
        Queue C{events} (dicts, or bytes / str of JSON) for sending.

        @return: a Deferred firing with their number once the server acked
            them all; failing with L{ClientClosed} if L{close} came first.
        """
        if self._stopped:
            raise ClientClosed("client is closed")
        payloads = [encode_event(e) for e in events]
        request = _Request(len(payloads))
        if not payloads:
            request.deferred.callback(0)
            return request.deferred
        self._queue.put(payloads, request)
        senders = self.senders
        first = self._next
        self._next = (first + 1) % len(senders)
        for sender in senders[first:] + senders[:first]:
            # a connected sender takes what it has room for; one that is
            # not connected connects (every host gets a connection)
            sender.wake()
        return request.deferred

    def close(self):
        """
        Stop: drop the connections, stop reconnecting, and fail every send
        not acked yet with L{ClientClosed}.

        @return: a Deferred firing once disconnected.
        """
        if not self._stopped:
            self._stopped = True
            gatherResults([s.stop() for s in self.senders]).addCallback(self._finish)
        return self._closed_event.when_fired()

    def _finish(self, ignored=None):
        # every sender gave its unacked batches back to the queue on the way out
        self._queue.fail_all(lambda: ClientClosed("client closed before the server acked"))
        self._closed_event.fire()

    # -- called by the senders ------------------------------------------------
    def _returned(self, sender):
        """C{sender} lost its connection and gave its batches back: others take them."""
        if self._stopped:
            return
        for other in self.senders:
            if other is not sender:
                other.wake()


class LumberjackClient(_Client):
    """
    One connection at a time (Filebeat's C{loadbalance: false}).

    @param endpoint: an IStreamClientEndpoint, e.g. from
        L{streamproto.core.tls.client_endpoint} (TCP or TLS), or a
        L{streamproto.core.failover.FailoverEndpoint} over several hosts.
    @param clock: IReactorTime for timeouts and backoff.
    @param bulk_max_size: largest batch (events).
    @param compression_level: zlib level 1-9, 0 for uncompressed frames.
    @param pipelining: batches in flight at once (at least 1).
    @param timeout: seconds to wait for an ack before dropping the connection.
    @param slow_start: start at C{initial_window} events a batch and grow,
        as Filebeat does; otherwise every batch is C{bulk_max_size}.
    @param backoff_initial: first reconnect delay, doubled per failure up to
        C{backoff_max}.
    @param jitter: each reconnect delay is drawn between the nominal one
        and this fraction more (0: exact); see
        L{streamproto.core.reconnect.backoff_policy}.
    @param rng: the random source of the jitter (C{random()} in [0, 1)).
    """

    def __init__(self, endpoint, clock=None, bulk_max_size=2048, compression_level=3,
                 pipelining=2, timeout=30.0, slow_start=True, initial_window=10,
                 backoff_initial=1.0, backoff_max=60.0, jitter=DEFAULT_JITTER, rng=random):
        super().__init__([(endpoint, None)], clock, bulk_max_size, compression_level,
                         pipelining, timeout, slow_start, initial_window, backoff_initial,
                         backoff_max, jitter, rng)
        self.endpoint = endpoint

    @property
    def window(self):
        return self.senders[0].window

    @property
    def batch_size(self):
        return self.senders[0].batch_size


class LoadBalancingLumberjackClient(_Client):
    """
    A connection to every host, sending batches from one queue (Filebeat's
    C{hosts} with C{loadbalance: true}).

    Each connection (a worker) has its own pipelining, slow-start window,
    ack timeout and reconnection backoff: a host that is down or slow
    takes no or fewer batches, and the others carry the load; the batches
    in flight on a connection that fails go back to the front of the queue
    for whichever connection has room first.  Events of one L{send} may be
    stored by different hosts, not in order.

    @param endpoints: one IStreamClientEndpoint per host.
    @param names: what to call each host in the log (default: repr).
    @param workers: connections per host (Filebeat's C{worker}).

    The other parameters are L{LumberjackClient}'s, and apply to each
    connection.
    """

    def __init__(self, endpoints, clock=None, bulk_max_size=2048, compression_level=3,
                 pipelining=2, timeout=30.0, slow_start=True, initial_window=10,
                 backoff_initial=1.0, backoff_max=60.0, jitter=DEFAULT_JITTER, rng=random,
                 names=None, workers=1):
        endpoints = list(endpoints)
        if not endpoints:
            raise ValueError("a LoadBalancingLumberjackClient needs at least one endpoint")
        if workers < 1:
            raise ValueError("workers must be at least 1")
        names = list(names) if names else [repr(e) for e in endpoints]
        if len(names) != len(endpoints):
            raise ValueError("one name per endpoint")
        self.endpoints = endpoints
        self.names = names
        # host after host, then again: the first send()s spread over hosts
        targets = [(e, n) for _ in range(workers) for e, n in zip(endpoints, names)]
        super().__init__(targets, clock, bulk_max_size, compression_level, pipelining,
                         timeout, slow_start, initial_window, backoff_initial, backoff_max,
                         jitter, rng)

    def acked_by_host(self):
        """@return: {name: events acked by that host}, for the log and tests."""
        counts = dict.fromkeys(self.names, 0)
        for sender in self.senders:
            counts[sender.name] += sender.events_acked
        return counts
