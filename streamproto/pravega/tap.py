"""C{twistd pravega-server}: the Pravega segment store on the shared log store."""

import ipaddress

from twisted.logger import Logger
from twisted.python import usage

from streamproto.core.endpoints import parse_endpoint
from streamproto.core.tap import ServerOptions, non_negative_float, positive_int, server_service
from streamproto.pravega.codec import MAX_FRAME_SIZE
from streamproto.pravega.controller import ControllerService, parse_controller_endpoint
from streamproto.pravega.server import PravegaServerFactory


DEFAULT_CONTROLLER = "tcp:9090"
log = Logger()


class Options(ServerOptions):
    """Options of the Pravega segment-store server."""

    configTable = "pravega-server"

    defaultPort = "tcp:12345"
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

    def postOptions(self):
        super().postOptions()
        if self["max-frame-size"] > MAX_FRAME_SIZE:
            raise usage.UsageError(f"--max-frame-size must be at most {MAX_FRAME_SIZE}")
        self["controller-default"] = self["controller"] is None
        if self["controller"] is None:
            self["controller"] = DEFAULT_CONTROLLER
        if self["controller"] != "none":
            try:
                host, port, tls = parse_controller_endpoint(self["controller"])
            except ValueError as e:
                raise usage.UsageError(str(e))
            self["controller-address"] = host, port
            self["controller-tls"] = tls
            try:
                self["advertise-address"] = advertised_address(self["advertise"],
                                                               self["port"])
            except ValueError as e:
                raise usage.UsageError(f"--advertise: {e}")
            if tls is not None and _is_ip_literal(self["advertise-address"][0]):
                # the Rust client checks the segment store's certificate
                # against the advertised host as a DNS name: an address fails
                log.warn("--controller uses TLS but clients are told to reach the segment "
                         "store at the address {host}; Rust clients need a DNS name "
                         "(--advertise NAME:PORT)", host=self["advertise-address"][0])


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


def makeService(options, store=None):
    from streamproto.core.auth import ALLOW_ALL
    from streamproto.pravega.auth import DelegationTokens
    built = []
    authorizer = options.get("authorizer") or ALLOW_ALL
    # one secret (unless the policy file sets one) for the controller's
    # tokens and the segment store that checks them
    tokens = DelegationTokens(authorizer)

    def factory(store):
        f = PravegaServerFactory(
            store, read_wait=options["read-wait"], max_frame_size=options["max-frame-size"],
            max_outstanding_bytes=options["max-outstanding"],
            idle_timeout=options["idle-timeout"], authorizer=authorizer, tokens=tokens)
        built.append(f)
        return f
    top = server_service(options, factory, store, name="pravega-server")
    # With a shared store (the umbrella, or an application sharing its store)
    # the controller only runs when asked for explicitly (the umbrella always
    # passes its --pravega-controller): its default port is fixed.
    wanted = not (store is not None and options.get("controller-default", True))
    if wanted and options.get("controller", "none") != "none":
        host, port = options["controller-address"]
        listener = None
        if options["advertise-address"][1] == 0:
            # --port tcp:0 and no --advertise: tell clients the port it gets
            listeners = [s for s in top if getattr(s, "_streamproto_listener", False)]
            index = _advertised_port_index(options["port"])
            if index is not None and index < len(listeners):
                listener = listeners[index]
        # added last: stopped before the store it writes to
        ControllerService(built[0].store, built[0].segments, host, port,
                          options["advertise-address"],
                          tls=options.get("controller-tls"),
                          retention_interval=options.get("retention-interval", 60.0),
                          store_listener=listener, authorizer=authorizer,
                          tokens=tokens).setServiceParent(top)
    return top
