"""
The authorization policy on the Styx HTTP API (doc/security.rst).

A request's principals are its connection's (the TLS client certificate,
L{streamproto.core.auth.connection_principals}) and, with an
C{Authorization: Bearer TOKEN} header, the token's.  A request the policy
does not allow is answered before the store is touched: 401
C{unauthorized} (with C{WWW-Authenticate: Bearer}) when it showed no
credentials, or an unknown token; 403 C{forbidden} when it did.

Which operation each route is: L{route_access}.
"""

from streamproto.core.auth import ANONYMOUS, connection_principals, denied, is_anonymous
from streamproto.styx.errors import APIError

SERVER = "styx-server"
#: the WWW-Authenticate header of a 401 answer
CHALLENGE = b'Bearer realm="streamproto"'
BEARER = b"bearer"


def bearer_token(request):
    """The token of an C{Authorization: Bearer} header, or None."""
    values = request.requestHeaders.getRawHeaders(b"authorization") or []
    for value in values:
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() == BEARER:
            return token.strip().decode("utf-8", "replace")
    return None


def request_principals(request, authorizer, op="read", resource="*"):
    """
    The principals of C{request}.

    @raise APIError: 401 for a bearer token the policy does not know
        (reported as a denial of C{op} on C{resource}; the token itself is
        never logged).
    """
    channel = getattr(request, "channel", None)
    transport = getattr(channel, "transport", None)
    token = bearer_token(request)
    extra = []
    if token is not None:
        principal = authorizer.token_principal(token)
        if principal is None:
            denied(SERVER, connection_principals(transport, ["invalid-token"]), op, resource,
                   "unknown bearer token")
            raise APIError("unauthorized", "api: unauthorized: unknown bearer token")
        extra.append(principal)
    return connection_principals(transport, extra)


def check(request, authorizer, op, resource):
    """
    @return: the request's principals, if the policy allows C{op} on
        C{resource}.
    @raise APIError: 401 or 403 otherwise (logged and counted).
    """
    if not authorizer.enabled:
        return (ANONYMOUS,)
    principals = request_principals(request, authorizer, op, resource)
    if authorizer.allows(principals, op, resource):
        return principals
    denied(SERVER, principals, op, resource)
    raise denial(principals, op, resource)


def denial(principals, op, resource):
    """The L{APIError} for a denied request: 401 without credentials, else 403."""
    if is_anonymous(principals):
        return APIError("unauthorized",
                        f"api: unauthorized: {op} on log {resource!r} needs credentials")
    return APIError("forbidden", f"api: forbidden: {op} on log {resource!r}")


def route_access(method, segments, args):
    """
    The (operation, log name) a request needs, from its method, path
    segments and query arguments; None for routes decided later (listing
    filters, creation reads its form) or not about a log.
    """
    if not segments or segments[0] != "logs":
        return None
    rest = segments[1:]
    if len(rest) == 1:
        if rest[0] == "restore" and method == b"POST":
            name = (args.get(b"name") or [b""])[0].decode("utf-8", "replace")
            return ("admin", name) if name else None
        if method == b"GET":
            return ("read", rest[0])
        if method == b"DELETE":
            return ("admin", rest[0])
    if len(rest) == 2:
        action = rest[1]
        if action in ("truncate", "backup"):
            return ("admin", rest[0])
        if action == "records":
            return ("write" if method == b"POST" else "read", rest[0])
    return None
