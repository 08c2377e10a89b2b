"""
C{streamproto styx ...}: the reference CLI's commands and options.

    streamproto styx logs list|create|get|delete|truncate|backup|restore ...
    streamproto styx logs write|read NAME ...   (the reference's names)
    streamproto styx produce|consume NAME ...   (the same, shorter)
    streamproto styx benchmark ...

Global options (accepted before or after the command): C{-H/--host}
(default C{localhost:7123}; C{https://...} for TLS, with C{--ca},
C{--cert}, C{--key}), C{-f/--format text|json}.
"""

import argparse
import importlib
import json
import sys

from streamproto.core.errors import describe
from streamproto.log.config import LogConfig
from streamproto.styx import formats

DEFAULT_HOST = "http://localhost:7123"
READ_CHUNK = 1024 * 1024
# records per produce request (one group commit each)
BATCH_BYTES = 1024 * 1024
LONG_POLL_SECONDS = 30

INFO_FIELDS = ("name", "status", "record_count", "file_size", "start_position",
               "end_position")
LIST_HEADER = ("NAME", "STATUS", "RECORD COUNT", "FILE SIZE", "START POSITION",
               "END POSITION")


class CLIError(Exception):
    """An error reported as C{Error: ...} with exit status 1."""


# -- output ------------------------------------------------------------------

def tabulate(rows, tab_width=8, padding=8):
    """
    Align cells like the reference's Go tabwriter (minwidth 0, tabwidth 8,
    padding 8, padded with tabs).
    """
    if not rows:
        return ""
    ncols = max(len(r) for r in rows)
    widths = []
    for c in range(ncols - 1):
        w = max((len(r[c]) for r in rows if len(r) > c + 1), default=0) + padding
        widths.append(-(-w // tab_width) * tab_width)
    lines = []
    for r in rows:
        out = []
        for c, cell in enumerate(r):
            if c < len(r) - 1:
                tabs = -(-(widths[c] - len(cell)) // tab_width)
                out.append(cell + "\t" * max(tabs, 1))
            else:
                out.append(cell)
        lines.append("".join(out))
    return "\n".join(lines) + "\n"


def show_info(info, fmt, out):
    if fmt == "json":
        out.write(json.dumps({k: info.get(k) for k in INFO_FIELDS}, indent=2) + "\n")
    else:
        out.write(tabulate([[f"{k}:", str(info.get(k))] for k in INFO_FIELDS]))


def show_list(infos, fmt, out):
    if fmt == "json":
        out.write(json.dumps([{k: i.get(k) for k in INFO_FIELDS} for i in infos],
                             indent=2) + "\n")
    else:
        rows = [list(LIST_HEADER)] + [[str(i.get(k)) for k in INFO_FIELDS] for i in infos]
        out.write(tabulate(rows))


# -- arguments ----------------------------------------------------------------

def _globals(parser, suppress):
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("-H", "--host", default=default,
                        help=f"server to connect to (default {DEFAULT_HOST})")
    parser.add_argument("-f", "--format", choices=["text", "json"], default=default,
                        help="output format (default text)")
    parser.add_argument("--ca", default=default, help="CA bundle verifying an https server")
    parser.add_argument("--cert", default=default, help="client certificate (PEM)")
    parser.add_argument("--key", default=default, help="client private key (PEM)")


def _writer_options(p):
    p.add_argument("name")
    p.add_argument("-u", "--unbuffered", action="store_true",
                   help="send every record at once (default on a terminal)")
    p.add_argument("-b", "--binary", action="store_true",
                   help="input is binary records (int32 big-endian size + bytes)")
    p.add_argument("-l", "--line-ending", choices=sorted(formats.LINE_ENDINGS), default="lf")
    p.add_argument("--http", action="store_true",
                   help="use HTTP batches even when the styx/0 client is available")


def _reader_options(p):
    p.add_argument("name")
    p.add_argument("-P", "--position", type=int, default=0)
    p.add_argument("-w", "--whence", choices=["origin", "start", "current", "end"],
                   default="origin")
    p.add_argument("-n", "--count", type=int, default=-1)
    p.add_argument("-F", "--follow", action="store_true",
                   help="wait for new records at the end of the log")
    p.add_argument("-u", "--unbuffered", action="store_true", help="flush every record")
    p.add_argument("-b", "--binary", action="store_true",
                   help="output binary records (int32 big-endian size + bytes)")
    p.add_argument("-l", "--line-ending", choices=sorted(formats.LINE_ENDINGS), default="lf")
    p.add_argument("--http", action="store_true",
                   help="use HTTP even when the styx/0 client is available")


def build_parser():
    # "benchmark" is dispatched before parsing (its own parser, an optional
    # module): name it here so that --help shows every command
    parser = argparse.ArgumentParser(
        prog="streamproto styx", description="Styx logs, produce and consume.",
        epilog="streamproto styx benchmark [--help]: the styx/0 produce/consume benchmark.")
    _globals(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    _globals(common, suppress=True)

    logs = commands.add_parser("logs", help="manage logs", parents=[common])
    actions = logs.add_subparsers(dest="action", required=True)
    p = actions.add_parser("list", help="list logs", parents=[common])
    p.add_argument("-w", "--watch", action="store_true", help="refresh every second")
    p = actions.add_parser("create", help="create a log", parents=[common])
    p.add_argument("name")
    defaults = LogConfig()
    for field in LogConfig.field_names():
        p.add_argument("--" + field.replace("_", "-"), type=int,
                       default=getattr(defaults, field))
    for action, help_ in (("get", "show a log"), ("delete", "delete a log"),
                          ("truncate", "truncate a log")):
        actions.add_parser(action, help=help_, parents=[common]).add_argument("name")
    p = actions.add_parser("backup", help="write a log's tar.gz backup", parents=[common])
    p.add_argument("name")
    p.add_argument("-o", "--output", help="file (default stdout)")
    p = actions.add_parser("restore", help="restore a log from a tar.gz backup",
                           parents=[common])
    p.add_argument("name")
    p.add_argument("-i", "--input", help="file (default stdin)")
    for action in ("write", "produce"):
        _writer_options(actions.add_parser(action, help="produce records from stdin",
                                           parents=[common]))
    for action in ("read", "consume"):
        _reader_options(actions.add_parser(action, help="consume records to stdout",
                                           parents=[common]))
    _writer_options(commands.add_parser("produce", help="produce records from stdin",
                                        parents=[common]))
    _reader_options(commands.add_parser("consume", help="consume records to stdout",
                                        parents=[common]))
    return parser


def _client(args, reactor):
    from streamproto.styx.api_client import StyxClient, base_url
    url = base_url(args.host or DEFAULT_HOST)
    tls = None
    if url.startswith("https://"):
        from urllib.parse import urlsplit

        from streamproto.core.tls import client_tls_options
        key = (args.key or args.cert) if args.cert else None
        tls = client_tls_options(urlsplit(url).hostname, ca_certs=args.ca, cert=args.cert,
                                 private_key=key)
    return StyxClient(url, reactor, tls_options=tls)


# -- commands ----------------------------------------------------------------

def _is_tty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


async def run_logs(reactor, args, client, out):
    from twisted.internet import task
    fmt = args.format or "text"
    action = args.action
    if action == "list":
        while True:
            infos = await client.list_logs()
            if args.watch:
                out.write("\x1b[H\x1b[2J")
            show_list(infos, fmt, out)
            out.flush()
            if not args.watch:
                return 0
            await task.deferLater(reactor, 1.0, lambda: None)
    if action == "create":
        config = {f: getattr(args, f) for f in LogConfig.field_names()}
        try:
            LogConfig(**config)
        except ValueError as e:
            raise CLIError(str(e))
        show_info(await client.create_log(args.name, **config), fmt, out)
    elif action == "get":
        show_info(await client.get_log(args.name), fmt, out)
    elif action == "delete":
        await client.delete_log(args.name)
    elif action == "truncate":
        await client.truncate_log(args.name)
    elif action == "backup":
        sink = open(args.output, "wb") if args.output else sys.stdout.buffer
        try:
            await client.backup_log(args.name, sink.write)
        finally:
            if args.output:
                sink.close()
            else:
                sink.flush()
    elif action == "restore":
        source = open(args.input, "rb") if args.input else sys.stdin.buffer
        try:
            await client.restore_log(args.name, source.read())
        finally:
            if args.input:
                source.close()
    return 0


def _stream_client():
    """The styx/0 client module, when it exists."""
    try:
        return importlib.import_module("streamproto.styx.stream_client")
    except ImportError as e:
        if e.name != "streamproto.styx.stream_client":
            raise
        return None


def _use_stream(args):
    """The styx/0 client module, unless --http or it is not in this build."""
    return None if args.http else _stream_client()


async def _stream_errors(d):
    """Report styx/0 failures like the HTTP API's (APIError carries the code)."""
    from streamproto.styx.errors import APIError
    try:
        return await d
    except APIError as e:
        raise CLIError(e.message)


def _in_thread(reactor):
    from twisted.internet.threads import deferToThreadPool

    def run(f, *args):
        return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)
    return run


async def produce(reactor, args, client, stdin=None, err=None, blocking=None):
    """
    Read records from stdin and append them: over styx/0 when the client is
    available (acked once durable; the window holds the reader back), else
    in HTTP batches.

    Reads from stdin run in a thread (C{blocking}): a slow pipe must not
    stop the reactor, which keeps the styx/0 heartbeats and acks going.
    """
    from streamproto.core.progress import Progress
    stdin = stdin or sys.stdin.buffer
    err = err or sys.stderr
    blocking = blocking or _in_thread(reactor)
    await client.get_log(args.name)  # fail early on an unknown log
    stream = _use_stream(args)
    producer = None
    if stream is not None:
        producer = await _stream_errors(stream.StyxProducer.connect_url(
            reactor, client.base_url, args.name, tls=client.tls_options))
    fmt = formats.BINARY if args.binary else formats.lines(args.line_ending)
    decoder = fmt.decoder(0x7FFFFFFF)
    unbuffered = args.unbuffered or _is_tty(stdin)
    progress = Progress(f"produce {args.name}", stream=err)
    sent = 0
    nbytes = 0
    batch = []
    batch_bytes = 0

    async def flush():
        nonlocal sent, nbytes, batch, batch_bytes
        if not batch:
            return
        if producer is not None:
            producer.writeMany(batch).addErrback(lambda f: None)  # close() reports
            await producer.whenWritable()
        else:
            await client.write_records(args.name, batch, formats.BINARY)
        sent += len(batch)
        nbytes += batch_bytes
        batch, batch_bytes = [], 0
        progress.update(sent, nbytes)

    read = getattr(stdin, "read1", stdin.read)
    while True:
        if unbuffered and not args.binary:
            chunk = await blocking(stdin.readline)  # a line at a time
        else:
            chunk = await blocking(read, READ_CHUNK)
        records = decoder.feed(chunk) if chunk else decoder.close()
        for r in records:
            batch.append(r)
            batch_bytes += len(r)
        if unbuffered or batch_bytes >= BATCH_BYTES or not chunk:
            await flush()
        if not chunk:
            break
    if producer is not None:
        await _stream_errors(producer.close())
    progress.finish()
    return 0


async def consume(reactor, args, client, stdout=None, err=None):
    """Write records to stdout; with --follow, long-poll for more for ever."""
    from streamproto.core.progress import Progress
    stdout = stdout or sys.stdout.buffer
    err = err or sys.stderr
    info = await client.get_log(args.name)
    if args.whence == "origin":
        position = args.position
    elif args.whence == "end":
        position = info["end_position"] + args.position
    else:
        position = info["start_position"] + args.position
    remaining = args.count
    encode_binary = args.binary
    delimiter = formats.LINE_ENDINGS[args.line_ending]
    unbuffered = args.unbuffered
    total = remaining if remaining >= 0 else (
        None if args.follow else max(info["end_position"] - position, 0))
    progress = Progress(f"consume {args.name}", total=total, stream=err)
    state = {"count": 0, "bytes": 0, "position": position}

    def write(records):
        if encode_binary:
            data = formats.encode_records(formats.BINARY, records)
        else:
            data = b"".join(r + delimiter for r in records)
        stdout.write(data)
        if unbuffered:
            stdout.flush()
        state["count"] += len(records)
        state["bytes"] += sum(map(len, records))
        state["position"] += len(records)
        progress.update(state["count"], state["bytes"])

    stream = _use_stream(args)
    if stream is not None:
        consumer = await _stream_errors(stream.StyxConsumer.connect_url(
            reactor, client.base_url, args.name, write, tls=client.tls_options,
            whence="origin", position=position, count=remaining, follow=args.follow))
        await _stream_errors(consumer.done)
        stdout.flush()
        progress.finish()
        return 0
    while True:
        got = await client.read_records(
            args.name, whence="origin", position=state["position"], count=remaining,
            follow=args.follow, timeout=LONG_POLL_SECONDS if args.follow else None,
            on_records=write)
        if remaining >= 0:
            remaining -= got
        if not args.follow or remaining == 0:
            break
    stdout.flush()
    progress.finish()
    return 0


async def run(reactor, args):
    from streamproto.styx.api_client import StyxAPIError
    client = _client(args, reactor)
    try:
        if args.command == "logs" and args.action in ("list", "create", "get", "delete",
                                                      "truncate", "backup", "restore"):
            return await run_logs(reactor, args, client, sys.stdout)
        action = args.action if args.command == "logs" else args.command
        if action in ("write", "produce"):
            return await produce(reactor, args, client)
        return await consume(reactor, args, client)
    except StyxAPIError as e:
        raise CLIError(e.message)
    finally:
        await client.close()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "benchmark":
        try:
            bench = importlib.import_module("streamproto.styx.benchmark")
        except ImportError as e:
            if e.name != "streamproto.styx.benchmark":
                raise
            sys.stderr.write("streamproto styx: benchmark is not available in this build\n")
            return 2
        return bench.main(argv[1:]) or 0
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code
    from twisted.internet import defer, task
    status = []

    def go(reactor):
        d = defer.ensureDeferred(run(reactor, args))
        d.addErrback(_report)
        d.addCallback(status.append)
        return d

    try:
        task.react(go)
    except SystemExit as e:
        if e.code not in (0, None):
            return e.code
    return status[0] if status else 1


def _report(failure):
    """Print a failure the way the reference does; return the exit status."""
    if failure.check(BrokenPipeError):
        return 0  # e.g. piped into head
    if failure.check(KeyboardInterrupt):
        return 130
    if failure.check(CLIError):
        sys.stderr.write(f"Error: {failure.value}\n")
    else:
        sys.stderr.write(f"Error: {describe(failure)}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
