"""
The Pravega client's errors: one exception per error reply of the segment
store (L{ERRORS} maps the decoded reply's class to it), and the client's
own.
"""

from streamproto.pravega import codec

__all__ = [
    "ERRORS", "AuthTokenCheckFailedError", "ConditionalCheckFailedError",
    "IncompatibleVersionError", "InvalidEventNumberError", "NoSuchSegmentError",
    "OperationUnsupportedError", "PravegaError", "SegmentExistsError", "SegmentSealedError",
    "SegmentTruncatedError", "ServerError", "WriterClosed", "WrongHostError",
]


class PravegaError(Exception):
    """An error reply from the server; C{reply} is the decoded command."""

    def __init__(self, reply):
        message = getattr(reply, "message", None)
        if message:
            # an ErrorMessage: the server's reason is the point
            super().__init__(f"{type(reply).__name__} on {reply.segment!r}: {message}")
        else:
            super().__init__(repr(reply))
        self.reply = reply


class NoSuchSegmentError(PravegaError):
    pass


class SegmentExistsError(PravegaError):
    pass


class SegmentSealedError(PravegaError):
    pass


class SegmentTruncatedError(PravegaError):
    pass


class ConditionalCheckFailedError(PravegaError):
    pass


class InvalidEventNumberError(PravegaError):
    pass


class OperationUnsupportedError(PravegaError):
    pass


class WrongHostError(PravegaError):
    pass


class AuthTokenCheckFailedError(PravegaError):
    pass


class ServerError(PravegaError):
    """
    An ErrorMessage: the server could not do what was asked, for the reason
    in C{reply.message} (e.g. its log fail-stopped after an fsync error).
    A writer that gets one fails at once: retrying would not help.
    """


class IncompatibleVersionError(Exception):
    pass


class WriterClosed(Exception):
    """The writer was closed: nothing more can be written with it."""


ERRORS = {
    codec.NoSuchSegment: NoSuchSegmentError,
    codec.SegmentAlreadyExists: SegmentExistsError,
    codec.SegmentIsSealed: SegmentSealedError,
    codec.SegmentIsTruncated: SegmentTruncatedError,
    codec.ConditionalCheckFailed: ConditionalCheckFailedError,
    codec.InvalidEventNumber: InvalidEventNumberError,
    codec.OperationUnsupported: OperationUnsupportedError,
    codec.WrongHost: WrongHostError,
    codec.AuthTokenCheckFailed: AuthTokenCheckFailedError,
    codec.ErrorMessage: ServerError,
}
