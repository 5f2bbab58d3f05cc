"""Adversarial completions and verifiers through the real reward service (gRPC, verifier pool, sandbox).

Each case returns within its timeout (+ MARGIN_S) with the documented result, and leaves the host unaffected: a
sentinel directory outside the sandbox is unchanged, a listening socket on the host accepted no connection, and
no process of the run is left (no descendant of this process but the verifier pool's, no process of a sandbox
uid). The last test is the control: a clean set of correct answers scores 1.0 everywhere.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from relayrl.config.reward import UID_RANGE, SandboxBackend, SandboxConfig
from tests.integration.helpers import reward_server

pytestmark = pytest.mark.integration

WALL_S = 1.0  # the sandbox's wall-clock limit in these tests
VERIFIER_TIMEOUT_S = 2.0  # the pool's per-call timeout
# this test session's own range of sandbox uids: a leftover process in it is ours, whatever else runs on the machine
UID_BASE = 300_000 + (os.getpid() % 4096) * UID_RANGE
# The time bounds prove a kill at the limit (without it a case runs until the 30 s RPC deadline). The margin covers
# what the call costs besides the limit on a loaded 2-core machine: the sandbox's probe run and the program's
# start-up (namespaces, an interpreter), the RPC, and a late timer; 1 s was enough only on an idle machine.
MARGIN_S = 3.0
SECRET = "relayrl-test-secret-7f3a91"
CODE_TOKEN = "relayrl-test-code-token-0c4e"  # scoring with the code verifier needs it (Score, ScoreBatch)
AUTH = (("authorization", f"Bearer {CODE_TOKEN}"),)


@dataclass
class Host:
    """What the sandboxed programs must not touch."""

    sentinel_dir: Path
    listener: socket.socket

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def snapshot(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.sentinel_dir.iterdir())}


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    monkeypatch.setenv("RELAYRL_TEST_SECRET", SECRET)  # inherited by the service and its workers
    sentinel = tmp_path / "outside"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("precious")
    sentinel.chmod(0o777)  # writable by anyone: only the sandbox stands between a program and it
    (sentinel / "keep.txt").chmod(0o666)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield Host(sentinel, listener)
    listener.close()


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _leftover_processes(sandbox: SandboxConfig, earlier: set[int]) -> list[str]:
    """Processes a run left: descendants of this process other than multiprocessing's (the pool's workers and
    the forkserver) and those that ran before the case (``earlier``: e.g. a tracking test's wandb-core), and any
    process whose real uid is in the sandbox's per-run uid range."""
    left = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid not in earlier and "multiprocessing" not in " ".join(proc.cmdline()):
                left.append(f"{proc.pid} {proc.cmdline()}")
        except psutil.NoSuchProcess:
            continue
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        uid = proc.info["uids"].real if proc.info["uids"] else -1
        if sandbox.uid_base <= uid < sandbox.uid_base + UID_RANGE:
            left.append(f"{proc.info['pid']} uid {uid} {proc.info['cmdline']}")
    return left


def _assert_host_unaffected(host: Host, before: dict[str, bytes], sandbox: SandboxConfig, earlier: set[int]) -> None:
    assert host.snapshot() == before
    with pytest.raises(BlockingIOError):
        host.listener.accept()  # nothing ever connected
    deadline = time.monotonic() + 2.0
    while (left := _leftover_processes(sandbox, earlier)) and time.monotonic() < deadline:
        time.sleep(0.05)  # a killed process may take a moment to disappear
    assert left == []


async def _score(
    host: Host,
    backend: SandboxBackend,
    completion: str,
    metadata: dict[str, object],
    function: str = "code",
    reference: str = "",
) -> tuple[pb.ScoreResponse, float]:
    sandbox = SandboxConfig(backend=backend, wall_timeout_s=WALL_S, total_timeout_s=WALL_S, uid_base=UID_BASE)
    before, earlier = host.snapshot(), _descendants()

    async def go() -> tuple[pb.ScoreResponse, float]:
        async with (
            reward_server(
                function, code_token=CODE_TOKEN, workers=1, timeout_s=VERIFIER_TIMEOUT_S, sandbox=sandbox
            ) as (target, _),
            insecure_channel(target) as ch,
        ):
            stub = pb_grpc.RewardServiceStub(ch)
            t0 = time.monotonic()
            resp = await stub.Score(
                pb.ScoreRequest(
                    episode_id="adv",
                    completion=completion,
                    reference=reference,
                    metadata={k: json.dumps(v) for k, v in metadata.items()},
                ),
                timeout=30,
                metadata=AUTH,
            )
            return resp, time.monotonic() - t0

    resp, elapsed = await go()
    _assert_host_unaffected(host, before, sandbox, earlier)
    return resp, elapsed


BACKENDS = [SandboxBackend.BWRAP, SandboxBackend.PROCESS]
ONE_TEST = {"tests": ["assert solve() == 1"]}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_infinite_loop_is_killed_at_the_wall_clock_and_scores_zero(host: Host, backend: SandboxBackend) -> None:
    resp, elapsed = await _score(host, backend, "def solve():\n    return 1\nwhile True:\n    pass\n", ONE_TEST)

    assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 0.0)
    assert "killed at the wall-clock limit" in resp.details
    assert elapsed < WALL_S + MARGIN_S


@pytest.mark.parametrize("backend", BACKENDS)
async def test_fork_bomb_is_contained_and_leaves_no_process(host: Host, backend: SandboxBackend) -> None:
    program = (
        "import os, time\ndef solve():\n    return 1\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        time.sleep(0.01)\n"
    )

    resp, elapsed = await _score(host, backend, program, ONE_TEST)

    assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 0.0)
    assert elapsed < WALL_S + MARGIN_S


@pytest.mark.parametrize("backend", BACKENDS)
async def test_ten_gigabyte_allocation_fails_inside_the_sandbox(host: Host, backend: SandboxBackend) -> None:
    program = "data = bytearray(10 * 1024 ** 3)\ndef solve():\n    return 1\n"

    resp, elapsed = await _score(host, backend, program, ONE_TEST)

    assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 0.0)
    assert "MemoryError" in resp.details
    assert elapsed < WALL_S + MARGIN_S


@pytest.mark.parametrize("backend", BACKENDS)
async def test_deleting_or_writing_files_outside_its_directory_fails(host: Host, backend: SandboxBackend) -> None:
    target = host.sentinel_dir
    program = (
        "import os, shutil\nblocked = []\n"
        f"for attempt in (lambda: os.remove({str(target / 'keep.txt')!r}),\n"
        f"                lambda: open({str(target / 'keep.txt')!r}, 'w').write('owned'),\n"
        f"                lambda: open({str(target / 'new.txt')!r}, 'w').write('dropped'),\n"
        f"                lambda: shutil.rmtree({str(target)!r}),\n"
        "                lambda: open('/usr/lib/relayrl-owned', 'w').write('x'),\n"
        "                lambda: open('/etc/relayrl-owned', 'w').write('x')):\n"
        "    try:\n        attempt()\n        blocked.append(False)\n"
        "    except OSError:\n        blocked.append(True)\n"
        "print('blocked' if all(blocked) else blocked)\n"
    )

    resp, elapsed = await _score(host, backend, program, {"io_tests": [{"input": "", "output": "blocked"}]})

    assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 1.0), resp.details
    assert not Path("/usr/lib/relayrl-owned").exists() and not Path("/etc/relayrl-owned").exists()
    assert elapsed < WALL_S + MARGIN_S


@pytest.mark.parametrize("backend", BACKENDS)
async def test_network_connection_is_impossible(host: Host, backend: SandboxBackend) -> None:
    program = (
        "import socket\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {host.port}), timeout=0.5)\n    print('connected')\n"
        "except OSError:\n    print('blocked')\n"
    )

    resp, elapsed = await _score(host, backend, program, {"io_tests": [{"input": "", "output": "blocked"}]})

    assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 1.0), resp.details
    assert elapsed < WALL_S + MARGIN_S


@pytest.mark.parametrize("backend", BACKENDS)
async def test_environment_secrets_are_not_visible(host: Host, backend: SandboxBackend) -> None:
    program = (
        "import os\nseen = ' '.join(os.environ.values())\n"
        "for pid in os.listdir('/proc'):\n    try:\n"
        "        seen += open('/proc/%s/environ' % pid, 'rb').read().decode(errors='replace')\n"
        "    except (OSError, ValueError):\n        pass\n"
        f"print('leaked' if {SECRET!r} in seen or 'RELAYRL_TEST_SECRET' in seen else 'clean')\n"
    )

    resp, elapsed = await _score(host, backend, program, {"io_tests": [{"input": "", "output": "clean"}]})

    assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 1.0), resp.details
    assert elapsed < WALL_S + MARGIN_S


@pytest.mark.parametrize("backend", BACKENDS)
async def test_megabytes_of_output_are_capped_and_the_program_killed(host: Host, backend: SandboxBackend) -> None:
    program = "import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * 10000)\nprint()\n"

    resp, elapsed = await _score(host, backend, program, {"io_tests": [{"input": "", "output": "x"}]})

    assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 0.0)
    assert "output limit exceeded" in resp.details
    assert elapsed < WALL_S + MARGIN_S


async def test_sympy_expression_that_never_finishes_is_a_timeout_not_a_zero(host: Host) -> None:
    resp, elapsed = await _score(
        host, SandboxBackend.BWRAP, "The answer is $\\boxed{9^{9^{9}}}$", {}, function="math", reference="2"
    )

    assert resp.status == pb.SCORE_STATUS_TIMEOUT
    assert "killed and replaced" in resp.error
    assert elapsed < VERIFIER_TIMEOUT_S + MARGIN_S


async def test_verifier_that_raises_is_an_error_not_a_zero(host: Host) -> None:
    resp, elapsed = await _score(host, SandboxBackend.BWRAP, "7", {}, function="tests.reward_fns:broken")

    assert resp.status == pb.SCORE_STATUS_ERROR
    assert "ZeroDivisionError" in resp.error
    assert elapsed < VERIFIER_TIMEOUT_S + MARGIN_S


CLEAN_SET = [  # (function, completion, reference, metadata): all correct
    ("arithmetic", "7", "7", {}),
    ("math", "The answer is $\\boxed{\\frac{1}{2}}$", "0.5", {}),
    ("math", "$(x+1)^2$", "x^2+2x+1", {}),
    ("exact_match", "  Paris. ", "paris", {}),
    ("regex", "Answer: 42", "42", {"pattern": "Answer: (\\d+)"}),
    ("format", "<answer>42</answer>", "", {}),
    (
        "code",
        "```python\ndef add(a, b):\n    return a + b\n```",
        "",
        {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
    ),
    (
        "code",
        "print(int(input()) * 2)",
        "",
        {"io_tests": [{"input": "21", "output": "42"}, {"input": "0\n", "output": "0"}]},
    ),
]


async def test_clean_correct_answers_score_one_everywhere(host: Host) -> None:
    sandbox = SandboxConfig(wall_timeout_s=WALL_S, total_timeout_s=2 * WALL_S, uid_base=UID_BASE)
    before, earlier = host.snapshot(), _descendants()

    async def go() -> dict[str, list[pb.ScoreResponse]]:
        out: dict[str, list[pb.ScoreResponse]] = {}
        for function in dict.fromkeys(f for f, *_ in CLEAN_SET):  # each verifier as the service's reward
            rows = [(c, r, m) for f, c, r, m in CLEAN_SET if f == function]
            async with (
                reward_server(function, code_token=CODE_TOKEN, workers=2, sandbox=sandbox) as (target, _),
                insecure_channel(target) as ch,
            ):
                batch = await pb_grpc.RewardServiceStub(ch).ScoreBatch(
                    pb.ScoreBatchRequest(
                        requests=[
                            pb.ScoreRequest(
                                episode_id=str(i),
                                completion=c,
                                reference=r,
                                metadata={k: json.dumps(v) for k, v in m.items()},
                            )
                            for i, (c, r, m) in enumerate(rows)
                        ]
                    ),
                    timeout=60,
                    metadata=AUTH,
                )
            out[function] = list(batch.responses)
        return out

    results = await go()

    for function, responses in results.items():
        for resp in responses:
            assert (resp.status, resp.score) == (pb.SCORE_STATUS_OK, 1.0), (function, resp.details, resp.error)
    assert sum(len(v) for v in results.values()) == len(CLEAN_SET)
    _assert_host_unaffected(host, before, sandbox, earlier)
