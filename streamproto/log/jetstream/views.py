"""
What each module of L{streamproto.log.jetstream} sees of the objects above
it: the parts of a log's work (the append chain, reading, truncation) see
their log as a L{LogView}, and the log and its parts see the store as a
L{StoreView}.  Declared here, at the bottom of the package, so that the
modules form a line (doc/architecture.rst): C{views} and C{common} under
the parts, the parts under the log that assembles them, the log under the
store that opens it; none imports the one above it, not even for its types.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from streamproto.log.bridge import AsyncioThreadBridge
from streamproto.log.config import LogConfig
from streamproto.log.errors import StoreUnavailable
from streamproto.log.msgindex import BodyCache, MessageIndex
from streamproto.log.natsformat import BatchInfo
from streamproto.log.natsio import NatsIO, StoredMsg

__all__ = ["LogView", "StoreView"]

_T = TypeVar("_T")
_P = ParamSpec("_P")


class StoreView(Protocol):
    """
    The L{streamproto.log.jetstream.store.JetStreamLogStore} as its logs
    see it: the cluster's client, the bridge to its loop, the shared body
    cache and the store's settings.
    """

    clock: IReactorTime
    #: seconds for durations, which no step of the wall clock moves
    monotonic: Callable[[], float]
    prefix: str
    timeout: float
    closed: bool
    read_ahead: int
    writer_id: str
    io: NatsIO
    bridge: AsyncioThreadBridge
    cache: BodyCache

    @property
    def max_message_bytes(self) -> int: ...

    def _call(self, coroutine_function: Callable[_P, Coroutine[Any, Any, _T]],
              *args: _P.args, **kwargs: _P.kwargs) -> Deferred[_T]: ...

    # Any: the store keeps its own logs; a part hands back the one it serves
    def _retain(self, log_: Any) -> None: ...


class _Truncating(Protocol):
    def due(self) -> bool: ...


class LogView(Protocol):
    """
    The L{streamproto.log.jetstream.log.JetStreamLog} as the parts of its
    work see it: its fixed facts, its acknowledged state, and the few
    steps of its own a part asks it to take.
    """

    store: StoreView
    name: str
    config: LogConfig
    stream: str
    failed: BaseException | None
    unavailable: StoreUnavailable | None
    _id: int
    _clock: IReactorTime
    _closed: bool
    start_position: int
    start_offset: int
    end_position: int
    end_offset: int
    _attributes: dict[str, int]
    _end_seq: int
    _first_seq: int
    _index: MessageIndex

    @property
    def _truncation(self) -> _Truncating: ...

    def _subject(self, kind: str) -> str: ...

    def _decode(self, msg: StoredMsg) -> BatchInfo: ...

    def _learn(self, info: BatchInfo) -> None: ...

    def _catch_up(self, resolving: bool = False) -> Deferred[None]: ...

    def _fail_stop(self, error: BaseException) -> None: ...

    def _check_position(self, position: int) -> None: ...

    def _check_offset(self, offset: int) -> None: ...

    def position_of_offset(self, offset: int) -> Deferred[int]: ...

    def truncate(self, position: int | None = None) -> Deferred[int]: ...
