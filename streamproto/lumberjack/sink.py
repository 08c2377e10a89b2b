"""
Where received events go: anything providing L{IEventSink}.  The server acks
a batch only after the sink's Deferred fired, so a sink must fire it only
once the events are durable.

L{LogStoreSink}, the default, appends one JSON record per event to a log of
the embedded log store::

    {"peer":"10.0.0.7:51234","tls":{"cn":"beat-7","sha256":"AB:..."},"event":{...}}

The event's JSON bytes are spliced in as received (validated, never decoded
and re-encoded); C{tls} is present only when the peer showed a certificate.
"""

import json
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

from streamproto.core.observer import SharedCall
from streamproto.log.batch import RecordBatch, lengths_array
from streamproto.log.config import LogConfig
from streamproto.log.interfaces import ILog, ILogStore
from streamproto.lumberjack.runs import PayloadRun, splice


class IEventSink(Interface):
    """Durable storage for received events."""

    def write(connection: "ConnectionInfo", events: Sequence[bytes]) -> Deferred[Any]:
        """
        Persist C{events}.

        @param connection: the L{ConnectionInfo} of the sender.
        @param events: a sequence of bytes, each one UTF-8 JSON document
            (from the server: a L{streamproto.lumberjack.runs.PayloadRun},
            the whole run in one buffer).
        @return: a Deferred firing once every event is durable; a failure
            makes the server close the connection without acking (the
            client sends them again).
        """


class IConnectionInfo(Interface):
    peer = Attribute("The sender's address as 'host:port'.")
    tls = Attribute("None, or the client certificate's {'cn': ..., 'sha256': ...}.")


@implementer(IConnectionInfo)
class ConnectionInfo:
    """What a sink may record about the connection events came from."""

    __slots__ = ("peer", "tls", "_prefix")

    def __init__(self, peer: str, tls: dict[str, str] | None = None) -> None:
        self.peer = peer
        self.tls = tls
        self._prefix: bytes | None = None

    def record_prefix(self) -> bytes:
        """C{b'{"peer":...,"tls":...,"event":'}: an event and C{b"}"} complete a record."""
        if self._prefix is None:
            meta: dict[str, object] = {"peer": self.peer}
            if self.tls:
                meta["tls"] = self.tls
            head = json.dumps(meta, ensure_ascii=False, separators=(",", ":"))
            self._prefix = (head[:-1] + ',"event":').encode("utf-8")
        return self._prefix

    def __repr__(self) -> str:
        return f"<ConnectionInfo peer={self.peer} tls={self.tls}>"


def make_records(connection: ConnectionInfo, events: Sequence[bytes]) -> RecordBatch:
    """
    The log records for C{events}: metadata spliced around the raw JSON, as
    one L{RecordBatch} (one call for all the bytes, no object per record:
    the store appends it as it is).
    """
    run = PayloadRun.of(events)
    if not run:
        return RecordBatch(0, lengths_array(), b"")
    data, lengths = splice(run, b"", connection.record_prefix(), b"}", b"")
    return RecordBatch(0, lengths, data)


@implementer(IEventSink)
class LogStoreSink:
    """
    Appends events to the log C{log_name} of an L{ILogStore}, created on
    first use (with C{config}, a L{streamproto.log.LogConfig}, if given).
    The append Deferred fires after fsync.
    """

    log = Logger()

    def __init__(self, store: ILogStore, log_name: str = "lumberjack",
                 config: LogConfig | None = None) -> None:
        self.store = store
        self.log_name = log_name
        self.config = config
        self._log: ILog | None = None
        # connections arriving while the log opens wait for that one open
        self._open = SharedCall(self._open_log)

    def _get_log(self):
        if self._log is not None:
            return succeed(self._log)
        return self._open()

    def _open_log(self):
        return self.store.get_or_create(self.log_name, self.config).addCallbacks(
            self._opened, self._open_failed)

    def _opened(self, log):
        self._log = log
        return log

    def _open_failed(self, failure):
        self.log.failure("cannot open log {name}", failure, name=self.log_name)
        return failure

    def write(self, connection: ConnectionInfo, events: Sequence[bytes]) -> Deferred[Any]:
        records = make_records(connection, events)
        if self._log is not None:
            return self._log.append(records)
        return self._get_log().addCallback(lambda log: log.append(records))
