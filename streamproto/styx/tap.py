"""
C{twistd styx-server}: the Styx HTTP API and styx/0 streams on one port.

    twistd -n styx-server --data ./data --port tcp:7123 \\
        --port ssl:7443:privateKey=key.pem:certKey=cert.pem
"""

from dataclasses import dataclass

from twisted.python import usage

from streamproto.core.tap import (
    ServerConfig, ServerOptions, as_config, common_fields, positive_int, server_service,
)
from streamproto.log.config import LogConfig
from streamproto.styx.resource import (
    DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_RESTORE_SIZE, DEFAULT_TIMEOUT, MIN_TIMEOUT,
)


def _timeout(value):
    try:
        v = int(value)
    except ValueError:
        raise ValueError("timeout must be an integer")
    if v < MIN_TIMEOUT:
        raise ValueError(f"timeout must be at least {MIN_TIMEOUT} seconds")
    return v


_timeout.coerceDoc = f"Seconds, at least {MIN_TIMEOUT}."


def _retention(name):
    def coerce(value):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer")
    coerce.coerceDoc = "Integer; -1 means unlimited."
    return coerce


_DEFAULTS = LogConfig()
DEFAULT_PORT = "tcp:7123"


@dataclass(frozen=True, kw_only=True)
class StyxServerConfig(ServerConfig):
    """
    What C{styx-server} is built from.

    @ivar cors_origins: origins allowed to call the API from browsers
        (empty: no CORS headers).
    @ivar log_config: the L{LogConfig} new logs get by default.
    """

    timeout: int = DEFAULT_TIMEOUT
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    http_idle_timeout: int = 60
    max_restore_size: int = DEFAULT_MAX_RESTORE_SIZE
    cors_origins: tuple = ("*",)
    log_config: LogConfig = _DEFAULTS
    access_log: bool = False

    @classmethod
    def from_options(cls, options):
        """See L{ServerConfig.from_options}; also sets C{cors_origins} and C{log_config}."""
        common = common_fields(options, DEFAULT_PORT)
        origins = options["cors-origin"] or ["*"]
        options["cors_origins"] = [] if origins == ["none"] else origins
        try:
            options["log_config"] = LogConfig(**{
                name: options[name.replace("_", "-")] for name in LogConfig.field_names()})
        except ValueError as e:
            raise usage.UsageError(str(e))
        return cls(**common, timeout=options["timeout"], max_body_size=options["max-body-size"],
                   http_idle_timeout=options["http-idle-timeout"],
                   max_restore_size=options["max-restore-size"],
                   cors_origins=tuple(options["cors_origins"]),
                   log_config=options["log_config"],
                   access_log=bool(options["access-log"]))


class Options(ServerOptions):
    """Options of C{twistd styx-server}."""

    configTable = "styx-server"
    configClass = StyxServerConfig

    defaultPort = DEFAULT_PORT
    optFlags = [
        ["access-log", None, "Log every HTTP request (off by default: it costs a tenth of a "
         "small request's time)."],
    ]
    optParameters = [
        ["timeout", "t", DEFAULT_TIMEOUT,
         "styx/0 heartbeat timeout in seconds (announced in X-Styx-Timeout).", _timeout],
        ["max-body-size", None, DEFAULT_MAX_BODY_SIZE,
         "Largest HTTP request body accepted (bytes); larger ones get 413.",
         positive_int("max-body-size")],
        ["http-idle-timeout", None, 60,
         "Seconds an HTTP connection may stay silent (keep-alive, slow "
         "requests) before it is closed.", positive_int("http-idle-timeout")],
        ["max-restore-size", None, DEFAULT_MAX_RESTORE_SIZE,
         "Largest backup accepted by POST /logs/restore (bytes; spooled to a "
         "temporary file while it arrives).", positive_int("max-restore-size")],
    ] + [
        [name.replace("_", "-"), None, getattr(_DEFAULTS, name),
         f"Default {name} of new logs (the create form may override it).",
         _retention(name)]
        for name in LogConfig.field_names()
    ]

    def __init__(self):
        super().__init__()
        self["cors-origin"] = []

    def opt_cors_origin(self, origin):
        # one line: usage.Options keeps a docstring's indentation in --help
        """Origin allowed to call the API from browsers, "*" wildcards allowed (repeatable; default "*" like the reference; "none" turns CORS off)."""
        self["cors-origin"].append(origin)


def build_service(config, store=None, reactor=None):
    """
    The styx-server service of C{config} (a L{StyxServerConfig}).

    @param store: a log store to share (default: one of its own).
    @param reactor: the reactor it runs on (default: the global one).
    """
    from streamproto.styx.resource import make_site

    def factory(the_store):
        return make_site(the_store, timeout=config.timeout, default_config=config.log_config,
                         max_body_size=config.max_body_size,
                         max_restore_size=config.max_restore_size,
                         cors_origins=config.cors_origins,
                         http_idle_timeout=config.http_idle_timeout,
                         authorizer=config.authorizer, clock=reactor,
                         access_log=config.access_log)

    return server_service(config, factory, store=store, name="styx-server", reactor=reactor)


def makeService(options, store=None, reactor=None):
    """twistd's entry point: L{build_service} of the parsed C{options}' config."""
    return build_service(as_config(options), store, reactor)
