"""
C{streamproto pravega COMMAND}: segment admin, writing and reading.

    streamproto pravega create scope/stream/0.#epoch.0
    streamproto pravega info SEGMENT
    streamproto pravega seal SEGMENT
    streamproto pravega truncate SEGMENT OFFSET
    streamproto pravega delete SEGMENT
    streamproto pravega write SEGMENT < lines        # one event per line
    streamproto pravega read SEGMENT [--offset N] [--follow]
    streamproto pravega scope create|delete SCOPE | scope list
    streamproto pravega stream create SCOPE/STREAM [--segments N]
    streamproto pravega stream info|seal|delete SCOPE/STREAM | stream list SCOPE

Scopes and streams go through the gRPC controller (C{-c/--controller},
default the segment store's host, port 9090); segments straight to the
segment store (C{-s/--server}).

The common options (C{-s/--server}, TLS, C{-f}, C{-v}/C{-q}, C{-t}), before
or after the command, are those of every streamproto command:
L{streamproto.core.cli}, doc/cli.rst.
"""

import argparse
import contextlib
import json
import sys

from twisted.internet import defer, threads

from streamproto.core import cli as common
from streamproto.core.stall import Answers, unanswered
from streamproto.pravega import client
from streamproto.pravega.controller_client import ControllerError

PROG = "streamproto pravega"
CONVENTION = common.Convention(PROG, "127.0.0.1:12345", timeout=30.0,
                               timeout_help="seconds to wait for the server: to connect, "
                                            "and for an answer (write: an acknowledgement)")


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

    sc = sub.add_parser("scope", help="create, list or delete scopes (controller)")
    scopes = sc.add_subparsers(dest="action", required=True)
    for name, help_ in [("create", "create a scope"), ("delete", "delete an empty scope")]:
        scopes.add_parser(name, help=help_).add_argument("scope")
    scopes.add_parser("list", help="list the scopes")
    st = sub.add_parser("stream", help="create, list, show, seal or delete streams (controller)")
    streams = st.add_subparsers(dest="action", required=True)
    c = streams.add_parser("create", help="create a stream")
    c.add_argument("stream", metavar="SCOPE/STREAM")
    c.add_argument("--segments", type=common.positive_int, default=1,
                   help="fixed number of segments (default 1)")
    streams.add_parser("list", help="list the streams of a scope").add_argument("scope")
    for name, help_ in [("info", "a stream's configuration and current segments, with "
                                 "their lengths on the segment store"),
                        ("seal", "seal a stream (no more writes)"),
                        ("delete", "delete a sealed stream")]:
        streams.add_parser(name, help=help_).add_argument("stream", metavar="SCOPE/STREAM")
    for parser_ in (p, sc, st, *scopes.choices.values(), *streams.choices.values()):
        parser_.add_argument(
            "-c", "--controller", metavar="ADDRESS",
            default=argparse.SUPPRESS if parser_ is not p else None,
            help="[tls://]HOST[:PORT] of the gRPC controller (default: the server's host, "
                 f"port {CONTROLLER_PORT}; TLS with the same --ca/--cert/--key)")
    return CONVENTION.share(p)


CONTROLLER_PORT = 9090


def controller_client(args):
    """A L{ControllerClient} for C{-c/--controller} (TLS as the convention's options say)."""
    from streamproto.pravega.controller_client import ControllerClient
    server = args.server
    scheme, host, port = None, server.host, CONTROLLER_PORT
    if args.controller:
        try:
            scheme, host, port, _ = common.parse_address(args.controller)
        except ValueError as e:
            raise common.CommandError(f"bad controller address {args.controller!r}: {e}")
        host = host or server.host
        port = port or CONTROLLER_PORT
    tls = scheme in common.TLS_SCHEMES or (scheme is None and server.tls)
    files = None
    if tls:
        files = tuple(open(path, "rb").read() if path else None
                      for path in (args.ca, args.cert, args.key or args.cert))
        if files[1] is None:
            files = (files[0], None, None)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return ControllerClient(target, tls=files, server_name=args.server_name,
                            timeout=args.timeout or None)


def split_stream(text):
    scope, sep, stream = text.partition("/")
    if not sep or not scope or not stream or "/" in stream:
        raise common.CommandError(f"{text!r}: a stream is SCOPE/STREAM")
    return scope, stream


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
    moved = Answers(reactor)
    try:
        if args.command in ("scope", "stream"):
            status = yield _controller(ep, args, stdout)
        elif args.command == "write":
            status = yield _answered(reactor, args, _write(ep, args, stdin, stdout, moved),
                                     moved)
        elif args.command == "read":
            status = yield _answered(reactor, args, _read(ep, args, stdout, moved), moved)
        else:
            status = yield _answered(reactor, args, _admin(ep, args, stdout), moved)
    except common.CommandError as e:
        return CONVENTION.report(common.CommandError(f"{args.command} {args.action}: {e}")
                                 if getattr(args, "action", None) else e, stderr)
    except ControllerError as e:
        return CONVENTION.report(common.CommandError(f"{args.command} {args.action}: {e}"),
                                 stderr)
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


def _answered(reactor, args, d, answers):
    """
    A segment command C{d}, given up after C{-t/--timeout} seconds in which
    the server answered nothing: a stopped server keeps the connection up
    and the client waiting for ever.  A follower (C{read -F}) waits as asked.
    """
    if getattr(args, "follow", False):
        return d
    what = {"write": "acknowledged", "read": "read"}.get(args.command)
    return unanswered(reactor, d, args.timeout, args.server.address, "-t/--timeout", answers,
                      lambda: f" ({answers.count} events {what})" if what else "")


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
def _controller(ep, args, stdout):
    """The scope and stream commands: the controller in a thread (grpcio blocks)."""
    controller = controller_client(args)
    try:
        call = threads.deferToThread
        if args.command == "scope":
            if args.action == "list":
                scopes = yield call(controller.list_scopes)
                _emit(args, stdout, "".join(f"{s}\n" for s in scopes), scopes)
            else:
                method = {"create": controller.create_scope,
                          "delete": controller.delete_scope}[args.action]
                yield call(method, args.scope)
                _emit(args, stdout, f"{args.action}d scope {args.scope}\n",
                            {"scope": args.scope, "status": f"{args.action}d"})
        elif args.action == "list":
            streams = yield call(controller.list_streams, args.scope)
            _emit(args, stdout, "".join(f"{args.scope}/{s}\n" for s in streams),
                        [f"{args.scope}/{s}" for s in streams])
        elif args.action == "info":
            scope, stream = split_stream(args.stream)
            description = yield call(controller.describe_stream, scope, stream)
            segments = yield _segment_details(ep, description.segments)
            _show_stream(args, stdout, description, segments)
        else:
            scope, stream = split_stream(args.stream)
            if args.action == "create":
                yield call(controller.create_stream, scope, stream, args.segments)
                done = "created"
            elif args.action == "seal":
                yield call(controller.seal_stream, scope, stream)
                done = "sealed"
            else:
                yield call(controller.delete_stream, scope, stream)
                done = "deleted"
            _emit(args, stdout, f"{done} stream {scope}/{stream}\n",
                        {"stream": f"{scope}/{stream}", "status": done})
    finally:
        controller.close()
    return 0


@defer.inlineCallbacks
def _segment_details(ep, segments):
    """Each current segment's state on the segment store (one connection)."""
    if not segments:
        return []
    proto = yield client.connect(ep)
    try:
        details = []
        for segment in segments:
            info = yield proto.segment_info(segment.name)
            details.append(info)
    finally:
        proto.transport.loseConnection()
        yield proto.closed
    return details


def _emit(args, stdout, text, data):
    """A result on the byte stream C{stdout}: C{text}, or C{data} as JSON with C{-f json}."""
    if args.format == "json":
        stdout.write(json.dumps(data, sort_keys=True).encode() + b"\n")
    elif text:
        stdout.write(text.encode())


def _show_stream(args, stdout, description, details):
    rows = []
    for segment, info in zip(description.segments, details):
        rows.append({"segment": segment.name, "number": segment.number, "epoch": segment.epoch,
                     "key_range": [segment.min_key, segment.max_key],
                     "start_offset": info.start_offset, "write_offset": info.write_offset,
                     "sealed": bool(info.is_sealed)})
    data = {"stream": f"{description.scope}/{description.stream}",
            "scaling": description.scaling, "min_segments": description.min_segments,
            "retention": description.retention, "tags": description.tags, "segments": rows}
    lines = [f"stream:       {data['stream']}",
             f"scaling:      {description.scaling}, at least {description.min_segments} "
             "segment(s)",
             f"retention:    {description.retention}"]
    if description.tags:
        lines.append(f"tags:         {', '.join(description.tags)}")
    lines.append(f"segments:     {len(rows)} current" + ("" if rows else " (sealed stream)"))
    for row in rows:
        lo, hi = row["key_range"]
        lines.append(f"  {row['segment']}  keys [{lo:.4f}, {hi:.4f})  bytes "
                     f"{row['start_offset']}..{row['write_offset']}"
                     + ("  sealed" if row["sealed"] else ""))
    _emit(args, stdout, "\n".join(lines) + "\n", data)


@defer.inlineCallbacks
def _write(ep, args, stdin, stdout, moved):
    source = open(args.file, "rb") if args.file else stdin
    writer = client.SegmentWriter(ep, args.segment, max_retries=5)
    count = 0

    def acked(result, n):
        moved.add(n)
        return result
    try:
        batch = []
        pending = []
        for line in source:
            moved.touch()
            batch.append(line.rstrip(b"\n"))
            if len(batch) >= args.batch:
                pending.append(writer.write_batch(batch).addCallback(acked, len(batch)))
                count += len(batch)
                batch = []
                if len(pending) >= 8:
                    yield pending.pop(0)
        if batch:
            pending.append(writer.write_batch(batch).addCallback(acked, len(batch)))
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
def _read(ep, args, stdout, moved):
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
            moved.add(len(events))
            stdout.write(b"".join(e + b"\n" for e in events))
    finally:
        yield reader.close()
    return 0


def main(argv):
    return CONVENTION.run(lambda reactor: run(reactor, argv))
