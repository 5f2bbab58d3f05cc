"""The run config of `relayrl run`'s local stack: every server on loopback and a free port of its own, weights
published through shared memory (trainer and inference share this host), and the automatic thread counts resolved
against the cores the launcher may use."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from relayrl.common.threads import automatic_cpus, automatic_division
from relayrl.config import RunConfig
from relayrl.config.endpoints import HttpConfig, ServerConfig
from relayrl.config.inference import InferenceConfig, ReplicaEndpoint
from relayrl.config.model_fit import fit_to_model
from relayrl.config.publication import PublicationConfig, WeightTransport
from relayrl.config.typed import ConfigError
from relayrl.local_redis import free_ports

SERVICE_ORDER = ("reward", "inference", "trainer", "rollout")


def local(server: ServerConfig, port: int) -> ServerConfig:
    """The same server settings on loopback and ``port`` (the launcher runs everything locally)."""
    return replace(server, host="127.0.0.1", port=port, address="")


def local_publication(pc: PublicationConfig) -> PublicationConfig:
    """``auto`` becomes ``shared_memory``: trainer and inference run on this host and share the run folder."""
    return replace(pc, transport=WeightTransport.SHARED_MEMORY) if pc.transport is WeightTransport.AUTO else pc


def local_http(http: HttpConfig, port: int) -> HttpConfig:
    """An HTTP API on loopback and ``port``."""
    return replace(http, host="127.0.0.1", port=port)


def with_thread_budget(cfg: RunConfig, cores: Sequence[int]) -> RunConfig:
    """``cfg`` with every automatic (0) thread count of reward, inference, trainer and rollout resolved by
    :func:`relayrl.common.threads.automatic_division` of ``cores`` (usable CPU ids; inter-op: 1); set counts stay.
    When inference's and the trainer's counts are both automatic and no service names its ``cpus``, the services
    are also pinned by :func:`relayrl.common.threads.automatic_cpus` (the trainer's cores apart from
    generation's), and a one-rank trainer borrows generation's cores while inference is idle
    (``trainer.threads.borrow_cpus``)."""
    ranks = cfg.trainer.distributed.world_size
    auto = automatic_division(len(cores), ranks)
    sections = {name: getattr(cfg, name) for name in SERVICE_ORDER}
    divided = not any(sections[name].threads.intra_op for name in ("inference", "trainer")) and not any(
        section.threads.cpus for section in sections.values()
    )
    cpus = automatic_cpus(cores, ranks) if divided else {name: s.threads.cpus for name, s in sections.items()}
    for name, section in sections.items():
        threads = replace(
            section.threads,
            intra_op=section.threads.intra_op or auto[name],
            interop=section.threads.interop or 1,
            cpus=list(cpus[name]),
        )
        sections[name] = replace(section, threads=threads)
    trainer = sections["trainer"]
    if divided and ranks == 1 and cpus["trainer"] and not trainer.threads.borrow_cpus:
        # generation's cores, for the trainer while inference is idle (relayrl.trainer.cores)
        sections["trainer"] = replace(trainer, threads=replace(trainer.threads, borrow_cpus=list(cpus["inference"])))
    return replace(cfg, **sections)


def local_replicas(ic: InferenceConfig, ports: Sequence[int]) -> InferenceConfig:
    """With ``replicas`` > 1, ``endpoints`` lists the local replicas: the first at ``server`` and ``weights_server``,
    the others on loopback at ``ports`` (their gRPC and weights servers, in pairs)."""
    if ic.replicas == 1:
        return ic
    first = ReplicaEndpoint(ic.server.target, ic.weights_server.target)
    others = [ReplicaEndpoint(f"127.0.0.1:{ports[i]}", f"127.0.0.1:{ports[i + 1]}") for i in range(0, len(ports), 2)]
    return replace(ic, endpoints=[first, *others])


def local_run_config(cfg: RunConfig, out_dir: Path) -> RunConfig:
    """``cfg`` checked (model, dataset, TLS files) and resolved for the local stack writing to ``out_dir``: fitted
    to the model, thread counts divided, every server on loopback and a free port of its own."""
    cfg.model.check_exists()
    cfg = fit_to_model(cfg)  # the length limits within the model's context and vocabulary, before any service
    if not cfg.rollout.dataset.exists():
        raise ConfigError("rollout.dataset", str(cfg.rollout.dataset), "dataset file does not exist")
    cfg.tls.read()  # every TLS file present and PEM before any service starts (ConfigError naming the field)
    cfg = with_thread_budget(cfg, sorted(os.sched_getaffinity(0)))
    if cfg.inference.endpoints:
        raise ConfigError(
            "inference.endpoints",
            [e.address for e in cfg.inference.endpoints],
            "relayrl run starts its own inference replicas: set inference.replicas instead",
        )
    extra = 2 * (cfg.inference.replicas - 1)  # the other replicas' gRPC and weights servers
    p = iter(free_ports(9 + extra))  # distinct: one per server of the stack
    return replace(
        cfg,
        output_dir=out_dir,
        tls=cfg.tls.resolved(),
        model=replace(cfg.model, path=cfg.model.path.resolve()),
        rollout=replace(
            cfg.rollout,
            dataset=cfg.rollout.dataset.resolve(),
            server=local(cfg.rollout.server, next(p)),
            http=local_http(cfg.rollout.http, next(p)),
        ),
        inference=local_replicas(
            replace(
                cfg.inference,
                server=local(cfg.inference.server, next(p)),
                http=local_http(cfg.inference.http, next(p)),
                weights_server=local(cfg.inference.weights_server, next(p)),
            ),
            [next(p) for _ in range(extra)],
        ),
        reward=replace(cfg.reward, server=local(cfg.reward.server, next(p)), http=local_http(cfg.reward.http, next(p))),
        trainer=replace(
            cfg.trainer,
            server=local(cfg.trainer.server, next(p)),
            http=local_http(cfg.trainer.http, next(p)),
            publication=local_publication(cfg.trainer.publication),
        ),
    )
