"""
The fault matrix: fault class x store x protocol, each run seeded, judged
by the independent checker, summed into the table of doc/reliability.rst.

    python -m test.faults.run --minutes N [--seed S] [--only kill9,powerloss]

One run (L{run_one}): set the target up (a real server on a lazy FS), start
the workload process, let the nemesis inject faults of one class for the
run's length, wait for the workload to end, heal, read the final state back
by another path, and check the history against it.  A progress line per run
goes to stderr; the table (reStructuredText) to stdout at the end, with the
command that reproduces each row.  A fault class a target cannot take here
is a row that says why.
"""

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

from twisted.internet import defer, task

from test.faults import checker, nemesis
from test.faults.workload import TX_PARTS, read_history

#: the promise of each protocol's workload (see L{test.faults.workload})
PROMISES = {"styx": checker.Promise(at_most_once=True, order="realtime"),
            # styx/0: nothing resent after a lost connection
            "styx0": checker.Promise(at_most_once=True, order="realtime"),
            # at least once (resent after a reconnection), one connection's order
            "lumberjack": checker.Promise(at_most_once=False, order="realtime"),
            "relink": checker.Promise(at_most_once=False, order="realtime"),
            # writer ids and event numbers: at most once, in order
            "pravega": checker.Promise(at_most_once=True, order="realtime"),
            # conditional appends: the same, and a refused one never stored
            "pravega-conditional": checker.Promise(at_most_once=True, order="realtime"),
            # exactly once, each transaction whole
            "relink-tx": checker.Promise(at_most_once=True, order="realtime",
                                         parts=TX_PARTS),
            # session ids and message ids: at most once, in order
            "reliable": checker.Promise(at_most_once=True, order="realtime")}

# the reference clients (test.faults.refworkloads): the official Pravega
# client resends with its writer id and event numbers, deduplicated by the
# segment store ("exactly once" across its retries, its documentation
# says): at most once, in order; its transactions: each whole, at most
# once; pylogbeat never resends: at least once is all Lumberjack promises
REF_PROTOCOLS = ("pravega-official", "pravega-official-tx", "lumberjack-pylogbeat")
PROMISES.update({
    "pravega-official": checker.Promise(at_most_once=True, order="realtime"),
    "pravega-official-tx": checker.Promise(at_most_once=True, order="realtime",
                                           parts=TX_PARTS),
    "lumberjack-pylogbeat": checker.Promise(at_most_once=False, order="realtime")})

#: the rows of the matrix: (fault class, store, protocol)
MATRIX = ([(fault, "file", "styx") for fault in ("kill9", "powerloss", "pause", "clock",
                                                   "partition")]
          + [(fault, "nats", "styx") for fault in ("kill9", "powerloss", "pause")]
          # the network (namespaces) and the front-end's clock, on JetStream with
          # sync_interval: always ("nats") and with nats-server's default ("nats-lazy")
          + [(fault, store, "styx") for store in ("nats", "nats-lazy")
             for fault in ("partition", "flap", "clock")]
          # what nats-server's default sync_interval risks: a power cut
          + [("powerloss", "nats-lazy", "styx")]
          # a node's clock: a row that says why it cannot be jumped here
          + [("nodeclock", "nats", "styx")]
          # Styx over styx/0 (the Go reference's streaming protocol)
          + [(fault, store, "styx0") for store, faults in (
              ("file", ("kill9", "powerloss", "pause", "clock")),
              ("nats", ("kill9", "powerloss", "pause", "partition", "clock")))
             for fault in faults]
          # Pravega's conditional appends, racing producers
          + [(fault, store, "pravega-conditional") for store, faults in (
              ("file", ("kill9", "powerloss", "pause", "clock")),
              ("nats", ("kill9", "powerloss", "pause", "partition"))) for fault in faults]
          # the other protocols' workloads on the file store
          + [(fault, "file", protocol) for protocol in ("lumberjack", "pravega", "relink",
                                                    "relink-tx", "reliable")
             for fault in ("kill9", "powerloss", "pause", "clock")]
          # and on JetStream, flapping links too, and the network's faults on
          # nats-server's default sync_interval as well
          + [(fault, store, protocol) for protocol in ("lumberjack", "pravega", "relink",
                                                   "relink-tx", "reliable")
             for store, faults in (("nats", ("kill9", "powerloss", "pause", "partition",
                                             "flap", "clock")),
                                   ("nats-lazy", ("partition", "flap")))
             for fault in faults])

# the reference clients' workloads on the file store
MATRIX += [(fault, "file", protocol) for protocol in REF_PROTOCOLS
           for fault in ("kill9", "powerloss", "pause", "clock")]

#: each JetStream store of the matrix: its nodes' sync_interval (None: not
#: set, nats-server's default of 2 minutes)
SYNC_INTERVALS = {"nats": "always", "nats-lazy": None}


@dataclass
class Row:
    fault: str
    store: str
    protocol: str
    runs: int = 0
    seconds: float = 0.0
    acknowledged: int = 0
    unknown: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    corrupt: int = 0
    unavailability: float = 0.0
    faults: int = 0
    unavailable: str | None = None
    verdicts: list = field(default_factory=list)
    disk_verdicts: list = field(default_factory=list)
    disk_anomalies: int = 0
    disk_failures: int = 0
    errors: int = 0           # runs that could not finish (a server did not come back...)
    notes: list = field(default_factory=list)

    def add(self, verdict, seconds, injected):
        a = verdict.anomalies
        self.runs += 1
        self.seconds += seconds
        self.acknowledged += verdict.acknowledged
        self.unknown += verdict.unknown
        self.lost += a[checker.LOST]
        self.duplicated += a[checker.DUPLICATE]
        self.reordered += a[checker.REORDERED]
        self.corrupt += (a[checker.CORRUPT] + a[checker.PHANTOM] + a[checker.FAILED_PRESENT]
                         + a[checker.PARTIAL])
        self.unavailability = max(self.unavailability, verdict.longest_unavailability)
        self.faults += injected
        self.verdicts.append(verdict)

    def add_disk(self, verdict):
        """The verdict on the disk read directly: its anomalies count too."""
        self.disk_verdicts.append(verdict)
        a = verdict.anomalies
        self.disk_anomalies += sum(a[k] for k in checker.KINDS)

    @property
    def valid(self):
        return (self.unavailable is None and not self.disk_failures and not self.errors
                and all(v.valid for v in self.verdicts + self.disk_verdicts))


def make_target(reactor, fault, store, protocol):
    if (store, protocol) in [("file", p) for p in REF_PROTOCOLS]:
        from test.faults.reftargets import make_target as make_ref_target
        return make_ref_target(reactor, fault, protocol)
    if protocol == "pravega-conditional":
        # the Pravega target (server, segment, final read), another workload
        target = make_target(reactor, fault, store, "pravega")
        target.workload = ("test.faults.workload", protocol)
        return target
    if protocol in ("styx", "styx0"):
        target = _styx_target(reactor, fault, store)
        # the same server and final read; the workload over HTTP or styx/0
        target.protocol = protocol
        target.workload = ("test.faults.workload", protocol)
        return target
    if (store, protocol) == ("file", "reliable"):
        from test.faults.logtargets import ReliableFileTarget
        return ReliableFileTarget(reactor, clock=(fault == "clock"))
    if store == "file" and protocol in ("lumberjack", "pravega", "relink", "relink-tx"):
        from test.faults.logtargets import LogFileTarget
        return LogFileTarget(reactor, protocol, clock=(fault == "clock"))
    if store in SYNC_INTERVALS:
        from test.faults.jstargets import nats_target
        return nats_target(reactor, fault, protocol, SYNC_INTERVALS[store])
    raise ValueError(f"no target for {protocol} on {store}")


def _styx_target(reactor, fault, store):
    from test.faults.targets import StyxFileTarget, StyxNatsTarget
    if store == "file":
        return StyxFileTarget(reactor, clock=(fault == "clock"))
    sync = SYNC_INTERVALS[store]
    if fault in ("partition", "flap"):
        from test.faults.nstargets import StyxPartitionTarget
        return StyxPartitionTarget(reactor, sync_interval=sync)
    return StyxNatsTarget(reactor, clock=(fault == "clock"), sync_interval=sync)


@defer.inlineCallbacks
def run_one(reactor, fault, store, protocol, seconds, seed, row=None, lying_disk=False):
    """
    One seeded run of C{seconds} of faults of class C{fault}; adds it to
    C{row} (a new L{Row} without one) and fires with the row.

    @param lying_disk: the lazy FS ignores fsync from the start of the
        workload (the harness's own test: acks must then be lost).
    """
    row = row or Row(fault, store, protocol)
    rng = random.Random(f"{seed}:{fault}:{store}:{protocol}")
    target = make_target(reactor, fault, store, protocol)
    # every target keeps its data on a lazy FS, whatever the fault
    why = nemesis.FAULTS[fault].unavailable(target) or target.lazy_unavailable()
    if why is not None:
        row.unavailable = why
        yield target.teardown()
        return row
    history_path = tempfile.mktemp(prefix="faults-history-", suffix=".jsonl")
    _progress["history"] = history_path
    try:
        yield target.setup()
        if lying_disk:
            target.lazy.control("lie")
        started = time.monotonic()
        client_done = target.start_client(history_path, duration=seconds)
        # faults judge a system that has acknowledged something: on a
        # loaded machine the workload's first acknowledgement came after
        # the first fault (a power cut of two JetStream nodes 0.5 to 2 s
        # in), and a run with nothing acknowledged judges nothing (CI,
        # test_nats_lumberjack_power_loss, 2026-11-29)
        yield first_ack(reactor, history_path, client_done, seconds)
        waited = time.monotonic() - started
        nem = nemesis.Nemesis(reactor, rng, [nemesis.FAULTS[fault]], target,
                              max(seconds - waited, nemesis.Nemesis.MIN_DURATION))
        log = yield nem.run()
        yield client_done
        final = yield target.final_records(power_cut=(fault == "powerloss"))
        ended = time.monotonic()
        history = read_history(history_path)
        verdict = checker.check(history, final["served"], PROMISES[protocol], end=ended)
        row.add(verdict, ended - started, len(log))
        if not verdict.valid:
            row.notes.append(f"seed {seed}, served: {verdict.describe()}\n  faults: {log}")
            keep_evidence(target, history_path, row)
        if final["disk_error"] is not None:
            row.disk_failures += 1
        elif final["disk"] is not None:
            disk = checker.check(history, final["disk"], PROMISES[protocol], end=ended)
            row.add_disk(disk)
            if not disk.valid:
                row.notes.append(f"seed {seed}, disk: {disk.describe()}")
    except Exception as e:   # noqa: BLE001 - a run that cannot finish is a finding
        row.errors += 1
        row.notes.append(f"seed {seed}: the run failed: {e!r}")
    finally:
        yield target.teardown()
        row.notes += target.notes
        if os.path.exists(history_path):
            os.unlink(history_path)
    return row


@defer.inlineCallbacks
def first_ack(reactor, history_path, client_done, limit):
    """
    Wait until the history at C{history_path} holds an acknowledged
    operation, the client is done, or C{limit} seconds have passed.
    """
    deadline = time.monotonic() + limit
    while not client_done.called and time.monotonic() < deadline:
        try:
            with open(history_path) as f:
                if '"ev": "ok"' in f.read():
                    return
        except FileNotFoundError:
            pass    # the client has not started writing
        yield task.deferLater(reactor, 0.05, lambda: None)


def keep_evidence(target, history_path, row):
    """
    An invalid verdict: keep the run's history and the server's output
    (where the target has one) in a directory the row's notes name, for
    whoever looks into it.
    """
    keep = tempfile.mkdtemp(prefix="faults-invalid-")
    if os.path.exists(history_path):
        shutil.copy(history_path, os.path.join(keep, "history.jsonl"))
    server = getattr(target, "server", None)   # the reference targets have none
    if server is not None:
        with open(os.path.join(keep, "server.log"), "w") as f:
            f.write(server.output_text())
    row.notes.append(f"the history and the server's output are kept in {keep}")


def command(fault, store, protocol, minutes, seed, run_seconds=None):
    length = "" if run_seconds is None else f" --run-seconds {run_seconds:g}"
    return (f"python -m test.faults.run --only {fault} --store {store} "
            f"--protocol {protocol} --minutes {minutes:g}{length} --seed {seed}")


def table(rows, minutes, seed, run_seconds=None):
    """The results as a reStructuredText table, and each row's command."""
    head = ("fault", "store", "protocol", "runs", "errors", "faults", "acked", "unknown", "lost",
            "dup", "reordered", "corrupt", "disk", "longest unavail.")
    lines = []
    body = []
    for r in rows:
        if r.unavailable:
            body.append((r.fault, r.store, r.protocol, "--", "--", "--", "--", "--", "--", "--",
                         "--", "--", "--", "not run: " + r.unavailable))
        else:
            body.append((r.fault, r.store, r.protocol, str(r.runs), str(r.errors), str(r.faults),
                         f"{r.acknowledged:,}", f"{r.unknown:,}", str(r.lost),
                         str(r.duplicated), str(r.reordered), str(r.corrupt),
                         "--" if not (r.disk_verdicts or r.disk_failures) else
                         "ok" if not (r.disk_anomalies or r.disk_failures) else
                         f"{r.disk_anomalies + r.disk_failures} bad",
                         f"{r.unavailability:.1f} s"))
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    rule = "  ".join("=" * w for w in widths)
    lines += [rule, "  ".join(h.ljust(w) for h, w in zip(head, widths)), rule]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    lines += [rule, ""]
    for r in rows:
        lines.append(f"{r.fault}/{r.store}/{r.protocol}: "
                     f"{command(r.fault, r.store, r.protocol, minutes, seed, run_seconds)}")
        lines += ["  " + n for n in r.notes]
    return "\n".join(lines)


@defer.inlineCallbacks
def run_matrix(reactor, args):
    rows = [(f, s, p) for f, s, p in MATRIX
            if (not args.only or f in args.only) and (not args.store or s == args.store)
            and (not args.protocol or p == args.protocol)]
    budget = args.minutes * 60.0
    per_run = max(5.0, min(args.run_seconds, budget / max(1, len(rows))))
    deadline = time.monotonic() + budget
    results = {key: Row(*key) for key in rows}
    _progress.update(results=results, args=args)
    install_interrupt_handlers()
    # again once the reactor runs: it installs its own (SIGTERM) after
    # this first call
    reactor.callLater(0, install_interrupt_handlers)
    repetition = 0
    while True:
        for key in rows:
            row = results[key]
            if row.unavailable or (repetition and time.monotonic() + per_run > deadline):
                continue
            # a row's runs depend on its own key and repetition only, so
            # that --only reproduces them
            seed = f"{args.seed}.{repetition}"
            print(f"starting {'/'.join(key)} seed {seed}", file=sys.stderr, flush=True)
            yield run_one(reactor, *key, per_run, seed, row)
            status = ("UNAVAILABLE: " + row.unavailable if row.unavailable else
                      "ok" if row.valid else "ANOMALIES")
            print(f"[{time.monotonic() - deadline + budget:6.0f} s] {'/'.join(key)} "
                  f"seed {seed}: runs {row.runs}, acked {row.acknowledged}, lost {row.lost},"
                  f" dup {row.duplicated}, reordered {row.reordered}, corrupt {row.corrupt}"
                  f" -- {status}", file=sys.stderr, flush=True)
        repetition += 1
        if time.monotonic() + per_run > deadline or all(r.unavailable for r in results.values()):
            break
    print(table(list(results.values()), args.minutes, args.seed, args.run_seconds))
    if any(r.verdicts and not r.valid for r in results.values()):
        raise SystemExit(1)   # task.react exits with its code


#: the matrix under way, for the table of an interrupted run
_progress = {}


def living_children():
    """C{{pid: [child pids]}} of every living (not zombie) process."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _children():
    """The pids of this process's living children."""
    return living_children().get(os.getpid(), [])


def abort_targets():
    """
    End the live targets and delete the namespaces, synchronously (an
    interrupted run; a test's timeout, after which trial cancels the
    pending calls the teardown would have waited for).
    """
    from test.faults import netns, targets
    for step in [targets.abort_all] + [fabric.teardown for fabric in list(netns.LIVE)]:
        try:
            step()
        except Exception as e:   # noqa: BLE001 - clean up the rest all the same
            print(f"cleaning up: {e!r}", file=sys.stderr, flush=True)


def clean_up():
    """
    Synchronously end everything the runs started: the live targets
    (servers, nats-server nodes, workload clients killed, lazy FS
    unmounted), the network namespaces, and any child left (a node a
    thread was starting meanwhile).
    """
    abort_targets()
    for pid in _children():
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    history = _progress.get("history")
    if history and os.path.exists(history):
        os.unlink(history)


def _interrupted(signum, frame):
    name = signal.Signals(signum).name
    print(f"interrupted by {name}: killing the servers, unmounting, deleting the "
          "namespaces", file=sys.stderr, flush=True)
    try:
        clean_up()
    finally:
        results, args = _progress.get("results"), _progress.get("args")
        if results:
            print(f"(interrupted by {name}: the runs finished so far)")
            print(table(list(results.values()), args.minutes, args.seed, args.run_seconds))
        sys.stdout.flush()
        sys.stderr.flush()
        # threads may be blocked on the processes just killed: leave now
        os._exit(128 + signum)


def install_interrupt_handlers():
    """Ctrl-C and SIGTERM clean up and print the partial table (replacing the reactor's)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupted)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m test.faults.run",
                                     description="the fault matrix, judged by the checker")
    parser.add_argument("--minutes", type=float, default=5.0,
                        help="total time; the matrix is repeated with new seeds to fill it")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help=f"fault classes, of {','.join(nemesis.FAULTS)}")
    parser.add_argument("--store", default=None)
    parser.add_argument("--protocol", default=None)
    parser.add_argument("--run-seconds", type=float, default=20.0,
                        help="length of one run (at most)")
    args = parser.parse_args(argv)
    for name in args.only or ():
        if name not in nemesis.FAULTS:
            parser.error(f"unknown fault class {name!r}")
    task.react(run_matrix, [args])


if __name__ == "__main__":
    sys.exit(main())
