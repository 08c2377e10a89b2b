"""
Certificates for TLS tests, made fresh with `cryptography`: a CA, a server
certificate for 127.0.0.1/localhost, a client certificate, and a second CA
(for "certificate from another CA") and an expired client certificate.
"""

import datetime
import ipaddress
import os
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_CACHE = {}


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key):
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert):
    return cert.public_bytes(serialization.Encoding.PEM)


def _ca(cn):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, cn, server, expired=False, san_dns=(), san_uri=()):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    if expired:
        start, end = now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)
    else:
        start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        if san_dns or san_uri:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in san_dns]
                + [x509.UniformResourceIdentifier(u) for u in san_uri]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


class Certs:
    """Paths of PEM files in a temporary directory (made once per process)."""

    def __init__(self, directory):
        self.dir = directory
        ca_key, ca_cert = _ca("streamproto test CA")
        self._ca_key, self._ca_cert = ca_key, ca_cert
        self._clients = {}
        other_key, other_cert = _ca("some other CA")
        self.ca = self._write("ca.pem", _pem_cert(ca_cert))
        self.other_ca = self._write("other-ca.pem", _pem_cert(other_cert))
        k, c = _leaf(ca_key, ca_cert, "localhost", server=True)
        self.server_key = self._write("server.key", _pem_key(k))
        self.server_cert = self._write("server.pem", _pem_cert(c))
        k, c = _leaf(ca_key, ca_cert, "test-client", server=False)
        self.client_key = self._write("client.key", _pem_key(k))
        self.client_cert = self._write("client.pem", _pem_cert(c))
        k, c = _leaf(other_key, other_cert, "intruder", server=False)
        self.other_client_key = self._write("intruder.key", _pem_key(k))
        self.other_client_cert = self._write("intruder.pem", _pem_cert(c))
        k, c = _leaf(ca_key, ca_cert, "expired-client", server=False, expired=True)
        self.expired_client_key = self._write("expired.key", _pem_key(k))
        self.expired_client_cert = self._write("expired.pem", _pem_cert(c))

    def client(self, cn, san_dns=(), san_uri=()):
        """(key path, certificate path) of a client certificate for C{cn} from our CA."""
        spec = (cn, tuple(san_dns), tuple(san_uri))
        if spec not in self._clients:
            k, c = _leaf(self._ca_key, self._ca_cert, cn, server=False, san_dns=san_dns,
                         san_uri=san_uri)
            n = len(self._clients)
            self._clients[spec] = (self._write(f"client-{n}.key", _pem_key(k)),
                                   self._write(f"client-{n}.pem", _pem_cert(c)))
        return self._clients[spec]

    def client_options_for(self, cn, hostname="localhost"):
        """Client TLS options presenting a certificate for C{cn} (from our CA)."""
        from streamproto.core.tls import client_tls_options
        key, cert = self.client(cn)
        return client_tls_options(hostname, ca_certs=self.ca, cert=cert, private_key=key)

    def _write(self, name, data):
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def server_endpoint(self, port=0, client_ca=True):
        """A server endpoint string on 127.0.0.1 (port 0 = any free port)."""
        s = f"mtls:{port}:interface=127.0.0.1:privateKey={self.server_key}:certKey={self.server_cert}"
        if client_ca:
            s += f":caCerts={self.ca}"
        return s.replace("\\", "/")

    def ssl_endpoint(self, port=0):
        """Twisted's own ssl: server endpoint string (no client verification)."""
        return (f"ssl:{port}:interface=127.0.0.1:privateKey={self.server_key}"
                f":certKey={self.server_cert}")

    def client_options(self, with_cert=True, hostname="localhost"):
        from streamproto.core.tls import client_tls_options
        if with_cert:
            return client_tls_options(hostname, ca_certs=self.ca, cert=self.client_cert,
                                      private_key=self.client_key)
        return client_tls_options(hostname, ca_certs=self.ca)


def certs():
    """The process-wide L{Certs}."""
    if "certs" not in _CACHE:
        _CACHE["certs"] = Certs(tempfile.mkdtemp(prefix="streamproto-certs-"))
    return _CACHE["certs"]


def make_client_cert(cn, san_dns=(), san_uri=()):
    """(key path, certificate path) of a client certificate from the test CA."""
    return certs().client(cn, san_dns, san_uri)
