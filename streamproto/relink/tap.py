"""
C{twistd relink-server}: the echo and log-bridge endpoints.

Default port: C{tcp:7350} (not assigned by IANA; chosen for this project).
"""

from twisted.python import usage

from streamproto.core.auth import ALLOW_ALL
from streamproto.core.tap import ServerOptions, positive_int, server_service
from streamproto.log.config import validate_name
from streamproto.log.public import check_public_name
from streamproto.relink.api import ListenerFactory
from streamproto.relink.config import LinkConfig
from streamproto.relink.endpoints import DEFAULT_LOG_TEMPLATE, SERVER_WINDOW, server_endpoints

DEFAULT_PORT = "tcp:7350"


def _id_size(value):
    size = int(value)
    if not 0 <= size <= 8:
        raise ValueError("channel id size must be 0..8")
    return size


_id_size.coerceDoc = "0..8."


class Options(ServerOptions):
    """Options of C{twistd relink-server}."""

    configTable = "relink-server"

    defaultPort = DEFAULT_PORT
    synopsis = "[options]"
    longdesc = ("Relink server: endpoint 'echo' sends every message back; 'log' and 'log-tx' "
                "(connector transactions) append channel N to the log named by --log.")
    optParameters = [
        ["log", None, DEFAULT_LOG_TEMPLATE,
         "Log name for channel N ({channel} is replaced by the channel id)."],
        ["id-size", None, 4, "Channel id size in bytes, both directions.", _id_size],
        ["window", None, SERVER_WINDOW, "Messages per channel we send (echoes) before "
         "waiting for acknowledgements.", positive_int("window")],
        ["max-unconsumed", None, LinkConfig.max_unconsumed,
         "Unconsumed incoming messages per channel before the connection stops reading "
         "(backpressure; also the largest transaction).", positive_int("max-unconsumed")],
        ["max-buffered-bytes", None, LinkConfig.max_buffered_bytes,
         "Unconsumed incoming bytes per link before the connection stops reading "
         "(backpressure; also the largest transaction).", positive_int("max-buffered-bytes")],
        ["window-bytes", None, 4 * 1024 * 1024,
         "Unconsumed payload bytes per channel we send on (a bigger message goes alone).",
         positive_int("window-bytes")],
        ["link-timeout", None, 60, "Seconds a disconnected link is kept for resumption.",
         positive_int("link-timeout")],
    ]

    def postOptions(self):
        super().postOptions()
        try:
            name = self["log"].format(channel=0)
        except (KeyError, IndexError, ValueError):
            raise usage.UsageError("--log may only contain {channel}")
        try:
            # checked now, not when the first message arrives
            validate_name(name)
        except ValueError:
            raise usage.UsageError(
                f"--log {self['log']!r}: channel 0 would go to {name!r}, not a valid log name "
                "(letters, digits, '_' and '-', at most 200 characters)")
        try:
            check_public_name(name)
        except ValueError as e:
            raise usage.UsageError(f"--log {self['log']!r}: {e}")


def makeService(options, store=None):
    config = LinkConfig(window=options["window"], max_queued=min(options["window"], 4096),
                        window_bytes=options["window-bytes"],
                        max_queued_bytes=options["window-bytes"],
                        link_timeout=options["link-timeout"],
                        max_unconsumed=options["max-unconsumed"],
                        max_buffered_bytes=options["max-buffered-bytes"])

    def factory(store):
        authorizer = options.get("authorizer")
        return ListenerFactory(server_endpoints(store, options["log"], options["id-size"],
                                                config, authorizer=authorizer or ALLOW_ALL),
                               config=config, authorizer=authorizer)

    return server_service(options, factory, store=store, name="relink-server")
