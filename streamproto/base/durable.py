"""
Making names durable: the directory operations every store and state file
shares (the file log store, the reliable session store, the Pravega
controller's log, backup restores, the data directory itself).

A file's data is made durable by fsyncing the file; its I{name} (a
creation, a rename, an unlink) only by fsyncing the directory that holds
it, and a directory the server created only by fsyncing its parent.  A
power loss keeps nothing else: a log whose data directory was created by
the server and never fsynced into its parent loses every record, however
many fsyncs its segments had.

Every call goes through a L{DirectoryIO} so that tests can record them and
rebuild "the disk after a power loss" (C{test/support/powerloss.py}).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import TypeAlias

#: what writev takes (the log's BytesLike; the base layer imports nothing above it)
BytesLike: TypeAlias = bytes | bytearray | memoryview



def fsync_dir(path: str) -> None:
    """Make the names in directory C{path} durable (creations, renames, unlinks)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectoryIO:
    """
    The system calls that create, write, name and sync files: one method
    each, so that a test layer can record them.
    """

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)

    def writev(self, fd: int, buffers: Sequence[BytesLike]) -> int:
        return os.writev(fd, buffers)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def fsync_dir(self, path: str) -> None:
        fsync_dir(path)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        os.mkdir(path, mode)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def rmdir(self, path: str) -> None:
        os.rmdir(path)


def write_all(io: DirectoryIO, fd: int, buffers: Sequence[BytesLike]) -> int:
    """C{writev} until everything is written (regular files rarely write short)."""
    total = sum(len(b) for b in buffers)
    done = io.writev(fd, buffers)
    while done < total:
        flat = b"".join(bytes(b) for b in buffers)[done:]
        n = io.writev(fd, [flat])
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
    return total


def make_dirs(path: str, io: DirectoryIO | None = None) -> list[str]:
    """
    C{os.makedirs(path, exist_ok=True)} whose result survives a power
    loss: each directory created is fsynced into its parent (top down, so
    that no name is durable before the directory that holds it).

    @return: the directories created, outermost first.
    @raise OSError: as C{os.makedirs} (C{ENOTDIR}, C{EACCES}...).
    """
    io = io or DirectoryIO()
    path = os.path.abspath(path)
    missing: list[str] = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    created: list[str] = []
    for directory in reversed(missing):
        try:
            io.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            # another process made it: its name may not be durable yet either
        created.append(directory)
        io.fsync_dir(os.path.dirname(directory))
    return created


def replace_durably(io: DirectoryIO, src: str, dst: str) -> None:
    """Rename C{src} to C{dst} and make the new name durable (both directories)."""
    io.replace(src, dst)
    io.fsync_dir(os.path.dirname(os.path.abspath(dst)))
    src_dir = os.path.dirname(os.path.abspath(src))
    if src_dir != os.path.dirname(os.path.abspath(dst)):
        io.fsync_dir(src_dir)


def write_file_atomically(io: DirectoryIO, path: str, data: bytes, tag: str) -> None:
    """
    Write C{path} so that a crash or power loss leaves either the old or the
    new content, and the new one only once it is durable: the data is
    fsynced under a temporary name (C{tag} makes it one no other writer
    uses), renamed over C{path}, and the directory is fsynced.
    """
    tmp = f"{path}.{tag}.tmp"
    fd = io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        write_all(io, fd, [data])
        io.fsync(fd)
    finally:
        io.close(fd)
    replace_durably(io, tmp, path)


def remove_tree(io: DirectoryIO, path: str) -> None:
    """
    Delete C{path} and everything under it, ignoring what is already gone
    (C{shutil.rmtree(path, True)} through C{io}).
    """
    try:
        entries = os.listdir(path)
    except OSError:
        return
    for name in entries:
        child = os.path.join(path, name)
        if os.path.isdir(child) and not os.path.islink(child):
            remove_tree(io, child)
        else:
            io.unlink(child)
    try:
        io.rmdir(path)
    except OSError:
        pass
