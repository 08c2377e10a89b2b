"""
A lazy FUSE filesystem: power loss on demand.

A passthrough over a backing directory that keeps what was not fsynced in
memory, the way a page cache does, and drops it on command, the way a power
cut does (the idea of Jepsen's LazyFS; this is our own, in Python, over
libfuse 2 through C{mfusepy}):

- file data: writes land in per-inode dirty pages; C{fsync}/C{fdatasync}
  writes them to the backing file and fsyncs it, and so does every write
  to a file opened C{O_SYNC} or C{O_DSYNC}; reads see the pages; a file
  created starts with none, whatever its inode number held before;
- names: a create, mkdir, unlink, rmdir or rename is applied to the backing
  directory at once but journalled; it becomes durable only when its
  directory (for a rename, the target's directory) is fsynced; until then a
  power cut undoes it (a created file vanishes, an unlinked or replaced one
  comes back from a stash);
- C{drop}: undo every non-durable name change (newest first) and forget
  every dirty page: what is left is what the disk would hold after a power
  cut, in the strictest model POSIX allows.

It is driven through a control file at the mount's root, C{.lazyfs}: write
C{drop}, C{sync} (make everything durable), C{stats} or C{lie} (from
now on fsync flushes nothing: a disk that lies), then read it back
for the answer (C{ok ...}).  Every file is opened with C{direct_io} (set
per open, L{LazyFS.open}) and the mount has zero attribute and entry
timeouts, so that the kernel caches nothing that a drop would make stale;
the one exception is SQLite's C{-shm} wal-index, which must be mapped
shared (L{page_cached} says why that is safe).

Run as a process (root, /dev/fuse, libfuse2)::

    python -m test.faults.lazyfs BACKING MOUNTPOINT

Symbolic and hard links are refused (ENOSYS): the stores do not use them.
"""

import argparse
import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

try:
    import mfusepy as fuse
except (ImportError, OSError) as e:   # OSError: libfuse is not installed
    fuse = None
    IMPORT_ERROR = e
else:
    IMPORT_ERROR = None

PAGE = 4096
CONTROL = "/.lazyfs"
STASH = ".lazyfs-stash"
#: the suffix of SQLite's wal-index (the shared memory of WAL mode)
SHM_SUFFIX = "-shm"


def page_cached(path):
    """
    Whether the file at C{path} may go through the kernel's page cache
    (every other file is C{direct_io}): only SQLite's C{-shm} wal-index.

    WAL mode maps it C{MAP_SHARED} and writable, which FUSE refuses on a
    C{direct_io} file ("disk I/O error" when the first connection opens
    the database); a page-cached file can be mapped so.  This cannot make
    a dropped write visible:

    - the wal-index is not durable data.  SQLite never fsyncs it; the
      first connection to open the database after a crash finds no live
      lock on its dead-man's-switch byte (the dead process's locks died
      with it), truncates the index and rebuilds it from the WAL and the
      database file, both C{direct_io} and so read from this model.  So
      what a stale C{-shm} holds is never believed, only rebuilt;
    - no C{keep_cache}: the kernel drops the file's cached pages at every
      open, so a process opening it after a drop reads what the model
      holds, not pages from before it (and attributes are never cached:
      C{attr_timeout=0}, the size is asked each time);
    - the cache is per file: the pages of C{X-shm} are never the pages of
      C{X} or C{X-wal}, which stay uncached, as everything else does.
    """
    return path.endswith(SHM_SUFFIX)


def unavailable():
    """Why a lazy FS cannot be mounted here, or C{None} when it can."""
    if IMPORT_ERROR is not None:
        return f"mfusepy/libfuse2 not usable: {IMPORT_ERROR}"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if os.geteuid() != 0:
        return "mounting a FUSE filesystem here needs root"
    return None


class Inode:
    """The unsynced state of one backing file: its dirty pages and size."""

    def __init__(self, size):
        self.size = size          # the logical size (what stat shows)
        self.base = size          # backing bytes past this were truncated away
        self.pages = {}           # page index -> bytearray(PAGE)

    def dirty(self):
        return bool(self.pages)


class LazyState:
    """
    The lazy filesystem's logic, on backing paths, without FUSE: what each
    operation does and what C{drop} and C{sync} undo or keep.  Thread-safe
    (one lock: libfuse calls from several threads).
    """

    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.stash = os.path.join(self.root, STASH)
        os.makedirs(self.stash, exist_ok=True)
        self.lock = threading.RLock()
        self.inodes = {}          # (dev, ino) -> Inode, only while dirty
        self.journal = []         # [dirs, undo, forget] of non-durable name changes
        self.stashed = 0
        self.drops = 0
        #: a lying disk (the "lie" command): fsync flushes nothing, so that
        #: the harness can show it catches a store whose acks are not durable
        self.lie = False

    def real(self, path):
        return os.path.join(self.root, path.lstrip("/"))

    # -- data ----------------------------------------------------------

    def _inode(self, fd, create=True):
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        node = self.inodes.get(key)
        if node is None and create:
            node = self.inodes[key] = Inode(st.st_size)
        return node

    def fresh(self, fd):
        """
        C{fd} is a file just created, empty: forget any state kept under its
        inode number.

        The pages of a closed file stay keyed by its backing inode until
        fsync or drop; once its last name is gone for good (an unlink or a
        rename over it, made durable) the backing filesystem frees that
        number and ext4 hands it to the next file created at once.  Without
        this the new file inherited the old one's size and pages: a 16-byte
        write into what the model still took for a 34-byte file left 18
        stale bytes after it.  (That is what nats-server's C{tav.idx} got,
        its panic in C{writeTermVote} on a later start.)
        """
        with self.lock:
            st = os.fstat(fd)
            self.inodes.pop((st.st_dev, st.st_ino), None)

    def size_of(self, fd, backing_size):
        node = self._inode(fd, create=False)
        return backing_size if node is None else node.size

    def _page(self, fd, node, index):
        page = node.pages.get(index)
        if page is None:
            page = bytearray(PAGE)
            data = os.pread(fd, PAGE, index * PAGE)
            # bytes of the backing file past a truncate not synced yet are
            # gone: they must not come back
            keep = max(0, min(len(data), node.base - index * PAGE))
            page[:keep] = data[:keep]
            node.pages[index] = page
        return page

    def write(self, fd, data, offset):
        with self.lock:
            node = self._inode(fd)
            end = offset + len(data)
            pos = offset
            while pos < end:
                index, start = divmod(pos, PAGE)
                n = min(PAGE - start, end - pos)
                page = self._page(fd, node, index)
                page[start:start + n] = data[pos - offset:pos - offset + n]
                pos += n
            node.size = max(node.size, end)
            return len(data)

    def read(self, fd, size, offset):
        with self.lock:
            node = self._inode(fd, create=False)
            if node is None:
                return os.pread(fd, size, offset)
            end = min(offset + size, node.size)
            out = bytearray()
            pos = offset
            while pos < end:
                index, start = divmod(pos, PAGE)
                n = min(PAGE - start, end - pos)
                page = node.pages.get(index)
                if page is None:
                    chunk = os.pread(fd, max(0, min(n, node.base - pos)), pos)
                    chunk += bytes(n - len(chunk))   # a hole, or truncated away
                else:
                    chunk = page[start:start + n]
                out += chunk
                pos += n
            return bytes(out)

    def truncate(self, fd, length):
        with self.lock:
            node = self._inode(fd)
            node.base = min(node.base, length)
            for index in [i for i in node.pages if i * PAGE >= length]:
                del node.pages[index]
            tail = node.pages.get(length // PAGE)
            if tail is not None:
                tail[length % PAGE:] = bytes(PAGE - length % PAGE)
            node.size = length

    def fsync(self, fd):
        with self.lock:
            if self.lie:
                return
            st = os.fstat(fd)
            node = self.inodes.pop((st.st_dev, st.st_ino), None)
            if node is not None:
                if st.st_size > node.base:
                    os.ftruncate(fd, node.base)
                for index, page in sorted(node.pages.items()):
                    n = max(0, min(PAGE, node.size - index * PAGE))
                    if n:
                        os.pwrite(fd, bytes(page[:n]), index * PAGE)
                if os.fstat(fd).st_size != node.size:
                    os.ftruncate(fd, node.size)
            os.fsync(fd)

    # -- names ---------------------------------------------------------

    def _stash(self, real):
        self.stashed += 1
        place = os.path.join(self.stash, str(self.stashed))
        os.rename(real, place)
        return place

    def _journal(self, dirs, undo, forget=None):
        self.journal.append([set(dirs), undo, forget])

    def created(self, path):
        """C{path} was just created (file or directory): undo removes it."""
        real = self.real(path)

        def undo():
            if os.path.isdir(real) and not os.path.islink(real):
                shutil.rmtree(real, ignore_errors=True)
            elif os.path.lexists(real):
                os.unlink(real)
        self._journal([os.path.dirname(real)], undo)

    def unlink(self, path, rmdir=False):
        with self.lock:
            real = self.real(path)
            if rmdir:
                os.rmdir(real)    # only empty ones: the same errors as the real call
                self._journal([os.path.dirname(real)], lambda: os.makedirs(real, exist_ok=True))
                return
            if not os.path.lexists(real):
                raise OSError(errno.ENOENT, path)
            place = self._stash(real)
            self._journal([os.path.dirname(real)], lambda: os.rename(place, real),
                          lambda: os.unlink(place))

    def rename(self, old, new):
        with self.lock:
            real_old, real_new = self.real(old), self.real(new)
            if not os.path.lexists(real_old):
                raise OSError(errno.ENOENT, old)
            place = None
            if os.path.lexists(real_new) and not os.path.isdir(real_new):
                place = self._stash(real_new)
            try:
                os.rename(real_old, real_new)
            except OSError:
                if place is not None:
                    os.rename(place, real_new)
                raise

            def undo():
                os.rename(real_new, real_old)
                if place is not None:
                    os.rename(place, real_new)

            def forget():
                if place is not None:
                    os.unlink(place)
            # durable once the new name's directory is synced
            self._journal([os.path.dirname(real_new)], undo, forget)

    def fsyncdir(self, path):
        with self.lock:
            if self.lie:
                return
            real = self.real(path).rstrip("/") or "/"
            keep = []
            for entry in self.journal:
                dirs, _, forget = entry
                if real in dirs:
                    if forget is not None:
                        forget()
                else:
                    keep.append(entry)
            self.journal = keep
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- power ---------------------------------------------------------

    def drop(self):
        """The power cut: forget dirty pages, undo non-durable name changes."""
        with self.lock:
            pages = sum(len(n.pages) for n in self.inodes.values())
            names = len(self.journal)
            self.inodes.clear()
            for _, undo, _ in reversed(self.journal):
                try:
                    undo()
                except OSError:
                    pass   # a later durable change took the name over: it stays
            self.journal = []
            shutil.rmtree(self.stash, ignore_errors=True)
            os.makedirs(self.stash, exist_ok=True)
            self.drops += 1
            return f"ok dropped {pages} pages {names} names"

    def sync_all(self, fds):
        """Make everything durable (a clean shutdown): C{fds} are the open handles."""
        with self.lock:
            for fd in fds:
                self.fsync(fd)
            for entry in self.journal:
                if entry[2] is not None:
                    entry[2]()
            self.journal = []
            return "ok synced"

    def stats(self):
        with self.lock:
            pages = sum(len(n.pages) for n in self.inodes.values())
            return (f"ok dirty_pages {pages} pending_names {len(self.journal)} "
                    f"drops {self.drops}")


if fuse is not None:
    _Base = fuse.Operations
else:   # pragma: no cover - the module still imports, unavailable() says why
    _Base = object


def _handle(fi):
    """Our handle of an open file, from its C{fuse_file_info} (C{raw_fi} mode)."""
    return None if fi is None else fi.fh


class LazyFS(_Base):
    """
    The FUSE operations: paths in, L{LazyState} on the backing directory.

    Mounted in C{raw_fi} mode: the file operations get the kernel's
    C{fuse_file_info}, whose C{fh} is our handle, so that C{open} and
    C{create} can choose C{direct_io} for each file (L{page_cached}).
    """

    #: times as nanoseconds (utimens)
    use_ns = True

    def __init__(self, root):
        self.state = LazyState(root)
        self.fds = {}        # fh -> (backing fd, append?, synchronous?)
        self.control = {}    # fh -> answer of the last control command
        self.next_fh = 1000
        self._mutex = self.state.lock

    def _real(self, path):
        if path.startswith("/" + STASH):
            raise fuse.FuseOSError(errno.ENOENT)
        return self.state.real(path)

    def _fh(self, fd, flags):
        with self._mutex:
            self.next_fh += 1
            # O_SYNC and O_DSYNC (whose bit O_SYNC includes): each write is
            # durable when it returns, as the kernel makes it on a disk.  A
            # direct_io write through FUSE does not fsync for it, so the
            # model must: without this, a power cut took back what
            # nats-server wrote with O_SYNC (its term-and-vote file)
            self.fds[self.next_fh] = (fd, bool(flags & os.O_APPEND),
                                      bool(flags & os.O_DSYNC))
            return self.next_fh

    # -- attributes ----------------------------------------------------

    def getattr(self, path, fi=None):
        if path == CONTROL:
            now = time.time()
            return {"st_mode": stat.S_IFREG | 0o600, "st_nlink": 1, "st_size": 0,
                    "st_atime": now, "st_mtime": now, "st_ctime": now}
        real = self._real(path)
        with self._mutex:
            try:
                st = os.lstat(real)
            except OSError as e:
                raise fuse.FuseOSError(e.errno) from None
            attrs = {k: getattr(st, k) for k in (
                "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime",
                "st_mtime", "st_ctime")}
            if stat.S_ISREG(st.st_mode):
                node = self.state.inodes.get((st.st_dev, st.st_ino))
                if node is not None:
                    attrs["st_size"] = node.size
            return attrs

    def access(self, path, amode):
        return 0

    def chmod(self, path, mode):
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        if times is None:
            os.utime(self._real(path))
        else:
            os.utime(self._real(path), ns=times)
        return 0

    def statfs(self, path):
        st = os.statvfs(self.state.root)
        return {k: getattr(st, k) for k in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
            "f_files", "f_flag", "f_frsize", "f_namemax")}

    # -- directories ---------------------------------------------------

    def readdir(self, path, fh):
        names = [".", ".."] + [n for n in os.listdir(self._real(path))
                               if not (path == "/" and n == STASH)]
        return names

    def opendir(self, path):
        self._real(path)
        return 0

    def releasedir(self, path, fh):
        return 0

    def fsyncdir(self, path, datasync, fh):
        self.state.fsyncdir(path)
        return 0

    def mkdir(self, path, mode):
        with self._mutex:
            os.mkdir(self._real(path), mode)
            self.state.created(path)
        return 0

    def rmdir(self, path):
        self._real(path)
        self.state.unlink(path, rmdir=True)
        return 0

    def unlink(self, path):
        self._real(path)
        self.state.unlink(path)
        return 0

    def rename(self, old, new):
        self._real(old)
        self._real(new)
        self.state.rename(old, new)
        return 0

    def link(self, target, source):
        raise fuse.FuseOSError(errno.ENOSYS)

    def symlink(self, target, source):
        raise fuse.FuseOSError(errno.ENOSYS)

    # -- files ---------------------------------------------------------

    @staticmethod
    def _backing_flags(flags):
        # we read pages to merge writes: always read-write, never append or
        # truncate in the backing file (the state does both)
        return (flags & ~(os.O_WRONLY | os.O_RDONLY | os.O_APPEND | os.O_TRUNC
                          | os.O_CREAT | os.O_EXCL)) | os.O_RDWR

    @staticmethod
    def _cache_policy(path, fi):
        # uncached unless it is a wal-index; never keep_cache: see page_cached
        fi.direct_io = 0 if page_cached(path) else 1
        fi.keep_cache = 0

    def create(self, path, mode, fi):
        if path == CONTROL:
            raise fuse.FuseOSError(errno.EEXIST)
        real = self._real(path)
        with self._mutex:
            fd = os.open(real, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            self.state.fresh(fd)
            self.state.created(path)
            fi.fh = self._fh(fd, fi.flags)
        self._cache_policy(path, fi)
        return 0

    def open(self, path, fi):
        flags = fi.flags
        if path == CONTROL:
            with self._mutex:
                self.next_fh += 1
                self.control[self.next_fh] = b""
                fi.fh = self.next_fh
            # its answer is read past the size getattr shows (0): never cached
            fi.direct_io = 1
            return 0
        real = self._real(path)
        try:
            fd = os.open(real, self._backing_flags(flags))
        except OSError as e:
            raise fuse.FuseOSError(e.errno) from None
        if flags & os.O_TRUNC:
            self.state.truncate(fd, 0)
        fi.fh = self._fh(fd, flags)
        self._cache_policy(path, fi)
        return 0

    def _fd(self, fh):
        try:
            return self.fds[fh]
        except KeyError:
            raise fuse.FuseOSError(errno.EBADF) from None

    def read(self, path, size, offset, fi):
        fh = _handle(fi)
        if fh in self.control:
            return self.control[fh][offset:offset + size]
        fd, _, _ = self._fd(fh)
        return self.state.read(fd, size, offset)

    def write(self, path, data, offset, fi):
        fh = _handle(fi)
        if fh in self.control:
            self.control[fh] = self._command(bytes(data).decode().strip()).encode() + b"\n"
            return len(data)
        fd, append, synchronous = self._fd(fh)
        with self._mutex:
            if append:
                offset = self.state.size_of(fd, os.fstat(fd).st_size)
            written = self.state.write(fd, bytes(data), offset)
            if synchronous:
                self.state.fsync(fd)
            return written

    def truncate(self, path, length, fi=None):
        fh = _handle(fi)
        if path == CONTROL:
            return 0
        if fh is not None and fh in self.fds:
            self.state.truncate(self.fds[fh][0], length)
            return 0
        fd = os.open(self._real(path), os.O_RDWR)
        try:
            self.state.truncate(fd, length)
        finally:
            os.close(fd)
        return 0

    def flush(self, path, fi):
        return 0

    def fsync(self, path, datasync, fi):
        fh = _handle(fi)
        if fh in self.control:
            return 0
        self.state.fsync(self._fd(fh)[0])
        return 0

    def release(self, path, fi):
        fh = _handle(fi)
        with self._mutex:
            if self.control.pop(fh, None) is not None:
                return 0
            fd, _, _ = self.fds.pop(fh, (None, None, None))
        if fd is not None:
            # the dirty pages stay, keyed by inode, until fsync or drop
            os.close(fd)
        return 0

    def _command(self, command):
        if command == "drop":
            return self.state.drop()
        if command == "sync":
            with self._mutex:
                closed = self._closed_dirty_fds()
                try:
                    return self.state.sync_all([fd for fd, _, _ in self.fds.values()] + closed)
                finally:
                    for fd in closed:
                        os.close(fd)
        if command == "lie":
            self.state.lie = True
            return "ok lying"
        if command == "stats":
            return self.state.stats()
        return f"error unknown command {command!r}"

    def _closed_dirty_fds(self):
        # dirty inodes whose files are all closed: find them by walking
        fds = []
        for dirpath, _, files in os.walk(self.state.root):
            for name in files:
                real = os.path.join(dirpath, name)
                st = os.lstat(real)
                if (st.st_dev, st.st_ino) in self.state.inodes:
                    fds.append(os.open(real, os.O_RDWR))
        return fds


class LazyMount:
    """
    A lazy FS over C{backing} mounted at C{mountpoint} by a child process
    (C{python -m test.faults.lazyfs}): C{mount()}, C{drop()} (the power
    cut), C{control(command)}, C{unmount()}.  Blocking calls, each short.
    """

    def __init__(self, backing, mountpoint):
        self.backing = backing
        self.mountpoint = mountpoint
        self.process = None
        self.log_path = os.path.join(os.path.dirname(os.path.abspath(backing)),
                                     os.path.basename(backing) + ".lazyfs.log")

    def mount(self, timeout=10.0):
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot mount a lazy FS: {why}")
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mountpoint, exist_ok=True)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "test.faults.lazyfs", self.backing, self.mountpoint],
                stdout=log, stderr=log, env=env, cwd=root)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                with open(self.log_path, errors="replace") as f:
                    raise RuntimeError(f"lazy FS did not mount: {f.read()[-2000:]}")
            time.sleep(0.05)
        return self

    def control(self, command):
        return control(self.mountpoint, command)

    def drop(self):
        """Lose everything not fsynced (files and names); returns the FS's answer."""
        answer = self.control("drop")
        if not answer.startswith("ok"):
            raise RuntimeError(f"lazy FS drop failed: {answer}")
        return answer

    def unmount(self):
        if self.process is None:
            return
        if os.path.ismount(self.mountpoint):
            # lazily: a killed server's descriptors may still be closing
            subprocess.run(["umount", "-l", self.mountpoint], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def control(mountpoint, command):
    """Send C{command} to the lazy FS mounted at C{mountpoint}; return its answer."""
    path = os.path.join(mountpoint, CONTROL.lstrip("/"))
    fd = os.open(path, os.O_RDWR)
    try:
        os.write(fd, command.encode() + b"\n")
        return os.pread(fd, 4096, 0).decode().strip()
    finally:
        os.close(fd)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m test.faults.lazyfs",
                                     description="a FUSE passthrough that loses unsynced "
                                                 "writes on command (write 'drop' to "
                                                 "MOUNTPOINT/.lazyfs)")
    parser.add_argument("backing")
    parser.add_argument("mountpoint")
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        parser.exit(2, f"lazyfs: {why}\n")
    # no global direct_io: LazyFS.open sets it for each file (raw_fi)
    fuse.FUSE(LazyFS(args.backing), args.mountpoint, raw_fi=True, foreground=True,
              nothreads=False, attr_timeout=0, entry_timeout=0, negative_timeout=0,
              fsname="lazyfs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
