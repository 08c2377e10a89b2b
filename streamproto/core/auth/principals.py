"""
A connection's principals (the one place a TLS client certificate becomes
C{cn:}/C{san:} names), and reporting a denial (one log line, one metric).
"""

from collections.abc import Iterable, Sequence
from typing import Any

from twisted.logger import Logger

from streamproto.core.auth.policy import ANONYMOUS

log = Logger(namespace="streamproto.core.auth")


def certificate_principals(x509: Any) -> list[str]:
    """
    The principals of a client certificate (a pyOpenSSL X509 or a
    cryptography Certificate): C{cn:} for each subject common name,
    C{san:} for each subjectAltName DNS name and URI.
    """
    from cryptography import x509 as cx509
    from cryptography.x509.oid import NameOID
    cert = x509.to_cryptography() if hasattr(x509, "to_cryptography") else x509
    found: list[str] = []
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


def connection_principals(transport: object, extra: Iterable[str] = ()) -> tuple[str, ...]:
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
        try:
            principals.extend(certificate_principals(cert))
        except Exception as e:  # noqa: BLE001 - an extension cryptography cannot parse
            # the connection gets no certificate principals (so less, never more)
            log.warn("client certificate names unreadable, ignored: {error}", error=e)
    return tuple(principals) or (ANONYMOUS,)


def describe(principals: Iterable[str]) -> str:
    """Principals for a log line (they hold names, never secrets)."""
    return ",".join(principals)


def denied(server: str, principals: Sequence[str], op: str, resource: str,
           why: str = "") -> None:
    """
    Report a denial: one log line naming the principals, the operation
    and the resource, and C{streamproto_auth_denied_total{server,op}}.
    """
    from streamproto.core.metrics import AUTH_DENIED
    AUTH_DENIED.labels(server, op).inc()
    log.warn("{server}: {op} on {resource!r} denied to {principals}{why}",
             server=server, op=op, resource=resource, principals=describe(principals),
             why=f" ({why})" if why else "")


def is_anonymous(principals: Iterable[str]) -> bool:
    return tuple(principals) == (ANONYMOUS,)


