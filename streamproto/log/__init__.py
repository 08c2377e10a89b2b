"""
The embedded durable log store shared by every protocol.

Use L{open_store} for the file-backed store, L{MemoryLogStore} in tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamproto.log.batch import RecordBatch
from streamproto.log.config import LogConfig, validate_name
from streamproto.log.errors import (
    CorruptLog, InvalidLogName, LogClosed, LogError, LogExists, LogFailed, LogNotFound,
    PositionOutOfRange, RecordTooLarge,
)
from streamproto.log.interfaces import ILog, ILogStore
from streamproto.log.memory import MemoryLog, MemoryLogStore
from streamproto.log.result import AppendResult

if TYPE_CHECKING:
    from streamproto.log.filestore import FileLogStore

__all__ = [
    "AppendResult", "CorruptLog", "ILog", "ILogStore", "InvalidLogName", "LogClosed",
    "LogConfig", "LogError", "LogExists", "LogFailed", "LogNotFound", "MemoryLog",
    "MemoryLogStore", "PositionOutOfRange", "RecordBatch", "RecordTooLarge", "open_store",
    "validate_name",
]


def open_store(path: str, **kwargs: Any) -> FileLogStore:
    """Open (creating if needed) the file-backed store at C{path}."""
    from streamproto.log.filestore import FileLogStore
    return FileLogStore(path, **kwargs)
