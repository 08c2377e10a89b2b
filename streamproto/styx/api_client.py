"""
A client of the Styx HTTP API on treq: one method per endpoint, each
returning a Deferred.  Errors answered by the server fail the Deferred with
L{StyxAPIError} carrying the server's code.

    client = StyxClient("https://styx.example:7443", reactor,
                        tls_options=client_tls_options("styx.example", ca_certs="ca.pem",
                                                       cert="me.pem", private_key="me.key"))
    info = yield client.create_log("events", max_record_size=65536)
    yield client.write_records("events", [b"a", b"b"])
    records = yield client.read_records("events", whence="start")
"""

import json
import urllib.parse
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import IO, Any

import treq
from treq.client import HTTPClient
from twisted.internet import defer
from twisted.internet.error import ConnectError, ConnectionLost
from twisted.logger import Logger
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator, IReactorTime
from twisted.web.client import (  # type: ignore[attr-defined]  # RequestNotSent: not in __all__
    Agent, HTTPConnectionPool, RequestNotSent, RequestTransmissionFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IPolicyForHTTPS
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.styx import formats

DEFAULT_URL = "http://localhost:7123"


class StyxAPIError(Exception):
    """
    An error answered by the server.

    @ivar code: the server's error code (e.g. C{log_not_found}).
    @ivar message: its message.
    @ivar status: the HTTP status.
    """

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(f"{code}: {message} (HTTP {status})")
        self.code = code
        self.message = message
        self.status = status


@implementer(IPolicyForHTTPS)
class _FixedTLSPolicy:
    """
    The client TLS options (CA, client certificate) given: the same for
    every host, or those a callable gives for each host name.
    """

    def __init__(self, options):
        self.options = options

    def creatorForNetloc(self, hostname, port):
        return tls_options_for(self.options, hostname)


#: client TLS options, or a callable giving them for a host name
TLSOptions = (IOpenSSLClientConnectionCreator
              | Callable[[str], IOpenSSLClientConnectionCreator | None])


def tls_options_for(options: TLSOptions | None, hostname: str | bytes
                    ) -> IOpenSSLClientConnectionCreator | None:
    """C{options} (see L{StyxClient}) for the server named C{hostname}."""
    if callable(options):
        name = hostname.decode("idna") if isinstance(hostname, bytes) else hostname
        return options(name)
    return options


#: a request failing with one of these never reached the server: any
#: request may go to the next front-end
NOT_SENT = (ConnectError, RequestNotSent)
#: these may have reached it: only reads go to the next front-end
MAYBE_SENT = (ResponseNeverReceived, RequestTransmissionFailed, ConnectionLost)


@implementer(IAgent)
class _BearerAgent:
    """Adds C{Authorization: Bearer TOKEN} to every request of an agent."""

    def __init__(self, agent, token):
        self._agent = agent
        self._value = f"Bearer {token}".encode("latin-1")

    def request(self, method, uri, headers=None, bodyProducer=None):
        headers = headers.copy() if headers is not None else Headers()
        headers.setRawHeaders(b"authorization", [self._value])
        return self._agent.request(method, uri, headers, bodyProducer)


def base_url(host):
    """C{localhost:7123} -> C{http://localhost:7123} (the CLI's -H)."""
    if "://" not in host:
        host = "http://" + host
    return host.rstrip("/")


class StyxClient:
    """
    @param base_url: e.g. C{http://localhost:7123} or C{https://host:7443};
        several front-ends of one store as a list or comma-separated.  A
        request that cannot reach the current one goes to the next (and the
        client stays there): any request when the connection failed, reads
        also when it was lost before the answer.  A write whose answer was
        lost is not sent again (it may be stored: the caller decides, as
        with any timeout); it fails, and the next request goes to the next
        front-end.
    @param reactor: the reactor (default: the global one).
    @param pool: an L{HTTPConnectionPool} to share; a persistent one is
        made otherwise (close it with L{close}).
    @param tls_options: client TLS options for https URLs (see
        L{streamproto.core.tls.client_tls_options}: server verification with
        service_identity, optional client certificate), or a callable
        giving them for a host name (several front-ends, each verified by
        its own name).
    @param token: a bearer token sent with every request (a server's
        C{--auth-policy}, doc/security.rst), or None.
    """

    log = Logger()

    def __init__(self, base_url: str | Iterable[str] = DEFAULT_URL,
                 reactor: IReactorTime | None = None, pool: HTTPConnectionPool | None = None,
                 tls_options: TLSOptions | None = None, agent: IAgent | None = None,
                 token: str | None = None) -> None:
        reactor = default_reactor(reactor)
        self.reactor = reactor
        urls = base_url.split(",") if isinstance(base_url, str) else list(base_url)
        self.base_urls: list[str] = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.base_urls:
            raise ValueError("no server URL")
        self._current = 0
        self.tls_options = tls_options
        #: the bearer token sent with every request (None: none)
        self.token = token
        self._own_pool = pool is None and agent is None
        self.pool = pool if pool is not None else HTTPConnectionPool(reactor, persistent=True)
        if agent is None:
            kwargs: dict[str, Any] = {"pool": self.pool}
            if tls_options is not None:
                kwargs["contextFactory"] = _FixedTLSPolicy(tls_options)
            agent = Agent(reactor, **kwargs)
        if token:
            agent = _BearerAgent(agent, token)
        self.http = HTTPClient(agent)

    def close(self) -> defer.Deferred[None]:
        """Close pooled connections (if the pool is ours)."""
        if self._own_pool:
            return self.pool.closeCachedConnections()
        return defer.succeed(None)

    @property
    def base_url(self) -> str:
        """The front-end requests go to now."""
        return self.base_urls[self._current]

    def tls_options_for(self, hostname: str) -> IOpenSSLClientConnectionCreator | None:
        """The client TLS options for the server named C{hostname} (or None)."""
        return tls_options_for(self.tls_options, hostname)

    # plumbing -------------------------------------------------------------
    def _url(self, *segments, query=None):
        path = "/".join(urllib.parse.quote(s, safe="") for s in segments)
        url = f"{self.base_url}/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        return url

    @defer.inlineCallbacks
    def _request(self, method, *segments, query=None, read=False, **kwargs):
        """
        C{method} on C{segments} at the current front-end, moving on to the
        next ones when it cannot be reached (see L{StyxClient}).

        @param read: the request changes nothing (it may be sent twice).
        """
        for attempt in range(len(self.base_urls)):
            url = self._url(*segments, query=query)
            try:
                response = yield self.http.request(method, url, **kwargs)
                return response
            except NOT_SENT + MAYBE_SENT as e:
                if len(self.base_urls) == 1:
                    raise
                # the next requests go to the next front-end in any case
                self._current = (self._current + 1) % len(self.base_urls)
                if attempt == len(self.base_urls) - 1 or not (isinstance(e, NOT_SENT) or read):
                    self.log.info("{url} failed ({error}): the next request goes to {next}",
                                  url=url, error=e.__class__.__name__, next=self.base_url)
                    raise
                self.log.info("{url} failed ({error}): trying {next}", url=url,
                              error=e.__class__.__name__, next=self.base_url)

    @staticmethod
    @defer.inlineCallbacks
    def _check(response):
        if response.code == 200:
            return response
        body = yield response.content()
        try:
            error = json.loads(body)
            code, message = error["code"], error["message"]
        except (ValueError, KeyError, TypeError):
            code, message = "unknown_error", body.decode("utf-8", "replace")[:200]
        raise StyxAPIError(code, message, response.code)

    @defer.inlineCallbacks
    def _json(self, d):
        response = yield d
        response = yield self._check(response)
        body = yield response.content()
        return json.loads(body) if body.strip() else None

    @defer.inlineCallbacks
    def _empty(self, d):
        response = yield d
        response = yield self._check(response)
        yield response.content()

    # logs -----------------------------------------------------------------
    def list_logs(self) -> defer.Deferred[list[dict[str, Any]]]:
        """@return: Deferred list of log-info dicts."""
        return self._json(self._request("GET", "logs", read=True))

    def create_log(self, name: str, **config: int | None) -> defer.Deferred[dict[str, Any]]:
        """
        @param config: LogConfig fields (C{max_record_size=...}, ...).
        @return: Deferred log-info dict.
        """
        form = {"name": name}
        form.update({k: str(int(v)) for k, v in config.items() if v is not None})
        return self._json(self._request("POST", "logs", data=form))

    def get_log(self, name: str) -> defer.Deferred[dict[str, Any]]:
        return self._json(self._request("GET", "logs", name, read=True))

    def delete_log(self, name: str) -> defer.Deferred[None]:
        return self._empty(self._request("DELETE", "logs", name))

    def truncate_log(self, name: str) -> defer.Deferred[None]:
        return self._empty(self._request("POST", "logs", name, "truncate"))

    @defer.inlineCallbacks
    def backup_log(self, name: str, sink: Callable[[bytes], None] | None = None
                   ) -> Generator[defer.Deferred[Any], Any, bytes | None]:
        """
        @param sink: a callable taking each chunk of the tar.gz as it
            arrives; without one the Deferred fires with the whole archive.
        """
        response = yield self._request("GET", "logs", name, "backup", read=True)
        response = yield self._check(response)
        if sink is None:
            return (yield response.content())
        yield treq.collect(response, sink)
        return None

    def restore_log(self, name: str, archive: bytes | IO[bytes]) -> defer.Deferred[None]:
        """@param archive: the tar.gz as bytes or a file object."""
        return self._empty(self._request(
            "POST", "logs", "restore", query={"name": name}, data=archive,
            headers={"Content-Type": "application/gzip"}))

    def metrics(self) -> defer.Deferred[str]:
        """@return: Deferred text of C{/metrics}."""
        return self._request("GET", "metrics", read=True).addCallback(
            self._check).addCallback(lambda r: r.text())

    # records ------------------------------------------------------------
    def write_record(self, name: str, record: bytes) -> defer.Deferred[dict[str, int]]:
        """
        Produce one record (octet-stream body).

        @return: Deferred C{{"position": synced end, "count": 1}}.
        """
        return self._json(self._request(
            "POST", "logs", name, "records", data=bytes(record),
            headers={"Content-Type": formats.OCTET_STREAM}))

    def write_records(self, name: str, records: Sequence[bytes],
                      fmt: formats.BodyFormat = formats.BINARY) -> defer.Deferred[dict[str, int]]:
        """
        Produce records in one request.

        @param fmt: L{formats.BINARY} (default) or L{formats.lines}(ending).
        @return: Deferred C{{"position": synced end, "count": n}}, fired once
            the records are durable.
        """
        if fmt.kind == "record":
            if len(records) != 1:
                raise ValueError("the octet-stream format carries exactly one record")
            return self.write_record(name, records[0])
        body = formats.encode_records(fmt, list(records))
        return self._json(self._request(
            "POST", "logs", name, "records", data=body,
            headers={"Content-Type": fmt.media_type()}))

    @staticmethod
    def _read_query(whence, position, count, follow):
        query = {"whence": whence, "position": str(position)}
        if count is not None and count != -1:
            query["count"] = str(count)
        if follow:
            query["follow"] = "true"
        return query

    @defer.inlineCallbacks
    def read_record(self, name: str, whence: str = "origin", position: int = 0
                    ) -> Generator[defer.Deferred[Any], Any, bytes | None]:
        """
        Consume one record (octet-stream).

        @return: Deferred bytes, or None at the end of the log.
        """
        response = yield self._request(
            "GET", "logs", name, "records", query={"whence": whence, "position": str(position)},
            headers={"Accept": formats.OCTET_STREAM}, read=True)
        response = yield self._check(response)
        body = yield response.content()
        if not body and not response.headers.hasHeader(b"content-type"):
            return None
        return body

    @defer.inlineCallbacks
    def read_records(self, name: str, whence: str = "origin", position: int = 0,
                     count: int = -1, follow: bool = False, timeout: float | None = None,
                     fmt: formats.BodyFormat = formats.BINARY,
                     on_records: Callable[[list[bytes]], object] | None = None,
                     max_record_size: int | None = None
                     ) -> Generator[defer.Deferred[Any], Any, list[bytes] | int]:
        """
        Consume records in one streamed response.

        @param timeout: the long-poll seconds (C{X-Styx-Timeout}, used by
            the server with C{follow} only).
        @param on_records: called with each list of records as they arrive;
            without it the Deferred fires with the list of all records.
        @return: Deferred: the records, or their count with C{on_records}.
        """
        if fmt.kind == "record":
            raise ValueError("use read_record for the octet-stream format")
        headers = {"Accept": fmt.media_type()}
        if timeout is not None:
            headers["X-Styx-Timeout"] = str(int(timeout))
        response = yield self._request(
            "GET", "logs", name, "records",
            query=self._read_query(whence, position, count, follow), headers=headers, read=True)
        response = yield self._check(response)
        decoder = fmt.decoder(max_record_size or 0x7FFFFFFF)
        collected: list[bytes] = []
        total = [0]

        def deliver(records):
            if not records:
                return
            total[0] += len(records)
            if on_records is None:
                collected.extend(records)
            else:
                on_records(records)

        yield treq.collect(response, lambda chunk: deliver(decoder.feed(chunk)))
        deliver(decoder.close())
        return collected if on_records is None else total[0]
