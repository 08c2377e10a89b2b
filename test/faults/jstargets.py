"""
The other protocols on JetStream: the servers of L{test.faults.logtargets}
(Lumberjack, Pravega, Relink C{log} and C{log-tx}, reliable streams), each
a front-end (C{--store nats://...?replicas=3}) of the 3-node cluster of
L{test.faults.targets.StyxNatsTarget}, or of
L{test.faults.nstargets.StyxPartitionTarget} in network namespaces for
partitions and flapping links.  Each target composes three pieces: the
protocol side of the file target (server, workload, payloads), the cluster
side of the Styx target (nodes, their verbs, healing), and one of the
mixins below, which replaces the file store's final read with the
cluster's:

- the logs (L{LogsOnJetStream}) are read from the store directly over the
  cluster, with the read-only L{JetStreamReader} (what the quorum
  acknowledged), after the cluster healed and a fresh front-end started
  (whose output is checked for tracebacks); asked again while the stream
  elects its leader.  Pravega's segment is its Event frames back to back;
- reliable-stream sessions (L{SessionsOnJetStream}) are in the cluster
  too: with C{--store nats://...} the server keeps them in a JetStream
  key-value bucket, not in SQLite (its data directory holds nothing), so
  a session counts if a fresh front-end, which knows it only from the
  bucket, resumes it where its client left it (L{ReliableFileTarget}'s
  rule).  No disk column.

In namespaces the harness's own calls to the front-end (create the
segment, resume a session) run inside C{fe} (L{InFrontEndNamespace}).
"""

from twisted.internet import defer

from test.faults.logtargets import SERVERS, LogFileTarget, ReliableFileTarget
from test.faults.nstargets import StyxPartitionTarget
from test.faults.targets import StyxNatsTarget


def read_log(servers, name):
    """Every record of log C{name} as the cluster holds it (blocking)."""
    from streamproto.log.natsreader import JetStreamReader
    reader = JetStreamReader(servers)
    start, end = reader.bounds(name)
    return [bytes(r) for batch in reader.read(name, start, end) for r in batch.records()]


class LogsOnJetStream:
    """The final state of a write-only protocol's log: read from the cluster."""

    store = "nats"

    def store_name(self):
        if self.protocol == "pravega":
            from streamproto.pravega.segments import log_name
            return log_name(self.log)
        return self.log

    @defer.inlineCallbacks
    def create_log(self, **config):
        """
        The log, created in the cluster before the workload starts, which
        the setup then makes durable on every node as it does Styx's:
        Pravega's segment through the server; the others, which their
        servers create at their first write, with the store itself (the
        same stream a server would make).  nats-server does not fsync the
        directories it creates, so in the lazy FS's strict model a node
        whose power is cut forgets a stream created during the run, and
        two such nodes lose it (doc/reliability.rst, finding 21): that
        window is the finding's, not every run's.
        """
        if self.protocol == "pravega":
            return (yield super().create_log(**config))
        from streamproto.log.jetstream import JetStreamLogStore
        store = JetStreamLogStore(self.cluster.urls, replicas=3, clock=self.reactor)
        try:
            yield store.start()
            yield store.get_or_create(self.store_name())
        finally:
            yield store.close()

    @defer.inlineCallbacks
    def read_back(self):
        records = yield self.on_cluster(read_log, self.cluster.urls, self.store_name())
        if self.protocol != "pravega":
            return self.payloads(records)
        from streamproto.pravega.codec import split_events
        data = b"".join(records)
        events, used = split_events(data)
        # bytes that are no whole Event frame count as a corrupt record
        return events + ([data[used:]] if used < len(data) else [])

    def final_records(self, power_cut=False):
        # the cluster's final read (heal, a fresh front-end, read_back),
        # not the file target's (the data directory's log)
        return StyxNatsTarget.final_records(self, power_cut=power_cut)


class SessionsOnJetStream:
    """Reliable-stream sessions in the cluster's bucket, resumed by a fresh front-end."""

    store = "nats"

    #: seconds a session's resume is asked again while it fails (the
    #: bucket's stream electing its leader after the heal)
    patience = 30.0

    def resumable_on_disk(self, sessions, refused):
        return None    # no database: the bucket is read by the fresh front-end

    @defer.inlineCallbacks
    def create_log(self, **config):
        """
        The sessions' bucket, made (or found) before the setup makes the
        nodes' disks durable: the server creates it as it starts, but a
        moment after it listens, so without this the bucket's stream could
        still be in the making at that sync, and a power cut of two nodes
        lose it (finding 21).
        """
        from streamproto.reliable.natsessions import JetStreamSessionStore
        store = JetStreamSessionStore(self.cluster.urls, self.reactor, replicas=3)
        try:
            yield store.start()
        finally:
            yield store.close()

    @defer.inlineCallbacks
    def final_records(self, power_cut=False):
        yield self.heal_cluster(power_cut)
        return (yield super().final_records(power_cut=False))

    @defer.inlineCallbacks
    def resume(self, name, last):
        import time

        from test.faults.nemesis import sleep
        deadline = time.monotonic() + self.patience
        while True:
            why = yield self.resume_once(name, last)
            if why is None or time.monotonic() > deadline:
                return why
            self.notes.append(f"session {name}: resume at {last} failed, retried: {why}")
            yield sleep(self.reactor, 1.0)

    def resume_once(self, name, last):
        return super().resume(name, last)


class InFrontEndNamespace:
    """The harness's calls to a front-end in namespace C{fe}, made from inside it."""

    def create_log(self, **config):
        if self.protocol != "pravega":
            return defer.succeed(None)
        return self._in_fe("pravega-create", str(self.server.port), self.log)

    @defer.inlineCallbacks
    def resume_once(self, name, last):
        out = yield self._in_fe("resume", str(self.server.port), name, str(last))
        return out.decode() or None


class LogNatsTarget(LogsOnJetStream, LogFileTarget, StyxNatsTarget):
    """Lumberjack, Pravega or Relink on JetStream: kill -9, pauses, clock jumps."""


class LogPartitionTarget(InFrontEndNamespace, LogsOnJetStream, LogFileTarget,
                         StyxPartitionTarget):
    """The same in namespaces: partitions and flapping links too."""


class ReliableNatsTarget(SessionsOnJetStream, ReliableFileTarget, StyxNatsTarget):
    """The reliable-stream server on JetStream."""


class ReliablePartitionTarget(InFrontEndNamespace, SessionsOnJetStream, ReliableFileTarget,
                              StyxPartitionTarget):
    """The same in namespaces."""


def nats_target(reactor, fault, protocol, sync_interval="always"):
    """
    The target of C{protocol} (one of L{SERVERS}) on JetStream for C{fault},
    its nodes on C{sync_interval} (None: nats-server's default).
    """
    partition = fault in ("partition", "flap")
    kwargs = dict(clock=(fault == "clock"), sync_interval=sync_interval)
    if protocol == "reliable":
        cls = ReliablePartitionTarget if partition else ReliableNatsTarget
        return cls(reactor, **kwargs)
    if protocol not in SERVERS:
        raise ValueError(f"no target for {protocol} on nats")
    cls = LogPartitionTarget if partition else LogNatsTarget
    return cls(reactor, protocol, **kwargs)
