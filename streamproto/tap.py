"""
C{twistd streamproto}: every server built so far on its default port, over
one log store (one C{--data} for all, or one C{--store nats://...}).

Each server's config is made from values, not from a command line: its
options' defaults, its table of the C{--config} file and what the umbrella
decides for it, each set and coerced as its command line would, then
checked by its config class (the same rules and usage errors as C{twistd
<server>}); L{makeService} builds every server from its config with
C{build_service}.
"""

import importlib

from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import usage

from streamproto.core.config import ConfigurableOptions, set_option, table_values
from streamproto.core.stores import STORE_PARAMETERS, check_store_options
from streamproto.core.tap import (
    ServerService,
    StoreService,
    check_data_directory,
    check_auth_policy,
    check_endpoint,
    check_ops_options,
    listen,
)

log = Logger()

# (protocol package, twistd name); a server joins once its tap module exists.
SERVERS = [
    ("styx", "styx-server"),
    ("pravega", "pravega-server"),
    ("lumberjack", "lumberjack-server"),
    ("reliable", "reliable-stream-server"),
    ("relink", "relink-server"),
]


def available_servers():
    """[(name, tap module)] for every server whose tap module imports."""
    found = []
    for package, name in SERVERS:
        try:
            module = importlib.import_module(f"streamproto.{package}.tap")
        except ModuleNotFoundError as e:
            # not built yet; any other missing module is a real error
            if e.name not in (f"streamproto.{package}", f"streamproto.{package}.tap"):
                raise
            continue
        found.append((name, module))
    return found


class Options(ConfigurableOptions):
    configTable = "streamproto"
    optParameters = [
        ["data", "d", "streamproto-data", "Data directory shared by every server."],
        ["metrics", None, "tcp:9180:interface=127.0.0.1",
         "Endpoint of the metrics/health HTTP server (/metrics, /health, /ready); "
         "'none' to turn it off."],
        ["shutdown-timeout", None, 3.0,
         "Seconds to let connections finish their in-flight work on shutdown.", float],
        ["log-format", None, "text", "Log format: text or json (one JSON object a line)."],
        ["auth-policy", None, None,
         "TOML authorization policy shared by every server (doc/security.rst); "
         "reloaded on SIGHUP.  Without it everything is allowed."],
        ["pravega-controller", None, "tcp:9090",
         "Endpoint of pravega-server's gRPC controller: tcp:PORT[:interface=HOST], "
         "ssl:PORT:privateKey=..[:certKey=..], mtls:..:caCerts=.., or 'none' for no "
         "controller (segment store only)."],
        ["pravega-advertise", None, None,
         "HOST:PORT of the Pravega segment store as the controller hands it to clients."],
        ["pravega-retention-interval", None, None,
         "Seconds between the Pravega controller's retention rounds (default 60; 0: never)."],
    ] + STORE_PARAMETERS

    def __init__(self):
        super().__init__()
        self["ports"] = {}

    def opt_listen(self, value):
        # one line: usage.Options keeps a docstring's indentation in --help
        """NAME=ENDPOINT: listen for server NAME (e.g. styx-server) on ENDPOINT instead of its default port (repeatable)."""
        name, sep, endpoint = value.partition("=")
        if not sep:
            raise usage.UsageError("--listen takes NAME=ENDPOINT")
        self["ports"].setdefault(name, []).append(endpoint)

    def opt_only(self, value):
        """Comma-separated server names to run (default: all)."""
        self["only"] = [v.strip() for v in value.split(",") if v.strip()]

    def postOptions(self):
        check_ops_options(self)
        if check_store_options(self) is None:
            self["data"] = check_data_directory(self["data"])
        check_auth_policy(self["auth-policy"])
        for endpoints in self["ports"].values():
            for description in endpoints:
                check_endpoint("listen", description)
        servers = dict(available_servers())
        known = set(servers)
        for name in list(self["ports"]) + self.get("only", []):
            if name not in known:
                raise usage.UsageError(f"unknown server {name!r}; known: {sorted(known)}")
        if self["pravega-controller"] == "none" and (
                self["pravega-advertise"] or self["pravega-retention-interval"] is not None):
            raise usage.UsageError("--pravega-advertise and --pravega-retention-interval "
                                   "need a --pravega-controller")
        document = self.config_document or {}
        for table in document:
            if table != self.configTable and table not in known:
                raise usage.UsageError(f"--config {self['config']!r}: unknown table "
                                       f"[{table}]; known: {sorted(known | {'streamproto'})}")
        # every server's options are checked now, not when twistd builds the service
        #: server name -> its option values (its Options, not parsed: set)
        self.server_options = {}
        #: server name -> its config (a ServerConfig), what it is built from
        self.server_configs = {}
        for name, module in servers.items():
            if self.get("only") and name not in self["only"]:
                continue
            sub = server_options(name, module, self)
            self.server_options[name] = sub
            self.server_configs[name] = sub.config


#: options every server of the umbrella shares: set once, for all of them
SHARED = ("data", "metrics", "log-format", "shutdown-timeout", "auth-policy")
#: the log store is shared too (reliable-stream-server's --store also
#: chooses its session store, so its table may set it)
STORE_KEYS = ("store", "store-ca", "store-cert", "store-key")


def server_options(name, module, options):
    """
    Server C{name}'s option values under the umbrella, without a command
    line: its C{module.Options} defaults, its table of the C{--config} file,
    then what the umbrella decides for it (the shared data directory, its
    C{--listen} endpoints, the C{--pravega-*} options given explicitly),
    each set as its command line would set it (L{set_option}), then
    checked by its config class.

    @return: the server's C{module.Options}, with its C{config}.
    @raise usage.UsageError: naming the server.
    """
    sub = module.Options()
    table = dict((options.config_document or {}).get(name, {}))
    where = f"--config {options.get('config')!r} [{name}]"
    for key in table:
        shared_store = key.replace("_", "-") in STORE_KEYS and name != "reliable-stream-server"
        if key.replace("_", "-") in SHARED or shared_store:
            raise usage.UsageError(f"{where}: {key!r} is shared by every server: set it in "
                                   "[streamproto]")
    ports = options["ports"].get(name, [])
    values = table_values(sub, table, where, skip={"port"} if ports else set())
    values += [("data", options["data"]), ("shutdown-timeout", options["shutdown-timeout"])]
    if options.get("auth-policy"):
        values.append(("auth-policy", options["auth-policy"]))
    values += [("port", endpoint) for endpoint in ports]
    values += server_values(name, options, table)
    try:
        for key, value in values:
            set_option(sub, key, value)
        sub.config = sub.configClass.from_options(sub)
    except usage.UsageError as e:
        raise usage.UsageError(f"{name}: {e}")
    return sub


def server_values(name, options, table=None):
    """The umbrella options that go on to server C{name}: C{(long name, value)} pairs."""
    values = []
    table = table or {}
    if options.get("store") and not (name == "reliable-stream-server" and "store" in table):
        # every server on the umbrella's cluster (reliable keeps its sessions
        # there too, unless its own table says otherwise)
        values.append(("store", options["store"]))
        for key in ("store-ca", "store-cert", "store-key"):
            if options.get(key):
                values.append((key, options[key]))
    if name == "pravega-server":
        # the umbrella's default controller, unless [pravega-server] sets one
        if "pravega-controller" in options.explicit or "controller" not in table:
            values.append(("controller", options["pravega-controller"]))
        if options["pravega-advertise"]:
            values.append(("advertise", options["pravega-advertise"]))
        if options["pravega-retention-interval"] is not None:
            values.append(("retention-interval", options["pravega-retention-interval"]))
    return values


class UmbrellaService(ServerService):
    """Stops every server at once (each drains its connections), then the store."""

    @defer.inlineCallbacks
    def stopService(self):
        service.Service.stopService(self)
        children = list(self)
        stores = [c for c in children if isinstance(c, StoreService)]
        yield defer.DeferredList([defer.maybeDeferred(c.stopService) for c in children
                                  if c not in stores and c.running])
        for store in stores:
            yield store.stopService()


def makeService(options, reactor=None):
    """
    Every server (of C{--only}) on one store, from the configs made while
    C{options} were parsed.

    @param reactor: the reactor everything runs on (default: the global one).
    """
    from streamproto.core.ops import metrics_site

    top = UmbrellaService(options["shutdown-timeout"], options["log-format"], clock=reactor)
    owner = StoreService(options, reactor=reactor)
    owner.setServiceParent(top)
    if options["metrics"] and options["metrics"] != "none":
        listen(top, [options["metrics"]], metrics_site([owner.store], clock=reactor), reactor)
    only = options.get("only")
    configs = getattr(options, "server_configs", {})
    for name, module in available_servers():
        if only and name not in only:
            continue
        config = configs.get(name) or server_options(name, module, options).config
        module.build_service(config, store=owner.store, reactor=reactor).setServiceParent(top)
        log.info("streamproto: {name} on {ports}", name=name, ports=list(config.ports))
    return top
