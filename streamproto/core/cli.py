"""
The one command-line convention of the C{streamproto} client commands
(C{styx}, C{lumberjack}, C{reliable}, C{pravega}, C{relink}, C{status}),
defined here once and documented in C{doc/cli.rst}.

Every command parses with C{argparse} (a L{CommandParser}) and takes the
same spellings for what they all need:

    -s/--server ADDRESS    [SCHEME://]HOST[:PORT][/PATH]
    --tls, --ca FILE, --cert FILE, --key FILE, --server-name NAME
    -f/--format text|json  (commands that print a result)
    -v/--verbose, -q/--quiet
    -n/--count N           (commands that count)
    -t/--timeout SECONDS   (how long to wait for the server; 0: for ever)

The spellings of the previous release (C{-H/--host}, C{-p/--port},
C{--connect}, C{--ca-certs}, and per command a few more) still work,
hidden from C{--help}, with a note on stderr naming the new spelling.

Exit statuses are the same everywhere: L{EXIT_OK} (0) when the command did
what it was asked, L{EXIT_FAILURE} (1) when it could not (the server
refused, an error reply, nothing acknowledged in time), L{EXIT_USAGE} (2)
for a bad command line, L{EXIT_INTERRUPTED} (130) on Ctrl-C.  Errors are
one line, C{PROG: error: TEXT}, written by L{report} (never a Python repr).
"""

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar, cast
from urllib.parse import urlsplit

from twisted.internet import defer, task
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IReactorTCP,
    IStreamClientEndpoint,
)
from twisted.logger import ILogObserver, LogEvent, LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from streamproto.core.clock import steady_timers
from streamproto.core.errors import describe

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: the URL schemes that mean TLS, and those that mean plain TCP
TLS_SCHEMES = frozenset({"https", "tls", "ssl"})
PLAIN_SCHEMES = frozenset({"http", "tcp"})

#: old spelling -> new spelling (the note printed when an old one is used)
RENAMED = {
    "-H/--host": "-s/--server",
    "--connect": "-s/--server",
    "-p/--port": "-s/--server HOST:PORT",
    "--ca-certs": "--ca",
}

_Parser = TypeVar("_Parser", bound=argparse.ArgumentParser)


class CommandError(Exception):
    """A failure the command explains itself: printed as it is, exit 1."""


class CommandParser(argparse.ArgumentParser):
    """
    C{argparse} with the convention's usage errors: C{PROG: error: TEXT}
    after the usage line, exit status L{EXIT_USAGE} (argparse's own).
    """


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be 0 or more")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


@dataclass(frozen=True)
class Server:
    """
    Where a command connects: the result of C{-s/--server} (or its old
    spellings) and the TLS options.

    @ivar scheme: the scheme given (lower case), or None.
    @ivar path: a URL path given after the port (status: C{/metrics}).
    """

    host: str
    port: int
    tls: bool
    scheme: str | None = None
    path: str = ""

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def url(self, default_path: str = "") -> str:
        """The address as an C{http} or C{https} URL."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.address}{self.path or default_path}"


def parse_address(text: str) -> tuple[str | None, str | None, int | None, str]:
    """
    C{[SCHEME://]HOST[:PORT][/PATH]} -> (scheme or None, host or None,
    port or None, path).  IPv6 hosts go in brackets.

    @raise ValueError: with the reason, for text that is no address.
    """
    text = text.strip()
    if not text:
        raise ValueError("empty address")
    scheme = None
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme not in TLS_SCHEMES | PLAIN_SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r} (http, https, tcp or tls)")
    parts = urlsplit(text if scheme else "//" + text)
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("only [SCHEME://]HOST[:PORT][/PATH]")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the port must be a number in 0..65535") from None
    host = parts.hostname
    if parts.netloc.endswith(":") and port is None:
        raise ValueError("missing port after ':'")
    return scheme, host, port, parts.path.rstrip("/")


class Convention:
    """
    One command's instance of the convention: its program name, default
    server and defaults, the options added to its parsers, and the
    resolution of what was given into L{Server} and TLS options.

    @param prog: e.g. C{"streamproto styx"}.
    @param default_server: the address used without C{-s}: a host and a
        port at least.
    @param timeout: the default of C{-t/--timeout} (None: no such option).
    @param timeout_help: what the timeout bounds, for C{--help}.
    @param formats: whether C{-f/--format} applies.
    @param aliases: extra old spellings of C{--server} for this command,
        e.g. C{("--metrics",)}.
    @param renamed: this command's other old spellings (hidden options the
        command adds itself), old -> new, for the note on stderr.
    """

    def __init__(self, prog: str, default_server: str, *, timeout: float | None = None,
                 timeout_help: str | None = None, formats: bool = True,
                 aliases: Iterable[str] = (), renamed: Mapping[str, str] | None = None) -> None:
        self.prog = prog
        self.default_server = default_server
        self.timeout = timeout
        self.timeout_help = timeout_help or "seconds to wait for the server"
        self.formats = formats
        self.aliases = tuple(aliases)
        self.renamed = dict(renamed or {})

    # -- parsers ---------------------------------------------------------
    def parser(self, description: str | None, **kwargs: Any) -> CommandParser:
        """A L{CommandParser} with the common options."""
        parser = CommandParser(prog=self.prog, description=description, **kwargs)
        self.add_options(parser)
        return parser

    def share(self, parser: _Parser) -> _Parser:
        """
        Add the common options (suppressed defaults) to every subcommand of
        C{parser}, at any depth, so that they are accepted after the
        command too; call it once the parser is complete.  @return: C{parser}.
        """
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in dict.fromkeys(action.choices.values()):
                    self.add_options(sub, suppress=True)
                    self.share(sub)
        return parser

    def common(self) -> CommandParser:
        """
        A parent parser with the common options for subcommands, so that
        they are accepted after the command too; its defaults are
        suppressed so they never override what came before the command.
        """
        parent = CommandParser(add_help=False)
        self.add_options(parent, suppress=True)
        return parent

    def add_options(self, parser: argparse.ArgumentParser, suppress: bool = False) -> None:
        def default(value: object) -> object:
            return argparse.SUPPRESS if suppress else value
        hidden = argparse.SUPPRESS
        g = parser.add_argument_group("connection (common to every streamproto command)")
        g.add_argument("-s", "--server", metavar="ADDRESS", action="append",
                       default=default(None),
                       help=f"[SCHEME://]HOST[:PORT] of the server (default "
                            f"{self.default_server}); https:// or tls:// turns TLS on; "
                            "several (repeated, or comma-separated): front-ends of one "
                            "store, tried in turn")
        g.add_argument("-H", "--host", dest="old_host", default=default(None), help=hidden)
        g.add_argument("-p", "--port", dest="old_port", type=int, default=default(None),
                       help=hidden)
        g.add_argument("--connect", dest="old_connect", default=default(None), help=hidden)
        for alias in self.aliases:
            g.add_argument(alias, dest="old_alias_" + alias.strip("-").replace("-", "_"),
                           default=default(None), help=hidden)
        g.add_argument("--tls", action="store_true", default=default(False),
                       help="connect with TLS (implied by --ca, --cert and a TLS scheme)")
        g.add_argument("--ca", metavar="FILE", default=default(None),
                       help="PEM CA bundle verifying the server (default: the system's)")
        g.add_argument("--ca-certs", dest="old_ca_certs", default=default(None), help=hidden)
        g.add_argument("--cert", metavar="FILE", default=default(None),
                       help="client certificate (PEM; may hold the key too)")
        g.add_argument("--key", metavar="FILE", default=default(None),
                       help="client private key (PEM; default: --cert)")
        g.add_argument("--server-name", metavar="NAME", default=default(None),
                       help="name to verify in the server's certificate (default: the host)")
        if self.timeout is not None:
            g.add_argument("-t", "--timeout", metavar="SECONDS", type=seconds,
                           default=default(self.timeout),
                           help=f"{self.timeout_help}; 0 waits for ever "
                                f"(default {self.timeout:g})")
        o = parser.add_argument_group("output (common to every streamproto command)")
        if self.formats:
            o.add_argument("-f", "--format", choices=["text", "json"], default=default("text"),
                           help="result as text or as one JSON document (default text)")
        o.add_argument("-v", "--verbose", action="count", default=default(0),
                       help="also log the client's progress on stderr (-vv: debug)")
        o.add_argument("-q", "--quiet", action="store_true", default=default(False),
                       help="nothing on stderr but errors (no progress, warnings or notes)")

    # -- resolution --------------------------------------------------------
    def parse(self, parser: argparse.ArgumentParser, argv: Sequence[str] | None,
              stderr: TextIO | None = None) -> argparse.Namespace:
        """
        Parse C{argv} and resolve the common options (see L{resolve}).

        @raise SystemExit: (status 2) on a usage error, after writing it.
        """
        args = parser.parse_args(argv)
        try:
            self.resolve(args, stderr)
        except ValueError as e:
            parser.error(str(e))
        for old, new in self.renamed.items():
            # argv None (sys.argv) only from commands with nothing renamed
            if any(a == old or a.startswith(old + "=") for a in cast(Sequence[str], argv)):
                self.note_renamed(args, old, stderr or sys.stderr, new)
        return args

    def resolve(self, args: argparse.Namespace, stderr: TextIO | None = None) -> None:
        """
        Set C{args.server} (a L{Server}), C{args.tls_options} (client TLS
        options or None) and C{args.verbosity} (0 quiet, 1 default, 2+
        verbose) from what was given, writing a note for each old spelling.

        @raise ValueError: a usage error (conflicting or malformed values,
            unreadable TLS files).
        """
        stderr = stderr or sys.stderr
        args.verbosity = 0 if getattr(args, "quiet", False) else 1 + getattr(args, "verbose", 0)
        if getattr(args, "format", None) is None and self.formats:
            args.format = "text"
        if self.timeout is not None and getattr(args, "timeout", None) is None:
            args.timeout = self.timeout
        given: list[tuple[str, str]] = []
        if getattr(args, "server", None) is not None:
            if isinstance(args.server, list):
                args.server = ",".join(args.server)
            given.append(("-s/--server", args.server))
        for option, attr in [("-H/--host", "old_host"), ("--connect", "old_connect")] + [
                (a, "old_alias_" + a.strip("-").replace("-", "_")) for a in self.aliases]:
            value = getattr(args, attr, None)
            if value is not None:
                given.append((option, value))
                self.note_renamed(args, option, stderr)
        if len({v for _, v in given}) > 1:
            raise ValueError("the server is given twice: " + " and ".join(
                f"{o} {v}" for o, v in given))
        # the default server names a host and a port (see the class docstring)
        _, default_host, default_port, default_path = cast(
            tuple[str | None, str, int, str], parse_address(self.default_server))
        text = given[0][1] if given else self.default_server
        texts = [t.strip() for t in text.split(",") if t.strip()] or [text]
        text, others = texts[0], texts[1:]
        host: str | None
        scheme, host, port, path = None, default_host, None, default_path
        if given:
            try:
                scheme, host, port, path = parse_address(text)
            except ValueError as e:
                raise ValueError(f"bad server address {text!r}: {e}") from None
        old_port = getattr(args, "old_port", None)
        if old_port is not None:
            self.note_renamed(args, "-p/--port", stderr)
            if port is not None and port != old_port:
                raise ValueError(f"the port is given twice: {text} and -p/--port {old_port}")
            if not 0 < old_port < 65536:
                raise ValueError(f"-p/--port {old_port}: not a port number")
            port = old_port
        if getattr(args, "old_ca_certs", None) is not None:
            self.note_renamed(args, "--ca-certs", stderr)
            if args.ca is not None and args.ca != args.old_ca_certs:
                raise ValueError("the CA bundle is given twice: --ca and --ca-certs")
            args.ca = args.old_ca_certs
        asked = bool(getattr(args, "tls", False) or args.ca or args.cert or args.key)
        if scheme in PLAIN_SCHEMES and asked:
            raise ValueError(f"{scheme}:// is plain TCP, but TLS options were given "
                             "(use https:// or tls://, or leave the scheme out)")
        if args.key and not args.cert:
            raise ValueError("--key needs --cert")
        tls = scheme in TLS_SCHEMES or asked
        server = Server(host or default_host, port if port is not None else default_port,
                        tls, scheme, path)
        args.server = server
        args.tls_options = self.tls_options(args, server) if tls else None
        # more front-ends of the same store: same TLS setting, each its own name
        args.servers = [server]
        for other in others:
            try:
                o_scheme, o_host, o_port, o_path = parse_address(other)
            except ValueError as e:
                raise ValueError(f"bad server address {other!r}: {e}") from None
            if (o_scheme in TLS_SCHEMES) != tls and o_scheme is not None:
                raise ValueError(f"{other}: every server is reached the same way "
                                 "(all TLS or none)")
            args.servers.append(Server(o_host or default_host,
                                       o_port if o_port is not None else default_port,
                                       tls, o_scheme or scheme, o_path or path))

    @staticmethod
    def tls_options(args: argparse.Namespace, server: Server) -> IOpenSSLClientConnectionCreator:
        """Client TLS options verifying C{server} (service_identity)."""
        from streamproto.core.tls import client_tls_options
        for option, path in (("--ca", args.ca), ("--cert", args.cert), ("--key", args.key)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{option} {path}: no such file")
        try:
            return client_tls_options(args.server_name or server.host, ca_certs=args.ca,
                                      cert=args.cert, private_key=args.key)
        except Exception as e:  # noqa: BLE001 - unreadable PEM: a usage error, one line
            raise ValueError(f"cannot use the TLS files given: {describe(e)}") from None

    def note_renamed(self, args: argparse.Namespace, option: str, stderr: TextIO,
                     new: str | None = None) -> None:
        new = new or RENAMED.get(option, "-s/--server")
        if getattr(args, "verbosity", 1) > 0:
            stderr.write(f"{self.prog}: note: {option} is the previous release's spelling, "
                         f"kept for this release only: use {new}\n")

    def endpoint(self, reactor: IReactorTCP, args: argparse.Namespace) -> IStreamClientEndpoint:
        """
        The client endpoint of C{args.server} (TLS when asked), its connect
        timeout C{-t/--timeout} when given (else TCP's 30 s); with several
        servers, a L{streamproto.core.failover.FailoverEndpoint} over them.
        """
        endpoints, names = self.endpoints(reactor, args)
        if len(endpoints) == 1:
            return endpoints[0]
        from streamproto.core.failover import FailoverEndpoint
        return FailoverEndpoint(endpoints, names)

    def endpoints(self, reactor: IReactorTCP,
                  args: argparse.Namespace) -> tuple[list[IStreamClientEndpoint], list[str]]:
        """
        One client endpoint per server given (see L{endpoint}), and their
        addresses: for a client that connects to all of them at once
        (C{lumberjack send --loadbalance}).
        """
        from streamproto.core.tls import client_endpoint
        timeout = getattr(args, "timeout", None) or 30
        servers = getattr(args, "servers", None) or [args.server]
        endpoints: list[IStreamClientEndpoint] = []
        if len(servers) > 1:
            # a dead front-end must not hold the client for the whole -t
            timeout = min(timeout, 5)
        for server in servers:
            tls = None
            if server.tls:
                tls = args.tls_options if server is args.server else \
                    self.tls_options(args, server)
            endpoints.append(client_endpoint(reactor, server.host, server.port, tls,
                                             timeout=timeout))
        return endpoints, [s.address for s in servers]

    # -- running -----------------------------------------------------------
    def run(self, main: Callable[[Any], object], stderr: TextIO | None = None) -> int | str:
        """
        Run C{main(reactor)} (a coroutine function or one returning a
        Deferred or a value: the exit status) under C{task.react}.

        @return: the exit status: C{main}'s, or that of L{report} on failure.
        """
        stderr = stderr or sys.stderr
        status: list[int] = []

        def interrupted() -> None:
            if not status:
                status.append(EXIT_INTERRUPTED)

        def go(reactor: Any) -> defer.Deferred[Any]:
            # the reactor stopping before main is done: Ctrl-C (SIGINT) or SIGTERM
            reactor.addSystemEventTrigger("before", "shutdown", interrupted)
            # timeouts, give-ups and reconnections that no clock step moves
            steady_timers(reactor)
            # main's result: an exit status, None, or an awaitable of one
            d: defer.Deferred[Any] = defer.maybeDeferred(main, reactor)
            d.addCallback(lambda r: defer.ensureDeferred(r) if _awaitable(r) else r)
            d.addErrback(self.report, stderr)
            d.addCallback(lambda code: status.append(EXIT_OK if code is None else code))
            return d

        try:
            task.react(go)
        except SystemExit as e:
            if e.code not in (0, None):
                return e.code
        return status[0] if status else EXIT_FAILURE

    def report(self, failure: Failure | BaseException, stderr: TextIO | None = None) -> int:
        """Write a failure as one line; return its exit status."""
        return report(self.prog, failure, stderr)

    def log_to(self, args: argparse.Namespace, stderr: TextIO | None = None) -> Callable[[], None]:
        """
        Show the client libraries' log events on C{stderr} at C{args}'
        verbosity: quiet nothing, by default warnings and errors (a
        reconnect, a refused handshake), C{-v} everything from info up,
        C{-vv} debug.  @return: a callable removing the observer.
        """
        stderr = stderr or sys.stderr
        verbosity = getattr(args, "verbosity", 1)
        if verbosity <= 0:
            return lambda: None
        level = {1: LogLevel.warn, 2: LogLevel.info}.get(verbosity, LogLevel.debug)

        def observer(event: LogEvent) -> None:
            if event.get("log_level", LogLevel.info) < level:
                return
            text = formatEvent(event)
            failure = event.get("log_failure")
            if failure is not None:
                text = f"{text}: {describe(failure)}"
            stderr.write(f"{self.prog}: {text}\n")

        # Twisted takes any callable as an ILogObserver (it only calls it)
        provider = cast(ILogObserver, observer)
        globalLogPublisher.addObserver(provider)
        return lambda: globalLogPublisher.removeObserver(provider)


def _awaitable(value: object) -> bool:
    return hasattr(value, "__await__") or hasattr(value, "send") and hasattr(value, "throw")


def report(prog: str, failure: Failure | BaseException, stderr: TextIO | None = None) -> int:
    """
    The one error formatter: C{failure} as C{PROG: error: TEXT} (nested
    reasons and OpenSSL errors unwrapped by L{describe}); the exit status.
    """
    stderr = stderr or sys.stderr
    if not isinstance(failure, Failure):
        failure = Failure(failure)
    if failure.check(BrokenPipeError):
        return EXIT_OK     # e.g. piped into head
    if failure.check(KeyboardInterrupt):
        return EXIT_INTERRUPTED
    stderr.write(f"{prog}: error: {error_text(failure)}\n")
    return EXIT_FAILURE


def error_text(error: Failure | BaseException) -> str:
    """An exception or failure as the text after C{error:}."""
    value = getattr(error, "value", error)
    if isinstance(value, CommandError):
        return str(value)
    return describe(error)


def emit(args: argparse.Namespace, out: TextIO, text: str | None, data: object) -> None:
    """
    Write a command's result: C{text} (a line, or None for nothing), or
    C{data} as one JSON document with C{-f json}.
    """
    if getattr(args, "format", "text") == "json":
        out.write(json.dumps(data, sort_keys=True) + "\n")
    elif text is not None:
        out.write(text + "\n")
