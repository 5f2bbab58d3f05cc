"""`relayrl status`: live state of a running stack, through the typed clients (and Redis, and metrics.jsonl).

TARGET is a run folder (its resolved config.yaml gives every address, its metrics.jsonl the recent training
figures), a run config file, or one service's HOST:PORT (its kind is found by asking). Channels use the config's
``tls`` section, or the one given (the CLI's ``--tls-*`` flags).
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from relayrl.client import InferenceClient, RewardClient, RolloutClient, ServiceClient, TrainerClient
from relayrl.common import books
from relayrl.common.metrics_row import RlRow, format_time_shares, read_rows, rl_rows, time_shares
from relayrl.common.redis_conn import async_client
from relayrl.common.redis_keys import RedisKeys
from relayrl.common.service import as_dict
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig, load_run_config
from relayrl.config.tls import TlsConfig
from relayrl.local_redis import REDIS_PASSWORD_FILE

# services that run as several replicas (each is shown): inference's are inference.endpoints, reward's every address
# its target resolves to (its client balances over them)
REPLICATED = ("inference", "reward")

CLIENTS: dict[str, type[ServiceClient]] = {
    "inference": InferenceClient,
    "reward": RewardClient,
    "rollout": RolloutClient,
    "trainer": TrainerClient,
}


@dataclass
class Target:
    cfg: RunConfig | None
    run_dir: Path | None
    address: str | None


def resolve(target: str) -> Target:
    path = Path(target)
    if path.is_dir():
        return Target(load_run_config(path / "config.yaml"), path, None)
    if path.is_file():
        return Target(load_run_config(path), None, None)
    return Target(None, None, target)


async def _service_status(kind: str, address: str, timeout_s: float, tls: TlsConfig | None) -> dict[str, Any]:
    async with CLIENTS[kind](address, timeout_s=timeout_s, retries=1, tls=tls) as client:
        try:
            return {"address": address, **as_dict(await client.status())}  # type: ignore[attr-defined]
        except grpc.aio.AioRpcError as exc:
            return {"address": address, "error": f"{exc.code().name}: {exc.details()}"}


async def replica_addresses(target: str) -> list[str]:
    """The replicas a balancing client spreads over: the addresses of an ``ipv4:``/``ipv6:`` list, or those a name
    resolves to now (``dns:///name:port`` or ``name:port``; IPv4 ones when it has any, so that ``localhost`` is one
    replica); ``[target]`` when that is one address or the name does not resolve."""
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return rest.split(",")
    name = target.removeprefix("dns:///")
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit() or host.startswith("["):
        return [target]
    loop = asyncio.get_running_loop()
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = await loop.getaddrinfo(host, int(port), family=family, type=socket.SOCK_STREAM)
        except OSError:
            continue
        ips = sorted({str(info[4][0]) for info in infos})
        if len(ips) > 1:
            return [f"{ip}:{port}" if family == socket.AF_INET else f"[{ip}]:{port}" for ip in ips]
        if ips:
            break
    return [target]


def _replica_tls(target: str, tls: TlsConfig | None) -> TlsConfig | None:
    """Dialling a replica by its IP still verifies the certificate against the name the target gave."""
    if tls is None or not tls.enabled or tls.server_name or target.startswith(("ipv4:", "ipv6:")):
        return tls
    return replace(tls, server_name=target.removeprefix("dns:///").rpartition(":")[0])


async def _replicas(cfg: RunConfig, kind: str, timeout_s: float, tls: TlsConfig | None) -> list[dict[str, Any]]:
    """The status of each replica of ``kind`` (empty when there is one)."""
    if kind == "inference":
        addresses = [e.address for e in cfg.inference.replica_endpoints()]
    else:
        target = getattr(cfg, kind).server.target
        addresses, tls = await replica_addresses(target), _replica_tls(target, tls)
    if len(addresses) < 2:
        return []
    return list(await asyncio.gather(*(_service_status(kind, a, timeout_s, tls) for a in addresses)))


async def _identify(address: str, timeout_s: float, tls: TlsConfig | None) -> tuple[str, dict[str, Any]]:
    for kind in CLIENTS:
        status = await _service_status(kind, address, timeout_s, tls)
        if not str(status.get("error", "")).startswith("UNIMPLEMENTED"):
            return kind, status
    return "unknown", {"address": address, "error": "no relayrl service answers there"}


def redis_password(cfg: RunConfig, run_dir: Path | None) -> dict[str, str]:
    """The embedded Redis's password from the run folder (``redis_password``, 0600) when the environment has none."""
    if run_dir is None or cfg.redis.effective_password():
        return {}
    path = run_dir / REDIS_PASSWORD_FILE
    return {"password": path.read_text().strip()} if path.is_file() else {}


async def _queue(cfg: RunConfig, run_dir: Path | None) -> dict[str, Any]:
    stream = EpisodeStream(
        async_client(cfg.redis, decode_responses=False, **redis_password(cfg, run_dir)),
        RedisKeys.from_config(cfg.redis, cfg.name),
    )
    try:
        info = await asyncio.wait_for(stream.info(), timeout=5)
        invalid_groups, invalid_episodes = await asyncio.wait_for(stream.invalid(), timeout=5)
    except Exception as exc:  # status must report what it can, whatever is down
        return {"error": str(exc) or type(exc).__name__}
    finally:
        await stream.close()
    return {
        "length": info.length,
        "lag": info.lag,
        "pending": info.pending,
        "invalid_groups": invalid_groups,
        "invalid_episodes": invalid_episodes,
        "dead_letter": stream.keys.dead_letter,
    }


def _training(run_dir: Path, window: int = 10) -> dict[str, Any]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    recent = rl_rows(read_rows(path))[-window:]  # a line being written is not a row yet
    if not recent:
        return {}
    mean = lambda values: sum(values) / len(recent)  # noqa: E731
    return {
        "step": recent[-1].step,
        "reward_mean": mean(r.reward_mean for r in recent),
        "staleness_mean": mean(r.staleness_mean for r in recent),
        "staleness_max": max(r.staleness_max for r in recent),
        "episodes_per_s": mean(r.episodes_per_s for r in recent),
        "window_steps": len(recent),
        "time_shares": time_shares(recent),
        **_multi_turn(recent),
    }


def _multi_turn(rows: list[RlRow]) -> dict[str, Any]:
    """Turns and tool calls per episode, failed tool calls and how episodes ended over ``rows`` (empty when none of
    their episodes was multi-turn)."""
    ends: dict[str, int] = {}
    for r in rows:
        for end, n in r.episode_ends.items():
            ends[end] = ends.get(end, 0) + n
    if not ends or set(ends) == {"single_turn"}:
        return {}
    return {
        "turns_mean": sum(r.turns_mean for r in rows) / len(rows),
        "tool_calls_mean": sum(r.tool_calls_mean for r in rows) / len(rows),
        "tool_errors": sum(r.tool_errors for r in rows),
        "episode_ends": ends,
    }


async def collect(target: Target, timeout_s: float = 3.0, tls: TlsConfig | None = None) -> dict[str, Any]:
    """The state of the target's services; channels use ``tls`` when given, else the config's ``tls`` section."""
    if target.address is not None:
        kind, status = await _identify(target.address, timeout_s, tls)
        return {"services": {kind: status}}
    assert target.cfg is not None
    cfg = target.cfg
    tls = tls if tls is not None else cfg.tls
    kinds = list(CLIENTS)
    statuses = await asyncio.gather(*(_service_status(k, getattr(cfg, k).server.target, timeout_s, tls) for k in kinds))
    out: dict[str, Any] = {"services": dict(zip(kinds, statuses, strict=True))}
    replicas = {k: await _replicas(cfg, k, timeout_s, tls) for k in REPLICATED}
    if any(replicas.values()):
        out["replicas"] = {k: v for k, v in replicas.items() if v}
    if cfg.redis.effective_url():
        out["queue"] = await _queue(cfg, target.run_dir)
    if target.run_dir is not None:
        out["training"] = _training(target.run_dir)
    return out


def _rollout_turns(s: dict[str, Any]) -> str:
    """The rollout's multi-turn counters, when it produced multi-turn episodes."""
    ends = s.get("episode_ends") or {}
    if not ends or set(ends) == {"single_turn"}:
        return ""
    return (
        f"; {s.get('episode_turns', 0)} turns, {s.get('tool_calls', 0)} tool calls ({s.get('tool_errors', 0)} "
        f"failed); ended: " + ", ".join(f"{k} {v}" for k, v in sorted(ends.items()))
    )


DETAIL: dict[str, Any] = {
    "inference": lambda s: (
        f"serves v{s.get('weight_version')}  {s.get('sequences_running', 0)} sequences "
        f"running, {s.get('requests_queued', 0)} queued"
    ),
    "reward": lambda s: f"{s.get('requests_served', s.get('scored', ''))} scored",
    "rollout": lambda s: (
        f"{s.get('groups_produced')} groups produced, {s.get('groups_running')} running"
        f"{', PAUSED' if s.get('paused') else ''}; sees trainer v{s.get('trainer_version')}" + _rollout_turns(s)
    ),
    "trainer": lambda s: (
        f"step {s.get('step')}  v{s.get('weight_version')}  {s.get('episodes_trained')} "
        "episodes trained, "
        + ", ".join(f"{s.get(o.episodes, 0)} {o.words}" for o in (*books.DROPS, books.INVALID))
        + f"{', FINISHED' if s.get('finished') else ''}"
    ),
}


def _replica_notes(state: dict[str, Any], address: str) -> str:
    """What rollout and the trainer say of the inference replica at ``address``: routed or not, its load as
    rollout's pool sees it, and its failed weight pushes."""
    services = state["services"]
    seen = {r.get("address"): r for r in services.get("rollout", {}).get("inference_replica_states", [])}
    notes = []
    if address in seen:
        r = seen[address]
        routed = r.get("routable", False) and not r.get("behind", False)
        notes.append(f"{'routed' if routed else 'NOT ROUTED'}, {r.get('samples_in_flight', 0)} samples in flight")
    failures = int(services.get("trainer", {}).get("weight_push_failures", {}).get(address, 0))
    if failures:
        notes.append(f"{failures} weight pushes failed")
    return f"  ({'; '.join(notes)})" if notes else ""


def _service_line(label: str, kind: str, st: dict[str, Any]) -> str:
    if "error" in st:
        return f"{label:<10} {st['address']:<22} DOWN  {st['error']}"
    state_name = str(st.get("component", {}).get("state", "")).removeprefix("SERVING_STATE_")
    return f"{label:<10} {st['address']:<22} {state_name:<8} {DETAIL.get(kind, lambda s: '')(st)}"


def render(state: dict[str, Any]) -> str:
    lines = []
    versions = []
    for kind, st in state["services"].items():
        lines.append(_service_line(kind, kind, st))
        lines.extend(
            _service_line("  replica", kind, r) + (_replica_notes(state, r["address"]) if kind == "inference" else "")
            for r in state.get("replicas", {}).get(kind, [])
        )
        if "weight_version" in st:
            versions.append(int(st["weight_version"]))
    if len(set(versions)) > 1:
        lines.append(
            f"versions differ between services: {sorted(set(versions))} (a publication in flight, or a "
            "service restarted)"
        )
    queue = state.get("queue")
    if queue:
        lines.append(
            "queue      "
            + (
                f"error: {queue['error']}"
                if "error" in queue
                else f"{queue['length']} entries, consumer lag {queue['lag']}, "
                f"pending (delivered, not yet durable) {queue['pending']}, invalid "
                f"{queue.get('invalid_groups', 0)} groups ({queue.get('invalid_episodes', 0)} "
                f"episodes) in {queue.get('dead_letter', 'the dead-letter stream')}"
            )
        )
    training = state.get("training")
    if training:
        lines.append(
            f"training   last {training['window_steps']} steps to step {training['step']}: reward "
            f"{training['reward_mean']:.3f}, staleness mean {training['staleness_mean']:.2f} max "
            f"{training['staleness_max']}, {training['episodes_per_s']:.0f} episodes/s"
        )
        if "episode_ends" in training:
            ends = ", ".join(f"{k} {v}" for k, v in sorted(training["episode_ends"].items()))
            lines.append(
                f"           multi-turn: {training['turns_mean']:.2f} turns and "
                f"{training['tool_calls_mean']:.2f} tool calls per episode, {training['tool_errors']} tool "
                f"errors; ended: {ends}"
            )
        if training.get("time_shares"):
            lines.append(f"           {format_time_shares(training['time_shares'])}")
    return "\n".join(lines)


def exit_code(state: dict[str, Any]) -> int:
    """`relayrl status`'s exit status: 1 when a service, or one replica of one, did not answer."""
    replicas = [r for rs in state.get("replicas", {}).values() for r in rs]
    return 1 if any("error" in s for s in [*state["services"].values(), *replicas]) else 0
