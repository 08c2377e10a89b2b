"""Errors of the log store.  Protocols map these to their own wire errors."""

from collections.abc import Mapping


class LogError(Exception):
    """Base class of every log store error."""

    code = "unknown_error"


class InvalidLogName(LogError, ValueError):
    code = "log_invalid_name"


class LogExists(LogError):
    code = "log_exist"


class LogNotFound(LogError, KeyError):
    code = "log_not_found"

    def __str__(self) -> str:  # KeyError would repr() the name
        return Exception.__str__(self)


class RecordTooLarge(LogError, ValueError):
    code = "record_too_large"


class PositionOutOfRange(LogError, IndexError):
    code = "invalid_params"


class LogClosed(LogError):
    """The log was closed or deleted while the operation was pending."""

    code = "log_not_available"


class LogFailed(LogError):
    """
    The log fail-stopped after a write or fsync error: nothing is acked after
    it and no further append is accepted until the store is reopened (and
    recovery runs).  Retrying an fsync after a failure is unsafe: the kernel
    may have dropped the dirty pages and report success the second time.
    """

    code = "log_not_available"


class CorruptLog(LogError):
    """Checksums disagree with data that had been synced: never served."""

    code = "log_not_available"


class WriteFailed(LogError):
    """
    A write to the OS failed (e.g. ENOSPC) and was rolled back: nothing of
    this append is visible, and the log keeps accepting appends once space
    is back.
    """

    code = "log_not_available"


class AppendConflict(LogError):
    """
    A conditional append (C{expected_position}, C{expected_attributes})
    found the log ending elsewhere or its attributes changed: another
    writer (on this or another front-end) appended first, or an earlier
    append whose outcome was unknown was stored after all.  Nothing of it
    was written.
    """

    code = "conflict"


def skip_conflict(name: str, start: int, end: int, end_offset: int,
                  position: int, offset: int) -> "AppendConflict | None":
    """
    The L{AppendConflict} of L{ILog.skip_to}C{(position, offset)} on a log
    from C{start} to C{end}/C{end_offset}, or None when the skip may go.
    """
    if start != end:
        return AppendConflict(f"log {name} holds records [{start}, {end}): cannot skip")
    if (position, offset) == (end, end_offset):
        return None
    if position <= end or offset < end_offset:
        return AppendConflict(f"log {name} ends at {end}/{end_offset}: cannot skip to "
                              f"{position}/{offset}")
    return None


def append_conflict(
    name: str,
    end_position: int,
    expected_position: int | None,
    attributes: Mapping[str, int],
    expected_attributes: Mapping[str, int | None] | None,
) -> "AppendConflict | None":
    """
    The L{AppendConflict} of a conditional append (see L{ILog.append}) to a
    log ending at C{end_position} with C{attributes}, both counting every
    append issued before it; None when its conditions hold (or it has none).
    """
    if expected_position is not None and expected_position != end_position:
        return AppendConflict(f"log {name} ends at {end_position}, not {expected_position}")
    return attributes_conflict(name, attributes, expected_attributes)


def attributes_conflict(
    name: str, attributes: Mapping[str, int], expected: Mapping[str, int | None] | None,
) -> "AppendConflict | None":
    """
    The L{AppendConflict} of an append expecting C{expected} (key -> value,
    None for unset) where the attributes are C{attributes}, or None when
    every expectation holds.
    """
    if not expected:
        return None
    for key, value in expected.items():
        if attributes.get(key) != value:
            return AppendConflict(f"log {name}: attribute {key} is {attributes.get(key)}, "
                                  f"not {value}")
    return None


class StoreUnavailable(LogError):
    """
    The store's backend (a JetStream cluster) did not answer in time: no
    quorum, no leader, not reachable.  Transient, unlike L{LogFailed}: the
    log takes appends again once the cluster answers.  An append that fails
    with it may still be stored (its outcome is unknown, as after any
    timeout); a read or an admin call did nothing.
    """

    code = "log_not_available"
