"""
Styx HTTP API throughput: produce (binary-records batches) and consume (one
streamed response, binary and line-delimited) against the log store used
directly as the baseline, server and client in this one process.

    python bench/styx_http_bench.py [--records N] [--size B] [--batch K] [--file]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet import defer, task  # noqa: E402
from twisted.web.client import HTTPConnectionPool  # noqa: E402

from streamproto.log import MemoryLogStore, open_store  # noqa: E402
from streamproto.styx import formats  # noqa: E402
from streamproto.styx.api_client import StyxClient  # noqa: E402
from streamproto.styx.resource import make_site  # noqa: E402


def line(label, n, size, seconds, baseline=None):
    rate = n / seconds
    text = f"{label:<44} {rate:>12,.0f} rec/s {rate * size / 1e6:>8.1f} MB/s"
    if baseline:
        text += f"   x{rate / baseline:.2f} of the direct store"
    print(text, flush=True)
    return rate


@defer.inlineCallbacks
def run(reactor, args):
    tmp = tempfile.mkdtemp(prefix="styx-http-bench-") if args.file else None
    store = open_store(tmp, reactor=reactor) if tmp else MemoryLogStore(reactor)
    port = reactor.listenTCP(0, make_site(store, max_body_size=1 << 30), interface="127.0.0.1")
    pool = HTTPConnectionPool(reactor, persistent=True)
    client = StyxClient(f"http://127.0.0.1:{port.getHost().port}", reactor, pool=pool)
    n, size, batch = args.records, args.size, args.batch
    records = [b"x" * size] * batch
    print(f"{n:,} records of {size} B, {batch:,} per produce request, "
          f"{'file' if tmp else 'memory'} store (shared machine: rough figures)")
    try:
        # baseline: the store's own append/read, no HTTP
        direct = yield store.create("direct")
        t = time.perf_counter()
        for _ in range(n // batch):
            yield direct.append(records)
        base_produce = line("direct store append", n, size, time.perf_counter() - t)
        t = time.perf_counter()
        position = 0
        while position < direct.end_position:
            b = yield direct.read(position, max_bytes=256 * 1024)
            position = b.next_position
        base_consume = line("direct store read (256 KiB batches)", n, size,
                            time.perf_counter() - t)

        yield client.create_log("bench")
        t = time.perf_counter()
        for _ in range(n // batch):
            yield client.write_records("bench", records)
        line("HTTP produce, binary-records", n, size, time.perf_counter() - t, base_produce)
        for label, fmt in (("HTTP consume, binary-records", formats.BINARY),
                           ("HTTP consume, line-delimited lf", formats.lines())):
            t = time.perf_counter()
            got = yield client.read_records("bench", fmt=fmt, on_records=lambda r: None)
            assert got == n // batch * batch, got
            line(label, n, size, time.perf_counter() - t, base_consume)
    finally:
        yield pool.closeCachedConnections()
        yield port.stopListening()
        yield store.close()
        if tmp:
            shutil.rmtree(tmp, True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--file", action="store_true", help="file store in a temp dir")
    args = parser.parse_args()
    task.react(run, [args])


if __name__ == "__main__":
    main()
