"""Capturing the log events a test provokes (no tests here)."""

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
