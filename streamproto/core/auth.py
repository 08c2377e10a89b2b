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
it shows neither.  A rule's C{principal} is a glob over them; C{*} matches
everyone, the anonymous too.

The operations: C{read} (read, consume, follow, list), C{write} (append,
produce) and C{admin} (create, delete, truncate, backup, restore).  None
implies another.

L{PolicyHolder} keeps the policy of a file and reloads it on demand (the
servers call L{PolicyHolder.reload} on SIGHUP, see L{watch_sighup}); a file
that does not parse leaves the old policy in force.  Servers ask
L{IAuthorizer}; they report a denial through L{denied}, which logs it with
the principals (never a token) and counts it.
"""

import hashlib
import hmac
import re
import signal
import tomllib
from fnmatch import translate

from twisted.application import service
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

log = Logger()

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

    def allows(principals, op, resource):
        """
        @param principals: the connection's principals (strings).
        @param op: C{"read"}, C{"write"} or C{"admin"}.
        @param resource: a log, stream, segment or endpoint name.
        @return: whether some rule allows it.
        """

    def token_principal(token):
        """
        @param token: a bearer token as presented (str).
        @return: C{"token:NAME"} for a known token, else None.  The
            comparison takes the same time whichever hash matches.
        """


def hash_token(token):
    """The policy file's form of a token: C{sha256:HEX}."""
    if isinstance(token, str):
        token = token.encode("utf-8")
    return "sha256:" + hashlib.sha256(token).hexdigest()


class Rule:
    """One C{[[allow]]} entry."""

    def __init__(self, principal, logs, ops):
        self.principal = principal
        self.logs = tuple(logs)
        self.ops = frozenset(ops)
        self._principal = re.compile(translate(principal), re.DOTALL)
        self._logs = re.compile("|".join(f"(?:{translate(g)})" for g in self.logs) or "(?!)",
                                re.DOTALL)

    def matches(self, principals, op, resource):
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

    def __init__(self, rules=(), tokens=None, users=None, pravega=None):
        self.rules = list(rules)
        self.tokens = dict(tokens or {})
        self.users = dict(users or {})
        self.pravega = dict(pravega or {})
        # per operation: rules naming one principal exactly, by principal
        # (most rules: a lookup instead of a scan), and the glob ones
        self._exact = {op: {} for op in OPS}
        self._globbed = {op: [] for op in OPS}
        for rule in self.rules:
            for op in rule.ops:
                if any(c in rule.principal for c in "*?["):
                    self._globbed[op].append(rule)
                else:
                    self._exact[op].setdefault(rule.principal, []).append(rule)
        # decisions so far: the policy never changes (a reload makes another)
        self._decided = {}

    def allows(self, principals, op, resource):
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

    def _decide(self, principals, op, resource):
        exact = self._exact[op]
        for principal in principals:
            for rule in exact.get(principal, ()):
                if rule.matches(principals, op, resource):
                    return True
        return any(r.matches(principals, op, resource) for r in self._globbed[op])

    def token_principal(self, token):
        return _lookup(self.tokens, token, "token:")

    def user_principal(self, user, password):
        """C{user:NAME} when C{password} is user C{user}'s, else None."""
        digest = self.users.get(user)
        given = hashlib.sha256(password.encode("utf-8")).digest()
        if digest is None:
            hmac.compare_digest(given, given)  # same work for unknown users
            return None
        return f"user:{user}" if hmac.compare_digest(given, digest) else None

    @classmethod
    def from_toml(cls, text, where="policy"):
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
    def from_document(cls, document, where="policy"):
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
        rules = []
        for i, entry in enumerate(entries, 1):
            rules.append(_rule(entry, f"{where} [[allow]] #{i}", tokens))
        return cls(rules, tokens, users, pravega)


def _hashes(table, where):
    if not isinstance(table, dict):
        raise PolicyError(f"{where}: must be a table of NAME = \"sha256:HEX\"")
    digests = {}
    for name, value in table.items():
        match = _HASH.match(value) if isinstance(value, str) else None
        if match is None:
            raise PolicyError(f"{where}: {name!r} must be \"sha256:\" and 64 hex digits "
                              "(python -m streamproto auth hash-token)")
        digests[name] = bytes.fromhex(match.group(1))
    return digests


def _rule(entry, where, tokens):
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


def _lookup(digests, secret, prefix):
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
    found = None
    for name, digest in digests.items():
        if hmac.compare_digest(given, digest) and found is None:
            found = name
    return None if found is None else prefix + found


@implementer(IAuthorizer)
class AllowAll:
    """No policy: everything is allowed, and no token is known."""

    enabled = False

    def allows(self, principals, op, resource):
        return True

    def token_principal(self, token):
        return None

    def user_principal(self, user, password):
        return None


ALLOW_ALL = AllowAll()


def load_policy(path):
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


# -- principals of a connection ---------------------------------------------------

def certificate_principals(x509):
    """
    The principals of a client certificate (a pyOpenSSL X509 or a
    cryptography Certificate): C{cn:} for each subject common name,
    C{san:} for each subjectAltName DNS name and URI.
    """
    from cryptography import x509 as cx509
    from cryptography.x509.oid import NameOID
    cert = x509.to_cryptography() if hasattr(x509, "to_cryptography") else x509
    found = []
    for attribute in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME):
        value = attribute.value
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        found.append("cn:" + value)
    try:
        san = cert.extensions.get_extension_for_class(cx509.SubjectAlternativeName).value
    except cx509.ExtensionNotFound:
        san = None
    if san is not None:
        for name in san.get_values_for_type(cx509.DNSName):
            found.append("san:" + name)
        for name in san.get_values_for_type(cx509.UniformResourceIdentifier):
            found.append("san:" + name)
    return found


def connection_principals(transport, extra=()):
    """
    The principals of a connection: its TLS client certificate's
    (L{certificate_principals}) and C{extra} ones (a token's, a user's),
    or C{("anonymous",)} when it has none.

    @param transport: the connection's transport (anything with
        C{getPeerCertificate()}, or not).
    """
    principals = list(extra)
    get = getattr(transport, "getPeerCertificate", None)
    cert = None
    if get is not None:
        try:
            cert = get()
        except Exception:  # noqa: BLE001 - no TLS layer, or handshake not done
            cert = None
    if cert is not None:
        principals.extend(certificate_principals(cert))
    return tuple(principals) or (ANONYMOUS,)


def describe(principals):
    """Principals for a log line (they hold names, never secrets)."""
    return ",".join(principals)


def denied(server, principals, op, resource, why=""):
    """
    Report a denial: one log line naming the principals, the operation
    and the resource, and C{streamproto_auth_denied_total{server,op}}.
    """
    from streamproto.core.metrics import AUTH_DENIED
    AUTH_DENIED.labels(server, op).inc()
    log.warn("{server}: {op} on {resource!r} denied to {principals}{why}",
             server=server, op=op, resource=resource, principals=describe(principals),
             why=f" ({why})" if why else "")


def is_anonymous(principals):
    return tuple(principals) == (ANONYMOUS,)


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
        if reactor is None:
            from twisted.internet import reactor

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
