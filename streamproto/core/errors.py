"""
Errors as one line for the person at the terminal: what a client command
prints after C{Error:}.  Twisted wraps the interesting failure in lists of
failures (C{ResponseNeverReceived.reasons}) and OpenSSL in lists of tuples;
printed as they are, users see C{[<twisted.python.failure.Failure ...>]}.
"""

from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure

#: what a TLS verification failure means, for someone who never asked for TLS details
_HINTS = {
    "certificate verify failed": "the server's certificate is not signed by a CA this "
                                 "command trusts: give its CA bundle with --ca",
    "certificate required": "the server requires a client certificate: give --cert and --key",
    "unknown ca": "the server does not trust the CA of this client certificate",
}


def describe(error: BaseException | Failure) -> str:
    """
    C{error} (an exception or a L{Failure}) as one readable line: nested
    reasons unwrapped, OpenSSL's error tuples turned into their texts, and
    a hint for the TLS failures users meet most.
    """
    if isinstance(error, Failure):
        error = error.value  # type: ignore[assignment]  # a Failure always has its value
    reasons = getattr(error, "reasons", None)
    if isinstance(reasons, list) and reasons:
        return "; ".join(dict.fromkeys(describe(r) for r in reasons))
    text = _openssl_text(error) or str(error).strip() or type(error).__name__
    text = " ".join(text.split())
    for needle, hint in _HINTS.items():
        if needle in text:
            return f"{text} ({hint})"
    return text


def _openssl_text(error: BaseException) -> str | None:
    """The texts of an C{OpenSSL.SSL.Error}'s C{[(lib, func, reason), ...]}, or None."""
    args: tuple[Any, ...] = getattr(error, "args", ())
    if len(args) == 1 and isinstance(args[0], list) and args[0] and all(
            isinstance(t, tuple) and len(t) == 3 for t in args[0]):
        return "TLS error: " + ", ".join(str(t[2]) for t in args[0] if t[2])
    return None


def log_failure(logger: Logger, failure: Failure, format: str, **kwargs: Any) -> None:
    """
    Put C{failure} in the server's log: the log store's own errors (it says
    why: full, unavailable, fail-stopped) as one error line, anything else
    (a bug) with its traceback.
    """
    from streamproto.log.errors import LogError
    if failure.check(LogError):
        logger.error(format + " ({error})", error=failure.getErrorMessage(), **kwargs)
    else:
        logger.failure(format, failure, **kwargs)
