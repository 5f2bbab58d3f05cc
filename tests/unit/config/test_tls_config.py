"""The tls section: plaintext by default, start-up errors that name the field, files read without showing them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relayrl.config import load_run_config
from relayrl.config.tls import TlsConfig
from relayrl.config.typed import ConfigError, from_dict
from tests.tls_certs import CertificateAuthority

FILE_FIELDS = ("cert_file", "key_file", "ca_file", "client_cert_file", "client_key_file")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.create(tmp_path_factory.mktemp("pki"))


def _config(tmp_path: Path, tls: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"tls:\n{tls}\n")
    return path


def test_default_run_config_has_tls_off() -> None:
    cfg = load_run_config(None)

    assert cfg.tls == TlsConfig()
    assert cfg.tls.enabled is False


def test_run_config_with_cert_key_and_ca_turns_tls_on(tmp_path: Path, ca: CertificateAuthority) -> None:
    pem = ca.issue("svc")
    path = _config(
        tmp_path,
        f"  cert_file: {pem.cert}\n  key_file: {pem.key}\n  ca_file: {ca.ca_file}\n  require_client_cert: true",
    )

    tls = load_run_config(path).tls

    assert tls.enabled and tls.require_client_cert
    files = tls.read()
    assert files.cert == pem.cert.read_bytes() and files.key == pem.key.read_bytes()
    assert files.ca == ca.ca_file.read_bytes() and files.client_cert is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"key_file": "k.pem"}, "tls.key_file"),
        ({"cert_file": "c.pem"}, "tls.key_file"),
        ({"client_key_file": "k.pem", "ca_file": "ca.pem"}, "tls.client_key_file"),
        ({"client_cert_file": "c.pem"}, "tls.client_key_file"),
        ({"cert_file": "c.pem", "key_file": "k.pem", "require_client_cert": True}, "tls.ca_file"),
        ({"ca_file": "ca.pem", "require_client_cert": True}, "tls.cert_file"),
        ({"server_name": "inference.internal"}, "tls.server_name"),
    ],
)
def test_inconsistent_tls_section_is_refused_naming_the_field(
    tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    body = "\n".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items())

    with pytest.raises(ConfigError) as err:
        load_run_config(_config(tmp_path, body))

    assert err.value.field == named


def test_missing_file_is_a_config_error_naming_the_field(tmp_path: Path, ca: CertificateAuthority) -> None:
    tls = TlsConfig(
        ca_file=str(ca.ca_file), client_cert_file=str(ca.ca_file), client_key_file=str(tmp_path / "gone.pem")
    )

    with pytest.raises(ConfigError, match="no such file") as err:
        tls.read()

    assert err.value.field == "tls.client_key_file"


def test_directory_instead_of_a_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="directory") as err:
        TlsConfig(ca_file=str(tmp_path)).read()

    assert err.value.field == "tls.ca_file"


def test_unreadable_path_is_a_config_error_naming_the_field(ca: CertificateAuthority) -> None:
    below_a_file = ca.ca_file / "ca.pem"  # an OSError other than "no such file", also for root

    with pytest.raises(ConfigError, match="cannot be read: Not a directory") as err:
        TlsConfig(ca_file=str(below_a_file)).read()

    assert err.value.field == "tls.ca_file"


def test_key_where_a_certificate_belongs_is_refused_without_showing_the_key(ca: CertificateAuthority) -> None:
    pem = ca.issue("svc")
    tls = TlsConfig(cert_file=str(pem.key), key_file=str(pem.key))  # the key named as the certificate

    with pytest.raises(ConfigError, match="PEM certificate") as err:
        tls.read()

    assert err.value.field == "tls.cert_file"
    body = pem.key.read_text().splitlines()[1]  # a line of the key's base64
    assert body not in str(err.value)


def test_files_read_never_show_their_bytes_in_a_repr(ca: CertificateAuthority) -> None:
    pem = ca.issue("svc")

    files = TlsConfig(cert_file=str(pem.cert), key_file=str(pem.key)).read()

    assert files.key is not None and b"PRIVATE KEY" in files.key
    assert "PRIVATE" not in repr(files) and "BEGIN" not in repr(files)


def test_world_readable_key_is_read_with_a_warning(ca: CertificateAuthority, caplog: pytest.LogCaptureFixture) -> None:
    pem = ca.issue("loose")
    pem.key.chmod(0o644)

    with caplog.at_level(logging.WARNING, logger="relayrl.config.tls"):
        files = TlsConfig(cert_file=str(pem.cert), key_file=str(pem.key)).read()

    assert files.key is not None
    assert [r.getMessage() for r in caplog.records] == [
        f"tls.key_file ({pem.key}) is readable by every user on this machine; make it 0600"
    ]


def test_resolved_section_holds_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    tls = TlsConfig(cert_file="c.pem", key_file="k.pem", ca_file="ca.pem").resolved()

    assert (tls.cert_file, tls.key_file, tls.ca_file) == tuple(str(tmp_path / n) for n in ("c.pem", "k.pem", "ca.pem"))
    assert tls.client_cert_file == "" and tls.client_key_file == ""


@given(set_fields=st.sets(st.sampled_from(FILE_FIELDS)), mutual=st.booleans(), named=st.booleans())
def test_any_tls_section_is_accepted_or_refused_naming_one_of_its_fields(
    set_fields: set[str], mutual: bool, named: bool
) -> None:
    data: dict[str, object] = {f: f"{f}.pem" for f in set_fields}
    data.update(require_client_cert=mutual, server_name="svc" if named else "")

    try:
        tls = from_dict(TlsConfig, data, "tls")
    except ConfigError as exc:
        assert exc.field.removeprefix("tls.") in {*FILE_FIELDS, "server_name"}
        return
    # accepted: every certificate comes with its key, mutual TLS has its CA and certificate
    assert ("cert_file" in set_fields) == ("key_file" in set_fields)
    assert ("client_cert_file" in set_fields) == ("client_key_file" in set_fields)
    assert not mutual or {"ca_file", "cert_file"} <= set_fields
    assert not named or tls.enabled


async def test_server_with_tls_on_but_no_certificate_is_refused_at_start_up(ca: CertificateAuthority) -> None:
    from relayrl.common.grpc_utils import create_server
    from relayrl.config.endpoints import ServerConfig

    async def start() -> None:  # an aio server is made on a running loop, as in the services
        create_server(ServerConfig(port=0), [], [], TlsConfig(ca_file=str(ca.ca_file)))  # a client-only section

    with pytest.raises(ConfigError, match="needs a certificate and its key") as err:
        await start()

    assert err.value.field == "tls.cert_file"
