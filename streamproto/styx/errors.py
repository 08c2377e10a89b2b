"""
The Styx HTTP API's errors: a code string and an HTTP status, rendered as
the reference renders them, C{{"code": ..., "message": ...}}.

The log store raises L{streamproto.log.errors.LogError} subclasses carrying a
Styx-style C{.code}; L{from_exception} maps any exception onto an
L{APIError}.
"""

import errno
import json

from twisted.logger import Logger

from streamproto.log.errors import LogError

# the HTTP API's log lines keep the namespace they had in one module
log = Logger(namespace="streamproto.styx.resource")

# code -> (HTTP status, default message).  The first nine, their statuses
# and messages are the reference's (styx 0.1.4 answers log_exist and
# log_not_available with 400 too).  The others are ours: the reference
# answers an oversized record or body with unknown_error, and has no
# authorization.
CODES = {
    "unknown_error": (500, "api: unknown error"),
    "method_not_allowed": (405, "api: method not allowed"),
    "not_found": (404, "api: not found"),
    "invalid_params": (400, "api: params: invalid params"),
    "log_exist": (400, "api: log already exists"),
    "log_not_found": (404, "api: log not found"),
    "log_not_available": (400, "api: log not available"),
    "log_invalid_name": (400, "api: log name invalid"),
    "missing_content_length": (400, "api: missing content-length"),
    "record_too_large": (400, "api: record too large"),
    "request_too_large": (413, "api: request body too large"),
    "not_supported": (501, "api: not supported"),
    # the authorization policy (doc/security.rst)
    "unauthorized": (401, "api: unauthorized"),
    "forbidden": (403, "api: forbidden"),
}


class APIError(Exception):
    """
    An error answered to an HTTP client.

    @ivar code: one of L{CODES}.
    @ivar status: the HTTP status.
    @ivar message: human-readable detail.
    """

    def __init__(self, code, message=None, status=None):
        if code not in CODES:
            code = "unknown_error"
        default_status, default_message = CODES[code]
        self.code = code
        self.status = status or default_status
        self.message = message or default_message
        super().__init__(self.message)

    def __repr__(self):
        return f"<APIError {self.code} {self.status}: {self.message}>"

    def to_json(self):
        return render_error(self.code, self.message)


def render_json(value):
    """JSON the way the reference writes it: 2-space indent, final newline."""
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")


def render_produced(position, count):
    """
    C{render_json({"position": position, "count": count})}, the answer of
    every produce request, formatted directly: C{json.dumps} with an
    indent runs the json module's pure-Python encoder.
    """
    if type(position) is int and type(count) is int:
        return b'{\n  "position": %d,\n  "count": %d\n}\n' % (position, count)
    return render_json({"position": position, "count": count})


def render_error(code, message):
    """The JSON body of an error response (bytes)."""
    return render_json({"code": code, "message": message})


def invalid_params(detail):
    """The reference prefixes parameter errors with C{api: params: }."""
    return APIError("invalid_params", f"api: params: {detail}")


def from_exception(exc):
    """
    Map an exception (an L{APIError}, a log store error with a C{.code}, or
    anything else) onto an L{APIError}.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LogError):
        detail = str(exc)
        return APIError(exc.code, f"api: {detail}" if detail else None)
    if isinstance(exc, OSError) and exc.errno is not None:
        # the cause belongs in the answer, not only in the server's log: a
        # read-only or full data directory is the operator's to fix
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        return APIError("unknown_error", f"api: storage error: {exc.strerror} ({name})")
    return APIError("unknown_error")


def report(failure, method, path, metrics):
    """
    The L{APIError} answering a request that failed with C{failure}, told
    in the server's log as its kind deserves and counted in C{metrics} (a
    L{streamproto.styx.metrics.StyxMetrics}).

    A storage error (read-only or full data directory) is the operator's
    to fix: one error line.  Anything unexpected gets its traceback.  The
    API's own answers (unknown log, bad parameters) are the client's
    business: debug.
    """
    error = from_exception(failure.value)
    if error.code == "unknown_error" and isinstance(failure.value, OSError):
        log.error("storage error on {method} {path}: {error}", method=method,
                  path=path, error=failure.value)
    elif error.code == "unknown_error" and not isinstance(failure.value, APIError):
        log.failure("unexpected error on {method} {path}", failure,
                    method=method, path=path)
    else:
        log.debug("{method} {path}: {code} {message}", method=method,
                  path=path, code=error.code, message=error.message)
    metrics.error(error.code)
    return error
