"""
Reloading: L{PolicyHolder} (the policy of a file, read again on demand)
and SIGHUP (L{watch_sighup}, installed by L{PolicyService} while a server
runs, never at import).
"""

import signal

from twisted.application import service
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

    def __init__(self, path):
        self.path = path
        self.policy = load_policy(path)

    def reload(self):
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

    def allows(self, principals, op, resource):
        return self.policy.allows(principals, op, resource)

    def token_principal(self, token):
        return self.policy.token_principal(token)

    def user_principal(self, user, password):
        return self.policy.user_principal(user, password)


# -- SIGHUP ----------------------------------------------------------------------

_watched = []
_previous_handler = None


def reload_all():
    """Reload every watched L{PolicyHolder} (what SIGHUP does)."""
    for holder in list(_watched):
        holder.reload()


def watch_sighup(holder, reactor=None):
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
        reactor = default_reactor(reactor)

        def on_hup(signum, frame):
            reactor.callFromThread(reload_all)

        try:
            _previous_handler = signal.signal(signal.SIGHUP, on_hup)
        except ValueError:  # not the main thread (embedded): reload() by hand
            _previous_handler = None


def unwatch_sighup(holder):
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

    def __init__(self, holder):
        self.holder = holder

    def startService(self):
        super().startService()
        watch_sighup(self.holder)

    def stopService(self):
        super().stopService()
        unwatch_sighup(self.holder)
