"""
The store URL: C{nats://HOST:PORT[,HOST:PORT...][?replicas=N&prefix=P&monitor=M]}
(C{tls://} for TLS), the one spelling every server plugin, C{twistd
streamproto} and the Spark data source take for a JetStream store.
Pure parsing, no I/O.
"""

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

from streamproto.log.natsformat import DEFAULT_PREFIX, PREFIX_PATTERN

DEFAULT_NATS_PORT = 4222
MAX_REPLICAS = 5

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?$")


class StoreURLError(ValueError):
    """Not a store URL; the message says what is wrong, for a usage error."""


@dataclass(frozen=True)
class StoreURL:
    """
    @ivar servers: C{scheme://host:port} of each server, in the order given.
    @ivar replicas: replicas of the streams created (None: the store's
        default, 3 with three or more servers, else 1).
    @ivar prefix: the streams' prefix.
    @ivar tls: whether the scheme is C{tls}.
    @ivar monitor: C{http(s)://host:port} of the servers' monitoring
        endpoints, where start-up reads their JetStream settings (the
        client protocol does not show C{sync_interval}); empty: not checked.
    """

    servers: tuple[str, ...]
    replicas: int | None = None
    prefix: str = DEFAULT_PREFIX
    tls: bool = False
    monitor: tuple[str, ...] = ()

    def __str__(self) -> str:
        hosts = ",".join(s.split("://", 1)[1] for s in self.servers)
        query: list[str] = []
        if self.replicas is not None:
            query.append(f"replicas={self.replicas}")
        if self.prefix != DEFAULT_PREFIX:
            query.append(f"prefix={self.prefix}")
        if self.monitor:
            query.append(f"monitor={','.join(self.monitor)}")
        scheme = "tls" if self.tls else "nats"
        return f"{scheme}://{hosts}" + (f"?{'&'.join(query)}" if query else "")


def is_store_url(text: object) -> bool:
    """Whether C{text} names a JetStream store (rather than a directory)."""
    return isinstance(text, str) and text.startswith(("nats://", "tls://"))


def parse_store_url(text: str) -> StoreURL:
    """
    @return: a L{StoreURL}.
    @raise StoreURLError: with what is wrong.
    """
    if not is_store_url(text):
        raise StoreURLError(f"{text!r}: a store URL starts with nats:// or tls://")
    scheme, rest = text.split("://", 1)
    hosts, _, query = rest.partition("?")
    hosts = hosts.rstrip("/")
    if not hosts:
        raise StoreURLError(f"{text!r}: no server (nats://HOST:PORT[,HOST:PORT...])")
    servers: list[str] = []
    for host in hosts.split(","):
        m = _HOST.match(host.strip())
        if m is None:
            raise StoreURLError(f"{text!r}: {host!r} is not HOST[:PORT]")
        port = int(m.group(2) or DEFAULT_NATS_PORT)
        if not 0 < port < 65536:
            raise StoreURLError(f"{text!r}: port {port} out of range")
        server = f"{scheme}://{m.group(1)}:{port}"
        if server not in servers:
            servers.append(server)
    replicas: int | None = None
    prefix = DEFAULT_PREFIX
    monitor: list[str] = []
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise StoreURLError(f"{text!r}: the query must be replicas=N&prefix=P&monitor=M")
    for key, value in pairs:
        if key == "replicas":
            if not value.isdigit() or not 1 <= int(value) <= MAX_REPLICAS:
                raise StoreURLError(f"{text!r}: replicas must be 1 to {MAX_REPLICAS}, "
                                    f"not {value!r}")
            replicas = int(value)
        elif key == "prefix":
            if not PREFIX_PATTERN.match(value):
                raise StoreURLError(f"{text!r}: prefix must be 1 to 32 letters and digits, "
                                    f"not {value!r}")
            prefix = value
        elif key == "monitor":
            monitor = [_monitor_url(text, m) for m in value.split(",")]
        else:
            raise StoreURLError(f"{text!r}: unknown parameter {key!r} "
                                "(replicas, prefix and monitor are known)")
    return StoreURL(tuple(servers), replicas, prefix, scheme == "tls", tuple(monitor))


def _monitor_url(text: str, value: str) -> str:
    """C{HOST:PORT} or C{http(s)://HOST:PORT} of a monitoring endpoint, as a URL."""
    scheme, _, hostport = value.strip().rpartition("://")
    if scheme not in ("", "http", "https"):
        raise StoreURLError(f"{text!r}: monitor {value!r} is not [http(s)://]HOST:PORT")
    m = _HOST.match(hostport.rstrip("/"))
    if m is None or m.group(2) is None or not 0 < int(m.group(2)) < 65536:
        raise StoreURLError(f"{text!r}: monitor {value!r} is not [http(s)://]HOST:PORT")
    return f"{scheme or 'http'}://{m.group(1)}:{m.group(2)}"
