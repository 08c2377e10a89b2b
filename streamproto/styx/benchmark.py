"""
C{streamproto styx benchmark}: the reference's C{styx benchmark}, over
styx/0 with durable acks.

For each record size it creates the log C{benchmark}, produces C{count}
records through a L{StyxProducer} (timed until the final ack: every record
is fsynced), deletes the log; then for each size it fills the log and times
a L{StyxConsumer} reading it all back.  It prints records/s and MB/s like
the reference.
"""

import sys
import time

from streamproto.core import cli as common
from streamproto.styx.api_client import StyxAPIError, StyxClient
from streamproto.styx.stream_client import StyxConsumer, StyxProducer

CONVENTION = common.Convention("streamproto styx benchmark", "http://localhost:7123",
                               formats=False)

#: (record size, count): the reference's sizes with 1/100 of its counts.
DEFAULT_RUNS = ((10, 1000000), (100, 1000000), (1000, 100000))
#: Records per writeMany call.
BATCH_RECORDS = 4096

LOGO = r"""             __
     _______/  |_ ___.__.___  ___
    /  ___/\   __<   |  |\  \/  /
    \___ \  |  |  \___  | >    <
   /____  > |__|  / ____|/__/\_ \  BENCHMARK (streamproto)
        \/        \/           \/
"""


def _rates(records, nbytes, elapsed):
    elapsed = max(elapsed, 1e-9)
    return records / elapsed, nbytes / elapsed / (1 << 20)


def display(out, prefix, records, nbytes, elapsed):
    rate, mbps = _rates(records, nbytes, elapsed)
    out.write(f"  {prefix} {records} records in {elapsed:.2f} seconds "
              f"({rate:.2f} records/s, {mbps:.2f} MB/s)\n")


def payloads(size, mixed=False):
    """C{BATCH_RECORDS} records of C{size} bytes, or (mixed) of sizes spread
    over [size/2, 3 size/2] averaging C{size}."""
    if not mixed:
        return [bytes(size)] * BATCH_RECORDS
    low = size // 2
    return [bytes(low + (i * 7919) % (size + 1)) for i in range(BATCH_RECORDS)]


async def produce(reactor, url, name, size, count, tls=None, window_bytes=None, mixed=False):
    """Produce C{count} records of C{size} bytes; return seconds until the
    final ack."""
    kwargs = {"window_bytes": window_bytes} if window_bytes else {}
    producer = await StyxProducer.connect_url(reactor, url, name, tls, **kwargs)
    batch = payloads(size, mixed)
    # like the reference, timed from the moment the stream is open
    remaining = count
    start = time.perf_counter()
    while remaining > 0:
        if not producer.writable:
            await producer.whenWritable()
        n = min(remaining, BATCH_RECORDS)
        producer.writeMany(batch if n == BATCH_RECORDS else batch[:n])
        remaining -= n
    final = await producer.close()
    elapsed = time.perf_counter() - start
    if final is None or final.count != count:
        raise RuntimeError(f"final ack {final} does not cover the {count} records")
    return elapsed


async def consume(reactor, url, name, count, tls=None):
    """Consume the whole log; return (records, bytes, seconds)."""
    received = [0, 0]

    def got(batch):
        # a RecordBatch: records are cut out of it only when used (like the
        # reference's Read, which hands out slices of its buffer)
        received[0] += len(batch)
        received[1] += batch.nbytes

    consumer = await StyxConsumer.connect_url(reactor, url, name, got, tls=tls,
                                              whence="start", batches=True)
    # like the reference, timed from the moment the stream is open
    start = time.perf_counter()
    total = await consumer.done
    elapsed = time.perf_counter() - start
    if total != count:
        raise RuntimeError(f"consumed {total} records, expected {count}")
    return received[0], received[1], elapsed


async def _fresh_log(client, name):
    try:
        await client.delete_log(name)
    except StyxAPIError as e:
        if e.code != "log_not_found":
            raise
    await client.create_log(name)


async def run(reactor, args, out):
    url = args.server.url()
    tls = args.tls_options
    client = StyxClient(url, reactor, tls_options=tls)
    name = args.log
    results = []
    try:
        out.write(LOGO + "\n")
        for size, count in args.runs:
            if "produce" in args.only:
                out.write("-" * 80 + "\n")
                out.write(f"* benchmarking PRODUCE with {count} records of size {size}\n")
                await _fresh_log(client, name)
                out.write("  starting ...\n")
                elapsed = await produce(reactor, url, name, size, count, tls, args.window)
                display(out, "produced", count, count * size, elapsed)
                results.append(("produce", size, count, elapsed))
                await client.delete_log(name)
        for size, count in args.runs:
            if "consume" in args.only:
                out.write("-" * 80 + "\n")
                out.write(f"* benchmarking CONSUME with {count} records of size {size}\n")
                out.write("  preparing log ...\n")
                await _fresh_log(client, name)
                await produce(reactor, url, name, size, count, tls, args.window)
                out.write("  starting ...\n")
                records, nbytes, elapsed = await consume(reactor, url, name, count, tls)
                display(out, "consumed", records, nbytes, elapsed)
                results.append(("consume", size, count, elapsed))
                await client.delete_log(name)
    finally:
        await client.close()
    return results


def _runs(text):
    runs = []
    for item in text.split(","):
        size, _, count = item.partition("x")
        runs.append((int(size), int(count)))
    return tuple(runs)


def build_parser():
    parser = CONVENTION.parser("Run the styx/0 produce/consume benchmark.")
    parser.add_argument("--runs", type=_runs, default=DEFAULT_RUNS,
                        help="SIZExCOUNT,... (default 10x1000000,100x1000000,1000x100000)")
    parser.add_argument("--only", choices=("produce", "consume"), action="append",
                        help="run only this half (repeatable)")
    parser.add_argument("--log", default="benchmark", help="log name (default benchmark)")
    parser.add_argument("--window", type=int, default=None,
                        help="producer in-flight window in bytes")
    return parser


def main(argv=None, out=None):
    try:
        args = CONVENTION.parse(build_parser(), sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code
    args.only = tuple(args.only or ("produce", "consume"))
    out = out or sys.stdout

    async def go(reactor):
        await run(reactor, args, out)
        return common.EXIT_OK
    return CONVENTION.run(go)
