"""
C{twistd reliable-stream-server}: both modes on one port (default
C{tcp:7341}), sessions in SQLite under C{--data} (or in memory).

The umbrella C{twistd streamproto} passes its shared log store in; this
server does not use it: its sessions are small, short-lived key/value state
that fits SQLite better than an append-only log.
"""

import os

from twisted.application import service
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.core.interfaces import IReadiness
from streamproto.core.stores import cannot_start
from streamproto.log.interfaces import log_problems
from streamproto.core.auth import ALLOW_ALL
from streamproto.core.tap import (
    ServerOptions, ServerService, listen, positive_float, positive_int, watch_policy,
)
from streamproto.reliable import codec
from streamproto.reliable.server import DEFAULT_WINDOW, SERVER_NAME, ReliableStreamFactory
from streamproto.reliable.session import DEFAULT_EXPIRY, MemorySessionStore, SQLiteSessionStore

DEFAULT_PORT = "tcp:7341"
SQLITE_FILE = "reliable-sessions.sqlite"


class Options(ServerOptions):
    configTable = "reliable-stream-server"
    defaultPort = DEFAULT_PORT
    localStores = ("sqlite", "memory")
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
        start = getattr(self.store, "start", None)      # a JetStream bucket connects
        if start is not None:
            start().addErrback(lambda f: cannot_start(
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
        failure = getattr(self.sessions, "failure", None)
        return [] if failure is None else [_FailedSessions(failure)]

    def problems(self):
        if getattr(self.sessions, "closed", False):
            return ["store closed"]
        own = IReadiness(self.sessions, None)      # a JetStream bucket
        return (own.problems() if own is not None else []) + log_problems(self.open_logs())


def make_store(options, clock=None):
    url = options.get("store-url")
    if url is not None:
        from streamproto.core.stores import store_tls_context
        from streamproto.reliable.natsessions import JetStreamSessionStore
        return JetStreamSessionStore(url.servers, clock, expiry=options["expiry"],
                                     prefix=url.prefix, replicas=url.replicas,
                                     tls=store_tls_context(options))
    if options["store"] == "memory":
        return MemorySessionStore(clock, expiry=options["expiry"])
    os.makedirs(options["data"], exist_ok=True)
    return SQLiteSessionStore(os.path.join(options["data"], SQLITE_FILE), clock,
                              expiry=options["expiry"])


def makeService(options, store=None):
    """
    @param store: the umbrella's shared log store, not used (see the module
        docstring); the session store is opened here.
    """
    from streamproto.core.ops import TrackingFactory, metrics_site

    # a ServerService stops the listeners, drains every connection (each
    # gets "server shutting down" once its stores are done), then the rest
    top = ServerService(options["shutdown-timeout"], options["log-format"])
    top.setName(SERVER_NAME)
    sessions = make_store(options)
    # added first so that it stops last, after the connections are drained
    SessionStoreService(sessions).setServiceParent(top)
    watch_policy(top, options)
    factory = ReliableStreamFactory(sessions, rate=options["rate"], max_line=options["max-line"],
                                    window=options["window"],
                                    authorizer=options.get("authorizer", ALLOW_ALL))
    tracker = TrackingFactory(factory, SERVER_NAME)
    top.trackers.append(tracker)
    listen(top, options["port"], tracker)
    if options.get("metrics"):
        # no log store: /ready reports on the session store instead
        listen(top, [options["metrics"]], metrics_site([SessionStoreHealth(sessions)]))
    return top
