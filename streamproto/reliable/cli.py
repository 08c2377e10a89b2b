"""
C{streamproto reliable client}: fetch a stream and verify it.

    streamproto reliable client --count 1000 --server 127.0.0.1:7341
    streamproto reliable client --mode stateless --count 20 --print
    streamproto reliable client -s localhost:7342 --ca ca.pem --cert c.pem --key k.pem

The common options (C{-s/--server}, TLS, C{-f}, C{-v}/C{-q}, C{-n},
C{-t}) are those of every streamproto command: L{streamproto.core.cli},
doc/cli.rst.
"""

import argparse
import sys

from streamproto.core import cli as common
from streamproto.reliable.client import (
    DEFAULT_ACK_EVERY,
    DEFAULT_GIVE_UP_AFTER,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_RETRY_DELAY,
    StatefulClient,
    StatelessClient,
)

PROG = "streamproto reliable"
CONVENTION = common.Convention(
    PROG, "127.0.0.1:7341", timeout=DEFAULT_GIVE_UP_AFTER,
    timeout_help="seconds without a connection, or without a message on it, before "
                 "giving up",
    renamed={"--give-up-after": "-t/--timeout"})


def build_parser():
    parser = CONVENTION.parser("A reliable-stream client: fetch a stream and verify it.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("client", parents=[CONVENTION.common()],
                            help="fetch a stream and verify it",
                            description="Fetch a stream and verify it (stateful: every id "
                                        "once and the CRC; stateless: the doubling values).")
    p.add_argument("-n", "--count", type=common.positive_int, default=100,
                   help="messages to receive (stateful: 1..65535); default 100")
    p.add_argument("-m", "--mode", choices=("stateful", "stateless"), default="stateful",
                   help="default stateful")
    p.add_argument("--uuid", help="session UUID (stateful; default: random)")
    p.add_argument("--ack-every", type=int, default=DEFAULT_ACK_EVERY,
                   help=f"ack every Nth message id (0: never); default {DEFAULT_ACK_EVERY}")
    p.add_argument("--retry-delay", type=common.seconds, default=DEFAULT_RETRY_DELAY,
                   help="seconds to wait after a failed connect (at least 5); default "
                        f"{DEFAULT_RETRY_DELAY:g}")
    p.add_argument("--backoff", type=float, default=1.0,
                   help="multiply the retry delay by this after each failure; default 1")
    p.add_argument("--print", action="store_true", help="print every value received")
    # the previous release's name of -t/--timeout
    p.add_argument("--give-up-after", dest="timeout", type=common.seconds,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def parse_args(argv, stderr=None):
    """The parsed and resolved arguments; SystemExit(2) on a usage error."""
    parser = build_parser()
    args = CONVENTION.parse(parser, argv, stderr)
    if args.mode == "stateful" and not 1 <= args.count <= 0xFFFF:
        parser.error("--count must be in 1..65535 in stateful mode")
    if args.retry_delay < DEFAULT_RETRY_DELAY:
        parser.error("--retry-delay must be at least 5 seconds")
    if not args.backoff >= 1:
        parser.error("--backoff must be at least 1")
    return args


def _run(reactor, args, out):
    """Fetch and verify; fire with the exit status (errors raise)."""
    endpoint = CONVENTION.endpoint(reactor, args)
    common_args = dict(clock=reactor, retry_delay=args.retry_delay, backoff=args.backoff,
                       give_up_after=args.timeout or float("inf"))
    if args.timeout:
        # a stopped server keeps the connection up and says nothing: dropped
        # after -t/--timeout of silence, which the give-up clock counts too
        common_args["idle_timeout"] = min(args.timeout, DEFAULT_IDLE_TIMEOUT)
    if args.mode == "stateful":
        client = StatefulClient(endpoint, args.count, uuid=args.uuid,
                                ack_every=args.ack_every, **common_args)
    else:
        # values double: keep them all only to print them
        client = StatelessClient(endpoint, args.count, keep=args.print, **common_args)

    def report(result):
        values = list(result.values) if args.print else None
        if values is not None and args.format == "text":
            for value in values:
                out.write(f"{value}\n")
        line = f"received {args.count} messages, {result.reconnects} reconnects"
        if result.crc is not None:
            line += f", CRC {result.crc} verified (uuid {result.uuid})"
        data = {"received": args.count, "reconnects": result.reconnects, "crc": result.crc,
                "uuid": result.uuid}
        if values is not None:
            data["values"] = values
        common.emit(args, out, line, data)
        return common.EXIT_OK

    return client.run().addCallback(report)


def main(argv, out=None):
    out = out or sys.stdout
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code

    def go(reactor):
        stop = CONVENTION.log_to(args)
        return _run(reactor, args, out).addBoth(lambda r: (stop(), r)[1])
    return CONVENTION.run(go)
