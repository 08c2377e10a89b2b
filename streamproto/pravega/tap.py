"""C{twistd pravega-server}: the Pravega segment store on the shared log store."""

import ipaddress
from dataclasses import dataclass

from twisted.logger import Logger
from twisted.python import usage

from streamproto.core.endpoints import parse_endpoint
from streamproto.core.tap import (
    ServerConfig, ServerOptions, as_config, common_fields, non_negative_float, positive_int,
    server_service,
)
from streamproto.pravega.codec import MAX_FRAME_SIZE
from streamproto.pravega.controller import ControllerService, parse_controller_endpoint
from streamproto.pravega.server import PravegaServerFactory


DEFAULT_CONTROLLER = "tcp:9090"
DEFAULT_PORT = "tcp:12345"
log = Logger()


@dataclass(frozen=True, kw_only=True)
class PravegaServerConfig(ServerConfig):
    """
    What C{pravega-server} is built from.

    @ivar controller: the controller's endpoint, or C{"none"}.
    @ivar controller_default: whether C{controller} is the default one (not
        asked for): with a shared store the controller then does not run.
    @ivar controller_address: the controller's C{(host, port)} (None without one).
    @ivar controller_tls: its L{ControllerTLS}, or None.
    @ivar advertise_address: the segment store's C{(host, port)} as clients
        are told to reach it (None without a controller).
    """

    read_wait: float = 60.0
    max_frame_size: int = MAX_FRAME_SIZE
    max_outstanding: int = 32 * 1024 * 1024
    controller: str = DEFAULT_CONTROLLER
    controller_default: bool = True
    controller_address: tuple | None = None
    controller_tls: object = None
    advertise: str | None = None
    advertise_address: tuple | None = None
    retention_interval: float = 60.0
    idle_timeout: float = 300.0

    @classmethod
    def from_options(cls, options):
        """See L{ServerConfig.from_options}; also sets the C{controller-*} values."""
        common = common_fields(options, DEFAULT_PORT)
        if options["max-frame-size"] > MAX_FRAME_SIZE:
            raise usage.UsageError(f"--max-frame-size must be at most {MAX_FRAME_SIZE}")
        options["controller-default"] = options["controller"] is None
        if options["controller"] is None:
            options["controller"] = DEFAULT_CONTROLLER
        if options["controller"] != "none":
            try:
                host, port, tls = parse_controller_endpoint(options["controller"])
            except ValueError as e:
                raise usage.UsageError(str(e))
            options["controller-address"] = host, port
            options["controller-tls"] = tls
            try:
                options["advertise-address"] = advertised_address(options["advertise"],
                                                                  options["port"])
            except ValueError as e:
                raise usage.UsageError(f"--advertise: {e}")
            if tls is not None and _is_ip_literal(options["advertise-address"][0]):
                # the Rust client checks the segment store's certificate
                # against the advertised host as a DNS name: an address fails
                log.warn("--controller uses TLS but clients are told to reach the segment "
                         "store at the address {host}; Rust clients need a DNS name "
                         "(--advertise NAME:PORT)", host=options["advertise-address"][0])
        return cls(**common, read_wait=options["read-wait"],
                   max_frame_size=options["max-frame-size"],
                   max_outstanding=options["max-outstanding"], controller=options["controller"],
                   controller_default=options["controller-default"],
                   controller_address=options.get("controller-address"),
                   controller_tls=options.get("controller-tls"), advertise=options["advertise"],
                   advertise_address=options.get("advertise-address"),
                   retention_interval=options["retention-interval"],
                   idle_timeout=options["idle-timeout"])


class Options(ServerOptions):
    """Options of the Pravega segment-store server."""

    configTable = "pravega-server"
    configClass = PravegaServerConfig

    defaultPort = DEFAULT_PORT
    optParameters = [
        ["read-wait", None, 60.0, "Seconds a ReadSegment at the tail waits for data.",
         non_negative_float("--read-wait")],
        ["max-frame-size", None, MAX_FRAME_SIZE, "Largest frame accepted (bytes).",
         positive_int("max-frame-size")],
        ["max-outstanding", None, 32 * 1024 * 1024,
         "Unacknowledged append bytes per connection before reading from it pauses.",
         positive_int("max-outstanding")],
        ["controller", None, None,
         "Endpoint of the gRPC Controller service: tcp:PORT[:interface=HOST], "
         "ssl:PORT[:interface=HOST]:privateKey=KEY[:certKey=CERT] (TLS), "
         "mtls:...:caCerts=CA (TLS, client certificates signed by CA required), or 'none' "
         "(default tcp:9090; under 'twistd streamproto': --pravega-controller)."],
        ["advertise", None, None,
         "HOST:PORT of the segment store that the controller hands to clients "
         "(default: the first --port's interface, or 127.0.0.1, and port)."],
        ["retention-interval", None, 60.0,
         "Seconds between the controller's rounds of stream retention (recording stream "
         "cuts, truncating what a stream's retention policy lets go; 0: never).",
         non_negative_float("--retention-interval")],
        ["idle-timeout", None, 300.0,
         "Seconds of silence before an idle connection is closed (0: never).",
         non_negative_float("--idle-timeout")],
    ]


def _is_ip_literal(host):
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def advertised_address(advertise, ports):
    """
    The segment store's (host, port) as clients must reach it.  A port of 0
    (from --port tcp:0) is learned once the server listens.
    """
    if advertise:
        host, _, port = advertise.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError("expected HOST:PORT")
        return host, int(port)
    index = _advertised_port_index(ports)
    if index is None:
        raise ValueError("cannot tell the segment store's address from --port: give --advertise")
    endpoint = parse_endpoint(ports[index])
    host = endpoint.interface
    if host in (None, "", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return host, endpoint.port


def _advertised_port_index(ports):
    """Which --port the advertised address comes from (without --advertise), or None."""
    for index, description in enumerate(ports):
        try:
            if parse_endpoint(description).port is not None:
                return index
        except ValueError:
            continue
    return None


def build_service(config, store=None, reactor=None):
    """
    The pravega-server service of C{config} (a L{PravegaServerConfig}): the
    segment store, and its controller unless there is none (or, with a
    shared C{store}, unless one was asked for).

    @param reactor: the reactor it runs on (default: the global one).
    """
    from streamproto.core.auth import ALLOW_ALL
    from streamproto.pravega.auth import DelegationTokens
    built = []
    authorizer = config.authorizer or ALLOW_ALL
    # one secret (unless the policy file sets one) for the controller's
    # tokens and the segment store that checks them
    tokens = DelegationTokens(authorizer)

    def factory(store):
        f = PravegaServerFactory(
            store, clock=reactor, read_wait=config.read_wait,
            max_frame_size=config.max_frame_size, max_outstanding_bytes=config.max_outstanding,
            idle_timeout=config.idle_timeout, authorizer=authorizer, tokens=tokens)
        built.append(f)
        return f
    top = server_service(config, factory, store, name="pravega-server", reactor=reactor)
    # With a shared store (the umbrella, or an application sharing its store)
    # the controller only runs when asked for explicitly (the umbrella always
    # passes its --pravega-controller): its default port is fixed.
    wanted = not (store is not None and config.controller_default)
    if wanted and config.controller != "none":
        host, port = config.controller_address
        listener = None
        if config.advertise_address[1] == 0:
            # --port tcp:0 and no --advertise: tell clients the port it gets
            listeners = [s for s in top if getattr(s, "_streamproto_listener", False)]
            index = _advertised_port_index(config.ports)
            if index is not None and index < len(listeners):
                listener = listeners[index]
        # added last: stopped before the store it writes to
        ControllerService(built[0].store, built[0].segments, host, port,
                          config.advertise_address, reactor=reactor, tls=config.controller_tls,
                          retention_interval=config.retention_interval,
                          store_listener=listener, authorizer=authorizer,
                          tokens=tokens).setServiceParent(top)
    return top


def makeService(options, store=None, reactor=None):
    """twistd's entry point: L{build_service} of the parsed C{options}' config."""
    return build_service(as_config(options), store, reactor)
