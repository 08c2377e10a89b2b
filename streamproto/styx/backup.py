"""
Backup and restore of one log (C{GET /logs/{name}/backup}, C{POST
/logs/restore?name=}): a gzipped tar of the log's directory, as in the
reference.

Only a file-backed store can do it: L{ILogStore} has no notion of a
directory, so these reach for the file store's C{path} (its data
directory) and C{log_path(name)} (passed through by
L{streamproto.log.public.PublicLogStore}); any other store answers
C{not_supported}.
"""

import json
import os
import shutil
import tarfile
import tempfile
import time

from twisted.internet import defer
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.web.static import NoRangeStaticProducer

from streamproto.core.compat import request_gone
from streamproto.base.durable import fsync_dir
from streamproto.log.config import LogConfig, validate_name
from streamproto.log.errors import LogExists
from streamproto.log.interfaces import ILogDirectories
from streamproto.log.public import check_public_name
from streamproto.styx.errors import APIError
from streamproto.styx.httputil import respond_empty

# the HTTP API's log lines keep the namespace they had in one module
log = Logger(namespace="streamproto.styx.resource")


def store_directory(store):
    """
    The data directory of a file-backed C{store} (an L{ILogDirectories}).

    @raise APIError: C{not_supported} for a store without one.
    """
    directories = ILogDirectories(store, None)
    if directories is None:
        raise APIError("not_supported",
                       "api: backup and restore need a file-backed log store")
    return str(directories.path)


@defer.inlineCallbacks
def backup_log(store, request, name):
    """
    Answer C{request} with a backup of log C{name}: its directory as a
    gzipped tar, made once everything appended so far is synced.

    @param store: the resource's L{streamproto.log.public.PublicLogStore}.
    """
    the_log = yield store.get(name)
    store_directory(store)
    yield the_log.sync()
    directory = store.log_path(name)
    archive = yield deferToThread(_tar_directory, directory)
    if request_gone(request):
        archive.close()
        return
    filename = f"{name}-{int(time.time())}.tar.gz"
    request.setHeader(b"Content-Disposition",
                      f"attachment; filename={filename}".encode())
    request.setHeader(b"Content-Type", b"application/gzip")
    archive.seek(0, os.SEEK_END)
    request.setHeader(b"Content-Length", str(archive.tell()).encode())
    archive.seek(0)
    request.notifyFinish().addBoth(lambda _: archive.close())
    # streams the file as the transport asks for it, then finishes
    NoRangeStaticProducer(request, archive).start()


@defer.inlineCallbacks
def restore_log(store, request):
    """
    Create log C{name} (the C{name} query argument of C{request}) from the
    backup in the request's body, and answer an empty 200.

    @param store: the resource's L{streamproto.log.public.PublicLogStore}.
    """
    args = request.args
    name = (args.get(b"name") or [b""])[0].decode("utf-8", "replace")
    if not name:
        raise APIError("invalid_params", "api: params: name is required")
    validate_name(name)
    check_public_name(name)
    root = store_directory(store)
    if name in store.names():
        raise LogExists(f"log {name!r} exists")
    request.content.seek(0)
    yield deferToThread(_untar_into, request.content, root, name)
    try:
        yield store.get(name)
    except Exception as e:
        # never leave an unopenable directory behind under the name
        yield deferToThread(_discard_directory, root, name)
        log.warn("restored log {name} cannot be opened: {error}", name=name, error=e)
        raise APIError("invalid_params",
                       f"api: params: restored log cannot be opened: {e}")
    log.info("restored log {name}", name=name)
    respond_empty(request)


# -- archives (run in a thread) ---------------------------------------------

def _tar_directory(directory):
    """
    A gzipped tar of the files of a log directory, flat names as in the
    reference's backups.  Each file is cut at the size it had when the
    backup began, so appends racing the backup never tear an archive
    member; the store's recovery treats the cut tail like any torn write.
    """
    if not os.path.isdir(directory):
        raise APIError("log_not_available", "api: log directory not found")
    entries = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_file(follow_symlinks=False):
            entries.append((entry.name, entry.stat().st_size))
    archive = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, size in entries:
            path = os.path.join(directory, name)
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                continue  # a segment expired meanwhile
            with f:
                info = tar.gettarinfo(arcname=name, fileobj=f)
                info.size = min(size, info.size)
                tar.addfile(info, _Limited(f, info.size))
    return archive


class _Limited:
    """A file object that reads at most C{size} bytes."""

    def __init__(self, f, size):
        self.f = f
        self.left = size

    def read(self, n=-1):
        if n < 0 or n > self.left:
            n = self.left
        data = self.f.read(n)
        self.left -= len(data)
        return data


def _untar_into(fileobj, root, name):
    """
    Unpack a backup into C{root/name}: members go to a hidden temporary
    directory first (only plain files with flat names are accepted), are
    fsynced, then the directory is renamed into place, so a half-restored
    log is never visible.
    """
    target = os.path.join(root, name)
    if os.path.exists(target):
        raise LogExists(f"log {name!r} exists")
    staging = tempfile.mkdtemp(prefix=f".restore-{name}-", dir=root)
    try:
        try:
            tar = tarfile.open(fileobj=fileobj, mode="r:gz")
        except (tarfile.TarError, OSError, EOFError) as e:
            raise APIError("invalid_params", f"api: params: not a tar.gz archive: {e}")
        with tar:
            try:
                members = list(tar)
            except (tarfile.TarError, OSError, EOFError) as e:
                raise APIError("invalid_params", f"api: params: corrupt archive: {e}")
            for member in members:
                member_name = member.name
                if member.isdir() and member_name.strip("./") == "":
                    continue
                if (not member.isfile() or "/" in member_name or "\\" in member_name
                        or member_name in (".", "..") or member_name.startswith(".")):
                    raise APIError("invalid_params",
                                   f"api: params: unexpected archive member {member_name!r}")
                source = tar.extractfile(member)
                path = os.path.join(staging, member_name)
                with open(path, "wb") as out:
                    while True:
                        block = source.read(1024 * 1024)
                        if not block:
                            break
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
        _check_backup(staging)
        fsync_dir(staging)
        if os.path.exists(target):
            raise LogExists(f"log {name!r} exists")
        os.rename(staging, target)
        fsync_dir(root)
    except BaseException:
        _remove_tree(staging)
        raise


#: The member every backup of our log store has (the file store's log
#: configuration).  A backup made by another Styx server (the Go reference
#: keeps C{config}, C{segment-...-records} and C{-index} files) has none.
BACKUP_CONFIG_MEMBER = "config.json"


def _check_backup(staging):
    """
    Refuse an archive that is not a backup of our log store before it
    becomes a log directory: without this a foreign archive (e.g. the Go
    reference's) was renamed into place, could not be opened (404), and
    left a directory behind that blocked the name.
    """
    path = os.path.join(staging, BACKUP_CONFIG_MEMBER)
    if not os.path.isfile(path):
        raise APIError("invalid_params",
                       f"api: params: not a backup of this server's log store (no "
                       f"{BACKUP_CONFIG_MEMBER}); backups of other Styx servers use "
                       f"another storage format")
    try:
        with open(path, "rb") as f:
            LogConfig.from_mapping(json.loads(f.read()))
    except (ValueError, TypeError, AttributeError) as e:
        raise APIError("invalid_params",
                       f"api: params: bad {BACKUP_CONFIG_MEMBER} in backup: {e}")


def _discard_directory(root, name):
    """Move C{root/name} out of the way (atomically), then delete it."""
    target = os.path.join(root, name)
    doomed = tempfile.mkdtemp(prefix=f".restore-failed-{name}-", dir=root)
    os.rename(target, os.path.join(doomed, name))
    _remove_tree(doomed)


def _remove_tree(path):
    shutil.rmtree(path, ignore_errors=True)
