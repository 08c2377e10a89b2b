"""
The query parameters of reads on C{/logs/{name}/records}, shared by the HTTP
consumer and the styx/0 and WebSocket consumers.

As in the reference: C{whence} is C{origin} (absolute positions, the
default), C{start} (relative to the log's first readable record; the
reference's C{current} means the same for a new reader) or C{end} (relative
to its synced end); C{position} (default 0, may be negative) is
added to it; C{count} (default -1: no limit) bounds the records sent;
C{follow} (default false) keeps the stream open at the end of the log.
"""

from dataclasses import dataclass

from streamproto.styx.errors import APIError, invalid_params

WHENCES = ("origin", "start", "current", "end")
_TRUE = ("1", "t", "T", "true", "TRUE", "True")
_FALSE = ("0", "f", "F", "false", "FALSE", "False")


@dataclass(frozen=True)
class ReadParams:
    whence: str = "origin"
    position: int = 0
    count: int = -1
    follow: bool = False

    def resolve(self, start_position, end_position):
        """
        The absolute position to read from, given the log's bounds.  Not
        clamped: the caller checks it against the log (the reference answers
        an out-of-range position with invalid_params).
        """
        # "current" is the reference's too: a fresh reader stands at the start
        if self.whence in ("start", "current"):
            return start_position + self.position
        if self.whence == "end":
            return end_position + self.position
        return self.position

    def resolve_log(self, log):
        """L{resolve} against an L{streamproto.log.ILog}."""
        return self.resolve(log.start_position, log.end_position)

    def start_in(self, log):
        """
        Where a consumer of C{log} starts (L{resolve_log}).

        @raise APIError: C{invalid_params} (the reference's answer) when
            that is outside the log's readable range.
        """
        position = self.resolve_log(log)
        if not log.start_position <= position <= log.end_position:
            raise APIError("invalid_params",
                           f"api: params: position {position} outside "
                           f"[{log.start_position}, {log.end_position}]")
        return position


def read_start(params, log):
    """
    The parameters of a consume request (the defaults when it gave none)
    and the position its stream starts at in C{log}: what the styx/0 and
    WebSocket upgrades both decide before they take the connection over.

    @raise APIError: see L{ReadParams.start_in}.
    """
    if params is None:
        params = ReadParams()
    return params, params.start_in(log)


def _first(args, name):
    """C{args} maps bytes or str keys to lists of bytes or str values."""
    for key in (name, name.encode("ascii")):
        values = args.get(key)
        if values:
            v = values[0]
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return None


def _int(args, name, default):
    v = _first(args, name)
    if v is None or v == "":
        return default
    try:
        return int(v, 10)
    except ValueError:
        raise invalid_params(f"{name} must be an integer")


def parse_bool(value, name):
    """Go's strconv.ParseBool spellings."""
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise invalid_params(f"{name} must be a boolean")


def parse_read_params(args):
    """
    Parse C{whence}, C{position}, C{count}, C{follow} from C{args} (a
    twisted.web C{request.args}: bytes keys -> lists of bytes; str keys
    also work).

    @raise streamproto.styx.errors.APIError: invalid_params.
    """
    whence = _first(args, "whence")
    if whence is None or whence == "":
        whence = "origin"
    if whence not in WHENCES:
        raise invalid_params("invalid whence")
    position = _int(args, "position", 0)
    count = _int(args, "count", -1)
    if count < -1:
        raise invalid_params("count must be -1 or positive")
    follow_value = _first(args, "follow")
    follow = False if follow_value in (None, "") else parse_bool(follow_value, "follow")
    return ReadParams(whence=whence, position=position, count=count, follow=follow)
