"""
CORS for the Styx HTTP API, as the reference does it (it wraps its router
in rs/cors): preflights answered, answers marked with C{Vary: Origin} and,
for an allowed origin, C{Access-Control-Allow-Origin}.

The allowed origins are a sequence of patterns, as in the reference's
C{cors_allowed_origins}: C{"*"} allows every origin, one C{*} in a pattern
is a wildcard (C{"https://*.example.com"}), and an empty sequence sends no
CORS headers at all.
"""

from streamproto.styx.httputil import header

CORS_METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH")
# rs/cors's defaults, plus the long-poll header
CORS_HEADERS = (b"origin", b"accept", b"content-type", b"x-requested-with",
                b"x-styx-timeout")


def allowed_origin(origins, origin):
    """Whether C{origin} (a str) matches one of the patterns C{origins}."""
    for pattern in origins:
        if pattern == "*":
            return True
        head, star, tail = pattern.partition("*")
        if not star and origin == pattern:
            return True
        if star and origin.startswith(head) and origin.endswith(tail) \
                and len(origin) >= len(head) + len(tail):
            return True
    return False


def apply_cors(request, origins):
    """
    Add the CORS headers to the answer to C{request}; answer a preflight.

    @param origins: the allowed origin patterns.
    @return: True if the request was a preflight (answered: an empty 204).
    """
    origin = header(request, b"origin")
    if not origins:
        return False
    if origin is None:
        # rs/cors (the reference) marks every response: a shared cache
        # must not serve one made without Origin to a CORS request
        request.responseHeaders.addRawHeader(b"Vary", b"Origin")
        return False
    origin = origin.decode("latin-1")
    asked_method = header(request, b"access-control-request-method")
    if request.method == b"OPTIONS" and asked_method is not None:
        allowed = allowed_origin(origins, origin)
        all_origins = "*" in origins
        request.responseHeaders.addRawHeader(b"Vary", b"Origin")
        request.responseHeaders.addRawHeader(b"Vary", b"Access-Control-Request-Method")
        request.responseHeaders.addRawHeader(b"Vary", b"Access-Control-Request-Headers")
        if allowed and asked_method.upper() in CORS_METHODS:
            request.setHeader(b"Access-Control-Allow-Origin",
                              b"*" if all_origins else origin.encode("latin-1"))
            request.setHeader(b"Access-Control-Allow-Methods", asked_method.upper())
            asked_headers = header(request, b"access-control-request-headers")
            if asked_headers:
                names = [h.strip().lower() for h in asked_headers.split(b",")]
                if all(h in CORS_HEADERS for h in names if h):
                    request.setHeader(b"Access-Control-Allow-Headers", asked_headers)
        request.setResponseCode(204)
        return True
    for name, value in cors_headers(origins, origin):
        request.responseHeaders.addRawHeader(name, value)
    return False


def cors_headers(origins, origin):
    """
    The CORS headers of an answer (not a preflight) to a request from
    C{origin} (a str, or None without an Origin header).

    @param origins: the allowed origin patterns.
    @return: a list of (name, value) pairs of bytes.
    """
    if not origins:
        return []
    headers = [(b"Vary", b"Origin")]
    if origin is not None and allowed_origin(origins, origin):
        headers.append((b"Access-Control-Allow-Origin",
                        b"*" if "*" in origins else origin.encode("latin-1")))
    return headers
