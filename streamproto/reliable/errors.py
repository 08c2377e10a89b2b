"""Errors of the reliable-stream protocol; each becomes C{{"error": str(e)}} on the wire."""


class ReliableError(Exception):
    """Base class: the message is what the peer is told."""


class ProtocolError(ReliableError):
    """A message the server (or client) does not understand or that breaks the protocol."""


class LineTooLong(ProtocolError):
    """A line longer than the configured bound."""


class SessionError(ReliableError):
    """A session store refused an operation."""


class UnknownSession(SessionError):
    def __init__(self, uuid=None):
        super().__init__("Unknown client")
        self.uuid = uuid


class UnknownMessageID(SessionError):
    """An id (state or ack) beyond the last message sent."""

    def __init__(self, message_id=None):
        super().__init__("Unknown message ID")
        self.message_id = message_id


class OutOfOrderAck(SessionError):
    """An ack (or state) older than a previous ack: those messages are gone."""

    def __init__(self, message_id=None):
        super().__init__("Out-of-order ACK")
        self.message_id = message_id


class SessionFull(SessionError):
    """The uint32 id space of the session is exhausted."""


class StoreFailed(SessionError):
    """The durable store failed a commit and refuses further work until reopened."""


class StoreUnavailable(StoreFailed):
    """
    The session store did not answer in time (a cluster electing a leader,
    or without a quorum): transient.  What it stored stays; a client that
    reconnects resumes its session once the store answers again.
    """


class RemoteError(ReliableError):
    """The server sent C{{"error": ...}} (raised on the client side)."""


class StreamGaveUp(ReliableError):
    """The client could not reconnect in time; the server may have dropped the session."""


class CRCMismatch(ReliableError):
    """The final CRC the server sent does not match the values received."""
