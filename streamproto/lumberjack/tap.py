"""
C{twistd lumberjack-server}: the Lumberjack (Beats) receiver, appending
events to a log of the embedded log store.

    twistd -n lumberjack-server --data /var/lib/streamproto --log beats \\
        --port mtls:5044:privateKey=server.key:certKey=server.pem:caCerts=ca.pem
"""

from twisted.python import usage

from streamproto.core.auth import ALLOW_ALL
from streamproto.core.tap import ServerOptions, non_negative_float, positive_int, server_service
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


class Options(ServerOptions):
    configTable = "lumberjack-server"
    defaultPort = "tcp:5044"
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

    def postOptions(self):
        super().postOptions()
        try:
            check_public_name(validate_name(self["log"]))
        except ValueError as e:
            raise usage.UsageError(str(e))


# room for the metadata spliced around an event (peer, TLS identity)
RECORD_OVERHEAD = 65536


def log_config(max_frame):
    """A new log's config: records big enough for the largest frame accepted."""
    default = LogConfig().max_record_size
    return LogConfig(max_record_size=min(0x7FFFFFFF, max(default, max_frame + RECORD_OVERHEAD)))


def factory_for_store(options, store):
    return LumberjackServerFactory(
        LogStoreSink(store, options["log"], log_config(options["max-frame"])),
        max_window=options["max-window"],
        max_frame=options["max-frame"],
        max_decompressed=options["max-decompressed"],
        idle_timeout=options["idle-timeout"],
        keepalive_interval=options["keepalive"],
        flush_bytes=options["flush-bytes"],
        max_buffered=options["max-buffered"],
        authorizer=options.get("authorizer", ALLOW_ALL),
    )


def makeService(options, store=None):
    return server_service(options, lambda s: factory_for_store(options, s), store,
                          name="lumberjack-server")
