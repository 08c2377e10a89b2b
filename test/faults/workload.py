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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m test.faults.workload")
    parser.add_argument("protocol", choices=["styx"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--log", default="faults")
    parser.add_argument("--history", required=True)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--tag", default="w", help="producer name prefix")
    args = parser.parse_args(argv)
    from twisted.internet import task
    task.react(lambda reactor: run_styx(reactor, args))


if __name__ == "__main__":
    sys.exit(main())
