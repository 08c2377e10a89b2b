"""
The controller as a Twisted service (L{ControllerService}): it opens the
state, runs the gRPC server (plain or TLS, L{ControllerTLS}) on the
endpoint L{parse_controller_endpoint} reads, and runs the periodic
transaction expiry and retention rounds.
"""

from concurrent import futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.application import service
from twisted.internet import defer, threads
from twisted.application.internet import StreamServerEndpointService
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from streamproto.core.clock import default_reactor
from streamproto.core.auth import IAuthorizer
from streamproto.core.compat import listening_port
from streamproto.core.endpoints import split_fields
from streamproto.core.ops import add_readiness_check
from streamproto.pravega.controller.servicer import ControllerServicer, _RpcError
from streamproto.log.interfaces import ILogStore
from streamproto.pravega.controller.state import ControllerState, ControllerStateDamaged
from streamproto.pravega.segments import SegmentStore

if TYPE_CHECKING:
    from streamproto.pravega.auth import DelegationTokens


class ControllerTLS:
    """
    PEM bytes for the controller's TLS: its key and certificate chain, and
    (to require and verify client certificates) the CAs to trust.
    """

    def __init__(self, private_key: bytes, cert_chain: bytes,
                 client_ca: bytes | None = None) -> None:
        self.private_key = private_key
        self.cert_chain = cert_chain
        self.client_ca = client_ca

    def credentials(self) -> Any:
        import grpc
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


def _read_pem(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}")


def parse_controller_endpoint(description: str) -> tuple[str, int, ControllerTLS | None]:
    """
    The controller's listening endpoint, in the words of Twisted's endpoint
    strings (gRPC needs its own listener, so only these):
    C{tcp:PORT[:interface=HOST]}, C{ssl:PORT[:interface=HOST]:privateKey=KEY
    [:certKey=CERT][:extraCertChain=CHAIN]} and C{mtls:...} (the same, plus
    C{caCerts=CA} to require client certificates signed by CA).

    @return: C{(host, port, tls)}: C{tls} a L{ControllerTLS} or None.
    @raise ValueError: on anything else.
    """
    parts = split_fields(description)
    kind = parts[0]
    if kind not in ("tcp", "ssl", "mtls") or len(parts) < 2 or not parts[1].isdigit():
        raise ValueError("controller endpoint must be tcp:PORT[:interface=HOST], "
                         f"ssl:PORT:privateKey=KEY[:certKey=CERT] or mtls:...: {description}")
    port = int(parts[1])
    allowed = {"interface"} if kind == "tcp" else {
        "interface", "privateKey", "certKey", "extraCertChain"} | (
        {"caCerts", "requireClientCert"} if kind == "mtls" else set())
    options = {}
    for p in parts[2:]:
        key, sep, value = p.partition("=")
        if not sep or key not in allowed or not value:
            raise ValueError(f"unsupported controller endpoint option {p!r}")
        options[key] = value
    if not 0 <= port <= 65535:
        raise ValueError(f"bad port {port}")
    host = options.get("interface", "0.0.0.0")
    if kind == "tcp":
        return host, port, None
    if "privateKey" not in options:
        raise ValueError(f"{kind}: controller endpoint needs privateKey=")
    key = _read_pem(options["privateKey"], "private key")
    chain = _read_pem(options.get("certKey", options["privateKey"]), "certificate")
    if "extraCertChain" in options:
        chain += b"\n" + _read_pem(options["extraCertChain"], "certificate chain")
    client_ca = None
    if "caCerts" in options and options.get("requireClientCert", "yes") != "no":
        client_ca = _read_pem(options["caCerts"], "CA certificates")
    return host, port, ControllerTLS(key, chain, client_ca)


class ControllerService(service.Service):
    """
    Runs the gRPC server: opens the state on the reactor, serves on
    C{host:port} (port 0: any; see C{self.port} once started), expires
    transaction leases and applies retention policies periodically.

    @ivar segment_store_address: C{(host, port)} clients are sent to; a
        port of 0 with C{store_listener} (the segment store's listening
        service) becomes the port it listens on, once it does.
    """

    log = Logger()

    def __init__(self, store: ILogStore, segments: SegmentStore, host: str, port: int,
                 segment_store_address: tuple[str, int], reactor: IReactorTime | None = None,
                 max_workers: int = 8, expiry_interval: float = 1.0,
                 tls: ControllerTLS | None = None, retention_interval: float = 60.0,
                 store_listener: StreamServerEndpointService | None = None,
                 authorizer: IAuthorizer | None = None,
                 tokens: "DelegationTokens | None" = None) -> None:
        # (also IReactorThreads: it runs gRPC's calls into the reactor)
        self.reactor = default_reactor(reactor)
        #: who may do what (L{streamproto.core.auth.IAuthorizer}; None: everyone)
        self.authorizer = authorizer
        #: the delegation tokens shared with the segment store
        self.tokens = tokens
        self.expiry_interval = expiry_interval
        self.retention_interval = retention_interval
        self.store_listener = store_listener
        self._expiry: LoopingCall | None = None
        self._retention: LoopingCall | None = None
        self.state = ControllerState(store, segments, self.reactor)
        self.host = host
        self.port = port
        self.segment_store_address = segment_store_address
        self.max_workers = max_workers
        self.tls = tls
        self._server: Any = None  # a grpc.Server
        self.ready: defer.Deferred[Any] | None = None
        #: why the controller fail-stopped (its state could not be read), or None
        self.failure: BaseException | None = None

    def startService(self) -> None:
        super().startService()
        import grpc
        from twisted.internet.threads import blockingCallFromThread

        opened = []
        waiting: list[defer.Deferred[None]] = []

        def ready(result):
            opened.append(result)
            for d in waiting:
                d.callback(None)
            return result

        self.failure = None
        self._remove_check = add_readiness_check(self._problems)
        self.ready = self._open()
        if self.segment_store_address[1] == 0 and self.store_listener is not None:
            self.ready.addCallback(lambda _: self._resolve_store_port())
        self.ready.addErrback(self._failed)
        self.ready.addBoth(ready)

        def run(fn, args):
            # requests that arrive before the state is read wait for it
            if opened:
                return self._serve(fn, args)
            d: defer.Deferred[None] = defer.Deferred()
            waiting.append(d)
            return d.addCallback(lambda _: self._serve(fn, args))

        def call(fn, *args):
            return blockingCallFromThread(self.reactor, run, fn, args)

        servicer = ControllerServicer(self.state, call, lambda: self.segment_store_address,
                                      authorizer=self.authorizer, tokens=self.tokens)
        # grpcio binds with SO_REUSEPORT by default: a second server on the
        # same port would start "fine" and take half of the connections
        server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=self.max_workers, thread_name_prefix="pravega-controller"),
            options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((servicer.handler(),))
        address = f"{self.host}:{self.port}"
        reason: RuntimeError | str
        try:
            if self.tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, self.tls.credentials())
        except RuntimeError as e:     # newer grpcio raises instead of answering 0
            port, reason = 0, e
        else:
            reason = "address in use or not available"
        if not port:
            server.stop(None)
            raise OSError(f"pravega controller cannot listen on {address}: {reason}")
        self.port = port
        self._server = server
        server.start()

        self._expiry = self._every(self.expiry_interval, self.state.expire_txns,
                                   "expiring transactions")
        if self.retention_interval:
            self._retention = self._every(self.retention_interval, self.state.apply_retention,
                                          "applying retention policies")
        self.log.info("pravega controller listening on {host}:{port} ({tls})",
                      host=self.host, port=self.port,
                      tls="plain" if self.tls is None else
                      "TLS" if self.tls.client_ca is None else "TLS, client certificates")

    @defer.inlineCallbacks
    def _open(self):
        """
        Read the state; while the store cannot answer (a cluster electing
        a leader, not reachable yet), try again with a growing pause:
        C{/ready} and every request say why meanwhile.  Damaged state is
        not retried (L{_failed}).
        """
        from twisted.internet.task import deferLater
        delay = 0.5
        while True:
            try:
                yield self.state.open()
            except ControllerStateDamaged:
                raise
            except Exception as e:  # noqa: BLE001 - the store's own transient errors
                if not self.running:
                    raise
                self.failure = e
                self.log.warn("pravega controller: cannot read its state yet ({error}); "
                              "trying again in {delay:g} s", error=e, delay=delay)
                yield deferLater(self.reactor, delay, lambda: None)
                delay = min(delay * 2, 5.0)
                continue
            self.failure = None
            return None

    def _failed(self, failure):
        """
        The state could not be read: fail-stop.  Every request answers
        UNAVAILABLE with the cause and C{/ready} says 503, until an operator
        repairs the state and restarts; never an empty state served as if
        it were the real one.
        """
        self.failure = failure.value
        if failure.check(ControllerStateDamaged):
            self.log.critical("pravega controller stopped serving: its state is damaged: "
                              "{error}; repair or remove the last record of the log, then "
                              "restart", error=failure.value)
        else:
            self.log.failure("pravega controller stopped serving: opening its state failed",
                             failure)
        return None

    def _serve(self, fn, args):
        if self.failure is not None:
            import grpc
            return defer.fail(_RpcError(grpc.StatusCode.UNAVAILABLE,
                                        f"controller state unavailable: {self.failure}"))
        # what another controller on the same store changed is seen at once
        return self.state.refresh().addCallback(lambda _: fn(*args))

    def _problems(self):
        if self.failure is None:
            return []
        return [f"pravega controller: state unavailable: {self.failure}"]

    def _resolve_store_port(self):
        """Learn the segment store's port from its listener (it was asked for port 0)."""
        assert self.store_listener is not None  # called only with one
        waiting = listening_port(self.store_listener)
        if waiting is None:
            self.log.warn("cannot learn the segment store's port: clients are told port 0")
            return None
        learned: defer.Deferred[None] = defer.Deferred()

        def listening(port):
            host = self.segment_store_address[0]
            self.segment_store_address = (host, port.getHost().port)
            self.log.info("advertising the segment store at {host}:{port}", host=host,
                          port=self.segment_store_address[1])
            learned.callback(None)
            return port

        def failed(f):
            learned.callback(None)   # the listener reports its own failure
            return f
        waiting.addCallbacks(listening, failed)
        return learned

    def _every(self, interval: float, work: Callable[[], defer.Deferred[Any]],
               what: str) -> LoopingCall:
        """
        Run C{work} every C{interval} seconds, on the reactor, while the
        state is open and has not failed; a failed round is logged (as
        C{what}) and the next one runs all the same.
        """
        def one_round() -> defer.Deferred[Any] | None:
            if not self.state.opened or self.failure is not None:
                return None
            return work().addErrback(lambda f: self.log.failure(what, f))
        loop = LoopingCall(one_round)
        loop.clock = self.reactor
        loop.start(interval, now=False)
        return loop

    def stopService(self) -> defer.Deferred[None] | None:
        super().stopService()
        remove = getattr(self, "_remove_check", None)
        if remove is not None:
            remove()
        for loop in (self._expiry, self._retention):
            if loop is not None and loop.running:
                loop.stop()
        server, self._server = self._server, None
        if server is None:
            return None
        # stop() returns a threading.Event: wait for it off the reactor
        return threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(),
                                         server.stop(1.0).wait)
