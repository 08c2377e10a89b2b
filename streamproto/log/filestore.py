"""
The file-backed log store: a directory of logs (L{FileLog}s), one
subdirectory each.  See L{streamproto.log.file} for a log, and
doc/logstore.rst for the format, guarantees and tuning.
"""

from __future__ import annotations

import errno
import json
import os
import time
from typing import cast

from twisted.internet.defer import Deferred, DeferredList, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorThreads, IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.base import durable
from streamproto.base.clock import default_reactor
from streamproto.log.config import LogConfig, validate_name
from streamproto.log.errors import LogClosed, LogExists, LogNotFound
from streamproto.log.format import SEGMENT_HEADER_SIZE, SEGMENT_MAGIC
from streamproto.log.file import (
    CONFIG_FILE, FileLog, RunBlocking, thread_runner, write_file_atomically,
)
from streamproto.log.interfaces import ILog, ILogDirectories, ILogStore, StoreHealth
from streamproto.log.segments import FileIO
from streamproto.log.syncer import make_syncer
from streamproto.log.versions import (
    LOG_FILES_VERSION, SEGMENT_VERSION, check, check_mapping,
)


def _errno_name(code: int | None) -> str | int | None:
    """C{ENOSPC} for an OSError's C{errno}, or the number when it has no name."""
    return errno.errorcode.get(code, code) if code is not None else None



@implementer(ILogStore, ILogDirectories)
class FileLogStore(StoreHealth):
    """
    A directory of logs, one subdirectory each.  Logs are opened (and
    recovered) on first use.

    @param run_blocking: C{f(*args) -> Deferred} running blocking calls
        (fsync, reads) off the reactor thread; default: the reactor's thread
        pool.  L{synchronous} runs them inline (tests, tools).
    @param io: the file layer (L{FileIO}); fault injection wraps it.
    @param inline_reads: read on the reactor thread whatever the page cache
        holds (only the rest through C{run_blocking}); default: when
        C{run_blocking} is the default thread pool.
    """

    log = Logger()

    def __init__(self, path: str, reactor: IReactorTime | None = None,
                 run_blocking: RunBlocking | None = None, io: FileIO | None = None,
                 retention_interval: float = 60.0, inline_reads: bool | None = None) -> None:
        reactor = cast(IReactorTime, default_reactor(reactor))
        # reads served by the page cache run on the reactor thread (they
        # cannot block): by default only where the rest go to a thread
        self._inline_reads = run_blocking is None if inline_reads is None else inline_reads
        self.path = os.path.abspath(path)
        self._reactor = reactor
        # without run_blocking, reactor is a real one, with a thread pool
        self._run_blocking = run_blocking or thread_runner(cast(IReactorThreads, reactor))
        self._io = io or FileIO()
        # every log's group commits: on native threads where the accelerator can
        self._syncer = make_syncer(reactor, run_blocking, self._run_blocking, self._io,
                                   default_io=io is None)
        self._logs: dict[str, FileLog] = {}
        self.closed = False
        # the data directory and the parents made for it must survive a
        # power loss, or every log in it is lost with them
        durable.make_dirs(self.path, self._io)
        for leftover in os.listdir(self.path):
            if leftover.startswith(".deleted-"):  # a delete interrupted by a crash
                durable.remove_tree(self._io, os.path.join(self.path, leftover))
        self._retention_call: IDelayedCall | None = None
        self._retention_interval = retention_interval

    def _retention_tick(self, interval: float) -> None:
        for log in self._logs.values():
            if not log._closed and log.failed is None:
                log._apply_retention()
        self._retention_call = self._reactor.callLater(interval, self._retention_tick, interval)

    def _log_path(self, name: str) -> str:
        return os.path.join(self.path, validate_name(name))

    def log_path(self, name: str) -> str:
        """The directory of log C{name} (for backups)."""
        return self._log_path(name)

    def names(self) -> list[str]:
        return sorted(n for n in os.listdir(self.path) if not n.startswith(".")
                      and os.path.isfile(os.path.join(self.path, n, CONFIG_FILE)))

    def _open(self, name: str) -> FileLog:
        log = self._logs.get(name)
        if log is not None:
            return log
        path = self._log_path(name)
        cfg_path = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(cfg_path):
            raise LogNotFound(f"log {name!r} not found")
        with open(cfg_path, "rb") as f:
            config = LogConfig.from_mapping(json.loads(f.read()))
        log = FileLog(name, path, config, self._io, self._run_blocking, self._reactor,
                      self._inline_reads, self._syncer)
        self._logs[name] = log
        if self._retention_interval and self._retention_call is None:
            # age-based retention also runs while no append comes in
            self._retention_call = self._reactor.callLater(
                self._retention_interval, self._retention_tick, self._retention_interval)
        return log

    def create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        try:
            path = self._log_path(name)
        except Exception as e:
            return fail(e)
        config = config or LogConfig()
        if os.path.exists(os.path.join(path, CONFIG_FILE)):
            return fail(LogExists(f"log {name!r} exists"))
        try:
            # the log's directory durable in the store's before its config
            durable.make_dirs(path, self._io)
            write_file_atomically(self._io, os.path.join(path, CONFIG_FILE),
                                  config.to_json().encode())
            self._io.fsync_dir(self.path)   # even if the directory was there
            return succeed(self._open(name))
        except Exception as e:
            return fail(e)

    def get(self, name: str) -> Deferred[ILog]:
        try:
            return succeed(self._open(name))
        except Exception as e:
            return fail(e)

    def get_or_create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        try:
            if os.path.isfile(os.path.join(self._log_path(name), CONFIG_FILE)):
                return succeed(self._open(name))
        except Exception as e:
            return fail(e)
        return self.create(name, config)

    def delete(self, name: str) -> Deferred[None]:
        try:
            path = self._log_path(name)
        except Exception as e:
            return fail(e)
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            return fail(LogNotFound(f"log {name!r} not found"))
        log = self._logs.pop(name, None)
        if log is not None:
            log._close(LogClosed(f"log {name!r} was deleted"))
        # rename first so that a crash never leaves a half-deleted log behind
        doomed = os.path.join(self.path, f".deleted-{name}-{time.time_ns()}")
        durable.replace_durably(self._io, path, doomed)
        return self._run_blocking(durable.remove_tree, self._io, doomed)

    def _store_problems(self) -> list[str]:
        found: list[str] = []
        probe = os.path.join(self.path, f".ready-probe-{os.getpid()}")
        try:
            # os.access says "no" without saying why; writing says why (EROFS...)
            io = self._io
            io.close(io.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
            io.unlink(probe)
        except OSError as e:
            found.append(f"data directory {self.path} cannot be written: "
                         f"{e.strerror or e} ({_errno_name(e.errno)})")
        return found

    def close(self) -> Deferred[None]:
        self.closed = True
        if self._retention_call is not None and self._retention_call.active():
            self._retention_call.cancel()
        logs = list(self._logs.values())
        self._logs.clear()

        def close_all(_: object) -> None:
            for log in logs:
                log._close()
            self._syncer.close()
        return DeferredList([log.sync() for log in logs if not log._closed and
                             log.failed is None], consumeErrors=True).addCallback(close_all)


def check_file_store(path: str) -> None:
    """
    Refuse a data directory holding a format newer than this release
    reads: every log's C{config.json}, C{state.json} and segment headers.
    Reads 40 bytes a segment: cheap enough for start-up.

    @raise NewerFormat: naming the first such file.
    """
    if not os.path.isdir(path):
        return
    for name in sorted(os.listdir(path)):
        log_dir = os.path.join(path, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(log_dir, "config.json")):
            continue
        for fname in ("config.json", "state.json"):
            try:
                with open(os.path.join(log_dir, fname), "rb") as f:
                    document = json.loads(f.read())
            except (OSError, ValueError):
                continue    # a missing or torn state file: the store's recovery decides
            if isinstance(document, dict):
                check_mapping(os.path.join(log_dir, fname), document, LOG_FILES_VERSION)
        for fname in sorted(os.listdir(log_dir)):
            if not fname.endswith(".seg"):
                continue
            try:
                with open(os.path.join(log_dir, fname), "rb") as f:
                    head = f.read(SEGMENT_HEADER_SIZE)
            except OSError:
                continue
            if head[:7] == SEGMENT_MAGIC[:7] and len(head) == SEGMENT_HEADER_SIZE:
                check(os.path.join(log_dir, fname), head[7], SEGMENT_VERSION)
