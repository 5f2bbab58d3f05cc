"""Real redis-servers for the Redis security tests: one that requires a password, one that speaks only TLS, and the
certificates the TLS one needs (a throwaway CA, a server certificate for 127.0.0.1, a client certificate), made
with the ``cryptography`` package."""

from __future__ import annotations

import datetime
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from relayrl.local_redis import secret_config
from tests.conftest import free_port, wait_for_redis


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:  # never skip: CI must go red when Redis is missing
        pytest.fail("redis-server is not installed: run scripts/ensure_system_deps.sh")
    return binary


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    pem = Pem(folder / f"{stem}.crt", folder / f"{stem}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pem.key.chmod(0o600)
    return pem


def make_ca(folder: Path, stem: str) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(_name(stem))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key), cert, key


def make_leaf(
    folder: Path, stem: str, ca: tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey], server: bool
) -> Pem:
    _, ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.ExtendedKeyUsage(
                [x509.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(IPv4Address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
    return _write(folder, stem, builder.sign(ca_key, hashes.SHA256()), key)


@dataclass(frozen=True)
class Certificates:
    ca: Pem  # signed the server's and the client's certificates
    server: Pem
    client: Pem
    other_ca: Pem  # trusted by nobody here


def make_certificates(folder: Path) -> Certificates:
    folder.mkdir(parents=True, exist_ok=True)
    ca = make_ca(folder, "relayrl-test-ca")
    other = make_ca(folder, "someone-elses-ca")
    return Certificates(
        ca[0], make_leaf(folder, "server", ca, server=True), make_leaf(folder, "client", ca, server=False), other[0]
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


@contextmanager
def password_server(password: str, extra: list[str] | None = None) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A loopback redis-server whose ``requirepass`` (and nothing else) comes on its stdin."""
    port = free_port()
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *(extra or []), "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    proc.stdin.write(secret_config(password))
    proc.stdin.close()
    try:
        wait_for_redis(proc, redis.Redis(port=port, password=password, socket_timeout=1.0))
        yield port, proc
    finally:
        _stop(proc)


@contextmanager
def tls_server(certs: Certificates, auth_clients: bool) -> Iterator[int]:
    """A redis-server that listens only with TLS (``--port 0``) on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--tls-cert-file",
            str(certs.server.cert),
            "--tls-key-file",
            str(certs.server.key),
            "--tls-ca-cert-file",
            str(certs.ca.cert),
            "--tls-auth-clients",
            "yes" if auth_clients else "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_redis(
            proc,
            redis.Redis(
                port=port,
                ssl=True,
                ssl_ca_certs=str(certs.ca.cert),
                ssl_certfile=str(certs.client.cert),
                ssl_keyfile=str(certs.client.key),
                socket_timeout=1.0,
            ),
        )
        yield port
    finally:
        _stop(proc)
