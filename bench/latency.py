"""
Latency under a fixed offered load: Styx produce->ack over styx/0 and over
HTTP, produce->visible to a following consumer, Lumberjack batch->ack,
Pravega event->ack (our writer), Relink message->ack (our connector, the
server's log endpoint) and reliable stateful sessions, against real
C{twistd styx-server}, C{lumberjack-server}, C{pravega-server},
C{relink-server} and C{reliable-stream-server} processes on the file
store (or JetStream R3 with C{--store nats}), next to the latency of one
fsync on the same disk.

    python bench/latency.py                       # every mode; 10%, 50%, 80% of max
    python bench/latency.py --seconds 20 --size 1000
    python bench/latency.py --store nats          # a 3-node JetStream cluster, R3, sync always
    python bench/latency.py --go-server /path/to/styx-server   # the reference, beside ours
    python bench/latency.py --targets styx0 --baseline ../old-checkout   # before/after
    python bench/latency.py --targets http --client c --floor   # and what the machine allows
    python bench/latency.py --targets http --client c --loads 10 --rounds 6 \
        --go-server /path/to/styx-server    # medians over rounds: past the machine's stalls

How it measures (open loop, coordinated omission corrected): first the
server's maximum rate for each target is measured closed loop (as many
requests in flight as the client keeps busy, for C{--max-seconds}).  Then
for each load (a fraction of that maximum) records are *planned* at a
fixed rate, record i at C{start + i / rate}, and sent when their time
comes whatever happened to the previous ones; each latency is counted
from the planned time, not from the moment the client got round to
sending.  A server that stalls for 100 ms therefore shows 100 ms of
latency for every record planned during the stall, as a user would see
it, instead of one slow record among many fast ones.  Latencies go into
HDR histograms (the C{hdrhistogram} package, the C{bench} extra), in
microseconds, 3 significant digits.

The follower: a styx/0 consumer following the same log from the start;
each record carries its planned time, and "visible" is when the consumer
has it.

The fsync line: C{--fsync-samples} appends of C{--size} bytes to a file in
the data directory, each followed by C{fsync}: what one acknowledgement
costs at the least on this disk.  The last column is each p99 over that
fsync's p50.

With C{--go-server}, the Go reference runs beside ours (both started
first): for each Styx target and load, ours then the reference, at the
same offered rate (the fraction of ours' maximum), so that the machine's
other load hits both alike; each server's own maximum is printed too.
C{--baseline CHECKOUT} does the same with another checkout's
C{styx-server} (its accelerator built): a change against the code before
it, in one run.

The last column, send lag, is how late the client itself was at worst
in sending a record after its planned time: latency it caused rather
than the server (a late send still counts from the planned time).

The client is one Python process (Twisted), the server another, on a
machine whose 2 cores others share: the maximum is the maximum of this
pair, and a busy neighbour shows as latency.  Compare rows of one run.

C{--client c}: the HTTP loads are sent by C{bench/openloop.c} instead
(built here with C{cc}, into the data directory), the same schedule and
the same counting from the planned time, without the Python client's own
lateness (2.4-3.6 ms send lag at p99 against servers whose p99 differed
by 0.3 ms: doc/performance.rst).  The maximum is still the Python
client's closed loop, so that the offered rates stay comparable.

C{--floor}: the HTTP rows against C{bench/floor.c} too, a server in C
that does the least a server can (one thread; each wake-up appends the
bodies of the complete requests to one file, fsyncs it once, then sends
the same fixed answer to each): what this machine allows a server
answering after the fsync, beside which the goal "p99 within twice one
fsync" can be judged.
"""

import argparse
import array
import os
import shutil
import struct
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from hdrh.histogram import HdrHistogram  # noqa: E402

from bench import gorefs  # noqa: E402
from streamproto.core.gcpolicy import tune_for_server  # noqa: E402

#: microseconds, from 1 us to 60 s, 3 significant digits
HIST_RANGE = (1, 60_000_000, 3)
PLANNED = struct.Struct(">d")


def histogram():
    return HdrHistogram(*HIST_RANGE)


def summary(h):
    """(p50, p99, p99.9, max) in milliseconds."""
    return tuple(v / 1000.0 for v in (
        h.get_value_at_percentile(50), h.get_value_at_percentile(99),
        h.get_value_at_percentile(99.9), h.get_max_value()))


def fsync_latency(directory, size, samples):
    """An HDR histogram of C{samples} appends of C{size} bytes, each fsynced."""
    h = histogram()
    path = os.path.join(directory, "fsync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        payload = b"x" * size
        for _ in range(samples):
            os.write(fd, payload)
            started = time.monotonic()
            os.fsync(fd)
            h.record_value(max(1, int((time.monotonic() - started) * 1e6)))
    finally:
        os.close(fd)
        os.unlink(path)
    return h


# -- clients: send(payload) -> Deferred firing when acknowledged -----------

class HTTPPipeline:
    """
    Keep-alive HTTP/1.1 connections sending C{POST /logs/NAME/records}
    (one octet-stream record each), pipelined, round robin: the smallest
    client that keeps many requests in flight without its own per-request
    cost hiding the server's.
    """

    def __init__(self, reactor, port, name, connections=8):
        from twisted.internet import protocol
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        self.reactor, self.name = reactor, name
        self.head = (f"POST /logs/{name}/records HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     "Content-Type: application/octet-stream\r\nContent-Length: ")
        owner = self

        class Connection(protocol.Protocol):
            def __init__(self):
                self.waiting = []
                self.buf = b""

            def dataReceived(self, data):
                self.buf += data
                while True:
                    size = owner._response_size(self.buf)
                    if size is None:
                        return
                    status = int(self.buf[9:12])
                    self.buf = self.buf[size:]
                    d = self.waiting.pop(0)
                    if 200 <= status < 300:
                        d.callback(None)
                    else:
                        d.errback(RuntimeError(f"HTTP {status}"))

        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        self.connections = []
        self.ready = None
        from twisted.internet import defer
        ds = [connectProtocol(endpoint, Connection()) for _ in range(connections)]
        self.ready = defer.gatherResults(ds).addCallback(self.connections.extend)
        self.turn = 0

    @staticmethod
    def _response_size(buf):
        """The length of the first whole response in C{buf}, or None."""
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = buf[:end].lower()
        start = end + 4
        i = head.find(b"content-length:")
        if i >= 0:
            n = int(head[i + 15:].split(b"\r\n", 1)[0])
            return start + n if len(buf) >= start + n else None
        # chunked
        pos = start
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            n = int(buf[pos:line_end].split(b";")[0], 16)
            pos = line_end + 2 + n + 2
            if len(buf) < pos:
                return None
            if n == 0:
                return pos

    def send(self, payload):
        from twisted.internet import defer
        conn = self.connections[self.turn % len(self.connections)]
        self.turn += 1
        d = defer.Deferred()
        conn.waiting.append(d)
        conn.transport.write(self.head.encode() + b"%d\r\n\r\n" % len(payload) + payload)
        return d

    def close(self):
        for c in self.connections:
            c.transport.loseConnection()


# -- the load ---------------------------------------------------------------

def closed_loop(reactor, send, payload, seconds, in_flight):
    """Deferred firing with the rate (acks/s) of C{in_flight} outstanding sends."""
    from twisted.internet import defer
    done = defer.Deferred()
    state = {"acked": 0, "stop": time.monotonic() + seconds, "started": time.monotonic()}

    def again(_=None):
        if time.monotonic() >= state["stop"]:
            state["open"] -= 1
            if state["open"] == 0:
                done.callback(state["acked"] / (time.monotonic() - state["started"]))
            return
        state["acked"] += _ is not None
        send(PLANNED.pack(time.monotonic()) + payload).addCallback(
            lambda _: again(True)).addErrback(done.errback)

    state["open"] = in_flight
    for _ in range(in_flight):
        again()
    return done


def open_loop(reactor, send, payload, rate, seconds, acks, lag=None, send_many=None):
    """
    Send at C{rate} records/s for C{seconds}, each at its planned time (see
    the module docstring), recording each ack's latency from that time in
    C{acks}.  With C{send_many} (records -> Deferred of their ack), the
    records due at one timer tick go in one call, as a batching producer
    sends what it was given meanwhile; each still counts from its own
    planned time.  @return: Deferred firing with (sent, worst send lag in s).
    """
    from twisted.internet import defer
    done = defer.Deferred()
    total = max(1, int(rate * seconds))
    start = time.monotonic() + 0.05
    state = {"i": 0, "acked": 0, "lag": 0.0}

    def acked(_, planned):
        now = time.monotonic()
        for p in planned:
            acks.record_value(max(1, int((now - p) * 1e6)))
        state["acked"] += len(planned)
        if state["acked"] == total:
            done.callback((total, state["lag"]))

    def failed(f):
        if not done.called:
            done.errback(f)

    def tick():
        now = time.monotonic()
        due = []
        while state["i"] < total:
            planned = start + state["i"] / rate
            if planned > now:
                break
            state["lag"] = max(state["lag"], now - planned)
            state["i"] += 1
            if send_many is None:
                send(PLANNED.pack(planned) + payload).addCallback(
                    acked, (planned,)).addErrback(failed)
            else:
                due.append(planned)
        if due:
            send_many([PLANNED.pack(p) + payload for p in due]).addCallback(
                acked, due).addErrback(failed)
        if state["i"] < total:
            reactor.callLater(max(0.0, start + state["i"] / rate - time.monotonic()), tick)

    reactor.callLater(max(0.0, start - time.monotonic()), tick)
    return done


def build_c(directory, name):
    """C{bench/NAME.c} compiled into C{directory}; @return: its path."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".c")
    binary = os.path.join(directory, name)
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-o", binary, source], check=True)
    return binary


def native_open_loop(binary, port, name, rate, seconds, connections, size, acks):
    """
    One load sent by C{bench/openloop.c} (blocking: run in a thread), each
    latency from its planned time recorded in C{acks}.
    @return: (sent, worst send lag in s), as L{open_loop}.
    """
    with tempfile.NamedTemporaryFile(prefix="openloop-") as f:
        subprocess.run([binary, str(port), name, repr(rate), repr(seconds), str(connections),
                        str(size), f.name], check=True)
        pairs = array.array("I", f.read())
    if sys.byteorder != "little":
        pairs.byteswap()
    for latency in pairs[0::2]:
        acks.record_value(max(1, latency))
    return len(pairs) // 2, max(pairs[1::2], default=0) / 1e6


def run_styx(reactor, styx_servers, args, out):
    """
    Every target and load: the Styx ones against each of C{styx_servers}
    ((title, port): ours first, then the Go reference), alternated load by
    load at the same offered rates (fractions of ours' maximum); the others
    against ours.  @return: Deferred of rows, (server title, *row).
    """
    from twisted.internet import defer

    from streamproto.styx.api_client import StyxClient
    from streamproto.styx.stream_client import StyxConsumer, StyxProducer

    payload = b"x" * max(0, args.size - PLANNED.size)
    rows = []
    apis = {port: StyxClient(f"http://127.0.0.1:{port}", reactor) for _, port in styx_servers}

    @defer.inlineCallbacks
    def fresh_log(tag, port):
        name = f"lat-{tag}-{uuid.uuid4().hex[:8]}"
        if port != args.floor_port:     # the floor appends any body to one file
            yield apis[port].create_log(name)
        return name

    @defer.inlineCallbacks
    def styx0(load, port):
        name = yield fresh_log("styx0", port)
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", port, name)
        visible = histogram()

        def seen(records):
            now = time.monotonic()
            for r in records:
                (planned,) = PLANNED.unpack_from(r)
                visible.record_value(max(1, int((now - planned) * 1e6)))

        consumer = None
        if load is not None and "follow" in args.targets:
            consumer = yield StyxConsumer.connect(reactor, "127.0.0.1", port, name, seen,
                                                  follow=True)
        try:
            if load is None:
                return (yield closed_loop(reactor, producer.write, payload,
                                          args.max_seconds, args.in_flight))
            acks = histogram()
            sent, lag = yield open_loop(reactor, producer.write, payload, load,
                                        args.seconds, acks, send_many=producer.writeMany)
            deadline = time.monotonic() + 10
            while consumer is not None and visible.get_total_count() < sent and \
                    time.monotonic() < deadline:
                yield task_sleep(reactor, 0.05)
            return acks, (visible if consumer is not None else None), sent, lag
        finally:
            yield producer.close()
            if consumer is not None:
                consumer.close()

    @defer.inlineCallbacks
    def http(load, port):
        name = yield fresh_log("http", port)
        acks = histogram()
        if load is not None and args.client == "c":
            from twisted.internet import threads
            sent, lag = yield threads.deferToThread(
                native_open_loop, args.openloop, port, name, load, args.seconds,
                args.connections, args.size, acks)
            return acks, None, sent, lag
        client = HTTPPipeline(reactor, port, name, args.connections)
        yield client.ready
        try:
            if load is None:
                return (yield closed_loop(reactor, client.send, payload, args.max_seconds,
                                          args.in_flight))
            sent, lag = yield open_loop(reactor, client.send, payload, load, args.seconds,
                                        acks)
            return acks, None, sent, lag
        finally:
            client.close()

    @defer.inlineCallbacks
    def lumberjack(load, _port=None):
        from twisted.internet.endpoints import TCP4ClientEndpoint

        from streamproto.lumberjack.client import LumberjackClient
        # a batch of --batch JSON events is one send, one ack
        events = [b'{"message":"%s"}' % (b"x" * max(0, args.size - 14))] * args.batch
        client = LumberjackClient(TCP4ClientEndpoint(reactor, "127.0.0.1", args.lj_port),
                                  clock=reactor, bulk_max_size=args.batch, pipelining=64)
        try:
            def send(_record):
                return client.send(events)
            if load is None:
                return (yield closed_loop(reactor, send, payload, args.max_seconds,
                                          max(1, args.in_flight // args.batch)))
            acks = histogram()
            sent, lag = yield open_loop(reactor, send, payload, load, args.seconds, acks)
            return acks, None, sent, lag
        finally:
            yield client.close()

    @defer.inlineCallbacks
    def pravega(load, _port=None):
        from twisted.internet.endpoints import TCP4ClientEndpoint

        from streamproto.pravega.client import SegmentWriter, connect
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", args.pravega_port)
        segment = f"lat/s{uuid.uuid4().hex[:8]}/0.#epoch.0"
        admin = yield connect(endpoint)
        yield admin.create_segment(segment)
        writer = SegmentWriter(endpoint, segment, window_events=1 << 20, window_bytes=1 << 30)
        try:
            if load is None:
                return (yield closed_loop(reactor, writer.write, payload, args.max_seconds,
                                          args.in_flight))
            acks = histogram()
            sent, lag = yield open_loop(reactor, writer.write, payload, load, args.seconds,
                                        acks)
            return acks, None, sent, lag
        finally:
            yield writer.close()

    @defer.inlineCallbacks
    def relink(load, _port=None):
        from streamproto.core.tls import client_endpoint
        from streamproto.relink.api import Connector
        # the server's log endpoint: a message is acknowledged consumed once
        # its append is durable (doc/relink.rst); its default 4-byte ids
        connector = Connector(client_endpoint(reactor, "127.0.0.1", args.relink_port, None),
                              "log", connector_id_size=4, listener_id_size=4)
        connector.start()
        link = yield connector.when_linked()
        channel = link.channel(1 + int(uuid.uuid4().int % 1000))

        def send(message):
            return channel.send([message])
        try:
            if load is None:
                return (yield closed_loop(reactor, send, payload, args.max_seconds,
                                          args.in_flight))
            acks = histogram()
            sent, lag = yield open_loop(reactor, send, payload, load, args.seconds, acks)
            return acks, None, sent, lag
        finally:
            yield connector.stop()

    @defer.inlineCallbacks
    def reliable(load, _port=None):
        from streamproto.core.tls import client_endpoint
        from streamproto.reliable.client import StatefulClient
        endpoint = client_endpoint(reactor, "127.0.0.1", args.reliable_port, None)

        # one stateful session a send: connect, open, its messages (each
        # stored durably before it is sent), the final CRC checked
        def send(_record):
            return StatefulClient(endpoint, args.reliable_count).run()
        if load is None:
            return (yield closed_loop(reactor, send, payload, args.max_seconds,
                                      max(1, args.in_flight // 8)))
        acks = histogram()
        sent, lag = yield open_loop(reactor, send, payload, load, args.seconds, acks)
        return acks, None, sent, lag

    targets = [("styx/0", styx0)] if "styx0" in args.targets or "follow" in args.targets \
        else []
    if "http" in args.targets:
        targets.append(("HTTP", http))
    if "pravega" in args.targets and args.pravega_port:
        targets.append(("Pravega event->ack", pravega))
    if "lumberjack" in args.targets and args.lj_port:
        targets.append((f"Lumberjack batch({args.batch})->ack", lumberjack))
    if "relink" in args.targets and args.relink_port:
        targets.append(("Relink message->ack", relink))
    if "reliable" in args.targets and args.reliable_port:
        targets.append((f"Reliable session({args.reliable_count})->last msg", reliable))

    styx_targets = {styx0, http}

    @defer.inlineCallbacks
    def go():
        for label, run in targets:
            servers = styx_servers if run in styx_targets else styx_servers[:1]
            if run is not http:     # the floor speaks HTTP produce only
                servers = [(t, p) for t, p in servers if p != args.floor_port]
            maxima = []
            for title, port in servers:
                maximum = yield run(None, port)
                maxima.append(maximum)
                print(f"  {title}: {label}: maximum {maximum:,.0f} sends/s closed loop "
                      f"({args.in_flight} records in flight)", file=out, flush=True)
            for fraction in args.loads:
                rate = maxima[0] * fraction / 100.0
                for title, port in servers:
                    acks, visible, sent, lag = yield run(rate, port)
                    what = label if "->" in label else label + " produce->ack"
                    rows.append((title, what, fraction, rate, sent, acks, lag))
                    if visible is not None:
                        rows.append((title, "styx/0 produce->visible", fraction, rate,
                                     visible.get_total_count(), visible, lag))
        for api in apis.values():
            api.close()
        return rows

    return go()


def task_sleep(reactor, seconds):
    from twisted.internet import task
    return task.deferLater(reactor, seconds, lambda: None)


def run_reactor(start):
    """
    Run the reactor until the Deferred of C{start(reactor)} fires (a bench
    runs one reactor a process).

    @return: its result; its failure is raised.
    """
    from twisted.internet import reactor
    result = {}

    def finished(value):
        result["value"] = value
        reactor.stop()

    def failed(f):
        result["error"] = f
        reactor.stop()

    # the client's own full garbage collections stalled its sends (24 of
    # 75-90 ms in 30 s at 50% load): the servers' settings here too
    tune_for_server(reactor)
    reactor.callWhenRunning(lambda: start(reactor).addCallbacks(finished, failed))
    reactor.run()
    if "error" in result:
        result["error"].raiseException()
    return result["value"]


def measure(styx_servers, args, out):
    """Run L{run_styx} in a fresh reactor (a child process: one reactor per run)."""
    return run_reactor(lambda reactor: run_styx(reactor, styx_servers, args, out))


def print_rows(title, rows, fsync_p50_ms, out):
    print(f"\n{title}", file=out)
    header = (f"{'what':<34} {'load':>5} {'rate/s':>9} {'records':>8} | {'p50 ms':>8} "
              f"{'p99 ms':>8} {'p99.9 ms':>9} {'max ms':>8} | {'p99/fsync':>9} "
              f"{'send lag ms':>11}")
    print(header, file=out)
    print("-" * len(header), file=out)
    rounds = {}
    for what, fraction, rate, count, h, lag in rows:
        p50, p99, p999, worst = summary(h)
        rounds.setdefault((what, fraction), []).append((p50, p99, p999, worst, lag))
        print(f"{what:<34} {fraction:>4.0f}% {rate:>9,.0f} {count:>8,} | {p50:>8.2f} "
              f"{p99:>8.2f} {p999:>9.2f} {worst:>8.2f} | {p99 / fsync_p50_ms:>9.1f} "
              f"{lag * 1000:>11.1f}", file=out)
    # a stall of the machine (tens to hundreds of ms, a few times a
    # minute here) decides the p99 of the round it falls in, whichever
    # server runs then: with --rounds, each percentile's median over the
    # rounds is the figure to compare
    for (what, fraction), got in rounds.items():
        if len(got) > 1:
            p50, p99, p999, worst, lag = (statistics.median(x) for x in zip(*got))
            print(f"{what:<34} {fraction:>4.0f}% {'median of':>9} "
                  f"{'%d rounds' % len(got):>8} | {p50:>8.2f} {p99:>8.2f} {p999:>9.2f} {worst:>8.2f} | "
                  f"{p99 / fsync_p50_ms:>9.1f} {lag * 1000:>11.1f}", file=out)
    out.flush()


def start_ours(directory, store, plugin="styx-server", *extra, root=gorefs.ROOT,
               name=None):
    """
    Start our C{plugin} server (C{twistd}) on a free port of 127.0.0.1, its
    data under C{directory} (or in C{store}, a C{--store} URL), its output
    in C{directory/PLUGIN.log}; @return: C{(process, port)} once it listens.
    """
    port = gorefs.free_port()
    data = name or ("ours" if plugin == "styx-server" else plugin)
    storage = ["--store", store] if store else ["--data", os.path.join(directory, data)]
    log = open(os.path.join(directory, f"{name or plugin}.log"), "wb")
    server = gorefs.twistd(plugin, *storage, "--port", f"tcp:{port}:interface=127.0.0.1",
                           *extra, log=log, root=root)
    gorefs.wait_port(port)
    return server, port


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="styx0,follow,http,lumberjack,pravega,relink,reliable",
                   help="styx0, follow (a consumer on the styx/0 log), http, lumberjack "
                        "(batch->ack against our lumberjack-server), pravega (event->ack "
                        "of our SegmentWriter against our pravega-server), relink (message->"
                        "consumed ack of our Connector against our relink-server's log "
                        "endpoint), reliable (a stateful session of --reliable-count "
                        "messages against our reliable-stream-server); all seven")
    p.add_argument("--reliable-count", type=int, default=16,
                   help="messages per reliable stateful session (16: one ack window)")
    p.add_argument("--batch", type=int, default=100,
                   help="events per Lumberjack batch (100)")
    p.add_argument("--size", type=int, default=100, help="bytes per record (100)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per load (10)")
    p.add_argument("--loads", default="10,50,80",
                   help="offered loads, percent of the measured maximum (10,50,80)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every load this many times, the servers alternated "
                        "each time, and print each percentile's median over the rounds "
                        "(1)")
    p.add_argument("--max-seconds", type=float, default=5.0,
                   help="seconds of the closed-loop maximum (5)")
    p.add_argument("--in-flight", type=int, default=256,
                   help="records in flight for the maximum (256)")
    p.add_argument("--connections", type=int, default=8, help="HTTP connections (8)")
    p.add_argument("--client", choices=("python", "c"), default="python",
                   help="who sends the HTTP loads: the Twisted client (default) or "
                        "bench/openloop.c, built here with cc (no client lateness of its own)")
    p.add_argument("--floor", action="store_true",
                   help="HTTP also against bench/floor.c (built here with cc): the least a "
                        "server can do for a request answered after its fsync, what the "
                        "machine allows")
    p.add_argument("--fsync-samples", type=int, default=500)
    p.add_argument("--data", help="directory for the stores (default: a temporary one)")
    p.add_argument("--store", choices=("file", "nats"), default="file",
                   help="file (default) or nats: a 3-node JetStream cluster, R3, "
                        "sync_interval always (test/support/natsutil.py)")
    p.add_argument("--go-server", metavar="PATH",
                   help="the reference styx-server, built outside this repository: "
                        "the Styx targets against it too, alternated with ours load by "
                        "load at the same offered rates (fractions of ours' maximum)")
    p.add_argument("--baseline", metavar="CHECKOUT",
                   help="another checkout of streamproto (accelerator built): its "
                        "styx-server beside ours for the Styx targets, alternated load by "
                        "load at the same offered rates, to see what a change did")
    args = p.parse_args(argv)
    args.targets = set(args.targets.split(","))
    args.loads = [float(x) for x in args.loads.split(",")] * max(1, args.rounds)
    out = sys.stdout
    directory = args.data or tempfile.mkdtemp(prefix="latency-bench-")
    os.makedirs(directory, exist_ok=True)

    args.openloop = build_c(directory, "openloop") if args.client == "c" else None
    fsync = fsync_latency(directory, args.size, args.fsync_samples)
    f50, f99, _, fmax = summary(fsync)
    print(f"one fsync of a {args.size} B append in {directory}: p50 {f50:.2f} ms, "
          f"p99 {f99:.2f} ms, max {fmax:.2f} ms ({args.fsync_samples} samples)", file=out)
    print("2 shared cores, others' load included: compare rows of one run", file=out,
          flush=True)

    cluster = None
    started = []
    store = None
    if args.store == "nats":
        from test.support.natsutil import NatsCluster
        cluster = NatsCluster(size=3, sync_interval="always")
        cluster.start()
        store = cluster.url + "?replicas=3"
        title = "ours, JetStream R3 (sync always)"
    else:
        title = ("ours (twistd styx-, lumberjack-, pravega-, relink- and "
                 "reliable-stream-server, file store; reliable: SQLite)")
    try:
        server, port = start_ours(directory, store)
        started.append(server)
        styx_servers = [(title, port)]
        if args.baseline:
            base, base_port = start_ours(directory, store, root=os.path.abspath(args.baseline),
                                         name="baseline")
            started.append(base)
            styx_servers.append((f"baseline: the checkout at {args.baseline}", base_port))
        if args.go_server:
            go_port = gorefs.free_port()
            started.append(gorefs.go_styx_server(args.go_server, go_port,
                                                 os.path.join(directory, "go")))
            styx_servers.append(("the Go reference styx-server (file store)", go_port))
        args.floor_port = None
        if args.floor:
            args.floor_port = gorefs.free_port()
            started.append(subprocess.Popen(
                [build_c(directory, "floor"), str(args.floor_port),
                 os.path.join(directory, "floor.log")]))
            gorefs.wait_port(args.floor_port)
            styx_servers.append(("the floor: bench/floor.c (write, one fsync a wake-up, "
                                 "a fixed answer)", args.floor_port))
        args.lj_port = args.pravega_port = args.relink_port = args.reliable_port = None
        if "lumberjack" in args.targets:
            lj_server, args.lj_port = start_ours(directory, store, "lumberjack-server")
            started.append(lj_server)
        if "relink" in args.targets:
            relink_server, args.relink_port = start_ours(directory, store, "relink-server")
            started.append(relink_server)
        if "reliable" in args.targets:
            # sessions in SQLite (WAL, synchronous=FULL) or a JetStream bucket
            reliable_server, args.reliable_port = start_ours(
                directory, None, "reliable-stream-server",
                "--store", store if store else "sqlite")
            started.append(reliable_server)
        if "pravega" in args.targets:
            # no controller: the writer talks to the segment store alone
            pravega_server, args.pravega_port = start_ours(
                directory, store, "pravega-server", "--controller", "none")
            started.append(pravega_server)
        child_out = os.path.join(directory, "rows")
        pid = os.fork()
        if pid == 0:        # the client in a fresh process, with its own reactor
            status = 1
            try:
                rows = measure(styx_servers, args, out)
                with open(child_out, "wb") as f:
                    import pickle
                    pickle.dump([(t, w, fr, r, c, h.encode(), lag)
                                 for t, w, fr, r, c, h, lag in rows], f)
                status = 0
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            print("  the client failed", file=out)
            return 1
        import pickle
        with open(child_out, "rb") as f:
            rows = [(t, w, fr, r, c, HdrHistogram.decode(h), lag)
                    for t, w, fr, r, c, h, lag in pickle.load(f)]
        for title, _ in styx_servers:
            print_rows(title, [row[1:] for row in rows if row[0] == title], f50, out)
    finally:
        for server in started:
            gorefs.stop(server)
        if cluster is not None:
            cluster.stop()
        if not args.data:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
