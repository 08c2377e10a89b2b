"""
C{twistd lumberjack-server}: the Lumberjack (Beats) receiver, appending
events to a log of the embedded log store.

    twistd -n lumberjack-server --data /var/lib/streamproto --log beats \\
        --port mtls:5044:privateKey=server.key:certKey=server.pem:caCerts=ca.pem
"""

from dataclasses import dataclass

from twisted.python import usage

from streamproto.core.auth import ALLOW_ALL
from streamproto.core.tap import (
    ServerConfig, ServerOptions, as_config, common_fields, non_negative_float, positive_int,
    server_service,
)
from streamproto.log import LogConfig, validate_name
from streamproto.log.public import check_public_name
from streamproto.lumberjack.codec import (
    DEFAULT_MAX_DECOMPRESSED, DEFAULT_MAX_FRAME, DEFAULT_MAX_WINDOW,
)
from streamproto.lumberjack.server import (
    DEFAULT_FLUSH_BYTES, DEFAULT_IDLE_TIMEOUT, DEFAULT_KEEPALIVE_INTERVAL, DEFAULT_MAX_BUFFERED,
    LumberjackServerFactory,
)
from streamproto.lumberjack.sink import LogStoreSink


DEFAULT_PORT = "tcp:5044"


@dataclass(frozen=True, kw_only=True)
class LumberjackServerConfig(ServerConfig):
    """What C{lumberjack-server} is built from; C{log}: the log events go to."""

    log: str = "lumberjack"
    max_window: int = DEFAULT_MAX_WINDOW
    max_frame: int = DEFAULT_MAX_FRAME
    max_decompressed: int = DEFAULT_MAX_DECOMPRESSED
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    keepalive: float = DEFAULT_KEEPALIVE_INTERVAL
    flush_bytes: int = DEFAULT_FLUSH_BYTES
    max_buffered: int = DEFAULT_MAX_BUFFERED

    @classmethod
    def from_options(cls, options):
        """See L{ServerConfig.from_options}."""
        common = common_fields(options, DEFAULT_PORT)
        try:
            check_public_name(validate_name(options["log"]))
        except ValueError as e:
            raise usage.UsageError(str(e))
        return cls(**common, log=options["log"], max_window=options["max-window"],
                   max_frame=options["max-frame"], max_decompressed=options["max-decompressed"],
                   idle_timeout=options["idle-timeout"], keepalive=options["keepalive"],
                   flush_bytes=options["flush-bytes"], max_buffered=options["max-buffered"])


class Options(ServerOptions):
    configTable = "lumberjack-server"
    configClass = LumberjackServerConfig
    defaultPort = DEFAULT_PORT
    optParameters = ServerOptions.optParameters + [
        ["log", None, "lumberjack", "Name of the log the events are appended to."],
        ["max-window", None, DEFAULT_MAX_WINDOW, "Largest window (events per batch) accepted.",
         positive_int("--max-window")],
        ["max-frame", None, DEFAULT_MAX_FRAME, "Largest data frame, bytes.",
         positive_int("--max-frame")],
        ["max-decompressed", None, DEFAULT_MAX_DECOMPRESSED,
         "Largest compressed frame, compressed or inflated, bytes.",
         positive_int("--max-decompressed")],
        ["idle-timeout", None, DEFAULT_IDLE_TIMEOUT,
         "Close a connection after this many seconds without input.",
         non_negative_float("--idle-timeout")],
        ["keepalive", None, DEFAULT_KEEPALIVE_INTERVAL,
         "Seconds between keepalive ACK 0 frames while a batch is pending.",
         non_negative_float("--keepalive")],
        ["flush-bytes", None, DEFAULT_FLUSH_BYTES,
         "Persist and partially ack a large batch in parts of this many bytes.",
         positive_int("--flush-bytes")],
        ["max-buffered", None, DEFAULT_MAX_BUFFERED,
         "Memory budget of all connections together: bytes of events received and not yet "
         "stored; past it, new batches wait.", positive_int("--max-buffered")],
    ]


# room for the metadata spliced around an event (peer, TLS identity)
RECORD_OVERHEAD = 65536


def log_config(max_frame):
    """A new log's config: records big enough for the largest frame accepted."""
    default = LogConfig().max_record_size
    return LogConfig(max_record_size=min(0x7FFFFFFF, max(default, max_frame + RECORD_OVERHEAD)))


def factory_for_store(config, store, reactor=None):
    """The receiver's factory of C{config} (a L{LumberjackServerConfig}) on C{store}."""
    config = as_config(config)
    return LumberjackServerFactory(
        LogStoreSink(store, config.log, log_config(config.max_frame)),
        clock=reactor,
        max_window=config.max_window,
        max_frame=config.max_frame,
        max_decompressed=config.max_decompressed,
        idle_timeout=config.idle_timeout,
        keepalive_interval=config.keepalive,
        flush_bytes=config.flush_bytes,
        max_buffered=config.max_buffered,
        authorizer=config.authorizer or ALLOW_ALL,
    )


def build_service(config, store=None, reactor=None):
    """
    The lumberjack-server service of C{config} (a L{LumberjackServerConfig}).

    @param store: a log store to share (default: one of its own).
    @param reactor: the reactor it runs on (default: the global one).
    """
    return server_service(config, lambda s: factory_for_store(config, s, reactor), store,
                          name="lumberjack-server", reactor=reactor)


def makeService(options, store=None, reactor=None):
    """twistd's entry point: L{build_service} of the parsed C{options}' config."""
    return build_service(as_config(options), store, reactor)
