"""
C{streamproto store}: commands on a whole log store, opened as the servers
open it (a data directory, or C{nats://...} / C{tls://...} with the
C{--store-*} TLS options).

    streamproto store copy SRC DST [--log PATTERN]... [--exclude PATTERN]...
                                   [--follow] [--no-verify]
    streamproto store list STORE

doc/cli.rst and doc/scale-out.rst (the cut-over runbook).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from twisted.internet import defer
from twisted.python.failure import Failure

from streamproto.core.cli import (
    EXIT_FAILURE, EXIT_OK, CommandError, CommandParser, Convention, emit,
)
from streamproto.core.progress import Progress
from streamproto.log.copy import CopyFailed, CopyRefused
from streamproto.log.copy.readonly import open_read_only, reopening_store
from streamproto.log.copy.store import StoreCopy, last_journal_entry
from streamproto.log.interfaces import ILogStore, IStartingStore
from streamproto.log.storeurl import is_store_url

PROG = "streamproto store"


def parser() -> CommandParser:
    p = CommandParser(prog=PROG, description="Commands on a whole log store: a data "
                      "directory or nats://HOST:PORT[,...][?replicas=N&prefix=P] (tls://...).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    copy = sub.add_parser("copy", help="copy every log (or those selected) to another store, "
                          "with the same positions and offsets",
                          description="Copy logs, internal ones included, keeping every "
                          "record's position, offset and boundaries and every log's "
                          "attributes; resumable (run it again); verified at the end.")
    copy.add_argument("src", metavar="SRC", help="source: a data directory (read-only, "
                      "servers may run on it) or a nats:// URL")
    copy.add_argument("dst", metavar="DST", help="destination: a data directory or a nats:// URL")
    copy.add_argument("--log", dest="include", action="append", default=[], metavar="PATTERN",
                      help="copy the logs matching this name or shell pattern (repeated: "
                           "any of them; default every log)")
    copy.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                      help="do not copy the logs matching this name or pattern (repeated)")
    copy.add_argument("--follow", action="store_true",
                      help="keep copying what the servers append to the source until "
                           "SIGINT/SIGTERM: then catch up once more, verify, exit 0")
    copy.add_argument("--no-verify", dest="verify", action="store_false",
                      help="skip the final count and CRC comparison of every log")
    copy.add_argument("--no-sessions", dest="sessions", action="store_false",
                      help="do not copy the reliable-stream sessions (SQLite under a data "
                           "directory, the PREFIX_reliable bucket of a nats:// store)")
    listing = sub.add_parser("list", help="the logs of a store, with their bounds, and the "
                             "last copy into it")
    listing.add_argument("store", metavar="STORE", help="a data directory or a nats:// URL")
    for p_ in (copy, listing):
        g = p_.add_argument_group("store options (those the servers take)")
        g.add_argument("--store-ca", metavar="FILE", help="CA certificates (PEM) verifying "
                       "the NATS servers of a tls:// store")
        g.add_argument("--store-cert", metavar="FILE", help="client certificate (PEM)")
        g.add_argument("--store-key", metavar="FILE", help="the private key of --store-cert")
        o = p_.add_argument_group("output")
        o.add_argument("-f", "--format", choices=["text", "json"], default="text",
                       help="result as text or as one JSON document (default text)")
        o.add_argument("-q", "--quiet", action="store_true",
                       help="nothing on stderr but errors (no progress bar)")
    return p


def store_options(where: str, args: argparse.Namespace, must_exist: bool) -> dict[str, Any]:
    """
    The server options naming the store C{where}, checked as a server
    checks them.

    @raise ValueError: a usage error.
    """
    from twisted.python import usage

    from streamproto.core.stores import check_store_options
    options: dict[str, Any] = {"data": where, "store": where if is_store_url(where) else None,
                               "store-ca": args.store_ca, "store-cert": args.store_cert,
                               "store-key": args.store_key}
    if options["store"] is None:
        options.update({"store-ca": None, "store-cert": None, "store-key": None})
        if must_exist and not os.path.isdir(where):
            raise ValueError(f"{where!r}: no such data directory")
    try:
        check_store_options(options)
    except usage.UsageError as e:
        raise ValueError(str(e))
    return options


@defer.inlineCallbacks
def open_store(options: dict[str, Any], reactor: Any, read_only: bool = False) -> Any:
    """
    The store, connected (a JetStream cluster that does not answer fails
    here); a data directory C{read_only} never changes (servers may be
    writing it: L{streamproto.log.copy.readonly}).
    """
    from streamproto.core.stores import describe_store, open_log_store
    store: ILogStore
    if read_only and options["store-url"] is None:
        store = open_read_only(options["data"], reactor)
    else:
        store = open_log_store(options, reactor)
    if IStartingStore.providedBy(store):        # a JetStream cluster connects first
        try:
            yield IStartingStore(store).start()
        except Exception as e:
            yield store.close()
            raise CommandError(f"{describe_store(options)} cannot be reached: {e}")
    return store


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int | str:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    p = parser()
    args = p.parse_args(argv)
    try:
        if args.command == "copy":
            src = store_options(args.src, args, must_exist=True)
            dst = store_options(args.dst, args, must_exist=False)
            if os.path.abspath(args.src) == os.path.abspath(args.dst):
                raise ValueError("SRC and DST are the same store")
        else:
            src = store_options(args.store, args, must_exist=True)
    except ValueError as e:
        p.error(str(e))
    convention = Convention(PROG, "localhost:0", formats=True)
    if args.command == "list":
        return convention.run(lambda reactor: list_store(reactor, src, args, out), err)
    return convention.run(lambda reactor: copy(reactor, src, dst, args, out, err), err)


@defer.inlineCallbacks
def copy(reactor: Any, src_options: dict[str, Any], dst_options: dict[str, Any],
         args: argparse.Namespace, out: TextIO, err: TextIO) -> Any:
    from streamproto.core.stores import describe_store
    src = yield open_store(src_options, reactor, read_only=True)
    try:
        dst = yield open_store(dst_options, reactor)
    except BaseException:
        yield src.close()
        raise
    progress = Progress("copy", stream=err)
    if args.quiet:
        progress.enabled = False
    done = [0, 0]

    def moved(records: int, nbytes: int) -> None:
        done[0] += records
        done[1] += nbytes
        progress.update(done[0], done[1])

    sides = SessionCopier(src_options, dst_options, reactor) if args.sessions else None
    copier = StoreCopy(src, dst, reactor, tuple(args.include), tuple(args.exclude),
                       follow=args.follow, progress=moved, describe=describe_store(src_options),
                       verify=args.verify,
                       log=None if args.quiet else lambda line: err.write(f"{PROG}: {line}\n"),
                       refresh=None if src_options["store-url"] is not None else
                       reopening_store(src_options["data"], reactor),
                       sessions=sides)
    if args.follow:
        def stop(signum: int, frame: object) -> None:
            if not args.quiet:
                err.write(f"\n{PROG}: stopping: last catch-up, then verification\n")
            reactor.callFromThread(copier.stop)
        # in place of the reactor's own (which would stop it mid-copy)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
    try:
        total = yield copier.totals()
        progress.total = total[0]
        try:
            report = yield copier.run()
        except CopyRefused as e:
            raise CommandError(f"refused: {e}")
        progress.finish()
        logs = {name: dict(digest, end_position=copier.ends[name],
                           copied=copier.copies[name].copied_records)
                for name, digest in report.items()} if report else {
            name: {"end_position": end} for name, end in copier.ends.items()}
        word = "verified" if args.verify else "copied (not verified)"
        sessions = copier.sessions_copied or (0, 0)
        lines = [f"{name}: {v['end_position']} end position, {v.get('records', '?')} records, "
                 f"{v.get('copied', 0)} copied now" if args.verify else
                 f"{name}: {v['end_position']} end position" for name, v in sorted(logs.items())]
        emit(args, out, "\n".join(lines + [
            f"reliable-stream sessions: {sessions[0]} found, {sessions[1]} copied"] * bool(
                sessions[0]) + [f"{len(logs)} logs {word}, {done[0]} records "
                                f"({done[1]} bytes) copied by this run"]),
             {"logs": logs, "verified": args.verify, "records": done[0], "bytes": done[1],
              "sessions": {"found": sessions[0], "copied": sessions[1]}})
    finally:
        closing = [src.close(), dst.close()]
        if sides is not None:
            closing += sides.close()
        yield defer.gatherResults(closing, consumeErrors=True)
    return EXIT_OK


class SessionCopier:
    """
    What copies the reliable-stream sessions beside two log stores, for
    L{StoreCopy}: called once the logs caught up, then closed.
    """

    def __init__(self, src: dict[str, Any], dst: dict[str, Any], reactor: Any) -> None:
        self.sides = (session_side(src, reactor), session_side(dst, reactor))

    def __call__(self) -> defer.Deferred[tuple[int, int]]:
        from streamproto.reliable.sessioncopy import SessionConflict, copy_sessions

        def failed(f: Failure) -> None:
            if f.check(SessionConflict):
                raise CopyRefused(f.getErrorMessage())
            raise CopyFailed(f"reliable-stream sessions: {f.getErrorMessage()}")
        return defer.maybeDeferred(copy_sessions, *self.sides).addErrback(failed)

    def close(self) -> list[defer.Deferred[None]]:
        return [side.close() for side in self.sides]


def session_side(options: dict[str, Any], reactor: Any) -> Any:
    from streamproto.reliable.sessioncopy import BucketSessions, SQLiteSessions
    url = options["store-url"]
    if url is None:
        return SQLiteSessions(options["data"])
    from streamproto.core.stores import store_tls_context
    from streamproto.log.bridge import AsyncioThreadBridge
    from streamproto.log.natsio import NatsIO
    bridge = AsyncioThreadBridge(reactor)
    io = NatsIO(list(url.servers), bridge, tls=store_tls_context(options),
                name="streamproto-store-copy")
    return BucketSessions(io, bridge.call, url.prefix,
                          url.replicas or (3 if len(url.servers) >= 3 else 1), bridge)


@defer.inlineCallbacks
def list_store(reactor: Any, options: dict[str, Any], args: argparse.Namespace,
               out: TextIO) -> Any:
    store = yield open_store(options, reactor, read_only=True)
    try:
        logs = {}
        for name in store.names():
            log = yield store.get(name)
            logs[name] = {k: v for k, v in log.info().items() if k != "name"}
        journal = yield last_journal_entry(store)
    finally:
        yield store.close()
    lines = [f"{name}: [{v['start_position']}, {v['end_position']}) offsets "
             f"[{v['start_offset']}, {v['end_offset']}) {v['status']}"
             for name, v in sorted(logs.items())]
    if journal is not None:
        lines.append(f"last copy into this store: {journal['event']} "
                     f"(from {journal.get('source') or '?'})")
    emit(args, out, "\n".join(lines) if lines else "no logs", {"logs": logs, "journal": journal})
    return EXIT_OK if all(v["status"] == "ok" for v in logs.values()) else EXIT_FAILURE
