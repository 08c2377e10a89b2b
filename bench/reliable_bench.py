"""
Reliable-stream benchmark: aggregate messages/s of many concurrent stateful
sessions (no send-rate limit) on the memory store (baseline) and on the
durable SQLite store, side by side, plus the time to resume after a
reconnect.

    python bench/reliable_bench.py                       # 100 sessions x 500
    python bench/reliable_bench.py --sessions 100 --count 5000
    python bench/reliable_bench.py --mt-module _mtfirst  # with a C MT19937

The server runs in a child process (its own core), the clients (which
verify every value's CRC) in this one, over TCP on 127.0.0.1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)


def serve(args):
    """Child process: one server on an ephemeral port, printed on stdout."""
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from streamproto.reliable import sequence
    from streamproto.reliable.server import ReliableStreamFactory
    from streamproto.reliable.session import MemorySessionStore, SQLiteSessionStore

    if args.mt_module:
        module = __import__(args.mt_module)
        sequence.first_random_int = module.mt19937_first
    if args.serve == "memory":
        store = MemorySessionStore()
    else:
        store = SQLiteSessionStore(os.path.join(args.data, "sessions.sqlite"))

    def listening(port):
        print(port.getHost().port, flush=True)
    TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        ReliableStreamFactory(store)).addCallback(listening)
    reactor.run()


def start_server(store, args, data):
    command = [sys.executable, os.path.abspath(__file__), "--serve", store, "--data", data]
    if args.mt_module:
        command += ["--mt-module", args.mt_module]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    child = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    port = int(child.stdout.readline())
    return child, port


def measure(store, args):
    from twisted.internet import defer, reactor, task
    from twisted.internet.protocol import Factory, Protocol

    from streamproto.core.tls import client_endpoint
    from streamproto.reliable import codec
    from streamproto.reliable.client import StatefulClient

    data = tempfile.mkdtemp(prefix="reliable-bench-")
    child, port = start_server(store, args, data)
    endpoint = client_endpoint(reactor, "127.0.0.1", port)
    out = {}

    class Resumer(Protocol):
        """Raw client: read `upto` messages, then hand back the time of the first one."""

        def __init__(self, first_line, upto):
            self.first_line, self.upto = first_line, upto
            self.decoder = codec.LineDecoder()
            self.got = defer.Deferred()
            self.last_id = 0
            self.first_at = None

        def connectionMade(self):
            self.transport.write(self.first_line)

        def dataReceived(self, data):
            for line in self.decoder.feed(data):
                message = codec.parse_server_message(line, True)
                if self.first_at is None:
                    self.first_at = time.perf_counter()
                self.last_id = message.message_id
                if self.last_id >= self.upto and not self.got.called:
                    self.transport.abortConnection()
                    self.got.callback(self)
                    return

    @defer.inlineCallbacks
    def run(reactor):
        # throughput: N concurrent sessions, every value verified
        start = time.perf_counter()
        results = yield defer.gatherResults([
            StatefulClient(endpoint, args.count).run() for _ in range(args.sessions)])
        elapsed = time.perf_counter() - start
        total = sum(len(r.values) for r in results)
        out["rate"] = total / elapsed
        out["total"] = total
        out["elapsed"] = elapsed
        # resume: connect, take 1000 messages, drop, reconnect with state
        times = []
        for i in range(args.resume_runs):
            uuid = f"resume-{i}"
            opening = codec.encode_open(uuid, 60000)
            first = yield endpoint.connect(Factory.forProtocol(
                lambda line=opening: Resumer(line, 1000)))
            yield first.got
            t0 = time.perf_counter()
            resume, upto = codec.encode_resume(uuid, first.last_id), first.last_id + 1
            again = yield endpoint.connect(Factory.forProtocol(
                lambda line=resume, upto=upto: Resumer(line, upto)))
            yield again.got
            times.append(again.first_at - t0)
        out["resume_ms"] = statistics.median(times) * 1000
    try:
        task.react(run)
    except SystemExit as e:
        if e.code:
            raise
    finally:
        child.terminate()
        child.wait()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--count", type=int, default=500)
    p.add_argument("--resume-runs", type=int, default=10)
    p.add_argument("--stores", default="memory,sqlite")
    p.add_argument("--mt-module", default=None,
                   help="module with a C mt19937_first(seed) to use in the server")
    p.add_argument("--serve", choices=["memory", "sqlite"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.serve:
        return serve(args)
    results = {}
    for store in args.stores.split(","):
        # each measurement in its own process: react() cannot run twice
        command = [sys.executable, os.path.abspath(__file__), "--stores", "_one_" + store,
                   "--sessions", str(args.sessions), "--count", str(args.count),
                   "--resume-runs", str(args.resume_runs)]
        if args.mt_module:
            command += ["--mt-module", args.mt_module]
        if store.startswith("_one_"):
            print(json.dumps(measure(store[5:], args)))
            return
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[store] = json.loads(output.strip().splitlines()[-1])
        r = results[store]
        print(f"{store:>7}: {r['total']} messages in {r['elapsed']:.2f} s = "
              f"{r['rate']:,.0f} msg/s ({args.sessions} sessions x {args.count}); "
              f"resume after reconnect: {r['resume_ms']:.2f} ms (median of {args.resume_runs})")
    if "memory" in results and "sqlite" in results:
        print(f"durable/memory throughput ratio: "
              f"{results['sqlite']['rate'] / results['memory']['rate']:.2f}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
