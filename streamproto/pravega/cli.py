"""
C{streamproto pravega COMMAND}: segment admin, writing and reading.

    streamproto pravega create scope/stream/0.#epoch.0
    streamproto pravega info SEGMENT
    streamproto pravega seal SEGMENT
    streamproto pravega truncate SEGMENT OFFSET
    streamproto pravega delete SEGMENT
    streamproto pravega write SEGMENT < lines        # one event per line
    streamproto pravega read SEGMENT [--offset N] [--follow]

The common options (C{-s/--server}, TLS, C{-f}, C{-v}/C{-q}, C{-t}), before
or after the command, are those of every streamproto command:
L{streamproto.core.cli}, doc/cli.rst.
"""

import contextlib
import json
import sys

from twisted.internet import defer

from streamproto.core import cli as common
from streamproto.pravega import client

PROG = "streamproto pravega"
CONVENTION = common.Convention(PROG, "127.0.0.1:12345", timeout=30.0,
                               timeout_help="seconds to wait to connect to the server")


def parser():
    p = CONVENTION.parser("Pravega segment store client")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in [("create", "create a segment"), ("info", "show a segment"),
                        ("seal", "seal a segment"), ("delete", "delete a segment")]:
        sub.add_parser(name, help=help_).add_argument("segment")
    t = sub.add_parser("truncate", help="drop the bytes of a segment before OFFSET")
    t.add_argument("segment")
    t.add_argument("offset", type=int)
    w = sub.add_parser("write", help="append stdin lines (or --file) as events")
    w.add_argument("segment")
    w.add_argument("--file", help="read events from this file instead of stdin")
    w.add_argument("--batch", type=int, default=1000, help="events per batch")
    r = sub.add_parser("read", help="print the events of a segment, one per line")
    r.add_argument("segment")
    r.add_argument("--offset", type=int, default=0)
    r.add_argument("--follow", action="store_true", help="wait for new events at the tail")
    return CONVENTION.share(p)


def endpoint(reactor, args):
    return CONVENTION.endpoint(reactor, args)


@defer.inlineCallbacks
def run(reactor, argv, stdin=None, stdout=None, stderr=None):
    """Run one command; fire with the exit status."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr
    try:
        with contextlib.redirect_stderr(stderr):
            args = CONVENTION.parse(parser(), argv, stderr)
    except SystemExit as e:
        return e.code
    ep = endpoint(reactor, args)
    stop = CONVENTION.log_to(args, stderr)
    try:
        if args.command == "write":
            status = yield _write(ep, args, stdin, stdout)
        elif args.command == "read":
            status = yield _read(ep, args, stdout)
        else:
            status = yield _admin(ep, args, stdout)
    except client.PravegaError as e:
        return CONVENTION.report(common.CommandError(
            f"{args.command}: {type(e.reply).__name__}: {getattr(e.reply, 'segment', '')}"),
            stderr)
    except Exception as e:  # noqa: BLE001 - one line, the convention's
        return CONVENTION.report(common.CommandError(f"{args.command}: "
                                                     f"{common.error_text(e)}"), stderr)
    finally:
        stop()
    return status


@defer.inlineCallbacks
def _admin(ep, args, stdout):
    proto = yield client.connect(ep)
    try:
        if args.command == "create":
            yield proto.create_segment(args.segment)
            stdout.write(f"created {args.segment}\n".encode())
        elif args.command == "info":
            info = yield proto.segment_info(args.segment)
            fields = ("segment", "is_sealed", "start_offset", "write_offset", "last_modified")
            if args.format == "json":
                stdout.write(json.dumps({n: getattr(info, n) for n in fields}).encode() + b"\n")
            else:
                for name in fields:
                    stdout.write(f"{name}: {getattr(info, name)}\n".encode())
        elif args.command == "seal":
            yield proto.seal_segment(args.segment)
            stdout.write(f"sealed {args.segment}\n".encode())
        elif args.command == "truncate":
            yield proto.truncate_segment(args.segment, args.offset)
            stdout.write(f"truncated {args.segment} at {args.offset}\n".encode())
        elif args.command == "delete":
            yield proto.delete_segment(args.segment)
            stdout.write(f"deleted {args.segment}\n".encode())
    finally:
        proto.transport.loseConnection()
        yield proto.closed
    return 0


@defer.inlineCallbacks
def _write(ep, args, stdin, stdout):
    source = open(args.file, "rb") if args.file else stdin
    writer = client.SegmentWriter(ep, args.segment, max_retries=5)
    count = 0
    try:
        batch = []
        pending = []
        for line in source:
            batch.append(line.rstrip(b"\n"))
            if len(batch) >= args.batch:
                pending.append(writer.write_batch(batch))
                count += len(batch)
                batch = []
                if len(pending) >= 8:
                    yield pending.pop(0)
        if batch:
            pending.append(writer.write_batch(batch))
            count += len(batch)
        yield defer.gatherResults(pending, consumeErrors=True)
        yield writer.close()
    except defer.FirstError as e:
        yield writer.close().addErrback(lambda _: None)
        raise e.subFailure.value
    finally:
        if args.file:
            source.close()
    stdout.write(f"wrote {count} events to {args.segment}\n".encode())
    return 0


@defer.inlineCallbacks
def _read(ep, args, stdout):
    reader = client.SegmentReader(ep, args.segment, offset=args.offset)
    try:
        while True:
            if not args.follow:
                proto = yield reader._connection()
                info = yield proto.segment_info(args.segment)
                if reader.offset >= info.write_offset:
                    break
            events = yield reader.read()
            if not events:
                break
            stdout.write(b"".join(e + b"\n" for e in events))
    finally:
        yield reader.close()
    return 0


def main(argv):
    return CONVENTION.run(lambda reactor: run(reactor, argv))
