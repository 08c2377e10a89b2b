"""
Who may do what: one authorization policy for every server.

A policy is a TOML file (C{--auth-policy FILE}, see doc/security.rst)::

    [tokens]                     # bearer tokens, stored hashed
    dashboards = "sha256:9f86d0..."

    [[allow]]
    principal = "cn:ingest-1"    # "san:...", "token:NAME", "anonymous", "*"
    logs = ["beats-*", "events"] # glob patterns over resource names
    ops = ["write"]              # read, write, admin

What no rule allows is denied.  Without a policy (L{ALLOW_ALL}) everything
is allowed, as before policies existed.

A connection's I{principals} are strings: C{cn:NAME} and C{san:NAME} from
its TLS client certificate (L{certificate_principals}), C{token:NAME} for a
bearer token that matches one of the policy's hashes, or C{anonymous} when
it shows neither (and C{user:NAME} for Pravega credentials, see
L{streamproto.pravega.auth}).  A rule's C{principal} is a glob over them; C{*} matches
everyone, the anonymous too.

The operations: C{read} (read, consume, follow, list), C{write} (append,
produce) and C{admin} (create, delete, truncate, backup, restore).  None
implies another.

L{PolicyHolder} keeps the policy of a file and reloads it on demand (the
servers call L{PolicyHolder.reload} on SIGHUP, see L{watch_sighup}); a file
that does not parse leaves the old policy in force.  Servers ask
L{IAuthorizer}; they report a denial through L{denied}, which logs it with
the principals (never a token) and counts it.

Modules: L{policy} (the file, the decisions), L{principals} (a
connection's principals, reporting denials), L{reload} (the holder and
SIGHUP).  Everything is importable from here.
"""

from streamproto.core.auth.policy import (
    ALLOW_ALL, ANONYMOUS, MAX_CACHED_DECISIONS, OPS, PRINCIPAL_PREFIXES, AllowAll,
    AuthorizationDenied, IAuthorizer, Policy, PolicyError, Rule, hash_token, load_policy,
)
from streamproto.core.auth.principals import (
    certificate_principals, connection_principals, denied, describe, is_anonymous,
)
from streamproto.core.auth.reload import (
    PolicyHolder, PolicyService, _watched, reload_all, unwatch_sighup, watch_sighup,
)

__all__ = [
    "ALLOW_ALL", "ANONYMOUS", "MAX_CACHED_DECISIONS", "OPS", "PRINCIPAL_PREFIXES", "AllowAll",
    "AuthorizationDenied", "IAuthorizer", "Policy", "PolicyError", "PolicyHolder",
    "PolicyService", "Rule", "certificate_principals", "connection_principals", "denied",
    "describe", "hash_token", "is_anonymous", "load_policy", "reload_all", "unwatch_sighup",
    "watch_sighup", "_watched",
]
