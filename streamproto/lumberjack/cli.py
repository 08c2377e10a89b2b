"""
C{streamproto lumberjack send}: send JSON lines (one event a line) from a
file or stdin to a Lumberjack server, with a progress line on a terminal.

    streamproto lumberjack send --server logs.example:5044 events.jsonl
    streamproto lumberjack send -s logs-1,logs-2 --loadbalance events.jsonl
    tail -F app.log.json | streamproto lumberjack send -s logs.example --ca ca.pem \\
        --cert client.pem --key client.key -

The common options (C{-s/--server}, TLS, C{-f}, C{-v}/C{-q}, C{-t}) are
those of every streamproto command: L{streamproto.core.cli}, doc/cli.rst.
Several servers are tried one at a time (failover), or with
C{--loadbalance} all used at once, as Filebeat's C{loadbalance} option:
L{streamproto.lumberjack.client}.
"""

import argparse
import sys

from twisted.internet import defer, task
from twisted.logger import LogLevel, formatEvent, globalLogPublisher

from streamproto.core import cli as common
from streamproto.core.progress import Progress
from streamproto.lumberjack.client import LoadBalancingLumberjackClient, LumberjackClient
from streamproto.lumberjack.codec import ProtocolError, validate_json

PROG = "streamproto lumberjack"
CONVENTION = common.Convention(
    PROG, "127.0.0.1:5044", timeout=60.0,
    timeout_help="seconds without any acknowledged event (a refused port, a TLS setting "
                 "the server refuses) before the command gives up with an error",
    renamed={"--give-up": "-t/--timeout"})


def build_parser():
    parser = CONVENTION.parser("Send JSON lines to a Lumberjack (Beats) server.")
    commands = parser.add_subparsers(dest="command", required=True)
    send = commands.add_parser(
        "send", parents=[CONVENTION.common()], help="send JSON lines as events",
        description="Send JSON lines (one event a line) from FILE or stdin; lines that are "
                    "not JSON are skipped and make the exit status 1.")
    send.add_argument("file", nargs="?", default="-", metavar="FILE",
                      help="file of JSON lines ('-' or none: stdin)")
    send.add_argument("-b", "--batch", type=common.positive_int, default=2048,
                      help="largest batch (bulk_max_size); default 2048")
    send.add_argument("-z", "--compression", type=int, choices=range(10), default=3,
                      metavar="0..9", help="zlib level, 0 for none; default 3")
    send.add_argument("--pipelining", type=common.positive_int, default=2,
                      help="batches in flight; default 2")
    send.add_argument("--ack-timeout", type=common.seconds, default=30.0,
                      help="seconds to wait for a batch's acknowledgement before sending it "
                           "again on a new connection; default 30")
    send.add_argument("--loadbalance", action="store_true", default=False,
                      help="with several servers (-s h1,h2): a connection to each, batches "
                           "spread over them, a failed batch sent again on another "
                           "(Filebeat's loadbalance: true); default: one at a time, the "
                           "next when it fails")
    send.add_argument("--worker", type=common.positive_int, default=None, metavar="N",
                      help="with --loadbalance: connections per server (Filebeat's "
                           "worker); default 1")
    # the previous release's name of -t/--timeout
    send.add_argument("--give-up", dest="timeout", type=common.seconds,
                      default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    # for the usage errors parse_args finds itself
    parser.send_parser = send
    return parser


def parse_args(argv, stderr=None):
    """The parsed and resolved arguments; SystemExit(2) on a usage error."""
    parser = build_parser()
    args = CONVENTION.parse(parser, argv, stderr)
    if args.command == "send":
        if args.worker is not None and not args.loadbalance:
            parser.send_parser.error("--worker needs --loadbalance")
        if args.worker is None:
            args.worker = 1
    return args


def make_client(reactor, args):
    """The client C{args} ask for: one connection at a time, or load-balancing."""
    options = dict(clock=reactor, bulk_max_size=args.batch,
                   compression_level=args.compression, pipelining=args.pipelining,
                   timeout=args.ack_timeout)
    if args.loadbalance:
        endpoints, names = CONVENTION.endpoints(reactor, args)
        return LoadBalancingLumberjackClient(endpoints, names=names, workers=args.worker,
                                             **options)
    return LumberjackClient(CONVENTION.endpoint(reactor, args), **options)


def read_events(stream, chunk, errors):
    """Lists of up to C{chunk} valid JSON lines (bytes); bad lines go to C{errors}."""
    events = []
    for number, line in enumerate(stream, 1):
        line = line.strip()
        if not line:
            continue
        try:
            validate_json(line)
        except ProtocolError:
            errors.write(f"line {number}: not a JSON document, skipped\n")
            errors.skipped += 1
            continue
        events.append(line)
        if len(events) >= chunk:
            yield events
            events = []
    if events:
        yield events


class GaveUp(common.CommandError):
    """Nothing was acknowledged for C{--timeout} seconds."""


def _client_warnings(client, last):
    """
    A log observer keeping C{client}'s last warning (cannot connect, TLS
    refused, no ack) in C{last["warning"]}, for the give-up message; the
    warnings themselves reach stderr through L{Convention.log_to}: the
    client retries for ever, and without them a wrong address or TLS
    setting would look like a silent hang.
    """
    def observer(event):
        if (event.get("log_source") is client
                and event.get("log_level", LogLevel.info) >= LogLevel.warn):
            last["warning"] = formatEvent(event).removeprefix(
                "lumberjack client: ").removesuffix("; reconnecting")
    return observer


class _Errors:
    def __init__(self, stream):
        self.stream = stream
        self.skipped = 0

    def write(self, text):
        self.stream.write(text)


@defer.inlineCallbacks
def send(reactor, args, stream, out=None, err=None):
    """
    Send every line of C{stream} with the options in C{args} (from
    L{parse_args}); returns (sent, skipped).  Fails with L{GaveUp} when
    nothing is acknowledged for C{args.timeout} seconds.
    """
    out = out or sys.stdout
    err = _Errors(err or sys.stderr)
    client = make_client(reactor, args)
    progress = Progress("lumberjack send", stream=err.stream)
    if args.verbosity <= 0:
        progress.enabled = False
    counts = {"acked": 0, "bytes": 0}
    in_flight = []
    # keep a few batches' worth queued ahead, not the whole file: enough to
    # fill every connection's pipeline
    chunk = args.batch
    ahead = max(2, args.pipelining) * 2 * len(client.senders)

    def acked(n, nbytes):
        counts["acked"] += n
        counts["bytes"] += nbytes
        progress.update(counts["acked"], counts["bytes"])
        return n

    last = {"warning": None}
    warnings = _client_warnings(client, last)
    globalLogPublisher.addObserver(warnings)
    shown = CONVENTION.log_to(args, err.stream)
    gave_up = []
    watchdog = None
    if args.timeout:
        progress_seen = {"acked": -1, "at": reactor.seconds()}

        def watch():
            # the client retries for ever (a service would); a command gives up
            if client.events_acked != progress_seen["acked"] or not client.pending:
                progress_seen.update(acked=client.events_acked, at=reactor.seconds())
            elif reactor.seconds() - progress_seen["at"] >= args.timeout:
                gave_up.append(last["warning"] or "no acknowledgement")
                watchdog.stop()
                client.close()
        watchdog = task.LoopingCall(watch)
        watchdog.clock = reactor
        watchdog.start(min(1.0, args.timeout / 4), now=False)
    try:
        for events in read_events(stream, chunk, err):
            nbytes = sum(map(len, events))
            d = client.send(events)
            d.addCallback(acked, nbytes)
            in_flight.append(d)
            if len(in_flight) >= ahead:
                yield in_flight.pop(0)
        for d in in_flight:
            yield d
    except Exception:
        if gave_up:
            servers = ",".join(s.address for s in args.servers)
            raise GaveUp(f"nothing acknowledged by {servers} in "
                         f"{args.timeout:g} s; giving up (last: {gave_up[0]})") from None
        raise
    finally:
        if watchdog is not None and watchdog.running:
            watchdog.stop()
        globalLogPublisher.removeObserver(warnings)
        shown()
        yield client.close()
    progress.finish()
    skipped = f", skipped {err.skipped} bad lines" if err.skipped else ""
    common.emit(args, out, f"sent {counts['acked']} events{skipped}",
                {"sent": counts["acked"], "skipped": err.skipped})
    return counts["acked"], err.skipped


def main(argv):
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code

    @defer.inlineCallbacks
    def go(reactor):
        if args.file == "-":
            stream = sys.stdin.buffer
        else:
            try:
                stream = open(args.file, "rb")
            except OSError as e:
                raise common.CommandError(f"cannot read {args.file}: {e.strerror}") from None
        try:
            sent, skipped = yield send(reactor, args, stream)
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()
        return common.EXIT_FAILURE if skipped else common.EXIT_OK

    return CONVENTION.run(go)
