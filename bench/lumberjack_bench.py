"""
Lumberjack throughput: events/s into the file log store, durably (acked
after fsync), client and server in separate processes.

Two senders against the same server process, in the same run:

- baseline "blaster": batches pre-encoded before the clock starts (W + one
  zlib C frame each), written with pipelining; measures the server alone;
- our L{LumberjackClient}: encodes every event (JSON) and batch (zlib) as it
  goes; end-to-end.

Besides wall-clock events/s it reports CPU-bound capacities from process CPU
time (the machine's cores are shared, so wall-clock mixes in other work):
server events per server CPU-second, client events per client CPU-second.

    python bench/lumberjack_bench.py                       # 200k events

Against go-lumber (built outside this repository), give its test sender
and test server: C{tst-send} then runs against C{tst-lj -v2} (which acks
without storing anything) and against C{twistd lumberjack-server} (file
store, acks after fsync), alternately (C{--senders N}: N of them at once);
it prints the commands, each round's acked events/s (the senders'
C{ACKed} counters at C{/debug/vars}, what a user running C{tst-send} by
hand reads) and events per server CPU-second (/proc), and the per-round
ratios' median and spread::

    python bench/lumberjack_bench.py --go-send /path/to/tst-send --go-server /path/to/tst-lj
    python bench/lumberjack_bench.py --go-send ... --go-server ... --pin --senders 4
    python bench/lumberjack_bench.py --events 2000000 --connections 2

With C{--loadbalance}, two server processes (each its own file store) and
one client over both, in the two modes of Filebeat's C{loadbalance}
option, alternately: failover (L{LumberjackClient} on a
L{FailoverEndpoint}: one server at a time) and load balancing
(L{LoadBalancingLumberjackClient}: both at once); prints each one's
events/s (best of C{--rounds}) and the ratio::

    python bench/lumberjack_bench.py --loadbalance --rounds 3
"""

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

WORDS = ("GET POST PUT /api/v1/users /static/app.js 200 404 500 upstream timeout "
         "connection reset cache hit miss user_id session ok error warn").split()


def make_events(n, seed=1):
    """~200-byte JSON events like a Filebeat log line (bytes, already encoded)."""
    rnd = random.Random(seed)
    events = []
    for i in range(n):
        message = " ".join(rnd.choice(WORDS) for _ in range(12))
        event = {
            "@timestamp": f"2026-11-22T04:{i // 60000 % 60:02d}:{i // 1000 % 60:02d}.{i % 1000:03d}Z",
            "message": message[:90],
            "host": {"name": f"web-{i % 16:02d}"},
            "log": {"offset": i * 211, "file": {"path": "/var/log/app.log"}},
        }
        events.append(json.dumps(event, separators=(",", ":")).encode())
    return events


def cpu_seconds(pid):
    """User + system CPU of process C{pid} (all threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- the server process ------------------------------------------------------------
def serve(data_dir):
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from streamproto.log import open_store
    from streamproto.lumberjack.server import LumberjackServerFactory
    from streamproto.lumberjack.sink import LogStoreSink

    if os.environ.get("LUMBERJACK_BENCH_STDLIB_JSON"):
        from streamproto.lumberjack import codec
        codec.fast_check = codec.stdlib_check  # measure the fallback validator
    store = open_store(data_dir)
    factory = LumberjackServerFactory(LogStoreSink(store, "bench"))

    def listening(port):
        sys.stdout.write(f"PORT {port.getHost().port}\n")
        sys.stdout.flush()

    TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory).addCallback(listening)
    def report():
        sys.stdout.write(f"PERSISTED {factory.events_persisted}\n")
        sys.stdout.flush()
        return store.close()

    reactor.addSystemEventTrigger("before", "shutdown", report)
    if os.environ.get("LUMBERJACK_BENCH_PROFILE"):
        import cProfile
        cProfile.runctx("reactor.run()", globals(), locals(),
                        os.environ["LUMBERJACK_BENCH_PROFILE"])
    else:
        reactor.run()


# -- senders ------------------------------------------------------------------------
def blaster(reactor, port, batches, pipelining):
    """Send pre-encoded batches on one connection; fires when all are acked."""
    from twisted.internet import defer, protocol
    from twisted.internet.endpoints import TCP4ClientEndpoint

    done = defer.Deferred()

    class Blaster(protocol.Protocol):
        def connectionMade(self):
            self.next = 0
            self.acked = 0
            self.buf = b""
            for _ in range(min(pipelining, len(batches))):
                self.send_one()

        def send_one(self):
            data, _ = batches[self.next]
            self.next += 1
            self.transport.write(data)

        def dataReceived(self, data):
            self.buf += data
            while len(self.buf) >= 6:
                seq = int.from_bytes(self.buf[2:6], "big")
                self.buf = self.buf[6:]
                if seq == 0:
                    continue  # keepalive
                if seq == batches[self.acked][1]:
                    self.acked += 1
                    if self.next < len(batches):
                        self.send_one()
                    elif self.acked == len(batches):
                        self.transport.loseConnection()
                        done.callback(None)

    TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(
        protocol.Factory.forProtocol(Blaster))
    return done


def run_senders(kind, port, events, args):
    from twisted.internet import defer, task
    from twisted.internet.endpoints import TCP4ClientEndpoint

    from streamproto.core.failover import FailoverEndpoint
    from streamproto.lumberjack.client import LoadBalancingLumberjackClient, LumberjackClient
    from streamproto.lumberjack.codec import encode_batch

    result = {}
    ports = [int(p) for p in str(port).split(",")]

    @defer.inlineCallbacks
    def main(reactor):
        per_conn = len(events) // args.connections
        slices = [events[i * per_conn:(i + 1) * per_conn] for i in range(args.connections)]
        if kind != "blaster" and args.dicts:
            slices = [[json.loads(e) for e in s] for s in slices]
        if kind == "blaster":
            encoded = [[(encode_batch(s[i:i + args.batch], args.level), len(s[i:i + args.batch]))
                        for i in range(0, len(s), args.batch)] for s in slices]
        t0, c0 = time.perf_counter(), own_cpu()
        if kind == "blaster":
            yield defer.gatherResults([blaster(reactor, ports[0], b, args.pipelining)
                                       for b in encoded])
        else:
            options = dict(bulk_max_size=args.batch, compression_level=args.level,
                           pipelining=args.pipelining)
            endpoints = [TCP4ClientEndpoint(reactor, "127.0.0.1", p) for p in ports]
            names = [f"127.0.0.1:{p}" for p in ports]
            if kind == "loadbalance":
                clients = [LoadBalancingLumberjackClient(endpoints, names=names, **options)
                           for _ in slices]
            elif kind == "failover":
                clients = [LumberjackClient(FailoverEndpoint(endpoints, names), **options)
                           for _ in slices]
            else:
                clients = [LumberjackClient(endpoints[0], **options) for _ in slices]
            # feed each client as a producer would: a batch at a time, a few
            # batches ahead of the acks (events are encoded in send())
            @defer.inlineCallbacks
            def feed(client, s):
                ahead = []
                for i in range(0, len(s), args.batch):
                    ahead.append(client.send(s[i:i + args.batch]))
                    # enough ahead to fill every connection's pipeline
                    if len(ahead) > args.pipelining * len(client.senders) + 1:
                        yield ahead.pop(0)
                yield defer.gatherResults(ahead)
            yield defer.gatherResults([feed(c, s) for c, s in zip(clients, slices)])
            yield defer.gatherResults([c.close() for c in clients])
        result["wall"] = time.perf_counter() - t0
        result["cpu"] = own_cpu() - c0
        result["events"] = per_conn * args.connections

    try:
        task.react(main)
    except SystemExit:
        pass
    return result


def child_run(kind, port, args):
    """Run one sender in a fresh process (its own CPU, its own reactor)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--sender", kind, "--port", str(port),
           "--events", str(args.events), "--batch", str(args.batch), "--level", str(args.level),
           "--pipelining", str(args.pipelining), "--connections", str(args.connections)]
    if args.dicts:
        cmd.append("--dicts")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def start_server(env=None):
    """A server process on a fresh file store: (process, port, data directory)."""
    data_dir = tempfile.mkdtemp(prefix="lumberjack-bench-")
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", data_dir],
                              stdout=subprocess.PIPE, text=True, env=env)
    port = int(server.stdout.readline().split()[1])
    return server, port, data_dir


def stop_server(server, data_dir):
    """Stop a server process: the events it persisted."""
    persisted = None
    if server.poll() is None:
        server.terminate()
        persisted = int(server.stdout.read().split()[-1])
    server.wait()
    shutil.rmtree(data_dir, ignore_errors=True)
    return persisted


def best_of_rounds(kinds, port, args, server_pids):
    """
    Run each sender kind in turn, C{args.rounds} times; return the fastest
    run of each kind (with C{server_cpu}: each server's CPU seconds over
    it) and how many events all the runs sent.
    """
    results = {}
    sent = 0
    for _ in range(args.rounds):
        for kind in kinds:
            s0 = [cpu_seconds(pid) for pid in server_pids]
            r = child_run(kind, port, args)
            r["server_cpu"] = [cpu_seconds(pid) - c for pid, c in zip(server_pids, s0)]
            sent += r["events"]
            best = results.get(kind)
            if best is None or r["wall"] < best["wall"]:
                results[kind] = r
    return results, sent


def compare_loadbalance(args):
    """Failover against load balancing over the same two server processes."""
    env = dict(os.environ)
    if args.stdlib_json:
        env["LUMBERJACK_BENCH_STDLIB_JSON"] = "1"
    servers = [start_server(env) for _ in range(2)]
    try:
        ports = ",".join(str(port) for _, port, _ in servers)
        print(f"events: {args.events}, batch {args.batch}, zlib level {args.level}, "
              f"pipelining {args.pipelining} per connection; two server processes, each its "
              "own file log store (acked after fsync); best of "
              f"{args.rounds} alternated round(s)")
        results, sent = best_of_rounds(("failover", "loadbalance"), ports, args,
                                       [server.pid for server, _, _ in servers])
        for kind, label in (("failover", "failover (one server at a time)"),
                            ("loadbalance", "loadbalance (both servers)")):
            r = results[kind]
            n = r["events"]
            cpu = " + ".join(f"{c:.2f}" for c in r["server_cpu"])
            print(f"{label:34s} {n / r['wall']:>10,.0f} events/s wall   client CPU "
                  f"{r['cpu']:.2f} s, servers' CPU {cpu} s")
        ratio = results["loadbalance"]["wall"] and (
            results["failover"]["wall"] / results["loadbalance"]["wall"])
        print(f"ratio loadbalance / failover (events/s): {ratio:.2f}")
    finally:
        persisted = [stop_server(server, data_dir) for server, _, data_dir in servers]
    print(f"servers persisted {persisted} events, {sum(p or 0 for p in persisted)} in all; "
          f"{sent} sent and acked")
    if sum(p or 0 for p in persisted) != sent:
        raise SystemExit("event count mismatch")


def compare_with_go(args):
    """
    C{--go-send}: tst-send against tst-lj and against ours, alternately;
    prints the commands, every run (what the senders' C{ACKed} counters
    and /proc say), the medians and the spread of the per-round ratios.
    """
    from bench.gorefs import compare_lumberjack, lumberjack_commands
    rounds = max(args.rounds, 3)
    median = statistics.median
    print("commands (PORT, VARSPORT, DIR: the bench's):")
    for command in lumberjack_commands(args.go_send, args.go_server, args.go_pipeline,
                                       args.pin):
        print(f"  {command}")
    print(f"{args.senders} tst-send at once (batches of 2048, zlib 3, pipeline "
          f"{args.go_pipeline}); {rounds} alternated rounds of {args.seconds:g} s"
          + ("; each server on CPU 1, the senders on CPU 0" if args.pin else ""))
    g, o = compare_lumberjack(args.go_send, args.go_server, args.seconds, rounds,
                              args.go_pipeline, args.pin, args.senders)
    print("round  tst-lj events/s  per server CPU-s | ours events/s  per server CPU-s | "
          "ours/tst-lj: events/s  CPU-s per event")
    rate_ratios, cpu_ratios = [], []
    for i, (a, b) in enumerate(zip(g, o), 1):
        rate_ratios.append(b.rate / a.rate)
        cpu_ratios.append(b.server_efficiency / a.server_efficiency)
        print(f"{i:5d}  {a.rate:>15,.0f}  {a.server_efficiency:>16,.0f} | {b.rate:>13,.0f}  "
              f"{b.server_efficiency:>16,.0f} | {rate_ratios[-1]:>20.2f}x  "
              f"{cpu_ratios[-1]:>6.2f}x fewer")
    for side, runs in (("tst-lj", g), ("ours", o)):
        for line in sorted({line for r in runs for line in r.log}):
            print(f"  tst-send against {side} said: {line}")
    print(f"medians: tst-lj (acks, stores nothing) {median(r.rate for r in g):,.0f} events/s, "
          f"{median(r.server_efficiency for r in g):,.0f} per server CPU-second; "
          f"twistd lumberjack-server (fsync, then ack) {median(r.rate for r in o):,.0f} "
          f"events/s, {median(r.server_efficiency for r in o):,.0f} per server CPU-second")
    print(f"ours / tst-lj per round: events/s {median(rate_ratios):.2f}x "
          f"(spread {min(rate_ratios):.2f}-{max(rate_ratios):.2f}), server CPU-seconds per "
          f"event {median(cpu_ratios):.2f}x fewer (spread {min(cpu_ratios):.2f}-"
          f"{max(cpu_ratios):.2f})")
    print(f"senders' load: {median(r.sender_load for r in g):.0%} of a core against tst-lj, "
          f"{median(r.sender_load for r in o):.0%} against ours (near 100% on their core: "
          "the senders bound events/s, not the server)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200000)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--pipelining", type=int, default=2)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stdlib-json", action="store_true",
                        help="server validates JSON with the stdlib only (no msgspec)")
    parser.add_argument("--dicts", action="store_true",
                        help="give the client dicts to encode (default: JSON bytes)")
    parser.add_argument("--go-send", metavar="PATH",
                        help="go-lumber's tst-send: compare with its tst-lj")
    parser.add_argument("--go-server", metavar="PATH", help="go-lumber's tst-lj")
    parser.add_argument("--seconds", type=float, default=8,
                        help="measured seconds per run with --go-send (8)")
    parser.add_argument("--go-pipeline", type=int, default=0,
                        help="tst-send's -pipeline (0: its synchronous client)")
    parser.add_argument("--pin", action="store_true",
                        help="with --go-send: each server on CPU 1 only, tst-send on CPU 0")
    parser.add_argument("--senders", type=int, default=1,
                        help="with --go-send: this many tst-send at once (1)")
    parser.add_argument("--serve", metavar="DATA_DIR")
    parser.add_argument("--loadbalance", action="store_true",
                        help="two servers: failover against load-balancing client")
    parser.add_argument("--sender", choices=["blaster", "client", "failover", "loadbalance"])
    parser.add_argument("--port", help="the server's port (PORT,PORT for two)")
    args = parser.parse_args()

    if args.go_send or args.go_server:
        if not (args.go_send and args.go_server):
            parser.error("--go-send and --go-server go together")
        compare_with_go(args)
        return
    if args.serve:
        serve(args.serve)
        return
    if args.loadbalance and not args.sender:
        compare_loadbalance(args)
        return
    if args.sender:
        events = make_events(args.events)
        print(json.dumps(run_senders(args.sender, args.port, events, args)))
        return

    data_dir = tempfile.mkdtemp(prefix="lumberjack-bench-")
    env = dict(os.environ)
    if args.stdlib_json:
        env["LUMBERJACK_BENCH_STDLIB_JSON"] = "1"
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", data_dir],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        port = int(line.split()[1])
        sample = make_events(1000)
        print(f"events: {args.events}, ~{sum(map(len, sample)) // len(sample)} B JSON each "
              f"({'dicts' if args.dicts else 'bytes'} given to the client), "
              f"batch {args.batch}, zlib level {args.level}, pipelining {args.pipelining}, "
              f"{args.connections} connection(s); file log store (acked after fsync)")
        results, sent = best_of_rounds(("blaster", "client"), port, args, [server.pid])
        for kind, label in (("blaster", "baseline: pre-encoded frames -> server"),
                            ("client", "LumberjackClient -> server")):
            r = results[kind]
            n = r["events"]
            print(f"{label:40s} {n / r['wall']:>10,.0f} events/s wall   "
                  f"server {n / max(r['server_cpu'][0], 1e-9):>10,.0f} events/CPU-s   "
                  f"sender {n / max(r['cpu'], 1e-9):>10,.0f} events/CPU-s")
        ratio = results["client"]["wall"] and (results["blaster"]["wall"] / results["client"]["wall"])
        print(f"ratio LumberjackClient / baseline (wall events/s): {ratio:.2f}")
        print("(shared 2-core machine: wall figures include other load; the per-CPU-second "
              "figures are each process's own capacity)")
        server.terminate()
        persisted = int(server.stdout.read().split()[-1])
        print(f"server persisted {persisted} events, {sent} sent and acked")
        if persisted != sent:
            raise SystemExit("event count mismatch")
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
