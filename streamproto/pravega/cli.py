"""
C{streamproto pravega COMMAND}: segment admin, writing and reading.

    streamproto pravega create scope/stream/0.#epoch.0
    streamproto pravega info SEGMENT
    streamproto pravega seal SEGMENT
    streamproto pravega truncate SEGMENT OFFSET
    streamproto pravega delete SEGMENT
    streamproto pravega write SEGMENT < lines        # one event per line
    streamproto pravega read SEGMENT [--offset N] [--follow]

Connection options (before the command): --host, --port, --tls with
--ca-certs / --cert / --key.
"""

import argparse
import contextlib
import sys

from twisted.internet import defer
from twisted.internet.task import react

from streamproto.core.tls import client_endpoint, client_tls_options
from streamproto.pravega import client


def parser():
    p = argparse.ArgumentParser(prog="streamproto pravega",
                                description="Pravega segment store client")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=12345)
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--ca-certs", help="PEM CA certificates to verify the server")
    p.add_argument("--cert", help="PEM client certificate")
    p.add_argument("--key", help="PEM client private key")
    p.add_argument("--server-name", default=None,
                   help="name to verify in the server certificate (default: --host)")
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
    return p


def endpoint(reactor, args):
    tls = None
    if args.tls or args.ca_certs or args.cert:
        tls = client_tls_options(args.server_name or args.host, ca_certs=args.ca_certs,
                                 cert=args.cert, private_key=args.key)
    return client_endpoint(reactor, args.host, args.port, tls)


@defer.inlineCallbacks
def run(reactor, argv, stdin=None, stdout=None, stderr=None):
    """Run one command; fire with the exit status."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser().parse_args(argv)
    except SystemExit as e:
        return e.code
    ep = endpoint(reactor, args)
    try:
        if args.command == "write":
            status = yield _write(ep, args, stdin, stdout)
        elif args.command == "read":
            status = yield _read(ep, args, stdout)
        else:
            status = yield _admin(ep, args, stdout)
    except client.PravegaError as e:
        stderr.write(f"streamproto pravega {args.command}: {type(e.reply).__name__}: "
                     f"{getattr(e.reply, 'segment', '')}\n")
        return 1
    except Exception as e:
        stderr.write(f"streamproto pravega {args.command}: {e}\n")
        return 1
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
            for name in ("segment", "is_sealed", "start_offset", "write_offset",
                         "last_modified"):
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
    status = []

    def go(reactor):
        return run(reactor, argv).addCallback(status.append)

    try:
        react(go)
    except SystemExit as e:
        if e.code:
            return e.code
    return status[0] if status else 1
