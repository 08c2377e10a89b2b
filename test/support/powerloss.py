"""
An in-process model of what a power loss leaves on disk, for tests.

L{PowerLossIO} is a file layer (a L{streamproto.log.segments.FileIO}, so a
store takes it as its C{io}) that does every call on the real file system
under C{root} and also journals it: writes, truncations, fsyncs, creates,
renames, unlinks, mkdirs and directory fsyncs, each at a I{moment} (the
number of calls before it).  L{PowerLossIO.image} then builds, in another
directory, the disk as a power loss at any moment could have left it:

- a file's data survives up to its last fsync (C{data="synced"}); the
  unsynced rest may be there entirely (C{"all"}), in part (C{"prefix"}: a
  prefix of the unsynced writes, as writeback in order would leave it;
  C{"pages"}: any mix of old and new 4 KiB pages and either size, as
  writeback out of order would);
- a directory's entries (names created, renamed, unlinked) survive as of
  its last fsync; with C{names=j} also every change made before moment
  C{j} (a journal commit that came later; C{names="all"}: all of them);
- a directory the code created exists only if its parent's entry survived.

Files made by code that does not go through the layer (SQLite's) are
adopted when their directory is fsynced through it: their names count from
then on, their content is copied as it is on the real disk when the image
is made (their own durability is their writer's business).

The model follows POSIX, not one file system: ext4 and XFS usually keep
more (an fsync of a new file commits its name too), never less.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field

from twisted.internet.defer import Deferred

from streamproto.log.segments import FileIO

PAGE = 4096

#: the moment of what was there before the layer saw anything: always durable
BEFORE = -1


@dataclass
class _Inode:
    kind: str                                   # "file", "dir" or "foreign"
    real: str                                   # a real path of it (foreign files)
    changes: list = field(default_factory=list)  # (moment, op...) in order
    fsyncs: list = field(default_factory=list)   # moments of fsyncs

    def synced_at(self, before: int) -> int:
        """The time its last fsync before moment C{before} made durable (changes < it)."""
        done = [m for m in self.fsyncs if m < before]
        return max(done) + 1 if done else BEFORE


class PowerLossIO(FileIO):
    """
    A L{FileIO} that journals what it does under C{root}, to rebuild the
    disk after a power loss at any moment (see the module docstring).
    Calls on paths outside C{root} are done and not journaled.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.moment = 0
        self._lock = threading.RLock()
        self._inodes: list[_Inode] = []
        self._paths: dict[str, int] = {}        # the live namespace: path -> inode
        self._fds: dict[int, list] = {}         # fd -> [inode, position, append]
        self._adopt(self.root, None, BEFORE)

    # -- bookkeeping -----------------------------------------------------
    def _new(self, kind: str, path: str) -> int:
        self._inodes.append(_Inode(kind, path))
        return len(self._inodes) - 1

    def _inside(self, path: str) -> str | None:
        path = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                            os.path.basename(path))
        if path == self.root or path.startswith(self.root + os.sep):
            return path
        return None

    def _tick(self) -> int:
        self.moment += 1
        return self.moment - 1

    def _link(self, path: str, inode: int | None, at: int) -> None:
        """Record that C{path}'s entry in its directory now names C{inode} (None: gone)."""
        parent = self._paths.get(os.path.dirname(path))
        if parent is None:
            return
        self._inodes[parent].changes.append((at, os.path.basename(path), inode))
        if inode is None:
            self._paths.pop(path, None)
        else:
            self._paths[path] = inode

    def _adopt(self, path: str, parent_known: bool | None, at: int) -> int:
        """Take what is at C{path} as it is (before the layer, or foreign)."""
        if os.path.isdir(path) and not os.path.islink(path):
            inode = self._new("dir", path)
            if parent_known is not None:
                self._link(path, inode, at)
            else:
                self._paths[path] = inode
            for name in sorted(os.listdir(path)):
                self._adopt(os.path.join(path, name), True, at)
            self._inodes[inode].fsyncs.append(at)
            return inode
        if at == BEFORE:
            inode = self._new("file", path)
            with open(path, "rb") as f:
                self._inodes[inode].changes.append((BEFORE, "write", 0, f.read()))
            self._inodes[inode].fsyncs.append(BEFORE)
        else:
            inode = self._new("foreign", path)
        self._link(path, inode, at)
        return inode

    # -- the file layer ----------------------------------------------------
    #
    # Safe to call from several threads (a store's fsyncs run in a pool):
    # a change is journaled after the call made it, an fsync at the moment
    # it was called, so that concurrent calls are ordered the cautious way
    # (an fsync covers only what was journaled before it began).

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        inside = self._inside(path)
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        if inside is None:
            return fd
        with self._lock:
            at = self._tick()
            inode = self._paths.get(inside)
            if inode is None:
                if existed:
                    inode = self._adopt(inside, True, at)
                else:
                    inode = self._new("file", inside)
                    self._link(inside, inode, at)
            if flags & os.O_TRUNC and self._inodes[inode].kind == "file":
                self._inodes[inode].changes.append((at, "truncate", 0))
            self._fds[fd] = [inode, 0, bool(flags & os.O_APPEND)]
        return fd

    def writev(self, fd, buffers):
        n = super().writev(fd, buffers)
        with self._lock:
            entry = self._fds.get(fd)
            if entry is not None:
                data = b"".join(bytes(b) for b in buffers)[:n]
                inode, position, append = entry
                if append:
                    position = os.fstat(fd).st_size - n
                self._inodes[inode].changes.append((self._tick(), "write", position, data))
                entry[1] = position + n
        return n

    def ftruncate(self, fd, size):
        super().ftruncate(fd, size)
        with self._lock:
            entry = self._fds.get(fd)
            if entry is not None:
                self._inodes[entry[0]].changes.append((self._tick(), "truncate", size))

    def fsync(self, fd):
        with self._lock:
            entry = self._fds.get(fd)
            at = self._tick()
        super().fsync(fd)
        if entry is not None:
            with self._lock:
                self._inodes[entry[0]].fsyncs.append(at)

    def close(self, fd):
        super().close(fd)
        with self._lock:
            self._fds.pop(fd, None)

    def fsync_dir(self, path):
        inside = self._inside(path)
        with self._lock:
            at = self._tick()
        super().fsync_dir(path)
        with self._lock:
            inode = self._paths.get(inside) if inside else None
            if inode is None:
                return
            # names made or removed by code that did not go through this layer
            real = set(os.listdir(inside))
            known = {n for p, n in ((p, os.path.basename(p)) for p in self._paths)
                     if os.path.dirname(p) == inside}
            for name in sorted(real - known):
                self._adopt(os.path.join(inside, name), True, at)
            for name in sorted(known - real):
                self._link(os.path.join(inside, name), None, at)
            self._inodes[inode].fsyncs.append(at)

    def mkdir(self, path, mode=0o777):
        super().mkdir(path, mode)
        inside = self._inside(path)
        if inside is not None:
            with self._lock:
                self._link(inside, self._new("dir", inside), self._tick())

    def replace(self, src, dst):
        super().replace(src, dst)
        src_in, dst_in = self._inside(src), self._inside(dst)
        with self._lock:
            if src_in is None or dst_in is None or src_in not in self._paths:
                return
            at = self._tick()
            inode = self._paths[src_in]
            moved = {p: i for p, i in self._paths.items() if p.startswith(src_in + os.sep)}
            self._link(src_in, None, at)
            self._link(dst_in, inode, at)
            for p, i in moved.items():
                del self._paths[p]
                self._paths[dst_in + p[len(src_in):]] = i

    def unlink(self, path):
        super().unlink(path)
        self._forget(path)

    def rmdir(self, path):
        super().rmdir(path)
        self._forget(path)

    def _forget(self, path):
        inside = self._inside(path)
        with self._lock:
            if inside is not None and inside in self._paths:
                self._link(inside, None, self._tick())

    # -- after the power loss -----------------------------------------------
    def image(self, dest, at=None, names="synced", data="synced", seed=0):
        """
        Build in C{dest} (created; it must not exist) what C{root} holds
        after a power loss at moment C{at} (default: now).

        @param names: C{"synced"}, C{"all"}, or a moment before which every
            directory change survived.
        @param data: C{"synced"}, C{"all"}, C{"prefix"} or C{"pages"}.
        @return: C{dest}.
        """
        with self._lock:
            at = self.moment if at is None else at
        cut = {"synced": BEFORE, "all": at}.get(names, names)
        rnd = random.Random(seed)
        os.mkdir(dest)
        self._build(0, dest, at, min(cut, at), data, rnd)
        return dest

    def _entries(self, inode: _Inode, at: int, cut: int) -> dict[str, int]:
        until = max(inode.synced_at(at), cut)
        entries: dict[str, int] = {}
        # in the order of their moments (an fsync's moment is when it began)
        for moment, name, child in sorted(inode.changes, key=lambda c: c[0]):
            if moment >= until:
                break
            if child is None:
                entries.pop(name, None)
            else:
                entries[name] = child
        return entries

    def _build(self, number, dest, at, cut, data, rnd):
        for name, child in sorted(self._entries(self._inodes[number], at, cut).items()):
            node = self._inodes[child]
            target = os.path.join(dest, name)
            if node.kind == "dir":
                os.mkdir(target)
                self._build(child, target, at, cut, data, rnd)
            elif node.kind == "foreign":
                content = b""
                if os.path.isfile(node.real):
                    with open(node.real, "rb") as f:
                        content = f.read()
                with open(target, "wb") as f:
                    f.write(content)
            else:
                with open(target, "wb") as f:
                    f.write(self._content(node, at, data, rnd))

    def content(self, node: _Inode, until: int) -> bytes:
        buf = bytearray()
        for change in sorted(node.changes, key=lambda c: c[0]):
            if change[0] >= until:
                break
            if change[1] == "truncate":
                del buf[change[2]:]
            else:
                _, _, position, chunk = change
                if len(buf) < position:
                    buf.extend(bytes(position - len(buf)))
                buf[position:position + len(chunk)] = chunk
        return bytes(buf)

    def _content(self, node, at, data, rnd):
        durable = self.content(node, node.synced_at(at))
        if data == "synced":
            return durable
        current = self.content(node, at)
        if data == "all" or durable == current:
            return current
        if data == "prefix":
            same = 0
            while same < min(len(durable), len(current)) and durable[same] == current[same]:
                same += 1
            n = rnd.randint(same, len(current))
            return current[:n] + durable[n:]
        if data == "pages":
            size = rnd.choice([len(durable), len(current)])
            out = bytearray()
            for page in range(0, size, PAGE):
                end = min(page + PAGE, size)
                piece = rnd.choice([durable, current])[page:end]
                out += piece + bytes(end - page - len(piece))
            return bytes(out[:size])
        raise ValueError(f"data={data!r}")


class HeldJobs:
    """
    A store's C{run_blocking} that holds every job (fsyncs, index and state
    writes) until the test runs it, in the order the test picks: the
    interleavings a thread pool allows, made repeatable.
    """

    def __init__(self):
        self.jobs = []

    def __call__(self, f, *args, **kwargs):
        d = Deferred()
        self.jobs.append((f, args, kwargs, d))
        return d

    def run(self, index=0):
        f, args, kwargs, d = self.jobs.pop(index)
        try:
            result = f(*args, **kwargs)
        except Exception as e:
            d.errback(e)
        else:
            d.callback(result)

    def run_all(self):
        while self.jobs:
            self.run()
