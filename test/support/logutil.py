"""Capturing the log events a test provokes; reading a whole log (no tests here)."""

from twisted.internet import defer
from twisted.logger import LogLevel, formatEvent, globalLogPublisher


def error_lines(testcase):
    """
    A list that fills with the formatted text of every error (or worse)
    event logged from now until the test ends.
    """
    lines = []

    def observer(event):
        if event.get("log_level") in (LogLevel.error, LogLevel.critical) \
                and "log_failure" not in event:
            lines.append(formatEvent(event))
    globalLogPublisher.addObserver(observer)
    testcase.addCleanup(globalLogPublisher.removeObserver, observer)
    return lines


@defer.inlineCallbacks
def read_records(store, name):
    """Every record of log C{name} of C{store}, from its start (bytes)."""
    log = yield store.get(name)
    out, position = [], log.start_position
    while position < log.end_position:
        batch = yield log.read(position, max_bytes=1 << 22)
        out.extend(bytes(r) for r in batch)
        position += len(batch)
    return out
