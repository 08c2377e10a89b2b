"""
What every server plugin shares: the core options (C{--port}, repeatable,
C{--data} or C{--store}) and building listening services from endpoint
strings.

A protocol's C{tap.py} has three parts, as magic-wormhole-transit-relay's
C{server_tap.py}: a frozen L{ServerConfig} subclass (what the server is
built from; C{from_options(options)} checks a mapping of option values
and makes one), a L{ServerOptions} subclass (the command line, whose
C{postOptions} makes that config: C{options.config}), and
C{build_service(config, store=None, reactor=None)}, with
C{makeService(options, store=None, reactor=None)} for twistd.  With a
store given (the umbrella C{twistd streamproto}) the server shares it,
otherwise it opens its own on C{--data} through L{StoreService}.  The
reactor given is the one every listener, factory and store uses (default:
the global one, imported only when needed).
"""

import os
import sys
from collections.abc import Callable, Collection, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Self, TypeVar, cast

from twisted.application import service
from twisted.application.internet import StreamServerEndpointService
from twisted.internet import defer
from twisted.internet.interfaces import IProtocolFactory, IStreamServerEndpoint
from twisted.logger import ILogObserver, Logger
from twisted.python import usage

from streamproto.core.auth import ALLOW_ALL, IAuthorizer
from streamproto.core.clock import default_reactor
from streamproto.core.compat import endpoint_tls_options, fail_at_start
from streamproto.core.config import ConfigurableOptions
from streamproto.core.endpoints import parse_endpoint
from streamproto.base.durable import make_dirs
from streamproto.core.stores import STORE_PARAMETERS, Options, StoreService, check_store_options
from streamproto.log.interfaces import ILogStore

if TYPE_CHECKING:
    from streamproto.core.ops import TrackingFactory

_T = TypeVar("_T", int, float)

__all__ = ["ServerConfig", "ServerOptions", "ServerService", "StoreService", "as_config",
           "check_auth_policy", "check_data_directory", "check_endpoint", "check_ops_options",
           "common_fields", "listen", "server_service", "watch_policy"]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """
    What every server is built from (its core options, checked): a
    server's own config class adds its fields.

    @ivar ports: endpoint descriptions to listen on.
    @ivar data: the absolute data directory.
    @ivar store: C{--store} as given (None: the file store under C{data}).
    @ivar store_url: C{store} parsed (a L{StoreURL}), or None.
    @ivar metrics: endpoint of the metrics/health server, or None.
    @ivar authorizer: the L{streamproto.core.auth.IAuthorizer} of
        C{auth_policy} (a L{PolicyHolder}), or L{ALLOW_ALL}.
    """

    ports: tuple[str, ...] = ()
    data: str = ""
    store: str | None = None
    store_url: object = None
    store_ca: str | None = None
    store_cert: str | None = None
    store_key: str | None = None
    metrics: str | None = None
    shutdown_timeout: float = 3.0
    log_format: str = "text"
    auth_policy: str | None = None
    authorizer: object = ALLOW_ALL

    @classmethod
    def from_options(cls, options: Options) -> Self:
        """
        Check C{options} (a mapping of long option names to values, such as
        a parsed L{ServerOptions}) and make the config; the values derived
        on the way (C{store-url}, C{authorizer}, the default port) are also
        set in C{options}.  @raise usage.UsageError: as the command line
        reports it.
        """
        return cls(**common_fields(options, getattr(options, "defaultPort", None),
                                   getattr(options, "localStores", ())))

    def store_options(self) -> dict[str, Any]:
        """The store options as L{StoreService} and L{store_tls_context} take them."""
        return {"data": self.data, "store": self.store, "store-url": self.store_url,
                "store-ca": self.store_ca, "store-cert": self.store_cert,
                "store-key": self.store_key}


def common_fields(options: Options, default_port: str | None = None,
                  local_stores: Collection[str] = ()) -> dict[str, Any]:
    """
    Check the core options in C{options} (a mutable mapping) as every
    server's command line does, completing them (the default port, the
    absolute data directory, C{store-url}, C{authorizer}).

    @param local_stores: values of C{--store} that name a store of the
        server's own (see L{check_store_options}).
    @return: the L{ServerConfig} fields, as keyword arguments.
    @raise usage.UsageError: naming the option.
    """
    if not options["port"] and default_port:
        options["port"] = [default_port]
    for description in options["port"]:
        check_endpoint("port", description)
    if check_store_options(options, local_stores) is None:
        options["data"] = check_data_directory(options["data"])
    else:
        # the cluster holds everything: nothing of ours on local disk
        options["data"] = os.path.abspath(options["data"])
    check_ops_options(options)
    options["authorizer"] = check_auth_policy(options.get("auth-policy"))
    return dict(ports=tuple(options["port"]), data=options["data"],
                store=options.get("store"), store_url=options["store-url"],
                store_ca=options.get("store-ca"), store_cert=options.get("store-cert"),
                store_key=options.get("store-key"), metrics=options.get("metrics"),
                shutdown_timeout=options["shutdown-timeout"], log_format=options["log-format"],
                auth_policy=options.get("auth-policy"), authorizer=options["authorizer"])


def as_config(options: "ServerConfig | ServerOptions") -> ServerConfig:
    """
    The config of C{options}: a parsed L{ServerOptions} (its C{config}), or
    a L{ServerConfig} already.
    """
    config = getattr(options, "config", None)
    # no parsed config: C{options} is a ServerConfig already
    return config if isinstance(config, ServerConfig) else cast(ServerConfig, options)


class ServerOptions(ConfigurableOptions):
    """
    Core options.  Subclasses set C{defaultPort}, C{configTable} (their
    twistd name: their table in a C{--config} file), C{configClass} (their
    L{ServerConfig}, which checks the options) and add their own.

    @ivar config: once parsed, the C{configClass} of the options.
    """

    #: set by L{postOptions}
    config: ServerConfig

    defaultPort: str | None = None
    configClass: type[ServerConfig] = ServerConfig
    optParameters = [
        ["data", "d", "streamproto-data", "Data directory of the embedded log store."],
        ["metrics", None, None,
         "Endpoint for the metrics/health HTTP server (/metrics, /health, /ready), "
         "e.g. tcp:9100:interface=127.0.0.1.  Off by default."],
        ["shutdown-timeout", None, 3.0,
         "Seconds to let connections finish their in-flight work on shutdown.", float],
        ["log-format", None, "text", "Log format: text or json (one JSON object a line)."],
        ["auth-policy", None, None,
         "TOML authorization policy: who may read, write, administer which logs "
         "(doc/security.rst); reloaded on SIGHUP.  Without it everything is allowed."],
    ] + STORE_PARAMETERS

    #: values of C{--store} that name a store of the server's own (not logs)
    localStores: Collection[str] = ()

    def __init__(self) -> None:
        super().__init__()
        self["port"] = []

    def opt_port(self, description: str) -> None:
        # one line: usage.Options keeps a docstring's indentation in --help
        """Endpoint to listen on (repeatable), e.g. tcp:7123:interface=127.0.0.1, ssl:8443:privateKey=key.pem:certKey=cert.pem, or mtls:8443:privateKey=key.pem:certKey=cert.pem:caCerts=ca.pem to require client certificates."""
        self["port"].append(description)

    opt_p = opt_port

    def postOptions(self) -> None:
        self.config = self.configClass.from_options(self)


def check_auth_policy(path: str | None) -> IAuthorizer:
    """
    The authorizer of C{--auth-policy}: a L{PolicyHolder} of the file, or
    L{ALLOW_ALL} without one.  @raise usage.UsageError: the file cannot be
    read or is not a valid policy (the message says which key and why).
    """
    from streamproto.core.auth import ALLOW_ALL, PolicyError, PolicyHolder
    if not path:
        return ALLOW_ALL
    try:
        return PolicyHolder(path)
    except PolicyError as e:
        raise usage.UsageError(f"--auth-policy {e}")


def check_ops_options(options: Options) -> None:
    if options["log-format"] not in ("text", "json"):
        raise usage.UsageError("--log-format must be text or json")
    if options["shutdown-timeout"] < 0:
        raise usage.UsageError("--shutdown-timeout must not be negative")
    if options["metrics"] and options["metrics"] != "none":
        check_endpoint("metrics", options["metrics"])


def check_endpoint(option: str, description: str) -> None:
    """
    Parse a server endpoint string now, so that a bad one is a usage error
    naming the option rather than a traceback when twistd starts.  Nothing
    listens: the string is parsed against a L{MemoryReactor}, which also
    reads (and so checks) the certificate and key files of C{ssl:}/C{mtls:}.
    """
    from twisted.internet.endpoints import serverFromString
    from twisted.internet.testing import MemoryReactor
    try:
        serverFromString(MemoryReactor(), description)  # type: ignore[no-untyped-call]  # untyped in Twisted
    except Exception as e:
        why = _describe(e)
        if description.startswith("systemd:"):
            why = (f"no socket passed by systemd matches it ({type(e).__name__}: {why}); "
                   "run it from a socket unit (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES)")
        raise usage.UsageError(f"--{option} {description!r}: {why}")


def check_data_directory(path: str, option: str = "data") -> str:
    """
    The absolute data directory, created if needed; a usage error naming
    the option if it cannot be created or written.  @return: the path.
    """
    path = os.path.abspath(path)
    try:
        # durable: a power loss must not take back a directory acks depend on
        make_dirs(path)
    except OSError as e:
        raise usage.UsageError(f"--{option} {path!r}: cannot create it: "
                               f"{e.strerror or _describe(e)}")
    if not os.path.isdir(path):
        raise usage.UsageError(f"--{option} {path!r}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise usage.UsageError(f"--{option} {path!r}: not writable by this user")
    return path


def _number(name: str, convert: Callable[[str], _T], accept: Callable[[_T], bool],
            requirement: str, doc: str) -> Callable[[str], _T]:
    """A coercer for usage.Options that names the option in its error."""
    def coerce(value: str) -> _T:
        try:
            v = convert(value)
        except ValueError:
            raise ValueError(f"{name} must be {'an integer' if convert is int else 'a number'}")
        if not accept(v):
            raise ValueError(f"{name} must {requirement}")
        return v
    coerce.coerceDoc = doc  # type: ignore[attr-defined]  # read by usage.Options for --help
    return coerce


def positive_int(name: str) -> Callable[[str], int]:
    return _number(name, int, lambda v: v > 0, "be positive", "Positive integer.")


def positive_float(name: str) -> Callable[[str], float]:
    return _number(name, float, lambda v: v > 0, "be positive", "Positive number.")


def non_negative_float(name: str) -> Callable[[str], float]:
    return _number(name, float, lambda v: v >= 0, "not be negative",
                   "Seconds; 0 turns it off.")


class ServerService(service.MultiService):
    """
    A server's services, stopped in order: listeners first, then every
    tracked connection is drained (bounded by C{shutdown_timeout}), then the
    rest (the store last, as it was added first).  Also installs the JSON
    log observer on the twistd application when asked to.

    Start-up is all or nothing.  When this is the application's top service
    (twistd), a child that cannot start (a port in use, a controller that
    cannot bind) is one critical log line, then whatever did start is
    stopped and the process exits with status 1: never a half-started
    server holding its other ports and answering nothing.  Anywhere else
    (embedded in a program's own services) the error is raised as usual.

    @ivar start_failure: the exception that stopped start-up, or None.
    """

    log = Logger()

    def __init__(self, shutdown_timeout: float = 3.0, log_format: str = "text",
                 clock: Any = None, gc: Any = None, sys_module: Any = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.shutdown_timeout = shutdown_timeout
        self.log_format = log_format
        self.trackers: list[TrackingFactory] = []
        self.clock = clock
        #: the garbage collector tuned when this is the process's server
        #: (streamproto.core.gcpolicy): the C{gc} module unless a test's
        self._gc = gc
        #: the interpreter whose switch interval is shortened then
        #: (streamproto.core.gil): this one unless a test's
        self._sys = sys_module or sys
        self.start_failure: Exception | None = None
        self._top = False
        #: (soft RLIMIT_NOFILE before, after raising it), when this is the process's server
        self.open_files_limit: tuple[int, int] | None = None

    def setServiceParent(self, parent: service.IServiceCollection) -> None:
        super().setServiceParent(parent)  # type: ignore[no-untyped-call]  # untyped in Twisted
        # twistd's application: a Componentized MultiService
        self._top = hasattr(parent, "setComponent")
        if self._top:
            # our own process: MiB buffers are reused, not faulted in anew
            from streamproto.core.memory import reuse_large_buffers
            reuse_large_buffers()
            # one descriptor per connection: do not stop at the soft 1024
            from streamproto.core.fdlimit import raise_open_files_limit
            self.open_files_limit = raise_open_files_limit()
            # full collections' pauses were every request's p99
            import gc as gc_module

            from streamproto.core.gcpolicy import tune_for_server
            tune_for_server(default_reactor(self.clock), self._gc or gc_module)
            # the fsync thread's results reach the reactor sooner
            from streamproto.core.gil import shorten_switch_interval
            shorten_switch_interval(self._sys)
            # no step of the wall clock fires or holds back the timers
            from streamproto.core.clock import steady_timers
            steady_timers(default_reactor(self.clock))
        if self.log_format == "json" and self._top:
            # twistd asks the application for its observer before logging starts
            from streamproto.core.ops import json_log_observer
            application: Any = parent  # a Componentized (above): untyped in Twisted
            application.setComponent(ILogObserver, json_log_observer(sys.stdout))

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        except Exception as e:
            self._cannot_start(e)

    def startService(self) -> None:
        if self._top:
            self._log_process_state()
        if self.start_failure is not None:
            # binding failed already: start nothing, only be stoppable
            service.Service.startService(self)  # type: ignore[no-untyped-call]  # untyped in Twisted
            return
        try:
            super().startService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        except Exception as e:
            self._cannot_start(e)

    def _log_process_state(self) -> None:
        """
        What an operator should know of this process at start-up: the C
        accelerator missing (a warning, with its cost), the open-files
        limit.
        """
        from streamproto.core import accelerator
        warning = accelerator.warning()
        if warning is not None:
            self.log.warn("{name}: {warning}", name=self.name or "streamproto", warning=warning)
        else:
            self.log.info("C accelerator loaded ({path})", path=accelerator.details()["path"])
        if self.open_files_limit is not None:
            before, after = self.open_files_limit
            self.log.info("open files limit: {after} (was {before})", before=before, after=after)

    def _cannot_start(self, error: Exception) -> None:
        if not self._top:
            raise error
        self.start_failure = error
        self.log.critical("{name} cannot start, stopping: {error}",
                          name=self.name or "streamproto", error=_describe(error))
        clock = default_reactor(self.clock)
        # twistd starts the reactor next: stop at once (what did start is
        # stopped in order, the store closed), then exit non-zero
        clock.callWhenRunning(clock.stop)
        clock.addSystemEventTrigger("after", "shutdown", exit_now, 1)

    @defer.inlineCallbacks
    def stopService(self) -> Generator[defer.Deferred[Any], Any, None]:
        service.Service.stopService(self)  # type: ignore[no-untyped-call]  # untyped in Twisted
        clock = default_reactor(self.clock)
        children = list(self)
        listeners = [c for c in children if getattr(c, "_streamproto_listener", False)]
        yield defer.DeferredList([defer.maybeDeferred(c.stopService) for c in listeners
                                  if c.running])
        yield defer.DeferredList([t.drain(clock, self.shutdown_timeout) for t in self.trackers])
        for child in reversed(children):
            if child not in listeners and child.running:
                yield child.stopService()


def _describe(error: BaseException) -> str:
    """An exception as one line for an operator: its message, not its repr."""
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


def exit_now(status: int) -> NoReturn:
    """
    End the process with C{status} once the reactor has shut down.  twistd
    has no way to set its exit status, and a failed start must not look
    like a clean stop to systemd or a shell.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


#: the listen queue of a TCP server endpoint that names none.  Twisted's
#: default is 50: a burst of connections beyond it (10,000 clients
#: reconnecting after a restart, a load balancer's warm-up) overflows the
#: queue, and each dropped SYN waits for the client's retransmission, 1 s
#: then 3 s.  Measured with bench/connections.py, 8,000 connections opened
#: 250 at a time took 46 s at 50 (doc/performance.rst).  The kernel caps it
#: at net.core.somaxconn (4096 on current Linux).
LISTEN_BACKLOG = 4096


def with_backlog(description: str) -> str:
    """
    C{description} with C{backlog=}L{LISTEN_BACKLOG} when it is a TCP
    endpoint (C{tcp}, C{tcp6}, C{ssl}, C{mtls}) that names no backlog.
    """
    parsed = parse_endpoint(description)
    if parsed.kind in ("tcp", "tcp6", "ssl", "mtls") and "backlog" not in parsed.options:
        return f"{description}:backlog={LISTEN_BACKLOG}"
    return description


def server_endpoint(description: str, reactor: Any = None) -> IStreamServerEndpoint:
    """
    The server endpoint of an endpoint string; TLS ones (C{ssl:}, C{mtls:})
    accept clients offering ALPN protocols the server does not speak
    (L{streamproto.core.tls.tolerate_alpn}).
    """
    from twisted.internet.endpoints import serverFromString

    from streamproto.core.tls import tolerate_alpn
    endpoint: IStreamServerEndpoint = serverFromString(default_reactor(reactor),
                                                       with_backlog(description))
    options = endpoint_tls_options(endpoint)
    if options is not None:
        tolerate_alpn(options)
    return endpoint


def listen(parent: service.IServiceCollection, descriptions: Iterable[str],
           factory: IProtocolFactory, reactor: Any = None) -> None:
    """
    Add one listening service per endpoint description to C{parent}.

    @param reactor: the reactor listening (default: the global one).
    """
    for description in descriptions:
        listener = StreamServerEndpointService(  # type: ignore[no-untyped-call]  # untyped in Twisted
            server_endpoint(description, reactor), factory)
        fail_at_start(listener)     # as strports.service: fail twistd at start
        # our mark, read by ServerService.stopService
        listener._streamproto_listener = True  # type: ignore[attr-defined]
        listener.setServiceParent(parent)  # type: ignore[no-untyped-call]  # untyped in Twisted


def watch_policy(top: service.IServiceCollection, authorizer: object) -> None:
    """
    Make C{authorizer}, C{--auth-policy}'s holder, reload on SIGHUP while
    C{top} runs (a L{PolicyService} child; nothing without a policy).
    """
    if getattr(authorizer, "reload", None) is not None:
        from streamproto.core.auth import PolicyHolder, PolicyService
        # only a PolicyHolder reloads
        holder = cast("PolicyHolder", authorizer)
        PolicyService(holder).setServiceParent(top)  # type: ignore[no-untyped-call]  # untyped in Twisted


def server_service(config: "ServerConfig | ServerOptions",
                   factory_from_store: Callable[[ILogStore], IProtocolFactory],
                   store: ILogStore | None = None, name: str | None = None,
                   reactor: Any = None) -> ServerService:
    """
    The usual shape of a server's C{build_service}: a L{ServerService}
    owning the store (unless one is shared in), one listener per port
    serving the factory wrapped in a L{TrackingFactory}, and the
    metrics/health endpoint if C{config.metrics} is set.

    @param config: a L{ServerConfig} (or parsed L{ServerOptions}).
    @param factory_from_store: callable(store) -> server protocol factory.
    @param name: the server's name in logs and metrics (e.g. "styx").
    @param reactor: the reactor everything runs on (default: the global one).
    """
    from streamproto.core.ops import TrackingFactory, metrics_site

    config = as_config(config)
    top = ServerService(config.shutdown_timeout, config.log_format, clock=reactor)
    if name:
        top.setName(name)  # type: ignore[no-untyped-call]  # untyped in Twisted
    stores: list[ILogStore] = []
    if store is None:
        owner = StoreService(config.store_options(), reactor=reactor)
        store = owner.store
        owner.setServiceParent(top)  # type: ignore[no-untyped-call]  # first in, so stopped last
    stores.append(store)
    watch_policy(top, config.authorizer)
    tracker = TrackingFactory(factory_from_store(store), name or "server")
    top.trackers.append(tracker)
    listen(top, config.ports, tracker, reactor)
    if config.metrics:
        listen(top, [config.metrics], metrics_site(stores, clock=reactor), reactor)
    return top
