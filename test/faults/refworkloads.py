"""
Workloads of the reference clients: the official Pravega client (PyPI
C{pravega}, the Python bindings of the Rust client) and C{pylogbeat}
(a Lumberjack v2 client), each against our server, writing the same
history as L{test.faults.workload} (its L{HistoryWriter}, its arguments):

    python -m test.faults.refworkloads pravega-official|pravega-official-tx|
        lumberjack-pylogbeat --url ... --history H [--duration S ...]

An operation is C{ok} only when the client reported the acknowledgement
(the event's future resolved, the commit returned, C{send} returned);
anything else (a timeout, an exception) is C{unknown}: the client may
still carry it out later.  Neither client offers a definite refusal here,
so no operation is C{failed}.

C{pravega-official}: each producer an C{EventWriter} of its own (the
client gives it a writer id; it resends what was not acknowledged after a
reconnection with the same event numbers, which the segment store drops
when it has them: the client's documentation promises each event
"exactly once" across its internal retries), each event with the
producer's name as its routing key, one event at a time.  The Python
binding exposes no conditional append (event writers, transactions, byte
streams and readers only): none is used.

C{pravega-official-tx}: each producer a transactional writer; an
operation is a transaction of L{TX_PARTS} events (routing key: the
producer) and its commit, C{ok} when C{commit()} returned.  These calls
block (see below): they are not bounded by C{--timeout}.

C{lumberjack-pylogbeat}: each producer a C{PyLogBeatClient} (one
connection) sending windows of L{BATCH} events C{{"m": payload}}; each
event of a window is an operation, C{ok} when C{send} returned (every
event acknowledged).  pylogbeat never resends: after an error the
producer drops the connection and carries on with a new client and new
payloads.  A window is invoked once its client is connected, so that a
server away (restarting) costs no operations.

The binding's blocking calls (transactions; C{flush}) hold the GIL in the
Rust runtime's C{block_on}, so a call stuck on a paused server stalls the
whole process: the process bounds itself with C{faulthandler} (a C
thread, no GIL) and leaves with C{os._exit}, as the client's runtime
threads can crash the interpreter's own shutdown
(L{test.pravega.test_pravega_interop}).
"""

import asyncio
import faulthandler
import os
import sys
import threading
import time

from test.faults.checker import OK, UNKNOWN, encode, encode_part
from test.faults.workload import HistoryWriter, TX_PARTS, arguments, now
from test.support.pravega_binding import settle

#: events of one pylogbeat window
BATCH = 4

#: the scope and stream of the Pravega workloads (two segments)
SCOPE, STREAM, SEGMENTS = "faults", "stream", 2

#: seconds past its duration after which the workload process ends itself
HARD_STOP = 20.0


class LockedHistory(HistoryWriter):
    """A L{HistoryWriter} several threads write to (one whole line each)."""

    def __init__(self, path):
        super().__init__(path)
        self.lock = threading.Lock()

    def event(self, producer, seq, ev):
        with self.lock:
            super().event(producer, seq, ev)


def controller_uri(url):
    """The official client's controller URI from C{tcp://HOST:PORT}."""
    return "tcp://" + url.removeprefix("tcp://")


def create_stream(controller):
    """Create the workloads' scope and stream (idempotent); C{True} if made now."""
    import pravega_client
    manager = pravega_client.StreamManager(controller)
    manager.create_scope(SCOPE)
    return manager.create_stream(SCOPE, STREAM, SEGMENTS)


def run_pravega_official(args):
    """One C{EventWriter} per producer, one event at a time (see the module docstring)."""
    import pravega_client

    history = HistoryWriter(args.history)
    deadline = now() + args.duration
    manager = pravega_client.StreamManager(controller_uri(args.url))

    async def producer(name):
        writer = manager.create_writer(SCOPE, STREAM)
        seq = 0
        while now() < deadline:
            history.event(name, seq, "invoke")
            future = asyncio.ensure_future(writer.write_event_async(
                encode(name, seq, args.size).decode(), routing_key=name))
            # not cancelled on a timeout: the client goes on with the event
            # (unknown), and the binding completes its future regardless
            done, _ = await asyncio.wait({future}, timeout=args.timeout)
            await settle()
            outcome = OK if future in done and future.exception() is None else UNKNOWN
            history.event(name, seq, outcome)
            if outcome != OK:
                await asyncio.sleep(0.05)
            seq += 1

    async def main():
        await asyncio.gather(*[producer(f"{args.tag}{i}") for i in range(args.producers)])
    try:
        asyncio.run(main())
    finally:
        history.close()


def run_pravega_official_tx(args):
    """
    One transactional writer per producer; an operation is a transaction
    of L{TX_PARTS} events and its commit (blocking calls, a thread each).
    """
    import pravega_client

    history = LockedHistory(args.history)
    deadline = now() + args.duration
    manager = pravega_client.StreamManager(controller_uri(args.url))

    def producer(index, name):
        writer = None
        seq = 0
        while now() < deadline:
            history.event(name, seq, "invoke")
            try:
                if writer is None:
                    writer = manager.create_transaction_writer(SCOPE, STREAM, 1000 + index)
                txn = writer.begin_txn()
                for part in range(TX_PARTS):
                    txn.write_event_bytes(encode_part(name, seq, part, args.size),
                                          routing_key=name)
                txn.commit()
                outcome = OK
            except Exception:   # noqa: BLE001 - anything but a commit: unknown
                outcome = UNKNOWN
            history.event(name, seq, outcome)
            if outcome != OK:
                time.sleep(0.05)
            seq += 1

    _threads([lambda i=i: producer(i, f"{args.tag}{i}") for i in range(args.producers)])
    history.close()


def run_pylogbeat(args):
    """One C{PyLogBeatClient} per producer, windows of L{BATCH} events."""
    import pylogbeat

    history = LockedHistory(args.history)
    deadline = now() + args.duration
    host, port = args.url.removeprefix("tcp://").rsplit(":", 1)

    def producer(name):
        client = None
        seq = 0
        while now() < deadline:
            if client is None:
                # connected before the window is invoked: a server that is
                # away (restarting) costs no operations
                client = pylogbeat.PyLogBeatClient(host, int(port), timeout=args.timeout)
                try:
                    client.connect()
                except OSError:
                    client = None
                    time.sleep(0.05)
                    continue
            seqs = range(seq, seq + BATCH)
            for s in seqs:
                history.event(name, s, "invoke")
            try:
                client.send([{"m": encode(name, s, args.size).decode()} for s in seqs])
                outcome = OK
            except Exception:   # noqa: BLE001 - no acknowledgement: unknown
                outcome = UNKNOWN
                # its sequence numbers and socket are past saving
                client.close()
                client = None
            for s in seqs:
                history.event(name, s, outcome)
            if outcome != OK:
                time.sleep(0.05)
            seq += BATCH
        if client is not None:
            client.close()

    _threads([lambda i=i: producer(f"{args.tag}{i}") for i in range(args.producers)])
    history.close()


def _threads(targets):
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


WORKLOADS = {
    "pravega-official": run_pravega_official,
    "pravega-official-tx": run_pravega_official_tx,
    "lumberjack-pylogbeat": run_pylogbeat,
}


def main(argv=None):
    parser = arguments("python -m test.faults.refworkloads", [*WORKLOADS, "create"])
    args = parser.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "error")
    # a blocking client call can hold the GIL as long as the server is
    # away: end the process from a C thread if it outlives its duration
    faulthandler.dump_traceback_later(args.duration + HARD_STOP, exit=True)
    code = 0
    try:
        if args.protocol == "create":
            create_stream(controller_uri(args.url))
        else:
            WORKLOADS[args.protocol](args)
    except Exception:   # noqa: BLE001 - said, and the exit code says it
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # the client's runtime threads can crash the interpreter's shutdown
    os._exit(code)


if __name__ == "__main__":
    main()
