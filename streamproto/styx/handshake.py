"""
The client side of the styx/0 HTTP upgrade, sans I/O: the request head,
reading and parsing the response head, and what the server announced.

Shared by the Twisted client (L{streamproto.styx.stream_client}) and the
blocking one the Spark sink runs in executors (L{streamproto.spark.sink}):
stdlib only, no reactor.
"""

from collections.abc import Mapping
from urllib.parse import quote, urlencode

#: The HTTP response head (101 or error) may not exceed this.
MAX_RESPONSE_HEAD = 65536
#: seconds, when the server announces no X-Styx-Timeout (the reference's default)
DEFAULT_REMOTE_TIMEOUT = 30


class HandshakeError(Exception):
    """The server's answer to the upgrade is not HTTP, or too large."""


def request_head(method: str, host: str, name: str, query: Mapping[str, str] | None = None,
                 timeout: float = DEFAULT_REMOTE_TIMEOUT, token: str | None = None,
                 base_path: str = "") -> bytes:
    """
    The request asking to switch to styx/0 for log C{name}.

    @param method: C{"POST"} (produce) or C{"GET"} (consume).
    @param base_path: the server's path prefix (a URL's path), if any.
    @param token: a bearer token for a server's C{--auth-policy}.
    @return: the request head, as bytes.
    """
    path = base_path.rstrip("/") + "/logs/" + quote(name, safe="") + "/records"
    if query:
        path += "?" + urlencode(query)
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {host}",
        "Connection: upgrade",  # the Go server matches this exact spelling
        "Upgrade: styx/0",
        f"X-Styx-Timeout: {int(timeout)}",
        "User-Agent: streamproto-styx",
    ]
    if token:
        # a server's --auth-policy (doc/security.rst); a token is one line
        lines.append("Authorization: Bearer " + "".join(token.split()))
    if method == "POST":
        lines.append("Content-Length: 0")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def parse_response_head(head: bytes | bytearray) -> tuple[int, dict[str, str]]:
    """
    @param head: the response head without its final blank line.
    @return: C{(status, {lowercase name: value})}.
    @raise HandshakeError: if it is not an HTTP response.
    """
    lines = bytes(head).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HandshakeError(f"not an HTTP response: {lines[0][:200]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


class ResponseHead:
    """
    Reads a response head from bytes as they come.

    @ivar status: the status code once the head is complete, else None.
    @ivar headers: its headers (lowercase names), once complete.
    """

    def __init__(self, max_size: int = MAX_RESPONSE_HEAD) -> None:
        self.max_size = max_size
        self.status: int | None = None
        self.headers: dict[str, str] | None = None
        self._buffer = bytearray()

    def feed(self, data: bytes) -> bytes | None:
        """
        @return: None while the head is incomplete, else the bytes that
            followed it (the styx/0 stream, or an error body).
        @raise HandshakeError: when the head is not HTTP or grows past
            C{max_size}.
        """
        buffer = self._buffer
        buffer += data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > self.max_size:
                raise HandshakeError("response head too large")
            return None
        self.status, self.headers = parse_response_head(buffer[:end])
        rest = bytes(buffer[end + 4:])
        self._buffer = bytearray()
        return rest


def upgraded(status: int | None, headers: Mapping[str, str]) -> bool:
    """Whether the server switched to styx/0."""
    return status == 101 and headers.get("upgrade", "").lower() == "styx/0"


def remote_timeout(headers: Mapping[str, str], default: float = DEFAULT_REMOTE_TIMEOUT) -> float:
    """The idle timeout the server announced (X-Styx-Timeout), in seconds."""
    try:
        return float(headers.get("x-styx-timeout", "") or default)
    except ValueError:
        return float(default)
