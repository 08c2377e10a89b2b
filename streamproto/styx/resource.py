"""
The Styx HTTP API on twisted.web, route for route like the reference (styx
0.1.4): statuses, JSON shapes, form fields and defaults.

Embed it::

    from streamproto.log import open_store
    from streamproto.styx.resource import make_site
    site = make_site(open_store("data"))
    endpoints.serverFromString(reactor, "tcp:7123").listen(site)

Requests to C{/logs/{name}/records} with C{Upgrade: styx/0} or C{Upgrade:
websocket} are handed to L{streamproto.styx.stream.upgrade}.

The router and the small endpoints are here; produce bodies
(L{streamproto.styx.produce}), consume responses
(L{streamproto.styx.consume}), backups (L{streamproto.styx.backup}) and
CORS (L{streamproto.styx.cors}) have their modules.
"""

import importlib
import inspect
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, server
from twisted.web.resource import Resource
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.core.auth import ALLOW_ALL, IAuthorizer
from streamproto.core.compat import request_gone
from streamproto.log.config import LogConfig
from streamproto.log.errors import RecordTooLarge
from streamproto.log.interfaces import ILogStore
from streamproto.log.public import PublicLogStore
from streamproto.styx import access, backup, cors, formats
from streamproto.styx.consume import RecordStreamer, consume_one, long_poll_timeout
from streamproto.styx.errors import APIError, report
from streamproto.styx.httputil import (
    header, respond_empty, respond_json, respond_produced, upgrade_protocol,
)
from streamproto.styx.interfaces import IProduceTarget
from streamproto.styx.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from streamproto.styx.metrics import StyxMetrics
from streamproto.styx.params import parse_read_params
from streamproto.styx.quick import AppendBatcher, QuickChannel
from streamproto.styx.produce import (
    DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_RESTORE_SIZE, StyxRequest, append_body,
)

log = Logger()

DEFAULT_TIMEOUT = 30
MIN_TIMEOUT = 2
INFO_FIELDS = ("name", "status", "record_count", "file_size", "start_position",
               "end_position")


def log_info(the_log):
    """The reference's log-info JSON object (its six fields, in its order)."""
    info = the_log.info()
    return {k: info[k] for k in INFO_FIELDS}


#: twisted.web's own default
DEFAULT_HTTP_IDLE_TIMEOUT = 60


class StyxSite(server.Site):
    """
    A L{server.Site} with bounded request bodies (see L{StyxRequest}),
    without twisted.web's form parsing, and with its access log only when
    asked for.

    twisted.web parses the body of every POST with a Content-Type into
    C{request.args} (through the C{email} package: a tenth of the server's
    time on one-record produce requests); the API reads the query only,
    and the create form itself (L{StyxResource._post_form}), like the
    reference's C{r.PostForm}.  The access log, one formatted and written
    line per request, cost another tenth (doc/styx.rst, "Performance").

    Its connections start on L{streamproto.styx.quick.QuickChannel}, which
    answers one-record produce requests itself and hands the connection to
    twisted.web's channel at the first other request; C{quick=False} (or
    the access log, which those requests would miss) gives every
    connection to twisted.web from the start.

    @ivar access_log: whether each request is logged (twisted.web's
        combined log format, to the server's log).
    @ivar quick: whether connections start on the quick path.
    """

    requestFactory = StyxRequest

    def __init__(self, resource: Resource, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
                 metrics: StyxMetrics | None = None,
                 max_restore_size: int = DEFAULT_MAX_RESTORE_SIZE, access_log: bool = False,
                 quick: bool = True, **kw: Any) -> None:
        super().__init__(resource, parsePOSTFormSubmission=False, **kw)
        self.max_body_size = max_body_size
        self.max_restore_size = max_restore_size
        self.metrics = metrics
        self.access_log = access_log
        self.quick = quick
        self._append_batcher: AppendBatcher | None = None

    @property
    def append_batcher(self) -> AppendBatcher:
        """The quick path's L{AppendBatcher}, on the resource's clock."""
        if self._append_batcher is None:
            self._append_batcher = AppendBatcher(self.resource.clock,
                                                 self.resource.metrics.produced)
        return self._append_batcher

    def buildProtocol(self, addr: Any) -> Any:
        if self.quick and not self.access_log and isinstance(self.resource, StyxResource):
            channel = QuickChannel(self, addr)
            channel.factory = self
            return channel
        return self.build_http_channel(addr)

    def build_http_channel(self, addr: Any) -> Any:
        """twisted.web's channel for a connection (from C{addr})."""
        return super().buildProtocol(addr)

    def log(self, request: http.Request) -> None:
        if self.access_log:
            super().log(request)


def make_site(store: ILogStore, timeout: float = DEFAULT_TIMEOUT,
              default_config: LogConfig | None = None,
              max_body_size: int = DEFAULT_MAX_BODY_SIZE, metrics: StyxMetrics | None = None,
              clock: IReactorTime | None = None, upgrade: Callable[..., object] | None = None,
              cors_origins: Iterable[str] = ("*",),
              max_restore_size: int = DEFAULT_MAX_RESTORE_SIZE,
              http_idle_timeout: float = DEFAULT_HTTP_IDLE_TIMEOUT,
              authorizer: IAuthorizer = ALLOW_ALL, access_log: bool = False,
              quick: bool = True) -> StyxSite:
    """
    The Site serving the Styx API over C{store} (an L{ILogStore}).

    @param authorizer: the L{streamproto.core.auth.IAuthorizer} deciding
        who may do what (default: everyone everything).

    @param http_idle_timeout: seconds an HTTP connection may stay silent
        (keep-alive or a slow request) before it is closed; upgraded styx/0
        and WebSocket streams use C{timeout} instead.

    @param access_log: log every request (off by default: it costs a
        tenth of a small request's time).

    @param quick: answer one-record produce requests without twisted.web's
        request machinery (L{streamproto.styx.quick}); off, or with the
        access log, every request goes through twisted.web.
    """
    root = StyxResource(store, timeout=timeout, default_config=default_config,
                        metrics=metrics, clock=clock, upgrade=upgrade,
                        cors_origins=cors_origins, authorizer=authorizer)
    site = StyxSite(root, max_body_size=max_body_size, metrics=root.metrics,
                    max_restore_size=max_restore_size, timeout=http_idle_timeout,
                    access_log=access_log, quick=quick)
    site.displayTracebacks = False
    return site


# -- the API -----------------------------------------------------------------

def _format_of(request, name):
    """The record format the C{name} header of C{request} names (an API error if none)."""
    try:
        return formats.format_of(header(request, name))
    except formats.FormatError as e:
        raise APIError("unknown_error", f"api: {e}", status=400)


@implementer(IProduceTarget)
class StyxResource(Resource):
    """
    The whole API as one leaf resource routing on the path (like the
    reference's router: unknown paths answer 404 C{not_found}, known paths
    with another method 405 C{method_not_allowed}).

    @ivar store: the L{streamproto.log.ILogStore}, seen through
        L{PublicLogStore}: the servers' internal logs (Pravega's) are not
        part of the API.
    @ivar timeout: the styx/0 heartbeat timeout (seconds) handed to upgrades.
    @ivar default_config: the L{LogConfig} new logs get unless the create
        form says otherwise.
    """

    isLeaf = True

    def __init__(self, store: ILogStore, timeout: float = DEFAULT_TIMEOUT,
                 default_config: LogConfig | None = None, metrics: StyxMetrics | None = None,
                 clock: IReactorTime | None = None,
                 upgrade: Callable[..., object] | None = None,
                 cors_origins: Iterable[str] = ("*",),
                 authorizer: IAuthorizer = ALLOW_ALL) -> None:
        super().__init__()
        self.authorizer = authorizer
        # origins allowed to call the API from browsers ("*" wildcards, as
        # in the reference's cors_allowed_origins; empty: no CORS headers)
        self.cors_origins = tuple(cors_origins)
        if timeout < MIN_TIMEOUT:
            raise ValueError(f"timeout must be at least {MIN_TIMEOUT} seconds")
        self.store = store if isinstance(store, PublicLogStore) else PublicLogStore(store)
        self.timeout = timeout
        self.default_config = default_config or LogConfig()
        self.metrics = metrics or StyxMetrics()
        self.reactor = default_reactor()
        self.clock = default_reactor(clock)
        # callable(request, log, params, **kw) taking over upgraded
        # connections; default: streamproto.styx.stream.upgrade
        self._upgrade_fn = upgrade

    # CORS (the reference wraps its router in rs/cors) ---------------------
    def cors_headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        """
        The CORS headers of an answer (not a preflight) to a request from
        C{origin} (a str, or None without an Origin header).
        """
        return cors.cors_headers(self.cors_origins, origin)

    # routing ------------------------------------------------------------
    def render(self, request: server.Request) -> bytes | int:
        if cors.apply_cors(request, self.cors_origins):
            return b""
        # route on what is left below our mount point (all of the path
        # when we are the root); twisted.web has unquoted the segments
        # (postpath is typed Optional: it is None only before the site routes)
        segments = [seg.decode("utf-8", "replace") for seg in request.postpath or ()]
        method = request.method
        handler = self._route(segments, method)
        try:
            self._authorize(request, segments, handler)
        except APIError as e:
            if upgrade_protocol(request) == b"styx/0" and e.code in ("unauthorized",
                                                                      "forbidden"):
                # styx/0 says no its own way: an Error message after the 101
                from streamproto.styx.stream import refuse
                self.metrics.error(e.code)
                refuse(request, e, self.timeout)
            else:
                self._error(Failure(e), request)
            return server.NOT_DONE_YET
        d = defer.maybeDeferred(handler, request, *segments[1:2])
        d.addErrback(self._error, request)
        return server.NOT_DONE_YET

    def _authorize(self, request, segments, handler):
        """
        Check the policy for a routed request, before anything touches the
        store (listing and creation check theirs in their handlers).
        @raise APIError: 401 or 403.
        """
        if not self.authorizer.enabled or handler in (self.not_found, self.not_allowed):
            return
        needed = access.route_access(request.method, segments, request.args)
        if needed is None:
            return
        op, name = needed
        if (op == "read" and upgrade_protocol(request) == b"websocket"
                and (header(request, b"x-http-method-override") or b"").upper() == b"POST"):
            op = "write"  # a browser's WebSocket produce (see consume)
        access.check(request, self.authorizer, op, name)

    def _readable(self, request, names):
        """The names of C{names} the request may read (all without a policy)."""
        if not self.authorizer.enabled:
            return list(names)
        principals = access.request_principals(request, self.authorizer)
        return [n for n in names if self.authorizer.allows(principals, "read", n)]

    def _route(self, segments, method):
        if segments == ["metrics"]:
            return self.render_metrics
        if not segments or segments[0] != "logs" or "" in segments[1:]:
            return self.not_found
        rest = segments[1:]
        if not rest:
            return {b"GET": self.list_logs, b"POST": self.create_log}.get(
                method, self.not_allowed)
        if len(rest) == 1:
            if rest[0] == "restore" and method == b"POST":
                return self.restore_log
            return {b"GET": self.get_log, b"DELETE": self.delete_log}.get(
                method, self.not_allowed)
        if len(rest) == 2:
            action = rest[1]
            if action == "truncate":
                return self.truncate_log if method == b"POST" else self.not_allowed
            if action == "backup":
                return self.backup_log if method == b"GET" else self.not_allowed
            if action == "records":
                return {b"GET": self.consume, b"POST": self.produce}.get(
                    method, self.not_allowed)
        return self.not_found

    # responses ----------------------------------------------------------
    def _error(self, failure, request):
        error = report(failure, request.method, request.path, self.metrics)
        if request.finished or request_gone(request):
            return
        if request.startedWriting:
            # the status line went out already: cut the response short
            request.channel.transport.abortConnection()
            return
        body = error.to_json()
        if error.code == "unauthorized":
            request.setHeader(b"WWW-Authenticate", access.CHALLENGE)
        request.setResponseCode(error.status)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", str(len(body)).encode())
        request.write(body)
        request.finish()

    def not_found(self, request, *args):
        raise APIError("not_found")

    def not_allowed(self, request, *args):
        raise APIError("method_not_allowed")

    # /metrics -----------------------------------------------------------
    @defer.inlineCallbacks
    def render_metrics(self, request, *args):
        infos = []
        for name in self._readable(request, self.store.names()):
            try:
                the_log = yield self.store.get(name)
                infos.append(the_log.info())
            except Exception:
                continue  # deleted meanwhile, or unavailable
        body = self.metrics.render(infos)
        if request_gone(request):
            return
        request.setHeader(b"Content-Type", METRICS_CONTENT_TYPE.encode())
        request.setHeader(b"Content-Length", str(len(body)).encode())
        request.write(body)
        request.finish()

    # /logs --------------------------------------------------------------
    @defer.inlineCallbacks
    def list_logs(self, request):
        entries = []
        for name in self._readable(request, self.store.names()):
            try:
                the_log = yield self.store.get(name)
            except Exception:
                continue
            entries.append(log_info(the_log))
        respond_json(request, entries)

    def _post_form(self, request):
        """The urlencoded body only, like Go's C{r.PostForm}."""
        ctype = header(request, b"content-type") or b""
        media, _ = formats.parse_media_type(ctype) if ctype else ("", {})
        if media != "application/x-www-form-urlencoded" or request.content is None:
            return {}
        request.content.seek(0)
        raw = request.content.read().decode("utf-8", "replace")
        return {k: v[0] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()}

    @defer.inlineCallbacks
    def create_log(self, request):
        form = self._post_form(request)
        name = form.get("name", "")
        if not name:
            raise APIError("invalid_params", "api: params: name is required")
        values = self.default_config.as_dict()
        for field in LogConfig.field_names():
            raw = form.get(field)
            if raw is None or raw == "":
                continue
            try:
                values[field] = int(raw, 10)
            except ValueError:
                raise APIError("invalid_params",
                               f"api: params: {field}: invalid integer {raw!r}")
        try:
            config = LogConfig(**values)
        except ValueError as e:
            raise APIError("invalid_params", f"api: params: {e}")
        access.check(request, self.authorizer, "admin", name)
        the_log = yield self.store.create(name, config)
        log.info("created log {name}", name=name)
        respond_json(request, log_info(the_log))

    @defer.inlineCallbacks
    def get_log(self, request, name):
        the_log = yield self.store.get(name)
        respond_json(request, log_info(the_log))

    @defer.inlineCallbacks
    def delete_log(self, request, name):
        yield self.store.delete(name)
        self.metrics.forget(name)
        log.info("deleted log {name}", name=name)
        respond_empty(request)

    @defer.inlineCallbacks
    def truncate_log(self, request, name):
        # The reference empties the log and starts positions again at 0, so
        # its CLI's default read (origin, position 0) works after a
        # truncate: recreate the log with the same configuration.  Streams
        # open on it end, as on a delete.
        the_log = yield self.store.get(name)
        config = the_log.config
        yield self.store.delete(name)
        yield self.store.create(name, config)
        log.info("truncated log {name}", name=name)
        respond_empty(request)

    # backup / restore ---------------------------------------------------
    def backup_log(self, request, name):
        """See L{streamproto.styx.backup.backup_log}."""
        return backup.backup_log(self.store, request, name)

    def restore_log(self, request, *args):
        """See L{streamproto.styx.backup.restore_log}."""
        return backup.restore_log(self.store, request)

    # records --------------------------------------------------------------
    def _upgrade_function(self, protocol):
        """
        styx/0 goes to L{streamproto.styx.stream.upgrade}, WebSocket to
        L{streamproto.styx.websocket.upgrade}; None when not available.
        """
        if self._upgrade_fn is not None:
            return self._upgrade_fn
        module = "stream" if protocol == b"styx/0" else "websocket"
        try:
            imported = importlib.import_module(f"streamproto.styx.{module}")
        except ImportError as e:
            if e.name != f"streamproto.styx.{module}":
                raise
            return None
        return getattr(imported, "upgrade", None)

    def _upgrade(self, request, the_log, params, protocol):
        """
        Hand the request to the styx/0 (or WebSocket) upgrade, passing the
        keyword arguments it accepts among C{timeout} (the server's
        heartbeat timeout), C{metrics}, C{protocol} (C{b"styx/0"} or
        C{b"websocket"}) and C{clock}.
        """
        upgrade = self._upgrade_function(protocol)
        kwargs = {"timeout": self.timeout, "metrics": self.metrics, "protocol": protocol,
                  "clock": self.clock}
        accepted: Mapping[str, inspect.Parameter]
        try:
            accepted = inspect.signature(upgrade).parameters
        except (TypeError, ValueError):
            accepted = {}
        if not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return upgrade(request, the_log, params, **kwargs)

    def _stream_available(self, protocol):
        return self._upgrade_function(protocol) is not None

    @defer.inlineCallbacks
    def produce(self, request, name):
        protocol = upgrade_protocol(request)
        if protocol is not None:
            params = parse_read_params(request.args)
            if not self._stream_available(protocol):
                raise APIError("not_supported",
                               f"api: {protocol.decode()} upgrade not available")
            the_log = yield self.store.get(name)
            yield self._upgrade(request, the_log, params, protocol)
            return
        fmt = _format_of(request, b"content-type")
        if fmt.kind == "record":
            length = header(request, b"content-length")
            if length is None:
                raise APIError("missing_content_length")
            try:
                size = int(length)
            except ValueError:
                raise APIError("unknown_error", "api: invalid content-length", status=400)
            if size == 0:
                # the reference answers an empty single record like this
                respond_produced(request, 0, 0)
                return
        sink = getattr(request, "body_sink", None)
        if sink is not None:
            count, end_position = yield sink.done
            if end_position is None:
                end_position = (yield self.store.get(name)).end_position
            respond_produced(request, end_position, count)
            return
        the_log = yield self.store.get(name)
        if request.content.closed:
            # the client went away while the store looked the log up (a
            # slow JetStream cluster): twisted.web has closed the body;
            # nothing is appended and there is no one to answer
            return
        request.content.seek(0)
        if fmt.kind == "record":
            record = request.content.read()
            limit = the_log.config.max_record_size
            if len(record) > limit:
                raise RecordTooLarge(
                    f"record of {len(record)} bytes exceeds max_record_size {limit}")
            result = yield the_log.append([record])
            self.metrics.produced(name, 1, len(record))
            respond_produced(request, result.end_position, 1)
            return
        decoder = fmt.decoder(the_log.config.max_record_size)
        count, end_position = yield append_body(the_log, request.content, decoder,
                                                self.metrics, self.reactor)
        if end_position is None:
            end_position = the_log.end_position
        respond_produced(request, end_position, count)

    @defer.inlineCallbacks
    def consume(self, request, name):
        params = parse_read_params(request.args)
        protocol = upgrade_protocol(request)
        if protocol is not None:
            if not self._stream_available(protocol):
                raise APIError("not_supported",
                               f"api: {protocol.decode()} upgrade not available")
            the_log = yield self.store.get(name)
            if protocol == b"websocket" and (header(request, b"x-http-method-override")
                                             or b"").upper() == b"POST":
                # browsers cannot POST a WebSocket handshake: the reference
                # routes this GET to the WebSocket producer
                request.method = b"POST"
            yield self._upgrade(request, the_log, params, protocol)
            return
        fmt = _format_of(request, b"accept")
        timeout = long_poll_timeout(request, params)
        the_log = yield self.store.get(name)
        position = params.resolve_log(the_log)
        if not the_log.start_position <= position <= the_log.end_position:
            raise APIError(
                "invalid_params",
                f"api: params: position {position} outside "
                f"[{the_log.start_position}, {the_log.end_position}]")
        if fmt.kind == "record":
            yield consume_one(request, the_log, position, params.follow, timeout,
                              self.metrics)
            return
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", fmt.media_type().encode())
        RecordStreamer(request, the_log, position, params.count, params.follow, timeout,
                       fmt.encoder(), self.metrics).start()
