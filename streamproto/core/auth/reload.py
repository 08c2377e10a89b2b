"""
Reloading: L{PolicyHolder} (the policy of a file, read again on demand)
and SIGHUP (L{watch_sighup}, installed by L{PolicyService} while a server
runs, never at import).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, cast

from twisted.application import service
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.core.auth.policy import IAuthorizer, PolicyError, load_policy

log = Logger(namespace="streamproto.core.auth")


@implementer(IAuthorizer)
class PolicyHolder:
    """
    The policy of a file, reloaded by L{reload} (on SIGHUP): connections
    keep running, and their next request is decided by the new policy.

    @ivar policy: the L{Policy} in force.
    """

    enabled = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.policy = load_policy(path)

    def reload(self) -> bool:
        """
        Read the file again.  @return: True if the new policy is in force;
        False if it did not parse (the old one stays, and the reason is
        logged).
        """
        try:
            policy = load_policy(self.path)
        except PolicyError as e:
            log.error("auth policy not reloaded, the previous one stays in force: {error}",
                      error=str(e))
            return False
        self.policy = policy
        log.info("auth policy reloaded from {path}: {rules} rules, {tokens} tokens",
                 path=self.path, rules=len(policy.rules), tokens=len(policy.tokens))
        return True

    def allows(self, principals: Sequence[str], op: str, resource: str) -> bool:
        return self.policy.allows(principals, op, resource)

    def token_principal(self, token: str) -> str | None:
        return self.policy.token_principal(token)

    def user_principal(self, user: str, password: str) -> str | None:
        return self.policy.user_principal(user, password)


# -- SIGHUP ----------------------------------------------------------------------

_watched: list[PolicyHolder] = []
# what signal.signal returned: a handler, SIG_DFL/SIG_IGN, or None
_previous_handler: Callable[[int, FrameType | None], Any] | int | None = None


def reload_all() -> None:
    """Reload every watched L{PolicyHolder} (what SIGHUP does)."""
    for holder in list(_watched):
        holder.reload()


def watch_sighup(holder: PolicyHolder, reactor: IReactorFromThreads | None = None) -> None:
    """
    Reload C{holder} on SIGHUP.  The signal handler is installed once, by
    the first holder watched (servers call this when they start, never at
    import); the reload runs in the reactor thread.
    """
    global _previous_handler
    if holder in _watched:
        return
    _watched.append(holder)
    if len(_watched) == 1 and hasattr(signal, "SIGHUP"):
        calls = cast(IReactorFromThreads, default_reactor(reactor))

        def on_hup(signum: int, frame: FrameType | None) -> None:
            calls.callFromThread(reload_all)

        try:
            _previous_handler = signal.signal(signal.SIGHUP, on_hup)
        except ValueError:  # not the main thread (embedded): reload() by hand
            _previous_handler = None


def unwatch_sighup(holder: PolicyHolder) -> None:
    global _previous_handler
    if holder in _watched:
        _watched.remove(holder)
    if not _watched and _previous_handler is not None:
        try:
            signal.signal(signal.SIGHUP, _previous_handler)
        except ValueError:
            pass
        _previous_handler = None



class PolicyService(service.Service):
    """
    Makes a server's L{PolicyHolder} reload on SIGHUP while the server runs
    (a child of the server's service).
    """

    def __init__(self, holder: PolicyHolder) -> None:
        self.holder = holder

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        watch_sighup(self.holder)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        unwatch_sighup(self.holder)
