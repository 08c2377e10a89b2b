"""
Targets for the write-only protocols (Lumberjack, Relink C{log} and
C{log-tx}): their real server (C{lumberjack-server}, C{relink-server}) on
the file store, its data on a lazy FS, under the same nemesis verbs as
L{test.faults.targets.StyxFileTarget} (kill -9, power loss, pauses,
libfaketime clock jumps).

These protocols have no read path: the final state is the log as the
store holds it, read with the read-only L{LogDirectoryReader} twice: the
disk as it is after the last power cut (or kill -9), before any recovery
(column I{disk}), and after a fresh server process started on it (its
recovery ran) and stopped gracefully (the counted columns: what any later
reader of the store is served).  Lumberjack stores each event as the JSON
document C{{"event": ..., ...}}: the payload is its C{m} field.
"""

import json
import os
import signal

from twisted.internet import defer

from test.faults.checker import encode
from test.faults.targets import StyxFileTarget
from test.support.torture_harness import suspicious_output

#: protocol -> (server plugin, the log the workload's records land in)
SERVERS = {
    "lumberjack": ("lumberjack-server", "lumberjack"),
    "relink": ("relink-server", "relink-1"),
    "relink-tx": ("relink-server", "relink-1"),
    # the segment, read back through the server (ReadSegment)
    "pravega": ("pravega-server", "faults/stream/0.#epoch.0"),
    # sessions, not a log (L{ReliableFileTarget})
    "reliable": ("reliable-stream-server", "sessions"),
}


def lumberjack_payload(record):
    """The workload's payload inside a stored Lumberjack event (the bytes if not one)."""
    try:
        return json.loads(record)["event"]["m"].encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return bytes(record)


class LogFileTarget(StyxFileTarget):
    """One server of C{protocol} (L{SERVERS}) on the file store, data on a lazy FS."""

    store = "file"

    def __init__(self, reactor, protocol, clock=False, **kwargs):
        plugin, log = SERVERS[protocol]
        self.protocol = protocol
        #: the workload process: C{python -m MODULE NAME} (L{test.faults.reftargets})
        self.workload = ("test.faults.workload", protocol)
        # the segment store only: no gRPC controller (it would bind :9090)
        args = ["--controller", "none"] if protocol == "pravega" else []
        # kwargs: the cluster's (sync_interval) when composed with a JetStream target
        super().__init__(reactor, clock=clock, log=log, plugin=plugin, args=args, **kwargs)

    @property
    def url(self):
        return f"tcp://127.0.0.1:{self.server.port}"

    def create_log(self, **config):
        """
        Pravega's segment, which the setup then syncs with the data
        directory before the workload starts; the other logs are created by
        their first write.
        """
        if self.protocol != "pravega":
            return defer.succeed(None)
        return create_segment(self._endpoint(), self.log)

    def _endpoint(self):
        return local_endpoint(self.reactor, self.server.port)

    def disk_records(self):
        if self.protocol == "pravega":
            return None    # segment blocks, not events: read through the server only
        try:
            records = super().disk_records()
        except (KeyError, FileNotFoundError):
            return []     # nothing was ever written: no log
        return self.payloads(records)

    def payloads(self, records):
        if self.protocol == "lumberjack":
            return [lumberjack_payload(r) for r in records]
        return [bytes(r) for r in records]

    @defer.inlineCallbacks
    def final_records(self, power_cut=True):
        yield self._heal_and_cut(power_cut)
        disk, disk_error = None, None
        try:
            disk = self.disk_records()
        except Exception as e:   # noqa: BLE001 - an unreadable disk is a finding
            disk_error = f"the read-only reader failed on the disk: {e!r}"
            self.notes.append(disk_error)
        yield self.server.start()
        if self.protocol == "pravega":
            served = yield self.read_segment()
        else:
            # the fresh server recovered the log; stopped gracefully, the store is read
            yield self.server.stop()
            served = self.disk_records()
        bad = suspicious_output(self.server.output_text())
        if bad:
            self.notes.append(f"{len(bad)} tracebacks in the server's output")
        return {"disk": disk, "disk_error": disk_error, "served": served}

    @defer.inlineCallbacks
    def read_segment(self):
        """Every event of the segment, through the fresh server (ReadSegment)."""
        from streamproto.pravega.client import SegmentReader, connect
        proto = yield connect(self._endpoint())
        try:
            info = yield proto.segment_info(self.log)
        finally:
            proto.transport.loseConnection()
            yield proto.closed
        reader = SegmentReader(self._endpoint(), self.log)
        events = []
        try:
            while reader.offset < info.write_offset:
                got = yield reader.read()
                if not got:
                    break
                events += got
        finally:
            yield reader.close()
        return events


class ReliableFileTarget(LogFileTarget):
    """
    The reliable-stream-server with its durable (SQLite) session store
    under C{--data}, on a lazy FS.  Its streams are generated, not stored
    records: the served records are what the workload's clients received
    (its C{.served} file, L{test.faults.workload.run_reliable}), each
    message C{id} of session C{p} as the payload of operation C{id - 1}.
    A session is kept only if a fresh server, after the last fault, still
    resumes it where its client left it (the next message, with the next
    id) and it was never refused on the way; otherwise every message of it
    counts as absent, so that what the server had sent (and so stored)
    shows as lost.  The disk column: the same records, a session kept only
    if the database as the last kill left it (read directly, before any
    server recovers it) holds it at or past its client's last id, with the
    next message when it has one (L{resumable_on_disk}).

    The data directory, and so the session database (SQLite in WAL mode:
    the database, its WAL and its C{-shm} wal-index), is on the lazy FS,
    so a power cut loses whatever SQLite had not synced; the wal-index is
    the one file the lazy FS lets the kernel cache, since WAL maps it
    shared (L{test.faults.lazyfs.page_cached}).
    """

    def __init__(self, reactor, clock=False, **kwargs):
        super().__init__(reactor, "reliable", clock=clock, **kwargs)
        self.history = None

    def start_client(self, history, duration, producers=3, timeout=3.0):
        self.history = history
        return super().start_client(history, duration, producers, timeout)

    def disk_records(self):
        return None

    @defer.inlineCallbacks
    def final_records(self, power_cut=True):
        from test.faults.workload import RELIABLE_COUNT, reliable_served_path
        # the clock row resumes on the running server: a restarted one
        # reads the disconnection times the database holds, wall time, and
        # counts a step back of the clock as time away (doc/reliability.rst)
        restart = not self.use_clock
        if restart:
            yield self._heal_and_cut(power_cut)
        else:
            self.signal("server", signal.SIGCONT)
            self.set_clock(0)
        sessions, refused, corrupt = {}, set(), []
        path = reliable_served_path(self.history)
        try:
            with open(path) as f:
                lines = f.readlines()
        finally:
            if os.path.exists(path):
                os.unlink(path)
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue    # torn by a kill of the client
            ids = sessions.setdefault(e["p"], [])
            if "id" in e:
                ids.append(e["id"])
            elif "refused" in e:
                refused.add(e["p"])
                self.notes.append(f"session {e['p']} refused: {e['refused']}")
            else:
                corrupt.append(f"{e['p']}: {e}".encode())
        disk, disk_error = None, None
        try:
            on_disk = self.resumable_on_disk(sessions, refused)
        except Exception as e:   # noqa: BLE001 - an unreadable database is a finding
            disk_error = f"the session database could not be read: {e!r}"
            self.notes.append(disk_error)
        else:
            # None: no database to read (the JetStream targets)
            disk = None if on_disk is None else self.records(
                sessions, refused | (set(sessions) - on_disk), corrupt)
        if restart:
            yield self.server.start()
        for name, ids in sorted(sessions.items()):
            last = ids[-1] if ids else 0
            if name in refused or not ids or last >= RELIABLE_COUNT:
                continue
            why = yield self.resume(name, last)
            if why is not None:
                refused.add(name)
                self.notes.append(f"session {name} not resumable at {last}: {why}")
        yield self.server.stop()
        bad = suspicious_output(self.server.output_text())
        if bad:
            self.notes.append(f"{len(bad)} tracebacks in the server's output")
        return {"disk": disk, "disk_error": disk_error,
                "served": self.records(sessions, refused, corrupt)}

    @staticmethod
    def records(sessions, dropped, corrupt):
        """Each received message of the sessions not C{dropped}, as the checker's payload."""
        return [encode(name, i - 1) for name, ids in sorted(sessions.items())
                if name not in dropped for i in ids] + corrupt

    def resumable_on_disk(self, sessions, refused):
        """
        The sessions the SQLite database itself could resume where their
        clients left them (finished ones count: the server deletes them).
        """
        import sqlite3

        from streamproto.reliable.tap import SQLITE_FILE
        from test.faults.workload import RELIABLE_COUNT, reliable_session_id
        path = os.path.join(self.server.data_dir, SQLITE_FILE)
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            ok = set()
            for name, ids in sessions.items():
                last = ids[-1] if ids else 0
                if name in refused or not ids or last >= RELIABLE_COUNT:
                    ok.add(name)
                    continue
                sid = reliable_session_id(name)
                row = db.execute("SELECT last_id FROM sessions WHERE uuid = ?",
                                 (sid,)).fetchone()
                if row is None or row[0] < last:
                    continue
                if row[0] > last and db.execute(
                        "SELECT 1 FROM messages WHERE uuid = ? AND id = ?",
                        (sid, last + 1)).fetchone() is None:
                    continue
                ok.add(name)
            return ok
        finally:
            db.close()

    def resume(self, name, last):
        """None if the server resumes session C{name} after C{last}, else why not."""
        return resume_session(self.reactor, self._endpoint(), name, last)


def local_endpoint(reactor, port):
    from streamproto.core.tls import client_endpoint
    return client_endpoint(reactor, "127.0.0.1", port)


@defer.inlineCallbacks
def create_segment(endpoint, segment):
    """Create Pravega segment C{segment} on the server at C{endpoint}."""
    from streamproto.pravega.client import connect
    proto = yield connect(endpoint)
    try:
        yield proto.create_segment(segment)
    finally:
        proto.transport.loseConnection()
        yield proto.closed


@defer.inlineCallbacks
def resume_session(reactor, endpoint, name, last):
    """
    None if the reliable-stream server at C{endpoint} resumes the
    workload's session C{name} after message C{last}, else why not.
    """
    from twisted.internet import protocol

    from streamproto.reliable import codec
    from test.faults.workload import reliable_session_id

    class First(protocol.Protocol):
        def __init__(self):
            self.decoder = codec.LineDecoder()
            self.line = defer.Deferred()

        def dataReceived(self, data):
            lines = self.decoder.feed(data)
            if lines and not self.line.called:
                self.line.callback(lines[0])

        def connectionLost(self, reason):
            if not self.line.called:
                self.line.callback(None)

    conn = yield endpoint.connect(protocol.Factory.forProtocol(First))
    conn.transport.write(codec.encode_resume(reliable_session_id(name), last))
    try:
        line = yield conn.line.addTimeout(10, reactor)
    except defer.TimeoutError:
        return "no answer in 10 s"
    finally:
        conn.transport.loseConnection()
    if line is None:
        return "closed without an answer"
    message = codec.parse_server_message(line, stateful=True)
    if isinstance(message, codec.ErrorMessage):
        return message.text
    if message.message_id != last + 1:
        return f"message {message.message_id} came next"
    return None
