"""
The authorization policy on Pravega (doc/security.rst): who may do what on
the gRPC controller and the segment store, and the delegation tokens that
carry the controller's answer to the segment store.

Resources are C{pravega:SCOPE} (creating, deleting, checking a scope) and
C{pravega:SCOPE/STREAM} (everything about a stream and its segments; a
segment's stream is the first two parts of its qualified name, so a
reader group's stream C{SCOPE/_RGNAME} and a key-value table's segments
C{SCOPE/_tables/...} are resources of their own).

Principals on the controller: C{user:NAME} from the C{authorization}
metadata (C{Basic base64(NAME:PASSWORD)}, as Pravega's basic auth plugin
and the official clients send it; the policy's C{[users]} table holds the
passwords' SHA-256), and the gRPC peer's client certificate (C{cn:},
C{san:}).  Empty credentials (what the Rust client sends without
C{pravega_client_auth_*} settings) are anonymous.

Delegation tokens: C{getDelegationToken} answers a JWT signed with
HMAC-SHA256 (C{HS256}) whose payload is::

    {"sub": "user:NAME", "aud": "segmentstore", "iat": T, "exp": T + lifetime,
     "prn": ["user:NAME", ...], "res": "pravega:SCOPE/STREAM"}

(C{prn}: every principal of the request).  The segment store verifies the
signature and the expiry of the token a command carries, then asks the
policy (the one in force now, so a reload applies at once) whether the
token's principals, with those of the connection's own client
certificate, may do the command's operation on the segment's stream.  A
command without a token is judged on the certificate alone.  Refusals are
C{AuthTokenCheckFailed} (error code 1 for an expired token, so that the
client fetches a new one; 0 otherwise) and nothing is touched.

The secret is C{[pravega] token-secret} of the policy file, shared by every
server that reads the file, or else one made at random when the server
starts (the controller and segment store of one process share it; tokens
do not survive a restart: clients fetch new ones).  The lifetime is
C{[pravega] token-lifetime} seconds (default 600; the Rust client fetches
a new token 5 s before expiry).
"""

import base64
import binascii
import hashlib
import hmac
import json
import os
import time

from streamproto.core.auth import ALLOW_ALL, ANONYMOUS, certificate_principals
from streamproto.core.clock import wall_seconds
from streamproto.pravega import codec

DEFAULT_LIFETIME = 600
#: verified tokens remembered (then forgotten all at once): bounds memory
MAX_VERIFIED = 1024
#: AuthTokenCheckFailed error codes (Pravega's WireCommands.AuthTokenCheckFailed.ErrorCode)
TOKEN_CHECK_FAILED = 0
TOKEN_EXPIRED = 1
_HEADER = {"alg": "HS256", "typ": "JWT"}


class TokenError(Exception):
    """A delegation token that cannot be used.  @ivar code: the wire error code."""

    code = TOKEN_CHECK_FAILED


class TokenExpired(TokenError):
    code = TOKEN_EXPIRED


def _b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text):
    text = text.encode("ascii")
    return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))


def _payload_json(payload):
    """
    The payload's JSON, made to read the same in base64url and in standard
    base64 without padding: the Rust client decodes the payload with the
    standard alphabet and padding to find C{exp}.  In ASCII JSON only the
    last character of a 3-byte group can make sextet 62 or 63 (C{>}, C{?},
    C{~}, DEL), so those are escaped, and spaces pad the JSON to a multiple
    of 3 bytes.
    """
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=True)
    for char in ">?~\x7f":
        text = text.replace(char, "\\u%04x" % ord(char))
    text = text[:-1] + " " * (-len(text) % 3) + "}"
    return text.encode("ascii")


class DelegationTokens:
    """
    Issues and verifies delegation tokens (shared by a controller and the
    segment store of its process).

    @param authorizer: the L{streamproto.core.auth.IAuthorizer}; its
        policy's C{[pravega]} table gives the secret and the lifetime.
    @param clock: anything with C{seconds()} (default: wall-clock time).
    """

    def __init__(self, authorizer=ALLOW_ALL, clock=None, lifetime=None):
        self.authorizer = authorizer
        self.clock = clock
        self._lifetime = lifetime
        self._random_secret = os.urandom(32)
        # tokens verified already: token -> (secret, exp, principals); a
        # reader sends the same token with every ReadSegment
        self._verified = {}

    def _settings(self):
        policy = getattr(self.authorizer, "policy", self.authorizer)
        return getattr(policy, "pravega", {}) or {}

    @property
    def secret(self):
        configured = self._settings().get("token-secret")
        return configured.encode("utf-8") if configured else self._random_secret

    @property
    def lifetime(self):
        if self._lifetime is not None:
            return self._lifetime
        return self._settings().get("token-lifetime", DEFAULT_LIFETIME)

    def _now(self):
        return int(wall_seconds(self.clock)() if self.clock is not None else time.time())

    def _sign(self, signing_input):
        return hmac.new(self.secret, signing_input, hashlib.sha256).digest()

    def issue(self, principals, resource):
        """A signed token for C{principals}, expiring after L{lifetime} seconds."""
        now = self._now()
        principals = list(principals)
        payload = {"sub": principals[0] if principals else ANONYMOUS, "aud": "segmentstore",
                   "iat": now, "exp": now + int(self.lifetime), "prn": principals,
                   "res": resource}
        signing_input = (_b64(json.dumps(_HEADER, separators=(",", ":")).encode())
                         + "." + _b64(_payload_json(payload))).encode("ascii")
        return signing_input.decode("ascii") + "." + _b64(self._sign(signing_input))

    def verify(self, token):
        """
        @return: the principals of a valid token.
        @raise TokenError: malformed, forged (bad signature) or not ours.
        @raise TokenExpired: past its C{exp}.
        """
        secret = self.secret
        known = self._verified.get(token)
        if known is not None and known[0] == secret:
            if known[1] <= self._now():
                raise TokenExpired("delegation token expired")
            return known[2]
        principals, exp = self._verify(token)
        if len(self._verified) >= MAX_VERIFIED:
            self._verified.clear()
        self._verified[token] = (secret, exp, principals)
        return principals

    def _verify(self, token):
        parts = token.split(".") if isinstance(token, str) else []
        if len(parts) != 3:
            raise TokenError("not a delegation token")
        signing_input = (parts[0] + "." + parts[1]).encode("ascii", "replace")
        try:
            signature = _unb64(parts[2])
            header = json.loads(_unb64(parts[0]))
            payload = json.loads(_unb64(parts[1]))
        except (ValueError, binascii.Error, UnicodeError):
            raise TokenError("malformed delegation token")
        if not hmac.compare_digest(signature, self._sign(signing_input)):
            raise TokenError("delegation token signature does not match")
        if header != _HEADER or not isinstance(payload, dict):
            raise TokenError("not a delegation token of ours")
        exp = payload.get("exp")
        principals = payload.get("prn")
        if not isinstance(exp, int) or not isinstance(principals, list) or not all(
                isinstance(p, str) for p in principals):
            raise TokenError("delegation token without exp or principals")
        if exp <= self._now():
            raise TokenExpired("delegation token expired")
        return tuple(principals), exp


# -- resources --------------------------------------------------------------------

def stream_resource(scope, stream=None):
    """C{pravega:SCOPE} or C{pravega:SCOPE/STREAM}."""
    return f"pravega:{scope}" if stream is None else f"pravega:{scope}/{stream}"


def segment_resource(segment):
    """The resource of a qualified segment name (its scope and stream)."""
    parts = segment.split("/")
    if len(parts) >= 2:
        return stream_resource(parts[0], parts[1])
    return stream_resource(segment)


#: the operation of each segment store command that carries a token, and
#: the fields naming the segments it touches
COMMAND_ACCESS = {
    codec.SetupAppend: ("write", ("segment",)),
    codec.UpdateSegmentAttribute: ("write", ("segment",)),
    codec.CreateTransientSegment: ("write", ("parent_segment",)),
    codec.UpdateTableEntries: ("write", ("segment",)),
    codec.RemoveTableKeys: ("write", ("segment",)),
    codec.ReadSegment: ("read", ("segment",)),
    codec.GetStreamSegmentInfo: ("read", ("segment",)),
    codec.GetSegmentAttribute: ("read", ("segment",)),
    codec.ReadTable: ("read", ("segment",)),
    codec.ReadTableKeys: ("read", ("segment",)),
    codec.ReadTableEntries: ("read", ("segment",)),
    codec.ReadTableEntriesDelta: ("read", ("segment",)),
    codec.CreateSegment: ("admin", ("segment",)),
    codec.SealSegment: ("admin", ("segment",)),
    codec.DeleteSegment: ("admin", ("segment",)),
    codec.TruncateSegment: ("admin", ("segment",)),
    codec.MergeSegments: ("admin", ("target", "source")),
    codec.CreateTableSegment: ("admin", ("segment",)),
    codec.DeleteTableSegment: ("admin", ("segment",)),
}
if hasattr(codec, "UpdateSegmentPolicy"):
    COMMAND_ACCESS[codec.UpdateSegmentPolicy] = ("admin", ("segment",))


def command_access(cmd):
    """C{(op, [resources])} a segment store command needs, or None (no check)."""
    entry = COMMAND_ACCESS.get(type(cmd))
    if entry is None:
        return None
    op, fields = entry
    return op, [segment_resource(getattr(cmd, f)) for f in fields]


# -- the controller -------------------------------------------------------------

def _info(request):
    return request.scope, request.stream


def _stream_of(field):
    def get(request):
        info = getattr(request, field)
        return stream_resource(info.scope, info.stream)
    return get


def _of_info(request):
    return stream_resource(*_info(request))


def _scope_of(request):
    return stream_resource(request.scope)


#: gRPC method -> (operation, resource of the request); methods not listed
#: need no permission (getControllerServerList, noteTimestampFromWriter:
#: which names no stream and does nothing here), or filter their answer
#: (listScopes, listStreamsInScope), or decide themselves
#: (getDelegationToken)
METHOD_ACCESS = {
    "createScope": ("admin", _scope_of),
    "deleteScope": ("admin", _scope_of),
    "checkScopeExists": ("read", _scope_of),
    "createStream": ("admin", _stream_of("streamInfo")),
    "updateStream": ("admin", _stream_of("streamInfo")),
    "sealStream": ("admin", _of_info),
    "deleteStream": ("admin", _of_info),
    "truncateStream": ("admin", _stream_of("streamInfo")),
    "scale": ("admin", _stream_of("streamInfo")),
    "getStreamConfiguration": ("read", _of_info),
    "checkStreamExists": ("read", _of_info),
    "getCurrentSegments": ("read", _of_info),
    "getEpochSegments": ("read", _stream_of("streamInfo")),
    "getSegments": ("read", _stream_of("streamInfo")),
    "getSegmentsImmediatelyFollowing": ("read", _stream_of("streamInfo")),
    "getSegmentsImmediatlyFollowing": ("read", _stream_of("streamInfo")),
    "checkScale": ("read", _stream_of("streamInfo")),
    "getSegmentsBetween": ("read", _stream_of("streamInfo")),
    "isStreamCutValid": ("read", _stream_of("streamInfo")),
    "getURI": ("read", _stream_of("streamInfo")),
    "isSegmentValid": ("read", _stream_of("streamInfo")),
    "removeWriter": ("write", _stream_of("stream")),
    "createTransaction": ("write", _stream_of("streamInfo")),
    "commitTransaction": ("write", _stream_of("streamInfo")),
    "abortTransaction": ("write", _stream_of("streamInfo")),
    "pingTransaction": ("write", _stream_of("streamInfo")),
    "checkTransactionState": ("read", _stream_of("streamInfo")),
}


class Unauthenticated(Exception):
    """Credentials that do not check out (a wrong password, an unknown user)."""


def grpc_principals(context, authorizer):
    """
    The principals of a gRPC call: C{user:NAME} of its C{authorization}
    metadata and its peer's client certificate; C{("anonymous",)} without
    either.

    @raise Unauthenticated: for credentials given but wrong (never logged).
    """
    principals = []
    metadata = dict(context.invocation_metadata() or ())
    value = metadata.get("authorization", "")
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, credentials = value.strip().partition(" ")
    if scheme.lower() == "basic" and credentials:
        try:
            user, sep, password = base64.b64decode(credentials.strip(), validate=True) \
                .decode("utf-8").partition(":")
        except (ValueError, binascii.Error, UnicodeError):
            raise Unauthenticated("malformed Basic credentials")
        if user or password:
            principal = authorizer.user_principal(user, password) if sep else None
            if principal is None:
                raise Unauthenticated(f"wrong password or unknown user {user!r}")
            principals.append(principal)
    elif scheme:
        raise Unauthenticated(f"unsupported authorization scheme {scheme!r}")
    principals.extend(_peer_certificate_principals(context))
    return tuple(principals) or (ANONYMOUS,)


def _peer_certificate_principals(context):
    auth = getattr(context, "auth_context", None)
    if auth is None:
        return []
    try:
        properties = auth() or {}
    except Exception:  # noqa: BLE001 - a context without TLS
        return []
    pem = properties.get("x509_pem_cert")
    if pem:
        from cryptography import x509
        try:
            return certificate_principals(x509.load_pem_x509_certificate(pem[0]))
        except ValueError:
            return []
    return ["cn:" + v.decode("utf-8", "replace")
            for v in properties.get("x509_common_name", [])]
