"""
C{twistd reliable-stream-server}: both modes on one port (default
C{tcp:7341}), sessions in SQLite under C{--data} (or in memory).

The umbrella C{twistd streamproto} passes its shared log store in; this
server does not use it: its sessions are small, short-lived key/value state
that fits SQLite better than an append-only log.
"""

import os
from dataclasses import dataclass

from twisted.application import service
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.core.interfaces import IReadiness
from streamproto.core.stores import cannot_start
from streamproto.log.interfaces import IStartingStore, log_problems
from streamproto.core.auth import ALLOW_ALL
from streamproto.core.tap import (
    ServerConfig, ServerOptions, ServerService, as_config, common_fields, listen, positive_float,
    positive_int, watch_policy,
)
from streamproto.reliable import codec
from streamproto.reliable.server import DEFAULT_WINDOW, SERVER_NAME, ReliableStreamFactory
from streamproto.reliable.session import DEFAULT_EXPIRY, MemorySessionStore, SQLiteSessionStore

DEFAULT_PORT = "tcp:7341"
SQLITE_FILE = "reliable-sessions.sqlite"
#: values of --store naming a session store of its own
LOCAL_STORES = ("sqlite", "memory")


@dataclass(frozen=True, kw_only=True)
class ReliableServerConfig(ServerConfig):
    """
    What C{reliable-stream-server} is built from; C{store} chooses the
    session store (C{sqlite}, C{memory}, or a NATS cluster: C{store_url}).
    """

    store: str | None = "sqlite"
    expiry: float = DEFAULT_EXPIRY
    rate: float | None = None
    max_line: int = codec.DEFAULT_MAX_LINE
    window: int = DEFAULT_WINDOW

    @classmethod
    def from_options(cls, options):
        """See L{ServerConfig.from_options}."""
        return cls(**common_fields(options, DEFAULT_PORT, LOCAL_STORES),
                   expiry=options["expiry"], rate=options["rate"],
                   max_line=options["max-line"], window=options["window"])


class Options(ServerOptions):
    configTable = "reliable-stream-server"
    configClass = ReliableServerConfig
    defaultPort = DEFAULT_PORT
    localStores = LOCAL_STORES
    optParameters = [
        ["expiry", None, DEFAULT_EXPIRY, "Seconds a disconnected session is kept.",
         positive_float("expiry")],
        ["rate", None, None, "Messages per second per connection (default: unlimited)",
         positive_float("rate")],
        ["max-line", None, codec.DEFAULT_MAX_LINE, "Longest accepted line, in bytes.",
         positive_int("max-line")],
        ["window", None, DEFAULT_WINDOW, "Messages a stateful connection keeps in flight.",
         positive_int("window")],
    ]

    def __init__(self):
        super().__init__()
        # the core --store, with this server's own session stores
        self["store"] = self.defaults["store"] = "sqlite"
        self.docs["store"] = (
            "Session store: sqlite (durable, under --data), memory, or "
            "nats://HOST:PORT[,...][?replicas=N&prefix=P] (tls://...): sessions in a "
            "JetStream key-value bucket, resumable on any front-end (doc/scale-out.rst).")


class SessionStoreService(service.Service):
    """Closes the session store (committing what is queued) when the server stops."""

    log = Logger()

    def __init__(self, store):
        self.store = store

    def startService(self):
        super().startService()
        if IStartingStore.providedBy(self.store):      # a JetStream bucket connects
            IStartingStore(self.store).start().addErrback(lambda f: cannot_start(
                self, f"session store cannot be reached: {f.getErrorMessage()}"))

    def stopService(self):
        super().stopService()
        return self.store.close()


class _FailedSessions:
    name = "sessions"

    def __init__(self, failure):
        self.failure = failure

    def info(self):
        return {"status": f"failed ({self.failure})"}


@implementer(IReadiness)
class SessionStoreHealth:
    """
    The session store as C{/ready} sees stores
    (L{streamproto.core.ops.store_problems}): not ready once closed or once
    a commit failed (the store then refuses every call until reopened), nor
    for the store's own L{IReadiness.problems} when it has them (a JetStream
    bucket disconnected).
    """

    def __init__(self, sessions):
        self.sessions = sessions

    def open_logs(self):
        failure = self.sessions.failure
        return [] if failure is None else [_FailedSessions(failure)]

    def problems(self):
        if self.sessions.closed:
            return ["store closed"]
        own = IReadiness(self.sessions, None)      # a JetStream bucket
        return (own.problems() if own is not None else []) + log_problems(self.open_logs())


def make_store(config, clock=None):
    """The session store of C{config} (a L{ReliableServerConfig})."""
    config = as_config(config)
    if config.store_url is not None:
        from streamproto.core.stores import store_tls_context
        from streamproto.reliable.natsessions import JetStreamSessionStore
        url = config.store_url
        return JetStreamSessionStore(url.servers, clock, expiry=config.expiry,
                                     prefix=url.prefix, replicas=url.replicas,
                                     tls=store_tls_context(config.store_options()))
    if config.store == "memory":
        return MemorySessionStore(clock, expiry=config.expiry)
    return SQLiteSessionStore(os.path.join(config.data, SQLITE_FILE), clock,
                              expiry=config.expiry, reactor=clock)


def build_service(config, store=None, reactor=None):
    """
    The reliable-stream-server service of C{config} (a L{ReliableServerConfig}).

    @param store: the umbrella's shared log store, not used (see the module
        docstring); the session store is opened here.
    @param reactor: the reactor it runs on (default: the global one).
    """
    from streamproto.core.ops import TrackingFactory, metrics_site

    # a ServerService stops the listeners, drains every connection (each
    # gets "server shutting down" once its stores are done), then the rest
    top = ServerService(config.shutdown_timeout, config.log_format, clock=reactor)
    top.setName(SERVER_NAME)
    sessions = make_store(config, reactor)
    # added first so that it stops last, after the connections are drained
    SessionStoreService(sessions).setServiceParent(top)
    watch_policy(top, config.authorizer)
    factory = ReliableStreamFactory(sessions, rate=config.rate, max_line=config.max_line,
                                    window=config.window, clock=reactor,
                                    authorizer=config.authorizer or ALLOW_ALL)
    tracker = TrackingFactory(factory, SERVER_NAME)
    top.trackers.append(tracker)
    listen(top, config.ports, tracker, reactor)
    if config.metrics:
        # no log store: /ready reports on the session store instead
        listen(top, [config.metrics], metrics_site([SessionStoreHealth(sessions)], reactor),
               reactor)
    return top


def makeService(options, store=None, reactor=None):
    """twistd's entry point: L{build_service} of the parsed C{options}' config."""
    return build_service(as_config(options), store, reactor)
