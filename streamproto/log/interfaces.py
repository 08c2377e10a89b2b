"""
The storage interfaces every protocol talks to.

A store is a directory (or a dict, in memory) of named logs.  A log is an
append-only sequence of opaque records.  Every record has two coordinates:

- its *position*: 0-based record index, never reused (truncation and retention
  move ``start_position`` forward, they never renumber);
- its *offset*: the number of payload bytes in the log before it, which is how
  Pravega addresses segments.

Every method that may touch the disk returns a Deferred.  Appends fire only
after their records are fsynced ("acknowledged means durable"); readers only
ever see synced records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred
from zope.interface import Attribute, Interface

if TYPE_CHECKING:
    from streamproto.log.batch import BytesLike, RecordBatch
    from streamproto.log.config import LogConfig
    from streamproto.log.result import AppendResult


class IReadiness(Interface):
    """
    Something C{/ready} asks whether the server can serve
    (L{streamproto.core.ops.store_problems}): every store the server was
    given (an L{ILogStore} extends this), or a view of another kind of
    store (the reliable-stream session store).  Declared here, under the
    core kit that asks it, because the stores provide it;
    L{streamproto.core.interfaces} names it for the protocols.
    """

    def problems() -> list[str]:
        """
        Why the store cannot serve now, for C{/ready}: one line each, with
        the cause (a closed store, a data directory that cannot be written
        and why, a log that fail-stopped and why).  Empty when it can.

        @return: a list of strings (synchronous: a health check must answer
            even when the store's I/O is stuck).
        """


class ILogStore(IReadiness):
    """
    A collection of named logs.  Its L{IReadiness.problems} says why it
    cannot serve (a closed store, a data directory that cannot be written,
    a log that fail-stopped), for C{/ready}.
    """

    def names() -> list[str]:
        """
        @return: a sorted list of the names of the logs that exist.
        """

    def create(name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        """
        Create a log.

        @param name: matches C{^[A-Za-z0-9_-]+$}, at most 200 characters.
        @param config: a L{streamproto.log.config.LogConfig} or None for the
            defaults.
        @return: Deferred firing with the new L{ILog}; fails with
            L{LogExists} or L{InvalidLogName}.
        """

    def get(name: str) -> Deferred[ILog]:
        """
        @return: Deferred firing with the open L{ILog}; fails with
            L{LogNotFound} or L{InvalidLogName}.
        """

    def get_or_create(name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        """
        @return: Deferred firing with the L{ILog}, created with C{config} if
            it did not exist.
        """

    def delete(name: str) -> Deferred[None]:
        """
        Delete a log and all its records.  Pending appends fail with
        L{LogClosed}; waiting readers are woken and their Deferreds fail.

        @return: Deferred firing with None; fails with L{LogNotFound}.
        """

    def open_logs() -> list[ILog]:
        """
        @return: a list of the L{ILog}s open now (for metrics: a scrape reads
            their C{info()} without opening every log on disk).
        """

    def close() -> Deferred[None]:
        """
        Wait for pending fsyncs, then close every log.

        @return: Deferred firing when every log is closed.
        """


class IStartingStore(Interface):
    """
    A store that must connect before it serves (a JetStream store or
    session bucket): the service that owns it starts it when the server
    starts, and a store that cannot be reached then is a clean start-up
    failure.  A store without it (file, memory) serves once opened.
    """

    def start() -> Deferred[None]:
        """
        Connect (once; again after a failure).

        @return: a Deferred firing when the store serves, or failing with
            why it cannot be reached.
        """


class ILogDirectories(Interface):
    """
    An L{ILogStore} whose logs are directories on a file system (the file
    store), which backups and restores need: a backup archives a log's
    directory, a restore unpacks one into the store's.  A store without
    them (memory, JetStream) does not provide this.
    """

    path = Attribute("The store's data directory (absolute): one subdirectory per log.")

    def log_path(name: str) -> str:
        """
        @return: the directory of log C{name} (whether or not it exists).
        @raise InvalidLogName: for a name that cannot be a log's.
        """


class ILog(Interface):
    """One append-only log of records."""

    name = Attribute("The log's name.")
    config = Attribute("The log's L{streamproto.log.config.LogConfig}.")
    start_position = Attribute("Position of the first readable record.")
    end_position = Attribute(
        "Synced end: the position the next record will get once everything "
        "pending is synced.  Only records below it are visible."
    )
    start_offset = Attribute("Payload byte offset of the first readable byte.")
    end_offset = Attribute("Synced end in payload bytes.")
    attributes = Attribute(
        "A read-only mapping str -> int of the attributes as of the synced "
        "end (see L{append})."
    )
    failed = Attribute(
        "None, or the exception that made this log fail-stop (an fsync or "
        "write error): no append is accepted after it."
    )
    holds_unsynced = Attribute(
        "True if appended records not yet durable stay in this process's memory "
        "until they are (JetStream: until the quorum stores them; the memory "
        "store); False if L{append} hands them to the OS at once (the file "
        "store: the page cache, which the kernel bounds itself).  Producers "
        "size how much they let wait for durability by it."
    )

    def append(
        records: Sequence[BytesLike] | RecordBatch,
        attributes: Mapping[str, int] | None = None,
        expected_position: int | None = None,
        expected_attributes: Mapping[str, int | None] | None = None,
        prepare_answers: Callable[[AppendResult], Sequence[Any]] | None = None,
    ) -> Deferred[AppendResult]:
        """
        Append records at the end of the log.

        The bytes go to the OS at once; one fsync, run off the reactor
        thread, covers every append pending when it starts (group commit).

        @param records: a sequence of bytes-like objects, each at most
            C{config.max_record_size} bytes, or a
            L{streamproto.log.batch.RecordBatch} (lengths + one buffer: no
            per-record work at all).  May be empty (to persist only
            attributes).
        @param attributes: optional dict str -> int stored atomically with
            these records (e.g. a Pravega writer's last event number): after
            a crash either both the records and the attributes are there, or
            neither.
        @param expected_position: append only if the first record would
            get this position (compare-and-append: a read-modify-write that
            several front-ends of one store may race on); otherwise fail
            with L{AppendConflict} and write nothing.  A conditional append
            must fit in one batch of the store.
        @param expected_attributes: append only if, counting every append
            issued before this one, each key of this dict has the value it
            maps to (None: the key is unset); otherwise fail with
            L{AppendConflict} and write nothing.  Judged where the append
            takes its place in the log, again each time a store sends it
            again: an exactly-once writer (a Pravega writer and its event
            number) can then never be stored twice, even when an earlier
            append whose outcome was unknown lands after all.
        @param prepare_answers: for a server whose answer is ready before
            the fsync: called at most once, on the reactor thread, after
            the records are written and before the fsync that covers them
            starts, with the L{AppendResult} the Deferred will fire with;
            returns held answers (L{streamproto.core.sendpath.SocketSender.hold})
            that the store sends from the thread that made the records
            durable, the moment it did (the file store on the accelerator's
            syncer).  A store that cannot never calls it.  Either way the
            Deferred fires as always, and the caller then settles each
            answer (C{SocketSender.finish_held}): not sent, it answers the
            usual way.
        @return: Deferred firing, after the fsync that covers these records,
            with an L{AppendResult}; fails with L{RecordTooLarge},
            L{LogFailed}, L{LogClosed}, L{AppendConflict}.
        """

    def read(position: int, max_records: int = -1,
             max_bytes: int = 1048576) -> Deferred[RecordBatch]:
        """
        Read synced records from C{position}.

        At least one record is returned if any is available at C{position},
        even if it is larger than C{max_bytes}.  A read may return fewer
        records than allowed (it never crosses a segment): loop on
        C{batch.next_position}.

        @return: Deferred firing with a L{streamproto.log.batch.RecordBatch}
            (empty at the synced end); fails with L{PositionOutOfRange} if
            C{position} is below C{start_position} or above C{end_position}.
        """

    def read_bytes(offset: int, max_bytes: int = 1048576) -> Deferred[bytes]:
        """
        Read synced payload bytes from the payload byte C{offset} (which may
        fall inside a record).  May return fewer bytes than allowed (a read
        never crosses a segment): loop.

        @return: Deferred firing with bytes (empty at the synced end); fails
            with L{PositionOutOfRange} outside C{[start_offset, end_offset]}.
        """

    def position_of_offset(offset: int) -> Deferred[int]:
        """
        @return: Deferred firing with the position of the record containing
            payload byte C{offset} (C{end_position} for C{end_offset}).
        """

    def offset_of_position(position: int) -> Deferred[int]:
        """
        The inverse of L{position_of_offset}: where record C{position}
        starts in payload bytes.  A log whose start was cut inside a record
        (L{truncate_offset}) still answers for that first record, whose
        start is below C{start_offset}: what a copy needs to give the same
        record the same offset.

        @return: Deferred firing with the offset (C{end_offset} for
            C{end_position}); fails with L{PositionOutOfRange} outside
            C{[start_position, end_position]}.
        """

    def skip_to(position: int, offset: int) -> Deferred[int]:
        """
        Make an empty log (no readable record: C{start_position ==
        end_position}) go on from C{position} and C{offset}, as if records
        up to there had been appended and truncated: the next record
        appended gets C{position}, its payload C{offset}.

        Why: a copy of a log whose head retention or a truncation removed
        keeps every record's position and offset, which consumers'
        checkpoints (Spark offsets, Pravega stream cuts) hold.

        @return: Deferred firing with the new C{end_position}; fails with
            L{AppendConflict} (nothing changed) when the log holds readable
            records, or when C{position}/C{offset} is below its end, or when
            only one of them moves forward.
        """

    def wait(position: int, timeout: float | None = None) -> Deferred[int]:
        """
        Wait until a record at C{position} is readable (synced).

        No polling: the Deferred fires from the fsync that makes it visible.

        @param timeout: seconds, or None to wait for ever.
        @return: Deferred firing with C{end_position} when C{end_position >
            position}, or when the timeout expires (then C{end_position <=
            position}), or failing with L{LogClosed} if the log is deleted or
            closed meanwhile.  Cancelling it stops the wait.
        """

    def wait_offset(offset: int, timeout: float | None = None) -> Deferred[int]:
        """
        Like L{wait}, for payload byte offsets: fires with C{end_offset}.
        """

    def truncate(position: int | None = None) -> Deferred[int]:
        """
        Make every record before C{position} (all records when None)
        unreadable and reclaim the whole segments it frees.  Positions are
        never reused.

        @return: Deferred firing with the new C{start_position}.
        """

    def truncate_offset(offset: int) -> Deferred[int]:
        """
        Make payload bytes before C{offset} unreadable (Pravega's
        TruncateSegment).

        @return: Deferred firing with the new C{start_offset}.
        """

    def info() -> dict[str, Any]:
        """
        @return: a dict with the Styx log-info fields: C{name, status,
            record_count, file_size, start_position, end_position}, plus
            C{start_offset, end_offset}.
        """

    def sync() -> Deferred[int]:
        """
        @return: Deferred firing with the synced C{end_position} once
            everything appended so far is fsynced.
        """


def log_problems(logs: Iterable[ILog]) -> list[str]:
    """
    The C{/ready} lines of the L{ILog}s C{logs} that are not usable: their
    status and, when they fail-stopped, the cause.  A helper for
    L{ILogStore.problems} implementations.
    """
    found = []
    for log in list(logs):
        status = log.info()["status"]
        if status != "ok":
            cause = getattr(log, "failed", None) or getattr(log, "unavailable", None)
            found.append(f"log {log.name}: {status}" + (f": {cause}" if cause else ""))
    return found


class StoreHealth:
    """
    L{ILogStore.open_logs} and L{ILogStore.problems} for a store that keeps
    its open logs in C{_logs}: every store reports the same way on
    C{/ready} (closed, then its own trouble, then its unusable logs), and a
    store writes only its own lines, in L{_store_problems}.
    """

    closed: bool
    _logs: Mapping[str, Any]

    def open_logs(self) -> list[ILog]:
        return list(self._logs.values())

    def problems(self) -> list[str]:
        if self.closed:
            return ["store closed"]
        return self._store_problems() + log_problems(self._logs.values())

    def _store_problems(self) -> list[str]:
        """What is wrong with the store itself (its disk, its servers)."""
        return []
