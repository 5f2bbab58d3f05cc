"""TLS and mutual TLS on gRPC: who can talk to a TLS server and who cannot, with certificates made per test.

The attacks: a client on the network talking plaintext to a server that should only speak TLS; a client without a
certificate, or with one from another CA, calling a server that demands mutual TLS; a server impersonating
another (a certificate from a CA the client does not trust, or for another name); and a downgrade, a TLS client
that would fall back to plaintext.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.client import RewardClient
from relayrl.common.grpc_utils import channel, create_server, health_status
from relayrl.common.pb import reward_pb2
from relayrl.config.endpoints import ServerConfig
from relayrl.config.tls import TlsConfig
from tests.integration.helpers import reward_server
from tests.tls_certs import CertificateAuthority, Pem

pytestmark = pytest.mark.security


@dataclass
class Pki:
    ca: CertificateAuthority
    server: Pem  # 127.0.0.1 and localhost, serverAuth + clientAuth
    client: Pem  # clientAuth only, from the same CA
    other_ca: CertificateAuthority
    other_client: Pem  # clientAuth, signed by the other CA

    def server_tls(self, mutual: bool = False) -> TlsConfig:
        return TlsConfig(
            cert_file=str(self.server.cert),
            key_file=str(self.server.key),
            ca_file=str(self.ca.ca_file),
            require_client_cert=mutual,
        )

    def client_tls(
        self, cert: Pem | None = None, ca: CertificateAuthority | None = None, server_name: str = ""
    ) -> TlsConfig:
        return TlsConfig(
            ca_file=str((ca or self.ca).ca_file),
            client_cert_file=str(cert.cert) if cert else "",
            client_key_file=str(cert.key) if cert else "",
            server_name=server_name,
        )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertificateAuthority.create(tmp_path / "ca")
    other = CertificateAuthority.create(tmp_path / "other", name="another CA")
    return Pki(ca, ca.issue("server"), ca.issue("client", server=False), other, other.issue("intruder", server=False))


@asynccontextmanager
async def health_server(tls: TlsConfig | None) -> AsyncIterator[str]:
    """A real gRPC server on port 0 with the standard health service, built by the services' create_server."""
    handle = create_server(ServerConfig(port=0), [], ["relayrl.v1.Probe"], tls)
    await handle.start()
    try:
        yield f"127.0.0.1:{handle.port}"
    finally:
        await handle.stop(0)


async def _check(target: str, tls: TlsConfig | None) -> grpc.StatusCode:
    """One health Check over a fresh channel: OK, or the status code of the failure."""
    async with channel(target, tls) as ch:
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


async def _outcome(server: TlsConfig | None, client: TlsConfig | None) -> grpc.StatusCode:
    async def go() -> grpc.StatusCode:
        async with health_server(server) as target:
            return await _check(target, client)

    return await go()


async def test_tls_server_answers_a_client_that_trusts_its_ca(pki: Pki) -> None:
    assert await _outcome(pki.server_tls(), pki.client_tls()) == grpc.StatusCode.OK


async def test_plaintext_client_is_refused_by_a_tls_server(pki: Pki) -> None:
    assert await _outcome(pki.server_tls(), None) == grpc.StatusCode.UNAVAILABLE


async def test_tls_client_does_not_fall_back_to_plaintext_server(pki: Pki) -> None:
    assert await _outcome(None, pki.client_tls()) == grpc.StatusCode.UNAVAILABLE


async def test_client_that_does_not_trust_the_servers_ca_refuses_it(pki: Pki) -> None:
    assert await _outcome(pki.server_tls(), pki.client_tls(ca=pki.other_ca)) == grpc.StatusCode.UNAVAILABLE


async def test_client_refuses_a_certificate_for_another_name(pki: Pki) -> None:
    elsewhere = pki.ca.issue("elsewhere", hosts=("inference.internal",))  # right CA, wrong name
    server = TlsConfig(cert_file=str(elsewhere.cert), key_file=str(elsewhere.key))

    assert await _outcome(server, pki.client_tls()) == grpc.StatusCode.UNAVAILABLE


async def test_server_name_override_accepts_the_certificates_name_on_an_ip_address(pki: Pki) -> None:
    elsewhere = pki.ca.issue("elsewhere", hosts=("inference.internal",))
    server = TlsConfig(cert_file=str(elsewhere.cert), key_file=str(elsewhere.key))

    assert await _outcome(server, pki.client_tls(server_name="inference.internal")) == grpc.StatusCode.OK


async def test_mutual_tls_refuses_a_client_without_a_certificate(pki: Pki) -> None:
    assert await _outcome(pki.server_tls(mutual=True), pki.client_tls()) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_a_client_certificate_from_another_ca(pki: Pki) -> None:
    intruder = pki.client_tls(cert=pki.other_client)

    assert await _outcome(pki.server_tls(mutual=True), intruder) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_accepts_a_client_certificate_from_its_ca(pki: Pki) -> None:
    assert await _outcome(pki.server_tls(mutual=True), pki.client_tls(cert=pki.client)) == grpc.StatusCode.OK


async def test_mutual_tls_service_presents_its_own_certificate_as_a_client(pki: Pki) -> None:
    # one tls section for a whole run: the services' channels present cert_file when no client cert is set
    assert await _outcome(pki.server_tls(mutual=True), pki.server_tls(mutual=True)) == grpc.StatusCode.OK


async def test_blocking_health_check_speaks_tls_and_is_refused_in_plaintext(pki: Pki) -> None:
    async def go() -> tuple[tuple[bool, str], tuple[bool, str]]:
        async with health_server(pki.server_tls(mutual=True)) as target:
            secure = await asyncio.to_thread(health_status, target, 10.0, "", pki.client_tls(cert=pki.client))
            plain = await asyncio.to_thread(health_status, target, 10.0, "", None)
            return secure, plain

    secure, plain = await go()

    assert secure == (True, "SERVING")
    assert plain[0] is False and plain[1].startswith("UNAVAILABLE")


async def test_reward_service_over_mutual_tls_scores_for_a_client_with_a_certificate_only(pki: Pki) -> None:
    request = reward_pb2.ScoreRequest(episode_id="e1", prompt="1+2=", completion="3", reference="3")

    async def go() -> tuple[float, grpc.StatusCode]:
        async with reward_server(tls=pki.server_tls(mutual=True)) as (target, _):
            async with RewardClient(target, tls=pki.client_tls(cert=pki.client)) as client:
                score = (await client.score(request, timeout_s=30)).score
            async with RewardClient(target, retries=0, tls=pki.client_tls()) as no_cert:
                try:
                    await no_cert.score(request, timeout_s=30)
                except grpc.aio.AioRpcError as exc:
                    return score, exc.code()
            return score, grpc.StatusCode.OK

    score, refused = await go()

    assert score == 1.0
    assert refused == grpc.StatusCode.UNAVAILABLE
