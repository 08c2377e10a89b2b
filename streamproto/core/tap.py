"""
What every server plugin shares: the core options (C{--port}, repeatable,
C{--data} or C{--store}) and building listening services from endpoint
strings.

A protocol's C{tap.py} subclasses L{ServerOptions} and defines
C{makeService(options, store=None)}; with a store given (the umbrella
C{twistd streamproto}) it shares it, otherwise it opens its own on
C{--data} through L{StoreService}.
"""

import os
import sys

from twisted.application import service
from twisted.application.internet import StreamServerEndpointService
from twisted.internet import defer
from twisted.logger import ILogObserver, Logger
from twisted.python import usage

from streamproto.core.compat import endpoint_tls_options, fail_at_start
from streamproto.core.config import ConfigurableOptions
from streamproto.core.stores import STORE_PARAMETERS, StoreService, check_store_options

__all__ = ["ServerOptions", "ServerService", "StoreService", "check_auth_policy",
           "check_data_directory", "check_endpoint", "check_ops_options", "listen",
           "server_service", "watch_policy"]


class ServerOptions(ConfigurableOptions):
    """
    Core options.  Subclasses set C{defaultPort}, C{configTable} (their
    twistd name: their table in a C{--config} file) and add their own.
    """

    defaultPort = None
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
    localStores = ()

    def __init__(self):
        super().__init__()
        self["port"] = []

    def opt_port(self, description):
        # one line: usage.Options keeps a docstring's indentation in --help
        """Endpoint to listen on (repeatable), e.g. tcp:7123:interface=127.0.0.1, ssl:8443:privateKey=key.pem:certKey=cert.pem, or mtls:8443:privateKey=key.pem:certKey=cert.pem:caCerts=ca.pem to require client certificates."""
        self["port"].append(description)

    opt_p = opt_port

    def postOptions(self):
        if not self["port"] and self.defaultPort:
            self["port"] = [self.defaultPort]
        for description in self["port"]:
            check_endpoint("port", description)
        if check_store_options(self, self.localStores) is None:
            self["data"] = check_data_directory(self["data"])
        else:
            # the cluster holds everything: nothing of ours on local disk
            self["data"] = os.path.abspath(self["data"])
        check_ops_options(self)
        self["authorizer"] = check_auth_policy(self.get("auth-policy"))


def check_auth_policy(path):
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


def check_ops_options(options):
    if options["log-format"] not in ("text", "json"):
        raise usage.UsageError("--log-format must be text or json")
    if options["shutdown-timeout"] < 0:
        raise usage.UsageError("--shutdown-timeout must not be negative")
    if options["metrics"] and options["metrics"] != "none":
        check_endpoint("metrics", options["metrics"])


def check_endpoint(option, description):
    """
    Parse a server endpoint string now, so that a bad one is a usage error
    naming the option rather than a traceback when twistd starts.  Nothing
    listens: the string is parsed against a L{MemoryReactor}, which also
    reads (and so checks) the certificate and key files of C{ssl:}/C{mtls:}.
    """
    from twisted.internet.endpoints import serverFromString
    from twisted.internet.testing import MemoryReactor
    try:
        serverFromString(MemoryReactor(), description)
    except Exception as e:
        why = _describe(e)
        if description.startswith("systemd:"):
            why = (f"no socket passed by systemd matches it ({type(e).__name__}: {why}); "
                   "run it from a socket unit (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES)")
        raise usage.UsageError(f"--{option} {description!r}: {why}")


def check_data_directory(path, option="data"):
    """
    The absolute data directory, created if needed; a usage error naming
    the option if it cannot be created or written.  @return: the path.
    """
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise usage.UsageError(f"--{option} {path!r}: cannot create it: "
                               f"{e.strerror or _describe(e)}")
    if not os.path.isdir(path):
        raise usage.UsageError(f"--{option} {path!r}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise usage.UsageError(f"--{option} {path!r}: not writable by this user")
    return path


def _number(name, convert, accept, requirement, doc):
    """A coercer for usage.Options that names the option in its error."""
    def coerce(value):
        try:
            v = convert(value)
        except ValueError:
            raise ValueError(f"{name} must be {'an integer' if convert is int else 'a number'}")
        if not accept(v):
            raise ValueError(f"{name} must {requirement}")
        return v
    coerce.coerceDoc = doc
    return coerce


def positive_int(name):
    return _number(name, int, lambda v: v > 0, "be positive", "Positive integer.")


def positive_float(name):
    return _number(name, float, lambda v: v > 0, "be positive", "Positive number.")


def non_negative_float(name):
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

    def __init__(self, shutdown_timeout=3.0, log_format="text", clock=None):
        super().__init__()
        self.shutdown_timeout = shutdown_timeout
        self.log_format = log_format
        self.trackers = []
        self.clock = clock
        self.start_failure = None
        self._top = False

    def setServiceParent(self, parent):
        super().setServiceParent(parent)
        # twistd's application: a Componentized MultiService
        self._top = hasattr(parent, "setComponent")
        if self._top:
            # our own process: MiB buffers are reused, not faulted in anew
            from streamproto.core.memory import reuse_large_buffers
            reuse_large_buffers()
        if self.log_format == "json" and self._top:
            # twistd asks the application for its observer before logging starts
            from streamproto.core.ops import json_log_observer
            parent.setComponent(ILogObserver, json_log_observer(sys.stdout))

    def privilegedStartService(self):
        try:
            super().privilegedStartService()
        except Exception as e:
            self._cannot_start(e)

    def startService(self):
        if self.start_failure is not None:
            # binding failed already: start nothing, only be stoppable
            service.Service.startService(self)
            return
        try:
            super().startService()
        except Exception as e:
            self._cannot_start(e)

    def _cannot_start(self, error):
        if not self._top:
            raise error
        self.start_failure = error
        self.log.critical("{name} cannot start, stopping: {error}",
                          name=self.name or "streamproto", error=_describe(error))
        clock = self.clock
        if clock is None:
            from twisted.internet import reactor as clock
        # twistd starts the reactor next: stop at once (what did start is
        # stopped in order, the store closed), then exit non-zero
        clock.callWhenRunning(clock.stop)
        clock.addSystemEventTrigger("after", "shutdown", exit_now, 1)

    @defer.inlineCallbacks
    def stopService(self):
        service.Service.stopService(self)
        clock = self.clock
        if clock is None:
            from twisted.internet import reactor as clock
        children = list(self)
        listeners = [c for c in children if getattr(c, "_streamproto_listener", False)]
        yield defer.DeferredList([defer.maybeDeferred(c.stopService) for c in listeners
                                  if c.running])
        yield defer.DeferredList([t.drain(clock, self.shutdown_timeout) for t in self.trackers])
        for child in reversed(children):
            if child not in listeners and child.running:
                yield child.stopService()


def _describe(error):
    """An exception as one line for an operator: its message, not its repr."""
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


def exit_now(status):
    """
    End the process with C{status} once the reactor has shut down.  twistd
    has no way to set its exit status, and a failed start must not look
    like a clean stop to systemd or a shell.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def server_endpoint(description, reactor=None):
    """
    The server endpoint of an endpoint string; TLS ones (C{ssl:}, C{mtls:})
    accept clients offering ALPN protocols the server does not speak
    (L{streamproto.core.tls.tolerate_alpn}).
    """
    from twisted.internet.endpoints import serverFromString

    from streamproto.core.tls import tolerate_alpn
    if reactor is None:
        from twisted.internet import reactor
    endpoint = serverFromString(reactor, description)
    options = endpoint_tls_options(endpoint)
    if options is not None:
        tolerate_alpn(options)
    return endpoint


def listen(parent, descriptions, factory):
    """Add one listening service per endpoint description to C{parent}."""
    for description in descriptions:
        listener = StreamServerEndpointService(server_endpoint(description), factory)
        fail_at_start(listener)     # as strports.service: fail twistd at start
        listener._streamproto_listener = True
        listener.setServiceParent(parent)


def watch_policy(top, options):
    """
    Make C{--auth-policy}'s holder reload on SIGHUP while C{top} runs (a
    L{PolicyService} child; nothing without a policy).
    """
    authorizer = options.get("authorizer")
    if getattr(authorizer, "reload", None) is not None:
        from streamproto.core.auth import PolicyService
        PolicyService(authorizer).setServiceParent(top)


def server_service(options, factory_from_store, store=None, name=None):
    """
    The usual shape of a server's C{makeService}: a L{ServerService} owning
    the store (unless one is shared in), one listener per C{--port} serving
    the factory wrapped in a L{TrackingFactory}, and the metrics/health
    endpoint if C{--metrics} is given.

    @param factory_from_store: callable(store) -> server protocol factory.
    @param name: the server's name in logs and metrics (e.g. "styx").
    """
    from streamproto.core.ops import TrackingFactory, metrics_site

    top = ServerService(options.get("shutdown-timeout", 3.0), options.get("log-format", "text"))
    if name:
        top.setName(name)
    stores = []
    if store is None:
        owner = StoreService(options)
        store = owner.store
        owner.setServiceParent(top)  # first in, so stopped last
    stores.append(store)
    watch_policy(top, options)
    tracker = TrackingFactory(factory_from_store(store), name or "server")
    top.trackers.append(tracker)
    listen(top, options["port"], tracker)
    if options.get("metrics"):
        listen(top, [options["metrics"]], metrics_site(stores))
    return top
