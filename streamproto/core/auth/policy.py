"""
The policy file and the decisions: L{Policy} (parsed from TOML), the
L{IAuthorizer} interface every server asks, L{ALLOW_ALL} (no policy), and
the hashed token and password lookups.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import translate
from typing import Any

from zope.interface import Attribute, Interface, implementer

#: the operations a rule may grant
OPS = ("read", "write", "admin")
#: principal kinds a rule may name (besides "anonymous" and globs like "*")
PRINCIPAL_PREFIXES = ("cn:", "san:", "token:", "user:")
ANONYMOUS = "anonymous"
#: decisions a policy remembers (then it starts again): bounds its memory
MAX_CACHED_DECISIONS = 8192
_HASH = re.compile(r"sha256:([0-9a-fA-F]{64})\Z")
_TOP_KEYS = ("tokens", "allow", "users", "pravega")
_RULE_KEYS = ("principal", "logs", "ops")


class PolicyError(ValueError):
    """A policy file that cannot be used; the message says where and why."""


class AuthorizationDenied(Exception):
    """An operation the policy does not allow (already logged and counted)."""


class IAuthorizer(Interface):
    """Answers whether principals may do an operation on a resource."""

    enabled = Attribute("False when there is no policy: everything is allowed.")

    def allows(principals: Sequence[str], op: str, resource: str) -> bool:
        """
        @param principals: the connection's principals (strings).
        @param op: C{"read"}, C{"write"} or C{"admin"}.
        @param resource: a log, stream, segment or endpoint name.
        @return: whether some rule allows it.
        """

    def token_principal(token: str) -> str | None:
        """
        @param token: a bearer token as presented (str).
        @return: C{"token:NAME"} for a known token, else None.  The
            comparison takes the same time whichever hash matches.
        """


def hash_token(token: str | bytes) -> str:
    """The policy file's form of a token: C{sha256:HEX}."""
    if isinstance(token, str):
        token = token.encode("utf-8")
    return "sha256:" + hashlib.sha256(token).hexdigest()


class Rule:
    """One C{[[allow]]} entry."""

    def __init__(self, principal: str, logs: Iterable[str], ops: Iterable[str]) -> None:
        self.principal = principal
        self.logs = tuple(logs)
        self.ops = frozenset(ops)
        self._principal = re.compile(translate(principal), re.DOTALL)
        self._logs = re.compile("|".join(f"(?:{translate(g)})" for g in self.logs) or "(?!)",
                                re.DOTALL)

    def matches(self, principals: Sequence[str], op: str, resource: str) -> bool:
        return (op in self.ops and self._logs.match(resource) is not None
                and any(self._principal.match(p) is not None for p in principals))


@implementer(IAuthorizer)
class Policy:
    """
    A parsed policy.  @ivar rules: the L{Rule}s; @ivar tokens: name ->
    SHA-256 digest (bytes); @ivar users: name -> digest (Pravega
    credentials); @ivar pravega: the C{[pravega]} table.
    """

    enabled = True

    def __init__(self, rules: Iterable[Rule] = (), tokens: Mapping[str, bytes] | None = None,
                 users: Mapping[str, bytes] | None = None,
                 pravega: Mapping[str, Any] | None = None) -> None:
        self.rules = list(rules)
        self.tokens = dict(tokens or {})
        self.users = dict(users or {})
        self.pravega = dict(pravega or {})
        # per operation: rules naming one principal exactly, by principal
        # (most rules: a lookup instead of a scan), and the glob ones
        self._exact: dict[str, dict[str, list[Rule]]] = {op: {} for op in OPS}
        self._globbed: dict[str, list[Rule]] = {op: [] for op in OPS}
        for rule in self.rules:
            for op in rule.ops:
                if any(c in rule.principal for c in "*?["):
                    self._globbed[op].append(rule)
                else:
                    self._exact[op].setdefault(rule.principal, []).append(rule)
        # decisions so far: the policy never changes (a reload makes another)
        self._decided: dict[tuple[tuple[str, ...], str, str], bool] = {}

    def allows(self, principals: Sequence[str], op: str, resource: str) -> bool:
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}")
        key = (tuple(principals), op, resource)
        decided = self._decided.get(key)
        if decided is None:
            decided = self._decide(key[0], op, resource)
            if len(self._decided) >= MAX_CACHED_DECISIONS:
                self._decided.clear()
            self._decided[key] = decided
        return decided

    def _decide(self, principals: Sequence[str], op: str, resource: str) -> bool:
        exact = self._exact[op]
        for principal in principals:
            for rule in exact.get(principal, ()):
                if rule.matches(principals, op, resource):
                    return True
        return any(r.matches(principals, op, resource) for r in self._globbed[op])

    def token_principal(self, token: str) -> str | None:
        return _lookup(self.tokens, token, "token:")

    def user_principal(self, user: str, password: str) -> str | None:
        """C{user:NAME} when C{password} is user C{user}'s, else None."""
        digest = self.users.get(user)
        given = hashlib.sha256(password.encode("utf-8")).digest()
        if digest is None:
            hmac.compare_digest(given, given)  # same work for unknown users
            return None
        return f"user:{user}" if hmac.compare_digest(given, digest) else None

    @classmethod
    def from_toml(cls, text: str, where: str = "policy") -> Policy:
        """
        Parse a policy document.  @raise PolicyError: naming C{where} and
        the key at fault.
        """
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise PolicyError(f"{where}: not valid TOML: {e}")
        return cls.from_document(document, where)

    @classmethod
    def from_document(cls, document: Mapping[str, Any], where: str = "policy") -> Policy:
        for key in document:
            if key not in _TOP_KEYS:
                raise PolicyError(f"{where}: unknown key {key!r} (known: "
                                  f"{', '.join(_TOP_KEYS)})")
        tokens = _hashes(document.get("tokens", {}), f"{where} [tokens]")
        users = _hashes(document.get("users", {}), f"{where} [users]")
        pravega = document.get("pravega", {})
        if not isinstance(pravega, dict):
            raise PolicyError(f"{where}: [pravega] must be a table")
        for key, value in pravega.items():
            if key == "token-secret":
                if not isinstance(value, str) or len(value) < 16:
                    raise PolicyError(f"{where} [pravega]: token-secret must be a string "
                                      "of at least 16 characters")
            elif key == "token-lifetime":
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise PolicyError(f"{where} [pravega]: token-lifetime must be a "
                                      "positive integer (seconds)")
            else:
                raise PolicyError(f"{where} [pravega]: unknown key {key!r} (known: "
                                  "token-secret, token-lifetime)")
        entries = document.get("allow", [])
        if not isinstance(entries, list):
            raise PolicyError(f"{where}: 'allow' must be an array of tables ([[allow]])")
        rules: list[Rule] = []
        for i, entry in enumerate(entries, 1):
            rules.append(_rule(entry, f"{where} [[allow]] #{i}", tokens))
        return cls(rules, tokens, users, pravega)


def _hashes(table: object, where: str) -> dict[str, bytes]:
    if not isinstance(table, dict):
        raise PolicyError(f"{where}: must be a table of NAME = \"sha256:HEX\"")
    digests: dict[str, bytes] = {}
    for name, value in table.items():
        match = _HASH.match(value) if isinstance(value, str) else None
        if match is None:
            raise PolicyError(f"{where}: {name!r} must be \"sha256:\" and 64 hex digits "
                              "(python -m streamproto auth hash-token)")
        digests[name] = bytes.fromhex(match.group(1))
    return digests


def _rule(entry: object, where: str, tokens: Mapping[str, bytes]) -> Rule:
    if not isinstance(entry, dict):
        raise PolicyError(f"{where}: must be a table")
    for key in entry:
        if key not in _RULE_KEYS:
            raise PolicyError(f"{where}: unknown key {key!r} (known: {', '.join(_RULE_KEYS)})")
    for key in _RULE_KEYS:
        if key not in entry:
            raise PolicyError(f"{where}: {key!r} is missing")
    principal = entry["principal"]
    if not isinstance(principal, str) or not principal:
        raise PolicyError(f"{where}: 'principal' must be a non-empty string")
    if not (principal == ANONYMOUS or principal.startswith(PRINCIPAL_PREFIXES)
            or principal == "*"):
        raise PolicyError(f"{where}: principal {principal!r} must be cn:NAME, san:NAME, "
                          "token:NAME, user:NAME, anonymous or *")
    if principal.startswith("token:") and not any(c in principal[6:] for c in "*?[") \
            and principal[6:] not in tokens:
        raise PolicyError(f"{where}: principal {principal!r} names no token of [tokens]")
    logs = entry["logs"]
    if isinstance(logs, str):
        logs = [logs]
    if not isinstance(logs, list) or not all(isinstance(g, str) and g for g in logs):
        raise PolicyError(f"{where}: 'logs' must be a list of glob patterns (strings)")
    ops = entry["ops"]
    if isinstance(ops, str):
        ops = [ops]
    if not isinstance(ops, list) or not ops:
        raise PolicyError(f"{where}: 'ops' must be a list of {', '.join(OPS)}")
    for op in ops:
        if op not in OPS:
            raise PolicyError(f"{where}: unknown op {op!r} (known: {', '.join(OPS)})")
    return Rule(principal, logs, ops)


def _lookup(digests: Mapping[str, bytes], secret: object, prefix: str) -> str | None:
    """
    The principal of the entry whose digest is C{secret}'s: every entry is
    compared (constant time each, no early exit), so the time taken tells
    nothing about which matched.
    """
    if not isinstance(secret, (str, bytes)) or not secret:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8", "surrogateescape")
    given = hashlib.sha256(secret).digest()
    found: str | None = None
    for name, digest in digests.items():
        if hmac.compare_digest(given, digest) and found is None:
            found = name
    return None if found is None else prefix + found


@implementer(IAuthorizer)
class AllowAll:
    """No policy: everything is allowed, and no token is known."""

    enabled = False

    def allows(self, principals: Sequence[str], op: str, resource: str) -> bool:
        return True

    def token_principal(self, token: str) -> str | None:
        return None

    def user_principal(self, user: str, password: str) -> str | None:
        return None


ALLOW_ALL = AllowAll()


def load_policy(path: str) -> Policy:
    """
    @return: the L{Policy} of file C{path}.
    @raise PolicyError: the file cannot be read or is not a valid policy.
    """
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except OSError as e:
        raise PolicyError(f"{path!r}: cannot read it: {e.strerror or e}")
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path!r}: not UTF-8: {e}")
    return Policy.from_toml(text, repr(path))
