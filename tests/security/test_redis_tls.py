"""Redis over TLS, configured by files: a rediss:// URL with the CA file gets through, a plaintext client does not,
a client that does not trust the server's CA does not, and a server that demands client certificates admits only
a client presenting one. The services' own stream (EpisodeStream.from_config) goes through the same factory."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from relayrl.common.pb.episode_pb2 import EpisodeGroup
from relayrl.common.redis_conn import sync_client
from relayrl.common.stream import EpisodeStream
from relayrl.config.redis import RedisConfig
from relayrl.config.typed import ConfigError, from_dict
from tests.security.redis_servers import Certificates, make_certificates, password_server, tls_server

pytestmark = pytest.mark.security

ONCE = {"socket_timeout": 2.0, "retry": Retry(NoBackoff(), 0)}  # a refusal at once (redis-py retries it by default)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


def _tls(port: int, certs: Certificates, ca: Path | None = None, client: bool = False) -> RedisConfig:
    return RedisConfig(
        url=f"rediss://127.0.0.1:{port}/0",
        tls_ca_file=str(ca or certs.ca.cert),
        tls_cert_file=str(certs.client.cert) if client else "",
        tls_key_file=str(certs.client.key) if client else "",
    )


def test_tls_client_with_the_ca_file_is_served(certs: Certificates) -> None:
    with tls_server(certs, auth_clients=False) as port:
        client = sync_client(_tls(port, certs), **ONCE)
        client.set("relayrl:probe", b"over tls")

        value = client.get("relayrl:probe")

    assert value == b"over tls"


def test_plaintext_client_gets_nothing_from_a_tls_only_server(certs: Certificates) -> None:
    with tls_server(certs, auth_clients=False) as port:
        plaintext = sync_client(RedisConfig(url=f"redis://127.0.0.1:{port}/0"), **ONCE)

        with pytest.raises(redis.exceptions.ConnectionError):
            plaintext.ping()


def test_client_that_does_not_trust_the_servers_ca_refuses_the_connection(certs: Certificates) -> None:
    with tls_server(certs, auth_clients=False) as port:
        untrusting = sync_client(_tls(port, certs, ca=certs.other_ca.cert), **ONCE)

        with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
            untrusting.ping()


def test_server_that_demands_client_certificates_admits_only_a_client_with_one(certs: Certificates) -> None:
    with tls_server(certs, auth_clients=True) as port:
        anonymous = sync_client(_tls(port, certs), **ONCE)
        with pytest.raises(redis.exceptions.ConnectionError):
            anonymous.ping()

        answered = sync_client(_tls(port, certs, client=True), **ONCE).ping()

    assert answered is True


async def test_the_services_stream_round_trips_a_group_over_tls(certs: Certificates) -> None:
    async def go(port: int) -> list[str]:
        stream = EpisodeStream.from_config(_tls(port, certs, client=True), "tls")
        try:
            await stream.ensure_group()
            await stream.append(EpisodeGroup(group_id="g-tls"))
            return [e.group.group_id for e in await stream.read("rank0", count=10, block_ms=1000)]
        finally:
            await stream.close()

    with tls_server(certs, auth_clients=True) as port:
        read = await go(port)

    assert read == ["g-tls"]


async def test_the_services_stream_presents_the_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go(port: int) -> int:
        stream = EpisodeStream.from_config(RedisConfig(url=f"redis://127.0.0.1:{port}/0"), "tls")
        try:
            await stream.append(EpisodeGroup(group_id="g-auth"))
            return (await stream.info()).length
        finally:
            await stream.close()

    with password_server("stream-secret") as (port, _):
        with pytest.raises(redis.exceptions.AuthenticationError):
            await go(port)
        monkeypatch.setenv("RELAYRL_REDIS_PASSWORD", "stream-secret")

        length = await go(port)

    assert length == 1


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"tls_ca_file": "/nonexistent/ca.pem"}, "redis.tls_ca_file"),
        ({"tls_cert_file": "{cert}"}, "redis.tls_key_file"),  # a client certificate without its key
        ({"url": "redis://127.0.0.1:6379/0", "tls_ca_file": "{ca}"}, "redis.url"),  # TLS files, plaintext URL
    ],
)
def test_tls_settings_that_cannot_work_are_refused_at_start_up_naming_the_field(
    certs: Certificates, section: dict[str, str], field: str
) -> None:
    values = {k: v.format(cert=certs.client.cert, ca=certs.ca.cert) for k, v in section.items()}

    with pytest.raises(ConfigError) as err:
        from_dict(RedisConfig, values, "redis")

    assert err.value.field == field


def test_tls_files_with_a_plaintext_url_from_the_environment_are_refused(
    certs: Certificates, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAYRL_REDIS_URL", "redis://:hunter2@127.0.0.1:6379/0")

    with pytest.raises(ConfigError, match="rediss://") as err:
        RedisConfig(tls_ca_file=str(certs.ca.cert)).require_url()

    assert "hunter2" not in str(err.value)
