"""Per-log configuration; names and defaults follow the Styx reference."""

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from streamproto.log.errors import InvalidLogName

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
