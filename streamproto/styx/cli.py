"""
C{streamproto styx ...}: the reference CLI's commands and options.

    streamproto styx logs list|create|get|delete|truncate|backup|restore ...
    streamproto styx logs write|read NAME ...   (the reference's names)
    streamproto styx produce|consume NAME ...   (the same, shorter)
    streamproto styx benchmark ...

The common options of every streamproto command (L{streamproto.core.cli},
doc/cli.rst) are accepted before or after the command: C{-s/--server}
(default C{http://localhost:7123}; C{https://...} or C{--tls} for TLS, with
C{--ca}, C{--cert}, C{--key}), C{-f/--format text|json}, C{-t/--timeout},
C{-v}/C{-q}; the reference's C{-H/--host} is a hidden alias.
"""

import importlib
import json
import os
import random
import sys

from streamproto.core import cli as common
from streamproto.log.config import LogConfig
from streamproto.styx import formats

DEFAULT_HOST = "http://localhost:7123"
#: the environment variable holding a bearer token (doc/security.rst)
TOKEN_ENV = "STREAMPROTO_TOKEN"
PROG = "streamproto styx"
CONVENTION = common.Convention(
    PROG, DEFAULT_HOST, timeout=60.0,
    timeout_help="seconds to wait to connect, for an answer (produce: an acknowledgement; "
                 "consume: records), and for a -F follower to get its server back after a "
                 "disconnect (a shutdown, a restart)")
#: a follower's reconnection delays: 0.25 s doubling to 10 s, with jitter
RECONNECT_INITIAL = 0.25
RECONNECT_MAX = 10.0
READ_CHUNK = 1024 * 1024
# records per produce request (one group commit each)
BATCH_BYTES = 1024 * 1024
LONG_POLL_SECONDS = 30

INFO_FIELDS = ("name", "status", "record_count", "file_size", "start_position",
               "end_position")
LIST_HEADER = ("NAME", "STATUS", "RECORD COUNT", "FILE SIZE", "START POSITION",
               "END POSITION")


class CLIError(common.CommandError):
    """An error reported as C{streamproto styx: error: ...} with exit status 1."""


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
    p.add_argument("-n", "--count", type=int, default=-1,
                   help="records to read (default: all)")
    p.add_argument("-F", "--follow", action="store_true",
                   help="wait for new records at the end of the log; reconnect (with "
                        "backoff) and resume at the next record when the server goes "
                        "away, for up to -t/--timeout seconds")
    p.add_argument("-u", "--unbuffered", action="store_true", help="flush every record")
    p.add_argument("-b", "--binary", action="store_true",
                   help="output binary records (int32 big-endian size + bytes)")
    p.add_argument("-l", "--line-ending", choices=sorted(formats.LINE_ENDINGS), default="lf")
    p.add_argument("--http", action="store_true",
                   help="use HTTP even when the styx/0 client is available")


def build_parser():
    # "benchmark" is dispatched before parsing (its own parser, an optional
    # module): name it here so that --help shows every command
    parser = CONVENTION.parser(
        "Styx logs, produce and consume.",
        epilog="streamproto styx benchmark [--help]: the styx/0 produce/consume benchmark.")
    commands = parser.add_subparsers(dest="command", required=True)
    common = CONVENTION.common()

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
    from streamproto.styx.api_client import StyxClient
    # a server's --auth-policy: the bearer token comes from the environment,
    # never the command line (where ps and shell histories show it)
    servers = getattr(args, "servers", None) or [args.server]
    tls = args.tls_options
    if tls is not None and len(servers) > 1:
        # several front-ends: each verified by its own name
        by_host = {s.host: CONVENTION.tls_options(args, s) for s in servers}
        by_host[args.server.host] = args.tls_options
        tls = by_host.get
    return StyxClient([s.url() for s in servers], reactor, tls_options=tls,
                      token=os.environ.get(TOKEN_ENV) or None)


def _stream_tls(client):
    """The TLS options of the front-end the HTTP client is on now (for styx/0)."""
    from urllib.parse import urlsplit
    return client.tls_options_for(urlsplit(client.base_url).hostname)


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


async def produce(reactor, args, client, stdin=None, err=None, blocking=None, answers=None):
    """
    Read records from stdin and append them: over styx/0 when the client is
    available (acked once durable; the window holds the reader back), else
    in HTTP batches.

    Reads from stdin run in a thread (C{blocking}): a slow pipe must not
    stop the reactor, which keeps the styx/0 heartbeats and acks going.
    """
    from streamproto.core.progress import Progress
    from streamproto.core.stall import Answers
    stdin = stdin or sys.stdin.buffer
    err = err or sys.stderr
    blocking = blocking or _in_thread(reactor)
    answers = answers or Answers(reactor)
    await client.get_log(args.name)  # fail early on an unknown log
    answers.touch()
    stream = _use_stream(args)
    producer = None
    if stream is not None:
        producer = await _stream_errors(stream.StyxProducer.connect_url(
            reactor, client.base_url, args.name, tls=_stream_tls(client), token=client.token))
    fmt = formats.BINARY if args.binary else formats.lines(args.line_ending)
    decoder = fmt.decoder(0x7FFFFFFF)
    unbuffered = args.unbuffered or _is_tty(stdin)
    progress = Progress(f"produce {args.name}", stream=err)
    if getattr(args, "verbosity", 1) <= 0:
        progress.enabled = False
    sent = 0
    nbytes = 0
    batch = []
    batch_bytes = 0

    async def flush():
        nonlocal sent, nbytes, batch, batch_bytes
        if not batch:
            return
        if producer is not None:
            n = len(batch)
            producer.writeMany(batch).addCallbacks(lambda _: answers.add(n),
                                                   lambda f: None)  # close() reports
            await producer.whenWritable()
        else:
            await client.write_records(args.name, batch, formats.BINARY)
            answers.add(len(batch))
        sent += len(batch)
        nbytes += batch_bytes
        batch, batch_bytes = [], 0
        progress.update(sent, nbytes)

    read = getattr(stdin, "read1", stdin.read)
    while True:
        answers.elsewhere += 1     # stdin's pace is not the server's
        try:
            if unbuffered and not args.binary:
                chunk = await blocking(stdin.readline)  # a line at a time
            else:
                chunk = await blocking(read, READ_CHUNK)
        finally:
            answers.elsewhere -= 1
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


async def consume(reactor, args, client, stdout=None, err=None, rng=random, answers=None):
    """
    Write records to stdout; with --follow, wait for more for ever.

    A follower whose server goes away after it was connected (the styx/0
    Error(SHUTDOWN) of a graceful stop, a lost connection, a refused
    reconnection while the server restarts) reconnects after a growing,
    jittered delay and resumes at the record after the last one it wrote:
    nothing lost, nothing twice.  It gives up after C{--timeout} seconds
    without a connection (0: never).
    """
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
    encode_binary = args.binary
    delimiter = formats.LINE_ENDINGS[args.line_ending]
    unbuffered = args.unbuffered
    total = args.count if args.count >= 0 else (
        None if args.follow else max(info["end_position"] - position, 0))
    progress = Progress(f"consume {args.name}", total=total, stream=err)
    if getattr(args, "verbosity", 1) <= 0:
        progress.enabled = False
    state = {"count": 0, "bytes": 0, "position": position}

    def write(records):
        connected["now"] = True
        if encode_binary:
            data = formats.encode_records(formats.BINARY, records)
        else:
            data = b"".join(r + delimiter for r in records)
        stdout.write(data)
        if unbuffered:
            stdout.flush()
        state["count"] += len(records)
        if answers is not None:
            answers.add(len(records))
        state["bytes"] += sum(map(len, records))
        state["position"] += len(records)
        progress.update(state["count"], state["bytes"])

    def remaining():
        return -1 if args.count < 0 else args.count - state["count"]

    stream = _use_stream(args)
    connected = {"now": False}

    async def styx0():
        consumer = await _stream_errors(stream.StyxConsumer.connect_url(
            reactor, client.base_url, args.name, write, tls=_stream_tls(client),
            token=client.token, whence="origin", position=state["position"], count=remaining(),
            follow=args.follow))
        connected["now"] = True
        await _stream_errors(consumer.done)

    async def http():
        while True:
            await client.read_records(
                args.name, whence="origin", position=state["position"], count=remaining(),
                follow=args.follow, timeout=LONG_POLL_SECONDS if args.follow else None,
                on_records=write)
            connected["now"] = True
            if not args.follow or remaining() == 0:
                return

    once = styx0 if stream is not None else http
    if not args.follow:
        await once()
    else:
        await _reconnecting(reactor, args, once, connected, remaining, rng)
    stdout.flush()
    progress.finish()
    return 0


def _retriable(error):
    """
    Whether a follower should reconnect after C{error}: the server went
    away (shut down, restarting, connection lost), not a refusal that
    would be the same next time (an unknown log, a TLS failure).
    """
    from twisted.internet import error as net
    from twisted.web.client import ResponseFailed

    from streamproto.styx.api_client import StyxAPIError
    from streamproto.styx.codec import ErrorCode
    from streamproto.styx.stream_client import StyxConnectionLost, StyxStreamError
    if isinstance(error, StyxStreamError):
        return error.code in (ErrorCode.SHUTDOWN, ErrorCode.TIMEOUT)
    if isinstance(error, (StyxAPIError, CLIError)):
        return getattr(error, "status", 0) == 503 or "shutting down" in str(error)
    if isinstance(error, (ResponseFailed, StyxConnectionLost)):
        # lost mid-response; but a TLS handshake failure is no reason to retry
        return "SSL" not in common.error_text(error)
    return isinstance(error, (net.ConnectError, net.ConnectionLost, net.ConnectionDone,
                              ConnectionError))


async def _reconnecting(reactor, args, once, connected, remaining, rng):
    """
    Run C{once()} (one connection's worth of following) again while the
    server comes and goes; see L{consume}.  The server answered C{get_log}
    with these settings before: what fails now and L{_retriable} says may
    pass later is the server being away.
    """
    from twisted.internet import task
    from twisted.logger import Logger
    log = Logger(namespace="streamproto.styx.cli")
    from streamproto.core.reconnect import backoff_policy
    delay = backoff_policy(RECONNECT_INITIAL, RECONNECT_MAX, 2.0, rng=rng)
    attempt = 0
    down_since = None
    while remaining() != 0:
        connected["now"] = False
        try:
            await once()
            return
        except Exception as e:  # noqa: BLE001 - sorted by _retriable below
            if not _retriable(e):
                raise
            if connected["now"]:
                attempt, down_since = 0, None   # it was back: start over
            down_since = reactor.seconds() if down_since is None else down_since
            away = reactor.seconds() - down_since
            if args.timeout and away >= args.timeout:
                raise CLIError(f"the server has been away for {away:.0f} s (-t/--timeout "
                               f"{args.timeout:g}): {common.error_text(e)}") from None
            wait = delay(attempt)
            attempt += 1
            log.warn("connection to the server lost ({why}); reconnecting in {wait:.1f} s",
                     why=common.error_text(e), wait=wait)
            await task.deferLater(reactor, wait, lambda: None)


def _answered(reactor, args, coroutine, answers, what):
    """
    C{coroutine} (a produce or consume), given up after C{-t/--timeout}
    seconds in which the server answered nothing: a stopped server keeps
    the connection up and the client waiting for ever.
    """
    from twisted.internet.defer import Deferred

    from streamproto.core.stall import unanswered
    return unanswered(reactor, Deferred.fromCoroutine(coroutine), args.timeout,
                      args.server.address, "-t/--timeout", answers,
                      lambda: f" ({answers.count} records {what})")


async def run(reactor, args):
    from streamproto.core.stall import Answers
    from streamproto.styx.api_client import StyxAPIError
    client = _client(args, reactor)
    try:
        if args.command == "logs" and args.action in ("list", "create", "get", "delete",
                                                      "truncate", "backup", "restore"):
            return await run_logs(reactor, args, client, sys.stdout)
        action = args.action if args.command == "logs" else args.command
        answers = Answers(reactor)
        if action in ("write", "produce"):
            return await _answered(reactor, args, produce(reactor, args, client, answers=answers),
                                   answers, "acknowledged")
        if args.follow:
            # a follower waits for records for ever, and for a server away
            # up to -t/--timeout (_reconnecting)
            return await consume(reactor, args, client)
        return await _answered(reactor, args, consume(reactor, args, client, answers=answers),
                               answers, "read")
    except StyxAPIError as e:
        raise CLIError(e.message)
    finally:
        await client.close()


def parse_args(argv):
    """The parsed and resolved arguments; SystemExit(2) on a usage error."""
    return CONVENTION.parse(build_parser(), argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "benchmark":
        try:
            bench = importlib.import_module("streamproto.styx.benchmark")
        except ImportError as e:
            if e.name != "streamproto.styx.benchmark":
                raise
            sys.stderr.write(f"{PROG}: error: benchmark is not available in this build\n")
            return common.EXIT_USAGE
        return bench.main(argv[1:]) or 0
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code
    return CONVENTION.run(lambda reactor: _run_logged(reactor, args))


async def _run_logged(reactor, args):
    stop = CONVENTION.log_to(args)
    try:
        return await run(reactor, args)
    finally:
        stop()


def _report(failure):
    """Print a failure as one line (L{common.report}); return the exit status."""
    return CONVENTION.report(failure)


if __name__ == "__main__":
    sys.exit(main())
