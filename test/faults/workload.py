"""
Workloads that record histories: concurrent clients, each operation
written down when invoked and when completed, with its outcome.

A workload runs in a process of its own (C{python -m test.faults.workload
styx ...}) so that the nemesis can pause or kill the client as well as the
servers.  It appends one JSON line per event to its history file, flushed
at once (a killed client loses none it wrote): C{{"p", "seq", "ev":
"invoke"|"ok"|"failed"|"unknown", "at"}} with C{at} on CLOCK_MONOTONIC,
which every process of the machine shares.  L{read_history} turns the file
into the checker's L{Op}s: an invocation without a completion is
C{unknown}.

Outcomes: an answer with the promised acknowledgement is C{ok}; a 4xx
refusal is C{failed} (the server said no); anything else (a timeout, a reset
connection, a refused connection while the server restarts, a 5xx) is
C{unknown}: the record may or may not be stored.  A producer never resends
a payload: every invocation has a new seq, so the promise checked is at
most once per invocation, and per-producer order in real time (a producer
invokes its next record only after the previous one completed).
"""

import argparse
import json
import sys
import time

from test.faults.checker import FAILED, OK, UNKNOWN, Op, encode


def now():
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class HistoryWriter:
    """Appends events to a history file, one flushed JSON line each."""

    def __init__(self, path):
        self.file = open(path, "a", buffering=1)

    def event(self, producer, seq, ev):
        self.file.write(json.dumps({"p": producer, "seq": seq, "ev": ev, "at": now()}) + "\n")

    def close(self):
        self.file.close()


def read_history(path):
    """The L{Op}s of a history file (every producer's, in invocation order)."""
    invoked, done = {}, {}
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:
                continue   # a line torn by a kill of the client
            key = (e["p"], e["seq"])
            if e["ev"] == "invoke":
                invoked[key] = e["at"]
            else:
                done[key] = (e["at"], e["ev"])
    ops = []
    for key, at in sorted(invoked.items(), key=lambda kv: kv[1]):
        complete, outcome = done.get(key, (None, UNKNOWN))
        ops.append(Op(key[0], key[1], at, complete, outcome))
    return ops


def classify(failure):
    """
    The outcome of a failed request: C{failed} for a 4xx refusal, else
    C{unknown}.  C{log_not_available} is a 400 (the reference's status) but
    not a refusal: on JetStream it also answers an append the quorum did
    not acknowledge in time, which it may still store.
    """
    from streamproto.styx.api_client import StyxAPIError
    if failure.check(StyxAPIError) and 400 <= failure.value.status < 500 \
            and failure.value.code != "log_not_available":
        return FAILED
    return UNKNOWN


def run_styx(reactor, args):
    """
    C{args.producers} producers, each writing one record per HTTP request
    (the project's L{StyxClient}, a pool of its own) for C{args.duration}
    seconds, each request bounded by C{args.timeout}.
    """
    from twisted.internet import defer, task
    from twisted.python.failure import Failure

    from streamproto.styx.api_client import StyxClient

    history = HistoryWriter(args.history)
    deadline = now() + args.duration

    @defer.inlineCallbacks
    def producer(name):
        client = StyxClient(args.url, reactor=reactor)
        seq = 0
        while now() < deadline:
            history.event(name, seq, "invoke")
            d = client.write_record(args.log, encode(name, seq, args.size))
            d.addTimeout(args.timeout, reactor)
            try:
                answer = yield d
            except Exception:
                outcome = classify(Failure())
                history.event(name, seq, outcome)
                # the server is away: do not spin on refused connections
                yield task.deferLater(reactor, 0.05, lambda: None)
            else:
                history.event(name, seq, OK if answer.get("count") == 1 else UNKNOWN)
            seq += 1
        yield client.close()

    d = defer.gatherResults([producer(f"{args.tag}{i}") for i in range(args.producers)])
    d.addBoth(lambda _: history.close())
    return d


class _Stream:
    """One styx/0 producer's connection, made again after any failure."""

    producer = None

    def drop(self):
        producer, self.producer = self.producer, None
        if producer is not None:
            producer.abort()


def run_styx0(reactor, args):
    """
    Styx over styx/0, the streaming protocol of the Go reference's own
    clients: each producer a L{StyxProducer} (one connection: its order),
    writing one record and waiting for the ack that covers it.  A failure
    or a timeout is C{unknown}, the connection is dropped and made again,
    and nothing is resent: at most once.
    """
    from twisted.internet import defer

    from streamproto.styx.stream_client import StyxProducer

    @defer.inlineCallbacks
    def send(stream, name, seq):
        try:
            if stream.producer is None:
                stream.producer = yield StyxProducer.connect_url(
                    reactor, args.url, args.log, timeout=args.timeout)
            ack = yield stream.producer.write(encode(name, seq, args.size))
        except BaseException:
            stream.drop()
            raise
        return OK if ack is not None else UNKNOWN

    def teardown(stream):
        if stream.producer is not None:
            return stream.producer.close()
        return None

    return _producers(reactor, args, send, lambda name: _Stream(), teardown)


def _endpoint(reactor, url):
    """The client endpoint of C{tcp://HOST:PORT}."""
    from streamproto.core.tls import client_endpoint
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return client_endpoint(reactor, host, int(port))


def _producers(reactor, args, operation, setup=None, teardown=None):
    """
    C{args.producers} producers, each its own client (C{setup(name)}: one
    connection, whose order the protocol promises), invoking
    C{operation(client, name, seq)} one after another for C{args.duration}
    seconds, each bounded by C{args.timeout}.  C{operation} fires with the
    outcome (C{ok}/C{failed}/C{unknown}); a failure or a timeout is
    C{unknown}.  A timed-out operation may still be carried out later by
    the client (Lumberjack and Relink retry what is unacknowledged): the
    checker counts it present or absent, never lost.
    """
    from twisted.internet import defer, task

    history = HistoryWriter(args.history)
    deadline = now() + args.duration

    @defer.inlineCallbacks
    def producer(name):
        client = setup(name) if setup is not None else None
        seq = 0
        while now() < deadline:
            history.event(name, seq, "invoke")
            d = defer.maybeDeferred(operation, client, name, seq)
            d.addTimeout(args.timeout, reactor)
            try:
                outcome = yield d
            except Exception:   # noqa: BLE001 - anything but an answer: unknown
                outcome = UNKNOWN
            history.event(name, seq, outcome)
            if outcome != OK:
                yield task.deferLater(reactor, 0.05, lambda: None)
            seq += 1
        if teardown is not None:
            yield defer.maybeDeferred(teardown, client).addErrback(lambda _: None)

    d = defer.gatherResults([producer(f"{args.tag}{i}") for i in range(args.producers)])
    d.addBoth(lambda _: history.close())
    return d


def run_lumberjack(reactor, args):
    """
    Each producer a L{LumberjackClient} (one connection) sending one event
    per window, C{{"m": payload}}; acknowledged is C{ok}.  The client
    resends what was not acknowledged after a reconnection: at least once.
    """
    from streamproto.lumberjack.client import LumberjackClient

    def setup(name):
        return LumberjackClient(_endpoint(reactor, args.url), reactor, slow_start=False,
                                timeout=args.timeout, backoff_initial=0.05, backoff_max=0.3)

    def send(client, name, seq):
        event = {"m": encode(name, seq, args.size).decode()}
        return client.send([event]).addCallback(lambda n: OK if n == 1 else UNKNOWN)

    return _producers(reactor, args, send, setup, lambda c: c.close())


def run_relink(reactor, args, transactions):
    """
    Each producer a relink L{Connector} (failing over to a restarted
    listener) on channel 1 of C{log} (a message acknowledged consumed is
    C{ok}: at least once) or C{log-tx}: a transaction of L{TX_PARTS}
    messages and its commit, C{ok} when committed, C{failed} when
    uncommitted, C{unknown} when the commit's outcome is
    (L{CommitOutcomeUnknown}): exactly once.
    """
    from twisted.internet import defer

    from streamproto.relink.api import Connector
    from streamproto.relink.errors import CommitOutcomeUnknown
    from test.faults.checker import encode_part

    def setup(name):
        c = Connector(_endpoint(reactor, args.url), "log-tx" if transactions else "log",
                      connector_id_size=4, listener_id_size=4,
                      connector_transactions=transactions, clock=reactor)
        c.start()
        return c

    @defer.inlineCallbacks
    def send(c, name, seq):
        link = yield c.when_linked()
        ch = link.channel(1)
        while ch.room < TX_PARTS:
            yield ch.when_writable()
        if not transactions:
            yield ch.send_payloads([encode(name, seq, args.size)])
            return OK
        ch.send_payloads([encode_part(name, seq, i, args.size) for i in range(TX_PARTS)],
                         ack=None)
        try:
            committed = yield ch.commit()
        except CommitOutcomeUnknown:
            return UNKNOWN
        return OK if committed else FAILED

    return _producers(reactor, args, send, setup, lambda c: c.stop())


def run_pravega(reactor, args):
    """
    Each producer a L{SegmentWriter} with a writer id of its own, writing
    one event at a time to segment C{args.log}; acknowledged is C{ok}.  The
    writer reconnects by itself and resends what was not acknowledged with
    the same event numbers, which the server drops when it has them: at
    most once, in order.
    """
    import uuid

    from streamproto.pravega.client import SegmentWriter

    def setup(name):
        return SegmentWriter(_endpoint(reactor, args.url), args.log, clock=reactor,
                             writer_id=uuid.uuid5(uuid.NAMESPACE_URL, f"faults:{name}"),
                             max_retries=10000, retry_delay=0.05, max_retry_delay=0.3)

    def send(writer, name, seq):
        return writer.write_batch([encode(name, seq, args.size)]).addCallback(lambda _: OK)

    return _producers(reactor, args, send, setup, lambda w: w.close())


class _Conditional:
    """One conditional producer: its writer, its info connection, the length it expects."""

    def __init__(self, writer):
        self.writer = writer
        self.info = None
        self.expected = None

    def drop_info(self):
        info, self.info = self.info, None
        if info is not None:
            info.transport.loseConnection()


def run_pravega_conditional(reactor, args):
    """
    Producers racing with conditional appends on one segment: each
    appends its event only if the segment has the length it last saw
    (C{GetStreamSegmentInfo} on a connection of its own, asked again after
    every refusal or doubt).  Stored is C{ok}; refused by the condition
    (C{ConditionalCheckFailed}) is C{failed}: the event must not be in the
    segment; anything else is C{unknown}.  The writer resends what was not
    acknowledged after a reconnection with the same event number, and the
    server drops what it has: at most once, in order.
    """
    import uuid

    from twisted.internet import defer

    from streamproto.pravega.client import SegmentWriter, connect
    from streamproto.pravega.errors import ConditionalCheckFailedError

    endpoint = _endpoint(reactor, args.url)

    def setup(name):
        return _Conditional(SegmentWriter(
            _endpoint(reactor, args.url), args.log, clock=reactor,
            writer_id=uuid.uuid5(uuid.NAMESPACE_URL, f"faults-conditional:{name}"),
            max_retries=10000, retry_delay=0.05, max_retry_delay=0.3))

    @defer.inlineCallbacks
    def send(producer, name, seq):
        event = encode(name, seq, args.size)
        try:
            if producer.expected is None:
                if producer.info is None:
                    producer.info = yield connect(endpoint)
                reply = yield producer.info.segment_info(args.log)
                producer.expected = reply.write_offset
            yield producer.writer.write_conditional(event, producer.expected)
        except ConditionalCheckFailedError:
            producer.expected = None
            return FAILED
        except BaseException:
            producer.expected = None
            producer.drop_info()
            raise
        producer.expected += 8 + len(event)     # the Event frame's header and the event
        return OK

    def teardown(producer):
        producer.drop_info()
        return producer.writer.close()

    return _producers(reactor, args, send, setup, teardown)


#: messages of one reliable-stream session of the workload
RELIABLE_COUNT = 200


def reliable_served_path(history):
    """Where the reliable workload writes what it received (the served records)."""
    return history + ".served"


def reliable_session_id(name):
    """The session id of the workload's session C{name} (the target resumes it by it)."""
    import uuid
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"faults:{name}"))


def run_reliable(reactor, args):
    """
    Each producer a chain of stateful reliable-stream sessions of
    L{RELIABLE_COUNT} messages, one connection at a time on its own line
    codec (not the project's client, which would hide a resend).
    Operation C{seq} of session C{name.k} is its message C{seq + 1}:
    invoked when the producer starts waiting for it, C{ok} when it arrives
    with that id, C{unknown} when the connection drops or times out first,
    C{failed} when the server answers C{{"error"}} (the session is then
    over).  A producer drops its connection after a random 1..40 messages
    and resumes after a short pause, so that sessions are often detached
    (expiry timers armed) when a fault strikes.

    Every message received is written, in order, to the C{.served} file
    (L{reliable_served_path}) as C{{"p", "id"}} lines; a session the server
    refused to resume is written as C{{"p", "refused": text}}; a final CRC
    that does not match the values received as C{{"p", "crc": false}}.
    The target reads that file back (L{test.faults.logtargets}).
    """
    import random
    import zlib

    from twisted.internet import defer, protocol, task

    from streamproto.reliable import codec

    history = HistoryWriter(args.history)
    served = open(reliable_served_path(args.history), "a", buffering=1)
    deadline = now() + args.duration
    rng = random.Random(args.tag)

    def serve(line):
        served.write(json.dumps(line) + "\n")

    class Lines(protocol.Protocol):
        def __init__(self):
            self.decoder = codec.LineDecoder()
            self.queue = defer.DeferredQueue()

        def dataReceived(self, data):
            for line in self.decoder.feed(data):
                self.queue.put(line)

        def connectionLost(self, reason):
            self.queue.put(None)

    @defer.inlineCallbacks
    def session(name):
        """One session to its end, its refusal, or the deadline."""
        sid = reliable_session_id(name)
        last, crc = 0, 0
        while now() < deadline:
            try:
                conn = yield _endpoint(reactor, args.url).connect(
                    protocol.Factory.forProtocol(Lines))
            except Exception:   # noqa: BLE001 - the server is away: try again
                yield task.deferLater(reactor, 0.05, lambda: None)
                continue
            conn.transport.write(codec.encode_open(sid, RELIABLE_COUNT) if last == 0
                                 else codec.encode_resume(sid, last))
            budget = rng.randint(1, 40)
            outcome = None
            while budget and now() < deadline:
                history.event(name, last, "invoke")
                d = conn.queue.get()
                d.addTimeout(args.timeout, reactor)
                try:
                    line = yield d
                except defer.TimeoutError:
                    line = None
                if line is None:
                    history.event(name, last, UNKNOWN)
                    break
                try:
                    message = codec.parse_server_message(line, stateful=True)
                except Exception as e:   # noqa: BLE001 - a bad line: the stream is corrupt
                    serve({"p": name, "corrupt": repr(e)})
                    history.event(name, last, UNKNOWN)
                    break
                if isinstance(message, codec.ErrorMessage):
                    if message.text == codec.SHUTDOWN_ERROR:
                        history.event(name, last, UNKNOWN)
                        break
                    history.event(name, last, FAILED)
                    serve({"p": name, "refused": message.text})
                    outcome = "refused"
                    break
                # what arrived, whatever its id: the checker judges it
                serve({"p": name, "id": message.message_id})
                if message.message_id != last + 1:
                    history.event(name, last, UNKNOWN)
                    break
                history.event(name, last, OK)
                last = message.message_id
                crc = zlib.crc32(message.value.to_bytes(4, "big"), crc)
                if message.crc is not None:
                    if message.crc != crc:
                        serve({"p": name, "crc": False})
                    outcome = "done"
                    break
                budget -= 1
                if last % 4 == 0:
                    conn.transport.write(codec.encode_ack(sid, last))
            conn.transport.loseConnection()
            if outcome is not None:
                return
            yield task.deferLater(reactor, rng.uniform(0.02, 0.2), lambda: None)

    @defer.inlineCallbacks
    def producer(name):
        k = 0
        while now() < deadline:
            yield session(f"{name}.{k}")
            k += 1

    d = defer.gatherResults([producer(f"{args.tag}{i}") for i in range(args.producers)])
    d.addBoth(lambda _: (history.close(), served.close()))
    return d


#: messages of one Relink log-tx transaction
TX_PARTS = 3

WORKLOADS = {
    "styx": run_styx,
    "styx0": run_styx0,
    "lumberjack": run_lumberjack,
    "relink": lambda reactor, args: run_relink(reactor, args, False),
    "relink-tx": lambda reactor, args: run_relink(reactor, args, True),
    "pravega": run_pravega,
    "pravega-conditional": run_pravega_conditional,
    "reliable": run_reliable,
}


def arguments(prog, choices):
    """The workload processes' argument parser (L{main}, L{test.faults.refworkloads})."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("protocol", choices=sorted(choices))
    parser.add_argument("--url", required=True,
                        help="styx: http://HOST:PORT; the others: tcp://HOST:PORT")
    parser.add_argument("--log", default="faults")
    parser.add_argument("--history", required=True)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--tag", default="w", help="producer name prefix")
    return parser


def main(argv=None):
    args = arguments("python -m test.faults.workload", WORKLOADS).parse_args(argv)
    from twisted.internet import task
    task.react(lambda reactor: WORKLOADS[args.protocol](reactor, args))


if __name__ == "__main__":
    sys.exit(main())
