"""
A synchronous, read-only view of the logs a L{JetStreamLogStore} keeps in a
NATS JetStream cluster, for processes that have no reactor (Spark
executors, tools): the JetStream counterpart of
L{streamproto.log.reader.LogDirectoryReader}, with the same C{names},
C{bounds} and C{read}.

It reads what the cluster acknowledged (the leader's answers, and bodies
by direct get from replicas, which only hold what the quorum committed),
laid out as L{streamproto.log.natsformat} says: the message holding a
position is found by a binary search over stream sequences (one header
read per step), then messages follow one another by sequence.  Each call
connects on a private asyncio loop and closes before it returns (C{read}
when its iterator ends or is closed), so readers pickle cleanly and
nothing stays open between Spark tasks.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, Literal, TypeVar, overload

from streamproto.log.batch import RecordBatch
from streamproto.log.errors import CorruptLog, LogNotFound, PositionOutOfRange
from streamproto.log.natsformat import (
    ATTRS, DEFAULT_PREFIX, MARKER, MessageFormatError, check_prefix, decode_body, decode_info,
    log_name, stream_name, subject, subjects_filter,
)
from streamproto.log.natsformat import BatchInfo
from streamproto.log.natsio import NatsIO, NotAvailable, StoredMsg

_T = TypeVar("_T")


class _Session:
    """One connection on a private loop: run coroutines to completion, then close."""

    def __init__(self, servers: list[str], tls: ssl.SSLContext | None, timeout: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.io = NatsIO(servers, bridge=None, tls=tls, name="streamproto-reader",
                         api_timeout=timeout)
        self.timeout = timeout
        try:
            self.run(self._connect())
        except BaseException:
            self.close()
            raise

    async def _connect(self) -> None:
        import nats

        async def error_cb(e: Exception) -> None:
            # nats-py prints a traceback without one; the error we raise says it
            self.io.last_error = str(e)
        options: dict[str, Any] = dict(servers=self.io.servers, name=self.io.name, allow_reconnect=True,
                       max_reconnect_attempts=3, connect_timeout=min(5, self.timeout),
                       error_cb=error_cb)
        if self.io.tls is not None:
            options["tls"] = self.io.tls
        try:
            self.io.nc = await nats.connect(**options)
        except Exception as e:
            raise NotAvailable(f"cannot connect to {', '.join(self.io.servers)}: {e}")

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return self.loop.run_until_complete(coroutine)

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        nc = self.io.nc
        try:
            if nc is not None and not nc.is_closed:
                self.run(nc.close())
        finally:
            self.loop.close()


class JetStreamReader:
    """
    @param servers: C{nats://host:port} (or C{tls://}) URLs of the cluster.
    @param prefix: the store's prefix (L{JetStreamLogStore}'s C{prefix}).
    @param tls: an C{ssl.SSLContext} for C{tls://} servers.
    @param timeout: seconds to wait for each answer of the cluster.
    """

    def __init__(self, servers: str | Iterable[str], prefix: str = DEFAULT_PREFIX,
                 tls: ssl.SSLContext | None = None, timeout: float = 10.0) -> None:
        if isinstance(servers, str):
            servers = [servers]
        self.servers = list(servers)
        self.prefix = check_prefix(prefix)
        self.tls = tls
        self.timeout = timeout

    def __reduce__(self) -> tuple[type[JetStreamReader], tuple[Any, ...]]:
        # an ssl.SSLContext does not pickle: executors get what makes one
        if self.tls is not None:
            raise TypeError("a JetStreamReader with an SSLContext does not pickle: "
                            "build it on the executor")
        return (JetStreamReader, (self.servers, self.prefix, None, self.timeout))

    def _session(self) -> _Session:
        return _Session(self.servers, self.tls, self.timeout)

    def names(self) -> list[str]:
        """The logs of this prefix, sorted."""
        with self._session() as session:
            streams = session.run(session.io.stream_names(f"{self.prefix}.>"))
        return sorted(n for n in (log_name(self.prefix, s) for s in streams) if n)

    def bounds(self, name: str) -> tuple[int, int]:
        """
        @return: C{(start_position, end_position)} of log C{name}: what the
            quorum acknowledged.
        @raise LogNotFound: there is no such log.
        """
        with self._session() as session:
            return session.run(self._bounds(session.io, name))

    async def _bounds(self, io: NatsIO, name: str) -> tuple[int, int]:
        stream = stream_name(self.prefix, name)
        info = await io.stream_info(stream)
        if info is None:
            raise LogNotFound(f"log {name!r} not found")
        last = await io.get(stream, last=subjects_filter(self.prefix, name))
        if last is None:
            return 0, 0
        end = _decode(name, last).end_position
        marker = await io.get(stream, last=subject(self.prefix, name, MARKER))
        start = 0
        if marker is not None:
            marker_start = _decode(name, marker).start
            start = marker_start[0] if marker_start is not None else 0
        state = info.get("state", {})
        first = await io.get(stream, seq=max(1, state.get("first_seq", 1)),
                             next=subjects_filter(self.prefix, name))
        if first is not None:
            first_info = _decode(name, first)
            if first_info.kind != MARKER and first_info.position > start:
                start = first_info.position      # purged without a marker
        return min(start, end), end

    def attributes(self, name: str) -> dict[str, int]:
        """The log's attribute map (Pravega's writer state, seals...)."""
        with self._session() as session:
            return session.run(self._attributes(session.io, name))

    async def _attributes(self, io: NatsIO, name: str) -> dict[str, int]:
        stream = stream_name(self.prefix, name)
        got = [await io.get(stream, last=subject(self.prefix, name, kind))
               for kind in (ATTRS, MARKER)]
        infos = [_decode(name, m) for m in got if m is not None]
        if not infos:
            return {}
        return dict(max(infos, key=lambda i: i.seq).attributes or {})

    @overload
    def read(self, name: str, start_position: int, end_position: int,
             max_bytes: int = ..., with_time: Literal[False] = ...) -> Iterator[RecordBatch]: ...

    @overload
    def read(self, name: str, start_position: int, end_position: int,
             max_bytes: int = ..., *,
             with_time: Literal[True]) -> Iterator[tuple[RecordBatch, int | None]]: ...

    @overload
    def read(self, name: str, start_position: int, end_position: int,
             max_bytes: int = ..., with_time: bool = ...,
             ) -> Iterator[RecordBatch | tuple[RecordBatch, int | None]]: ...

    def read(self, name: str, start_position: int, end_position: int,
             max_bytes: int = 8 * 1024 * 1024, with_time: bool = False,
             ) -> Iterator[RecordBatch | tuple[RecordBatch, int | None]]:
        """
        Yield L{RecordBatch}es covering C{[start_position, end_position)},
        each at most about C{max_bytes} (at least one record).

        @param with_time: yield C{(batch, microseconds)} pairs instead, the
            time the cluster stored the batch's message (its append time),
            in microseconds since the epoch.

        @raise PositionOutOfRange: C{start_position} is before the log's
            start (truncated or purged) or the range ends past its end.
        """
        if start_position >= end_position:
            return
        with self._session() as session:
            io = session.io
            stream = stream_name(self.prefix, name)
            info = session.run(io.stream_info(stream))
            if info is None:
                raise LogNotFound(f"log {name!r} not found")
            state = info.get("state", {})
            first_seq, last_seq = max(1, state.get("first_seq", 1)), state.get("last_seq", 0)
            start, end = session.run(self._bounds(io, name))
            if start_position < start or end_position > end:
                raise PositionOutOfRange(
                    f"log {name!r}: [{start_position}, {end_position}) outside [{start}, {end})")
            seq = session.run(self._locate(io, stream, name, first_seq, last_seq,
                                           start_position))
            position = start_position
            while position < end_position and seq <= last_seq:
                msg = session.run(io.get_direct(stream, seq))
                seq += 1
                if msg is None:
                    continue                     # purged in the meantime, or a gap
                msg_info = _decode(name, msg)
                if msg_info.count == 0 or msg_info.end_position <= position:
                    continue
                if msg_info.position > position:
                    raise CorruptLog(f"log {name!r}: positions {position} to "
                                     f"{msg_info.position} are missing")
                try:
                    lengths, data = decode_body(msg_info, msg.data)
                except MessageFormatError as e:
                    raise CorruptLog(f"log {name!r}: {e}")
                batch = RecordBatch(msg_info.position, lengths, data)
                lo = position - msg_info.position
                hi = min(end_position, msg_info.end_position) - msg_info.position
                when = stored_time_us(msg.time) if with_time else None
                for piece in _split(batch.slice(lo, hi), max_bytes):
                    yield (piece, when) if with_time else piece
                position = msg_info.position + hi
            if position < end_position:
                raise PositionOutOfRange(f"log {name!r}: ends at {position}, "
                                         f"before {end_position}")

    async def _locate(self, io: NatsIO, stream: str, name: str, first_seq: int, last_seq: int,
                      position: int) -> int:
        """The sequence of the message holding C{position} (binary search on headers)."""
        lo, hi = first_seq, last_seq
        found: int | None = None
        filter_ = subjects_filter(self.prefix, name)
        while lo <= hi:
            mid = (lo + hi) // 2
            got = await io.get(stream, seq=mid, next=filter_)
            if got is None or got.seq > hi:
                hi = mid - 1
                continue
            info = _decode(name, got)
            if info.count and info.position <= position < info.end_position:
                return got.seq
            if info.end_position <= position:
                lo = got.seq + 1
            else:
                found = got.seq
                hi = mid - 1
        if found is None:
            raise PositionOutOfRange(f"log {name!r}: no message holds position {position}")
        return found


def _decode(name: str, msg: StoredMsg) -> BatchInfo:
    try:
        return decode_info(msg.seq, msg.subject, msg.headers)
    except MessageFormatError as e:
        raise CorruptLog(f"log {name!r}: {e}")


def stored_time_us(text: str | None) -> int:
    """
    JetStream's C{Nats-Time-Stamp} (RFC 3339 in UTC with up to nanoseconds,
    C{2024-05-01T12:00:00.123456789Z}) as microseconds since the epoch.
    """
    import datetime
    if not text:
        raise CorruptLog("a stored message without Nats-Time-Stamp")
    text = text.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    head, sep, rest = text.partition(".")
    fraction = ""
    if sep:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        fraction, rest = rest[:digits], rest[digits:]
    when = datetime.datetime.fromisoformat(head + rest)
    seconds = int(when.timestamp())
    return seconds * 1_000_000 + int((fraction + "000000")[:6])


def _split(batch: RecordBatch, max_bytes: int) -> Iterator[RecordBatch]:
    """C{batch} in pieces of about C{max_bytes} (at least one record each)."""
    if len(batch.data) <= max_bytes:
        yield batch
        return
    lengths = batch.lengths
    i, n = 0, len(lengths)
    while i < n:
        size, j = 0, i
        while j < n and (j == i or size + lengths[j] <= max_bytes):
            size += lengths[j]
            j += 1
        yield batch.slice(i, j)
        i = j


__all__ = ["JetStreamReader"]
