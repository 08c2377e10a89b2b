"""
TLS for every server and client.

Servers take endpoint strings.  Twisted's own C{ssl:} (key and certificate
files) and C{tls:} (a directory of PEMs, with SNI) work for server TLS; for
client-certificate verification use our C{mtls:} server endpoint (registered
as a plugin in C{twisted/plugins/streamproto_plugins.py})::

    mtls:8443:privateKey=key.pem:certKey=cert.pem:caCerts=ca.pem:interface=127.0.0.1

C{caCerts} (a PEM file, one or more CA certificates) turns on verification:
a client without a certificate signed by one of them is refused during the
handshake, before any protocol byte is read.  C{requireClientCert=no} asks
for a certificate but lets anonymous clients in.

Clients verify the server with service_identity (through
L{optionsForClientTLS}) against a CA file, or the platform's trust store.
"""

from typing import Any

from OpenSSL import SSL, crypto
from twisted.internet import ssl
from twisted.internet.endpoints import SSL4ServerEndpoint, TCP4ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator, IProtocolNegotiationFactory, IReactorSSL, IReactorTCP,
    IStreamClientEndpoint, IStreamServerEndpointStringParser,
)
from twisted.python.filepath import FilePath
from twisted.plugin import IPlugin
from zope.interface import implementer


def _pem_certificates(path: str) -> list[ssl.Certificate]:
    """Every certificate in a PEM file (a CA bundle may hold several)."""
    data = FilePath(path).getContent()
    marker = b"-----END CERTIFICATE-----"
    certs: list[ssl.Certificate] = []
    for chunk in data.split(marker)[:-1]:
        pem = chunk[chunk.index(b"-----BEGIN CERTIFICATE-----"):] + marker + b"\n"
        certs.append(ssl.Certificate.loadPEM(pem))
    if not certs:
        raise ValueError(f"no PEM certificate in {path}")
    return certs


def server_tls_options(private_key: str, cert: str | None = None, ca_certs: str | None = None,
                       require_client_cert: bool = True,
                       extra_cert_chain: str | None = None) -> ssl.CertificateOptions:
    """
    L{ssl.CertificateOptions} for a server.

    @param private_key: path of a PEM private key (may also hold the cert).
    @param cert: path of the PEM certificate (default: C{private_key}).
    @param ca_certs: path of a PEM bundle of CAs trusted to sign client
        certificates; None for no client verification.
    """
    cert = cert or private_key
    key_pem = FilePath(private_key).getContent()
    cert_pem = FilePath(cert).getContent()
    chain: list[crypto.X509] = []
    if extra_cert_chain:
        chain = [c.original for c in _pem_certificates(extra_cert_chain)]
    kwargs: dict[str, Any] = {}
    if ca_certs:
        kwargs.update(verify=True, caCerts=[c.original for c in _pem_certificates(ca_certs)],
                      requireCertificate=require_client_cert)
    return tolerate_alpn(ssl.CertificateOptions(
        privateKey=crypto.load_privatekey(crypto.FILETYPE_PEM, key_pem),
        certificate=crypto.load_certificate(crypto.FILETYPE_PEM, cert_pem),
        extraCertChain=chain,
        **kwargs,
    ))


def _select_alpn(connection: SSL.Connection, offered: list[bytes]) -> Any:
    """
    Pick the first ALPN protocol the served factory speaks that the client
    offered; with none in common, go on without ALPN (RFC 7301 lets a
    server ignore the extension) instead of Twisted's fatal alert.
    """
    tls_protocol = connection.get_app_data()
    wrapped = getattr(getattr(tls_protocol, "factory", None), "wrappedFactory", None)
    negotiation = IProtocolNegotiationFactory(wrapped, None)
    for name in (negotiation.acceptableProtocols() if negotiation is not None else ()):
        if name in offered:
            return name
    return SSL.NO_OVERLAPPING_PROTOCOLS


def tolerate_alpn(options: ssl.CertificateOptions) -> ssl.CertificateOptions:
    """
    Make server TLS C{options} (L{ssl.CertificateOptions}) accept clients
    that offer ALPN protocols the server does not speak.  Twisted (26.10)
    installs an ALPN callback on every server context that answers "no
    overlap" with a fatal alert, so a client offering, say, C{h2} (curl,
    Go's and Java's HTTP stacks, C{openssl s_client -alpn}) could not reach
    a Lumberjack, Pravega, Relink, reliable or styx/0 server at all.  The
    context is the one every connection of these options uses.

    @return: C{options}
    """
    options.getContext().set_alpn_select_callback(_select_alpn)
    return options


def client_tls_options(hostname: str, ca_certs: str | None = None, cert: str | None = None,
                       private_key: str | None = None) -> IOpenSSLClientConnectionCreator:
    """
    Client TLS options that verify the server's identity (service_identity)
    for C{hostname}, against the CAs in C{ca_certs} (a PEM path) or the
    platform trust store, presenting a client certificate if given.
    """
    trust = None
    if ca_certs:
        certs = _pem_certificates(ca_certs)
        trust = ssl.trustRootFromCertificates(certs)
    client_cert = None
    first = cert or private_key
    if first:
        pem = FilePath(first).getContent()
        if private_key and private_key != cert:
            pem += b"\n" + FilePath(private_key).getContent()
        client_cert = ssl.PrivateCertificate.loadPEM(pem)
    return ssl.optionsForClientTLS(hostname, trustRoot=trust, clientCertificate=client_cert)


def client_endpoint(reactor: IReactorTCP, host: str, port: int,
                    tls: IOpenSSLClientConnectionCreator | None = None,
                    timeout: float = 30) -> IStreamClientEndpoint:
    """
    A client endpoint for C{host:port}, wrapped in TLS when C{tls} (client
    TLS options, e.g. from L{client_tls_options}) is given; C{timeout}:
    seconds to wait for the TCP connection.
    """
    endpoint: IStreamClientEndpoint = TCP4ClientEndpoint(reactor, host, port, timeout=timeout)
    if tls is not None:
        endpoint = wrapClientTLS(tls, endpoint)
    return endpoint


def peer_identity(transport: object) -> dict[str, str] | None:
    """
    The subject common name and the SHA-256 fingerprint of the peer's TLS
    certificate, or None over plain TCP / without a client certificate.
    """
    get = getattr(transport, "getPeerCertificate", None)
    if get is None:
        return None
    try:
        x509 = get()
    except Exception:  # noqa: BLE001 - no TLS layer or handshake not done
        return None
    if x509 is None:
        return None
    subject = x509.get_subject()
    return {
        "cn": subject.commonName,
        "sha256": x509.digest("sha256").decode("ascii"),
    }


@implementer(IPlugin, IStreamServerEndpointStringParser)
class TLSServerParser:
    """C{mtls:PORT:privateKey=..:certKey=..[:caCerts=..][:requireClientCert=no][:interface=..]}"""

    prefix = "mtls"

    # the interface declares (reactor, *args, **kwargs): these are the
    # fields of an mtls: endpoint string
    def parseStreamServer(  # type: ignore[override]
        self, reactor: IReactorSSL, port: str, privateKey: str = "server.pem",
        certKey: str | None = None, caCerts: str | None = None, requireClientCert: str = "yes",
        interface: str = "", backlog: int | str = 50, extraCertChain: str | None = None,
    ) -> SSL4ServerEndpoint:
        options = server_tls_options(
            privateKey, certKey, caCerts,
            require_client_cert=requireClientCert.lower() in ("yes", "true", "1"),
            extra_cert_chain=extraCertChain)
        return SSL4ServerEndpoint(reactor, int(port), options, backlog=int(backlog),
                                  interface=interface)
