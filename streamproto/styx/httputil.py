"""
Small HTTP helpers of the Styx API, shared by the resource
(L{streamproto.styx.resource}), the request class that streams produce
bodies (L{streamproto.styx.produce}), CORS (L{streamproto.styx.cors}),
consume (L{streamproto.styx.consume}) and backups
(L{streamproto.styx.backup}).
"""

import urllib.parse

from twisted.web import http, server

from streamproto.core.compat import request_gone
from streamproto.styx.errors import render_json, render_produced


def header(request, name):
    """The first value of request header C{name} (bytes), or None."""
    value = request.requestHeaders.getRawHeaders(name)
    return value[0] if value else None


def upgrade_protocol(request):
    """C{b"styx/0"}, C{b"websocket"} or None, from the Upgrade header."""
    value = header(request, b"upgrade")
    if not value:
        return None
    tokens = [t.strip().lower() for t in value.split(b",")]
    for proto in (b"styx/0", b"websocket"):
        if proto in tokens:
            return proto
    return None


def path_segments(path):
    """C{b"/logs/a%20b/records?x"} -> C{["logs", "a b", "records"]}."""
    path = path.split(b"?", 1)[0]
    return [urllib.parse.unquote(s.decode("utf-8", "replace")) for s in path.split(b"/")[1:]]


def raw_json_answer(status, body, headers=(), date=None):
    """
    The bytes of an HTTP/1.1 answer carrying the JSON C{body}, for the
    paths that write to the connection themselves rather than through a
    twisted.web C{Request}: a refusal before the body is read
    (L{streamproto.styx.produce}), the quick path's answers
    (L{streamproto.styx.quick}).

    @param headers: (name, value) pairs of bytes, after C{Content-Type}
        and C{Content-Length}.
    @param date: the C{Date} header's value: with it, C{Server} and
        C{Date} lead the headers, as in twisted.web's answers.
    """
    lead = b"HTTP/1.1 %d %s\r\n" % (status, http.RESPONSES.get(status, b"Unknown Status"))
    if date is not None:
        lead += b"Server: " + server.version + b"\r\nDate: " + date + b"\r\n"
    return b"".join(
        [lead, b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)]
        + [name + b": " + value + b"\r\n" for name, value in headers] + [b"\r\n", body])


def respond_json(request, value, status=200):
    """Answer C{value} as the reference's JSON, and finish the request."""
    respond_json_body(request, render_json(value), status)


def respond_produced(request, position, count):
    """Answer a produce request (see L{render_produced})."""
    respond_json_body(request, render_produced(position, count))


def respond_json_body(request, body, status=200):
    """Answer C{body} (JSON bytes), and finish the request."""
    if request_gone(request):
        return  # the client left while we worked; finish() would raise
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    request.setHeader(b"Content-Length", str(len(body)).encode())
    request.write(body)
    request.finish()


def respond_empty(request, status=200):
    """Answer with an empty body (no Content-Type, like the reference)."""
    if request_gone(request):
        return
    request.setResponseCode(status)
    request.setHeader(b"Content-Length", b"0")
    request.finish()
