"""
A store that answers later: a wrapper over L{MemoryLogStore} whose
C{get}/C{get_or_create}/C{create} and each log's C{append} return Deferreds
held until the test releases or fails them.

This is the shape of the JetStream store (every one of these asks the
cluster), which the memory and file stores, answering at once, never show:
a protocol server that acknowledges before the append it stands for fires,
or drops the append's failure, passes every test against them.  With this
store a test can look between the request and the store's answer: no
acknowledgement may be out yet; after L{Held.release} it carries what the
store gave; after L{Held.fail} it must be the protocol's error.

The inner operation runs only when its hold is released (an append's
records become readable then, and take their position then), like a
store whose synced end moves only when the cluster answered.  Release in
the order asked (L{HeldStore.release_all}) to keep positions in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred

from streamproto.log.memory import MemoryLogStore

#: the operations held unless the test says otherwise
HELD_OPERATIONS = frozenset({"get", "get_or_create", "create", "append"})


class Held:
    """One operation asked of the store, not answered yet."""

    def __init__(self, operation: str, name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any], run: Callable[[], Deferred[Any]]) -> None:
        self.operation = operation
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self._run = run
        self.deferred: Deferred[Any] = Deferred()
        self.answered = False

    def __repr__(self) -> str:
        return f"<Held {self.operation} {self.name}>"

    def release(self) -> None:
        """Run the operation on the inner store and answer with its outcome."""
        self._answer()
        self._run().chainDeferred(self.deferred)

    def fail(self, reason: BaseException) -> None:
        """Answer with C{reason} (the operation never happened)."""
        self._answer()
        self.deferred.errback(reason)

    def _answer(self) -> None:
        assert not self.answered, f"{self!r} answered twice"
        self.answered = True


class HeldLog:
    """An L{ILog} of the inner store whose appends wait for the test."""

    def __init__(self, store: HeldStore, log: Any) -> None:
        self._store = store
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    def append(self, records: Any, *args: Any, **kwargs: Any) -> Deferred[Any]:
        if not isinstance(records, list | tuple):
            records = records.records()     # a RecordBatch: kept for the test to read
        records = [bytes(r) for r in records]
        return self._store._ask("append", self._log.name, (records,) + args, kwargs,
                                lambda: self._log.append(records, *args, **kwargs))


class HeldCalls:
    """
    The test's side of holding calls: what was asked, releasing and
    failing it.  A store mixes this in and routes its calls through
    L{_ask} (L{HeldStore}; a reliable-stream session store in its tests).

    @ivar asked: every L{Held} asked, in order (answered ones too).
    @ivar held: the operations that wait for the test; others run at once.
    """

    asked: list[Held]
    held: set[str]

    def pending(self, operation: str | None = None) -> list[Held]:
        """The operations (of kind C{operation}) not answered yet, in order."""
        return [h for h in self.asked
                if not h.answered and (operation is None or h.operation == operation)]

    def appends(self) -> list[list[bytes]]:
        """The records of each append asked, one list an append, in order (answered or not)."""
        return [h.args[0] for h in self.asked if h.operation == "append"]

    def appended(self) -> list[bytes]:
        """The records of every append asked, in order (answered or not)."""
        return [r for records in self.appends() for r in records]

    def release_all(self, operation: str | None = None) -> int:
        """
        Release what is pending (of kind C{operation}) in the order asked,
        again while releasing asks more.  @return: how many were released.
        """
        count = 0
        while self.pending(operation):
            self.pending(operation)[0].release()
            count += 1
        return count

    def fail_all(self, reason: BaseException, operation: str | None = None) -> int:
        """Fail what is pending (of kind C{operation}) with C{reason}."""
        count = 0
        while self.pending(operation):
            self.pending(operation)[0].fail(reason)
            count += 1
        return count

    def _ask(self, operation: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             run: Callable[[], Deferred[Any]]) -> Deferred[Any]:
        held = Held(operation, name, args, kwargs, run)
        self.asked.append(held)
        if operation not in self.held:
            held.release()
        return held.deferred


class HeldStore(HeldCalls):
    """
    An L{ILogStore} over C{inner} (a fresh L{MemoryLogStore} by default)
    whose operations in C{held} wait for the test; the others pass through.
    """

    def __init__(self, inner: MemoryLogStore | None = None,
                 held: frozenset[str] = HELD_OPERATIONS) -> None:
        self.inner = inner if inner is not None else MemoryLogStore()
        self.held = set(held)
        self.asked = []
        self._wrapped: dict[int, HeldLog] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def wrap(self, log: Any) -> HeldLog:
        """The one L{HeldLog} of the inner log C{log}."""
        if id(log) not in self._wrapped:
            self._wrapped[id(log)] = HeldLog(self, log)
        return self._wrapped[id(log)]

    def _opening(self, operation: str, name: str, *args: Any) -> Deferred[Any]:
        method = getattr(self.inner, operation)
        d = self._ask(operation, name, args, {}, lambda: method(name, *args))
        return d.addCallback(self.wrap)

    def get(self, name: str) -> Deferred[Any]:
        return self._opening("get", name)

    def get_or_create(self, name: str, config: Any = None) -> Deferred[Any]:
        return self._opening("get_or_create", name, config)

    def create(self, name: str, config: Any = None) -> Deferred[Any]:
        return self._opening("create", name, config)

    def open_logs(self) -> list[Any]:
        return [self.wrap(log) for log in self.inner.open_logs()]


def unreachable() -> BaseException:
    """What a JetStream store fails with when the cluster does not answer."""
    from streamproto.log.errors import StoreUnavailable
    return StoreUnavailable("JetStream: no answer within the store's timeout")


__all__ = ["HELD_OPERATIONS", "Held", "HeldCalls", "HeldLog", "HeldStore", "unreachable"]
