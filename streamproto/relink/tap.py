"""
C{twistd relink-server}: the echo and log-bridge endpoints.

Default port: C{tcp:7350} (not assigned by IANA; chosen for this project).
"""

from dataclasses import dataclass

from twisted.python import usage

from streamproto.core.auth import ALLOW_ALL
from streamproto.core.tap import (
    ServerConfig, ServerOptions, as_config, common_fields, positive_int, server_service,
)
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


@dataclass(frozen=True, kw_only=True)
class RelinkServerConfig(ServerConfig):
    """
    What C{relink-server} is built from; C{log}: the log name template of
    channel N (C{{channel}} replaced by N).
    """

    log: str = DEFAULT_LOG_TEMPLATE
    id_size: int = 4
    window: int = SERVER_WINDOW
    max_unconsumed: int = LinkConfig.max_unconsumed
    max_buffered_bytes: int = LinkConfig.max_buffered_bytes
    window_bytes: int = 4 * 1024 * 1024
    link_timeout: int = 60

    @classmethod
    def from_options(cls, options):
        """See L{ServerConfig.from_options}."""
        common = common_fields(options, DEFAULT_PORT)
        try:
            name = options["log"].format(channel=0)
        except (KeyError, IndexError, ValueError):
            raise usage.UsageError("--log may only contain {channel}")
        try:
            # checked now, not when the first message arrives
            validate_name(name)
        except ValueError:
            raise usage.UsageError(
                f"--log {options['log']!r}: channel 0 would go to {name!r}, not a valid log "
                "name (letters, digits, '_' and '-', at most 200 characters)")
        try:
            check_public_name(name)
        except ValueError as e:
            raise usage.UsageError(f"--log {options['log']!r}: {e}")
        return cls(**common, log=options["log"], id_size=options["id-size"],
                   window=options["window"], max_unconsumed=options["max-unconsumed"],
                   max_buffered_bytes=options["max-buffered-bytes"],
                   window_bytes=options["window-bytes"], link_timeout=options["link-timeout"])

    def link_config(self):
        """The L{LinkConfig} of every link."""
        return LinkConfig(window=self.window, max_queued=min(self.window, 4096),
                          window_bytes=self.window_bytes, max_queued_bytes=self.window_bytes,
                          link_timeout=self.link_timeout, max_unconsumed=self.max_unconsumed,
                          max_buffered_bytes=self.max_buffered_bytes)


class Options(ServerOptions):
    """Options of C{twistd relink-server}."""

    configTable = "relink-server"
    configClass = RelinkServerConfig

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


def build_service(config, store=None, reactor=None):
    """
    The relink-server service of C{config} (a L{RelinkServerConfig}).

    @param store: a log store to share (default: one of its own).
    @param reactor: the reactor it runs on (default: the global one).
    """
    link_config = config.link_config()

    def factory(store):
        authorizer = config.authorizer
        return ListenerFactory(server_endpoints(store, config.log, config.id_size, link_config,
                                                clock=reactor,
                                                authorizer=authorizer or ALLOW_ALL),
                               config=link_config, clock=reactor, authorizer=authorizer)

    return server_service(config, factory, store=store, name="relink-server", reactor=reactor)


def makeService(options, store=None, reactor=None):
    """twistd's entry point: L{build_service} of the parsed C{options}' config."""
    return build_service(as_config(options), store, reactor)
