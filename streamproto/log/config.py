"""Per-log configuration; names and defaults follow the Styx reference."""

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Concatenate, ParamSpec, TypeVar

from twisted.internet.defer import Deferred, fail

from streamproto.log.errors import InvalidLogName

_S = TypeVar("_S")
_T = TypeVar("_T")
_P = ParamSpec("_P")

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_NAME_LENGTH = 200


def validate_name(name: object) -> str:
    """
    @raise InvalidLogName: unless C{name} is a safe log name (it can never
        escape the store directory: no dots, no slashes).
    """
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH \
            or not NAME_PATTERN.match(name):
        raise InvalidLogName(f"invalid log name: {name!r}")
    return name


def name_checked(check: Callable[[Any, str], object]) -> Callable[
        [Callable[Concatenate[_S, str, _P], Deferred[_T]]],
        Callable[Concatenate[_S, str, _P], Deferred[_T]]]:
    """
    Decorate a store method whose first argument is a log name so that
    C{check(store, name)} runs first: a name it refuses (L{InvalidLogName})
    is a failed Deferred, as L{ILogStore} promises, and the method never
    runs.  Why a decorator: a store checks the same name on every call that
    can create or open a log, and a call that forgot would be a hole.
    """
    def decorate(method: Callable[Concatenate[_S, str, _P], Deferred[_T]],
                 ) -> Callable[Concatenate[_S, str, _P], Deferred[_T]]:
        @functools.wraps(method)
        def checked(self: _S, name: str, /, *args: _P.args, **kwargs: _P.kwargs) -> Deferred[_T]:
            try:
                check(self, name)
            except InvalidLogName as e:
                return fail(e)
            return method(self, name, *args, **kwargs)
        return checked
    return decorate


@dataclass(frozen=True)
class LogConfig:
    """
    The Styx reference's log options.  -1 means unlimited.  Ages are seconds.
    """

    max_record_size: int = 1048576
    index_after_size: int = 1048576
    segment_max_count: int = -1
    segment_max_size: int = 1073741824
    segment_max_age: int = -1
    log_max_count: int = -1
    log_max_size: int = -1
    log_max_age: int = -1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{f.name} must be an integer")
        if self.max_record_size < 1 or self.max_record_size > 0x7FFFFFFF:
            raise ValueError("max_record_size must be in 1..2147483647")
        if self.index_after_size < 1:
            raise ValueError("index_after_size must be positive")
        if self.segment_max_size < 1 and self.segment_max_size != -1:
            raise ValueError("segment_max_size must be positive or -1")
        for name in ("segment_max_count", "segment_max_age", "log_max_count",
                     "log_max_size", "log_max_age"):
            v = getattr(self, name)
            if v < -1 or v == 0:
                raise ValueError(f"{name} must be positive or -1")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "LogConfig":
        """Build from a dict of str -> str|int, ignoring unknown keys."""
        kwargs: dict[str, int] = {}
        for name in cls.field_names():
            if name in mapping and mapping[name] not in (None, ""):
                try:
                    kwargs[name] = int(mapping[name])
                except (TypeError, ValueError):
                    raise ValueError(f"{name} must be an integer")
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
