"""
A data directory that a server is writing, seen read-only through the
file store itself, so that C{store copy --follow} can copy from a live
file store (the cut-over from one machine to a JetStream cluster).

The file store opened on a directory recovers it: it cuts a torn tail,
creates missing segments, writes state files, deletes expired segments.
A server writing that directory makes every one of those wrong (its tail
is torn because it is being written).  L{ReadOnlyFileIO} is the file
layer that never writes: files open read-only, a cut or an fsync does
nothing to the file (the store's view then simply ends where the whole
batches end, as L{streamproto.log.reader} does), a write fails with
C{EROFS}.  Each round of a follow opens the directory again
(L{reopening_store}): a store only learns of appends it made itself.

What it sees may include batches the server wrote but has not fsynced
yet: a crash of the source machine during the mirror can take them back
on the source.  The copy's verification then fails; the runbook
(doc/scale-out.rst) says what to do.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, succeed

from streamproto.log.batch import BytesLike
from streamproto.log.interfaces import ILogStore
from streamproto.log.segments import FileIO

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_EXCL


class ReadOnlyFileIO(FileIO):
    """The file layer of a store that must never change its files."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, f"read-only view: not creating {path}")
        return super().open(path, (flags & ~_WRITES) | os.O_RDONLY, mode)

    def writev(self, fd: int, buffers: Sequence[BytesLike]) -> int:
        raise OSError(errno.EROFS, "read-only view: not writing")

    def fsync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass

    def ftruncate(self, fd: int, size: int) -> None:
        pass    # a tail being written: the store's view ends before it

    def unlink(self, path: str) -> None:
        pass

    def rmdir(self, path: str) -> None:
        pass

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        raise OSError(errno.EROFS, f"read-only view: not creating {path}")

    def replace(self, src: str, dst: str) -> None:
        raise OSError(errno.EROFS, f"read-only view: not renaming {src}")


def open_read_only(path: str, reactor: Any, **kwargs: Any) -> ILogStore:
    """
    The file store at C{path}, read-only, without retention of its own
    (C{kwargs}: more L{FileLogStore} arguments, C{run_blocking} in tests).
    """
    from streamproto.log.filestore import FileLogStore
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, f"no data directory {path}")
    return FileLogStore(path, reactor=reactor, io=ReadOnlyFileIO(), retention_interval=0,
                        **kwargs)


def reopening_store(path: str, reactor: Any,
                    **kwargs: Any) -> Callable[[], Deferred[ILogStore]]:
    """A C{refresh} for L{streamproto.log.copy.store.StoreCopy}: a new read-only view each call."""
    def refresh() -> Deferred[ILogStore]:
        return succeed(open_read_only(path, reactor, **kwargs))
    return refresh
