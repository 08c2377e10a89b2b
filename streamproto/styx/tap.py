"""
C{twistd styx-server}: the Styx HTTP API and styx/0 streams on one port.

    twistd -n styx-server --data ./data --port tcp:7123 \\
        --port ssl:7443:privateKey=key.pem:certKey=cert.pem
"""

from twisted.python import usage

from streamproto.core.tap import ServerOptions, positive_int, server_service
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


class Options(ServerOptions):
    """Options of C{twistd styx-server}."""

    configTable = "styx-server"

    defaultPort = "tcp:7123"
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

    def postOptions(self):
        super().postOptions()
        origins = self["cors-origin"] or ["*"]
        self["cors_origins"] = [] if origins == ["none"] else origins
        try:
            self["log_config"] = LogConfig(**{
                name: self[name.replace("_", "-")] for name in LogConfig.field_names()})
        except ValueError as e:
            raise usage.UsageError(str(e))


def makeService(options, store=None):
    from streamproto.styx.resource import make_site

    def factory(the_store):
        return make_site(the_store, timeout=options["timeout"],
                         default_config=options["log_config"],
                         max_body_size=options["max-body-size"],
                         max_restore_size=options["max-restore-size"],
                         cors_origins=options["cors_origins"],
                         http_idle_timeout=options["http-idle-timeout"],
                         authorizer=options["authorizer"])

    return server_service(options, factory, store=store, name="styx-server")
