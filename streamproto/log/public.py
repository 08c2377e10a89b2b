"""
The servers' internal state is not a public resource.

Some logs hold a server's own state: the Pravega controller's document
(C{pravega-controller}) and every Pravega segment (C{pravega_...}).  They
share the store with the users' logs, but the public APIs (the Styx HTTP
API, C{styx/0}, WebSocket, Spark's "every log", the Lumberjack and Relink
target logs) neither list nor touch them: a log written or deleted behind
Pravega's back leaves Pravega listing a segment that no longer reads, or
a controller whose state does not parse.

The reserved namespace: names starting with C{__} (for internal logs to
come), and, kept as they were so that existing data directories need no
migration, C{pravega-controller} and names starting with C{pravega_}.
L{PublicLogStore} is the view the public APIs get.
"""

from typing import Any, cast

from twisted.internet.defer import Deferred, fail
from zope.interface import alsoProvides, implementer

from streamproto.log.config import LogConfig, name_checked
from streamproto.log.errors import InvalidLogName, LogNotFound
from streamproto.log.interfaces import ILog, ILogDirectories, ILogStore

#: prefixes of the names reserved for the servers' internal state
RESERVED_PREFIXES = ("__", "pravega_")
#: names reserved for the servers' internal state
RESERVED_NAMES = ("pravega-controller",)


def is_internal(name: object) -> bool:
    """Whether log C{name} is in the reserved namespace of internal state."""
    return isinstance(name, str) and (name in RESERVED_NAMES
                                      or name.startswith(RESERVED_PREFIXES))


def check_public_name(name: str) -> str:
    """
    @raise InvalidLogName: if C{name} is reserved for internal state.
    @return: C{name}.
    """
    if is_internal(name):
        raise InvalidLogName(f"log name {name!r} is reserved for the servers' internal state "
                             f"(names starting with {' or '.join(RESERVED_PREFIXES)}, and "
                             f"{', '.join(RESERVED_NAMES)})")
    return name


@implementer(ILogStore)
class PublicLogStore:
    """
    The public view of an L{ILogStore}: internal logs are neither listed
    nor found, and cannot be created or deleted through it.  Everything
    else passes through.
    """

    def __init__(self, store: ILogStore) -> None:
        self.store = store
        if ILogDirectories.providedBy(store):
            # its path (through __getattr__) and log_path, for backups
            alsoProvides(self, ILogDirectories)

    def names(self) -> list[str]:
        return [name for name in self.store.names() if not is_internal(name)]

    @name_checked(lambda self, name: check_public_name(name))
    def create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        return self.store.create(name, config)

    @name_checked(lambda self, name: check_public_name(name))
    def get_or_create(self, name: str, config: LogConfig | None = None) -> Deferred[ILog]:
        return self.store.get_or_create(name, config)

    def get(self, name: str) -> Deferred[ILog]:
        if is_internal(name):
            return fail(LogNotFound(f"log {name!r} not found"))
        return self.store.get(name)

    def delete(self, name: str) -> Deferred[None]:
        if is_internal(name):
            return fail(LogNotFound(f"log {name!r} not found"))
        return self.store.delete(name)

    def open_logs(self) -> list[ILog]:
        return [log for log in self.store.open_logs() if not is_internal(log.name)]

    def problems(self) -> list[str]:
        return self.store.problems()

    def close(self) -> Deferred[None]:
        return self.store.close()

    def log_path(self, name: str) -> str:
        """The directory of a public log (file stores: backups)."""
        if is_internal(name):
            raise LogNotFound(f"log {name!r} not found")
        # only called where the store provides it (see __init__)
        return cast(ILogDirectories, self.store).log_path(name)

    def __getattr__(self, name: str) -> Any:
        # what a particular store offers beyond ILogStore (a file store's
        # path, for restores) passes through
        if name in ("open_log",):
            raise AttributeError(name)
        return getattr(self.store, name)
