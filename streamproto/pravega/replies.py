"""
How the Pravega segment store answers what failed: the ErrorMessage codes,
the table from a storage or table error to the reply the reference sends
(by request, and for appends by writer and event number), and the
C{replying} decorator of the request handlers that answers through it.
L{streamproto.pravega.server} names every one of these too.
"""

from twisted.internet import defer

from streamproto.log.errors import CorruptLog, LogFailed
from streamproto.pravega import codec
from streamproto.pravega.segments import (
    BadOffset, MergeTooLarge, SegmentExists, SegmentNotFound, SegmentSealed, SegmentTruncated,
)
from streamproto.pravega.tables import (
    BadContinuationToken, KeyBadVersion, KeyDoesNotExist, TableError, TableNotEmpty,
)

#: ErrorMessage error codes (Pravega's ErrorMessage.ErrorCode): UNSPECIFIED
#: becomes a RuntimeException in the Java client, ILLEGAL_ARGUMENT an
#: IllegalArgumentException.
UNSPECIFIED = -1
ILLEGAL_ARGUMENT = 0
#: AuthTokenCheckFailed's code for "not allowed" (1 is "token expired")
TOKEN_CHECK_FAILED = 0
#: Log errors after which a log takes no more appends until the server is
#: restarted (recovery runs on open): a fail-stopped log (fsync or write
#: error) or a corrupt one.  Writers get an ErrorMessage and stop, rather
#: than reconnecting to a log that cannot take their data.
FINAL_STORAGE_ERRORS = (LogFailed, CorruptLog)


def storage_failure_message(error):
    """The ErrorMessage text for a log that failed with C{error}."""
    return f"segment store log failed, restart the server to recover: {error}"


def storage_failure(segment):
    """The reason C{segment}'s log takes no appends, or None if it does."""
    failed = getattr(segment.log_, "failed", None)
    if failed is None and isinstance(segment.failed, FINAL_STORAGE_ERRORS):
        failed = segment.failed
    if failed is None:
        return None
    return storage_failure_message(failed)


def _segment_of(cmd, error):
    """The segment an error reply names: the one the error is about, else the request's."""
    name = getattr(error, "segment", None)
    if name is None:
        name = getattr(cmd, "segment", None)
    if name is None:
        name = getattr(cmd, "source", "")
    return name


def _offset_of(cmd):
    """The offset an error reply about C{cmd} reports (-1: none)."""
    offset = getattr(cmd, "offset", None)
    if offset is None:
        offset = getattr(cmd, "truncation_offset", -1)
    return offset


#: How request handlers answer errors: the first entry whose exception class
#: matches builds the reply from (request, error).  Anything else is an
#: internal error: logged, and the connection is closed (the reference does
#: the same, so that the client reconnects with a clean state).
ERROR_REPLIES = (
    (SegmentNotFound, lambda cmd, e: codec.NoSuchSegment(
        cmd.request_id, _segment_of(cmd, e), "", _offset_of(cmd))),
    (SegmentExists, lambda cmd, e: codec.SegmentAlreadyExists(
        cmd.request_id, _segment_of(cmd, e), "")),
    (SegmentSealed, lambda cmd, e: codec.SegmentIsSealed(
        cmd.request_id, _segment_of(cmd, e), "", -1)),
    (SegmentTruncated, lambda cmd, e: codec.SegmentIsTruncated(
        cmd.request_id, _segment_of(cmd, e), e.start_offset, "", _offset_of(cmd))),
    # a truncation beyond the end: the reference answers with the segment's
    # current bounds the same way
    (BadOffset, lambda cmd, e: codec.SegmentIsTruncated(
        cmd.request_id, _segment_of(cmd, e), e.expected, "", _offset_of(cmd))),
    (TableNotEmpty, lambda cmd, e: codec.TableSegmentNotEmpty(
        cmd.request_id, _segment_of(cmd, e), "")),
    (KeyBadVersion, lambda cmd, e: codec.TableKeyBadVersion(
        cmd.request_id, _segment_of(cmd, e), "")),
    (KeyDoesNotExist, lambda cmd, e: codec.TableKeyDoesNotExist(
        cmd.request_id, _segment_of(cmd, e), "")),
    (BadContinuationToken, lambda cmd, e: codec.ErrorMessage(
        cmd.request_id, _segment_of(cmd, e), str(e), ILLEGAL_ARGUMENT)),
    (TableError, lambda cmd, e: codec.ErrorMessage(
        cmd.request_id, _segment_of(cmd, e), str(e), UNSPECIFIED)),
    (MergeTooLarge, lambda cmd, e: codec.ErrorMessage(
        cmd.request_id, cmd.source, str(e), UNSPECIFIED)),
    (FINAL_STORAGE_ERRORS, lambda cmd, e: codec.ErrorMessage(
        cmd.request_id, _segment_of(cmd, e), storage_failure_message(e), UNSPECIFIED)),
)


#: How failed appends are answered (by writer and event number, not by
#: request); a log that fail-stopped and other storage errors are handled
#: in L{PravegaServerProtocol._append_failed}.
APPEND_ERROR_REPLIES = (
    (BadOffset, lambda a, e: codec.ConditionalCheckFailed(
        a.writer_id, a.event_number, a.request_id)),
    (SegmentSealed, lambda a, e: codec.SegmentIsSealed(
        a.request_id, a.segment, "", a.event_number)),
    (SegmentNotFound, lambda a, e: codec.NoSuchSegment(a.request_id, a.segment, "", -1)),
)


def error_reply(cmd, error, table=ERROR_REPLIES):
    """The reply to request C{cmd} that failed with C{error}, or None (internal error)."""
    for kind, build in table:
        if isinstance(error, kind):
            return build(cmd, error)
    return None


def replying(handler):
    """
    A request handler that may fail: the generator C{handler} runs as
    L{defer.inlineCallbacks}, and an error it raises is answered through
    L{ERROR_REPLIES} (or closes the connection when no entry matches).
    """
    handler = defer.inlineCallbacks(handler)

    def run(self, cmd):
        return handler(self, cmd).addErrback(self._reply_error, cmd)

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run
