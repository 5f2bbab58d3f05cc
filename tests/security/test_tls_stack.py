"""The whole local stack (`relayrl run`) with mutual TLS from one tls section: the launcher's health checks, the
services' channels to one another (generation, scores, trainer status, weight pushes), the client library and the
CLI (health, status, control) all speak TLS; a plaintext client, or one without a client certificate, is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from relayrl.client import InferenceClient
from relayrl.common.pb import inference_pb2
from relayrl.config import load_run_config
from relayrl.config.tls import TlsConfig
from tests.conftest import REPO
from tests.polling import wait_for
from tests.tls_certs import CertificateAuthority

pytestmark = [pytest.mark.security, pytest.mark.integration, pytest.mark.slow]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


async def _generate(target: str, tls: TlsConfig | None) -> inference_pb2.GenerateResponse | grpc.StatusCode:
    async with InferenceClient(target, retries=0, tls=tls) as client:
        try:
            return await client.generate("1+2=", inference_pb2.SamplingParams(n=2, max_new_tokens=2), timeout_s=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def _served_version(target: str, tls: TlsConfig) -> int:
    async with InferenceClient(target, tls=tls) as client:
        return int((await client.status()).weight_version)


async def test_local_stack_with_mutual_tls_trains_and_refuses_plaintext_and_certless_clients(
    tmp_path: Path, demo_model: Path
) -> None:
    ca = CertificateAuthority.create(tmp_path / "pki")
    svc = ca.issue("svc")  # the services' certificate, for 127.0.0.1 (where the launcher puts them)
    out = tmp_path / "run"
    tls_args = [
        f"tls.cert_file={svc.cert}",
        f"tls.key_file={svc.key}",
        f"tls.ca_file={ca.ca_file}",
        "tls.require_client_cert=true",
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            "examples/quickstart.yaml",
            "--out",
            str(out),
            *(a for s in [f"model.path={demo_model}", "trainer.total_steps=100000", *tls_args] for a in ("--set", s)),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = out / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, "training", alive=proc)
        cfg = load_run_config(out / "config.yaml")
        target, tls = cfg.inference.server.target, cfg.tls
        without_cert = TlsConfig(ca_file=tls.ca_file)

        served = await _served_version(target, tls)
        answer = await _generate(target, tls)
        plaintext = await _generate(target, None)
        certless = await _generate(target, without_cert)
        status = _cli("status", str(out), "--json")
        paused = _cli("control", "pause", str(out), "--reason", "tls test")  # the run folder's token and tls
        health_plain = _cli("health", "--target", target, "--timeout", "5")
        health_tls = _cli(
            "health",
            "--target",
            target,
            "--timeout",
            "5",
            "--tls-ca",
            str(ca.ca_file),
            "--tls-cert",
            str(svc.cert),
            "--tls-key",
            str(svc.key),
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)

    assert served >= 1  # the trainer's weight pushes reached inference over mutual TLS
    assert isinstance(answer, inference_pb2.GenerateResponse) and len(answer.samples) == 2
    assert plaintext == grpc.StatusCode.UNAVAILABLE
    assert certless == grpc.StatusCode.UNAVAILABLE
    services = json.loads(status.stdout)["services"]
    assert status.returncode == 0 and all("error" not in s for s in services.values()), status.stdout
    assert paused.returncode == 0 and json.loads(paused.stdout)["paused"] is True, paused.stderr
    assert health_plain.returncode == 1 and "UNAVAILABLE" in health_plain.stdout
    assert health_tls.returncode == 0 and health_tls.stdout.strip() == f"{target}: SERVING"


def test_run_with_a_missing_tls_file_exits_2_naming_the_field_before_starting_anything(
    tmp_path: Path, demo_model: Path
) -> None:
    missing = tmp_path / "nowhere" / "ca.pem"

    result = _cli(
        "run",
        "examples/quickstart.yaml",
        "--out",
        str(tmp_path / "run"),
        "--set",
        f"model.path={demo_model}",
        "--set",
        f"tls.ca_file={missing}",
    )

    assert result.returncode == 2
    assert "tls.ca_file" in result.stderr and "no such file" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_health_cli_with_a_key_but_no_certificate_exits_2_naming_the_field(tmp_path: Path) -> None:
    result = _cli("health", "--target", "127.0.0.1:1", "--tls-key", str(tmp_path / "k.pem"))

    assert result.returncode == 2
    assert "tls.client_key_file" in result.stderr
