"""A service's thread budget: torch's intra-op and inter-op threads and the CPUs it runs on (shared by every service
section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.config.typed import ConfigError

MAX_THREADS = 1024
MAX_CPU = 8191  # the highest CPU id Linux's default cpu set size (8192) can name


def check_cpu_ids(name: str, cpus: list[int]) -> None:
    """Each a CPU id Linux can name, none repeated (ConfigError naming ``name``)."""
    for i, cpu in enumerate(cpus):
        if not 0 <= cpu <= MAX_CPU:
            raise ConfigError(f"{name}[{i}]", cpu, f"must be a CPU id in [0, {MAX_CPU}]")
    if len(set(cpus)) != len(cpus):
        raise ConfigError(name, cpus, "must not repeat a CPU")


@dataclass
class ThreadsConfig:
    """How many CPU threads a service's torch may use (0: automatic), and on which CPUs the service runs.

    Automatic under ``relayrl run``: the launcher divides the cores it may use (``os.sched_getaffinity``) between
    inference and the trainer (inference half, at least 1; the trainer the rest, split between its ranks, at
    least 1) and gives reward and rollout 1 thread each, inter-op 1 everywhere; it exports ``OMP_NUM_THREADS``
    and ``MKL_NUM_THREADS`` to each child so that they hold from import. With at least 2 cores and both
    inference's and the trainer's counts automatic and no service's ``cpus`` set, it also pins them: the trainer
    to the cores its threads got, inference, reward and rollout to the others, so that the trainer's step never
    shares its core with generation (relayrl.common.threads.automatic_cpus). Started any other way, 0 leaves
    torch's own default (all cores, or ``OMP_NUM_THREADS`` when set) and an empty ``cpus`` the inherited
    affinity."""

    intra_op: int = field(
        default=0,
        metadata={
            "help": "torch intra-op threads (torch.set_num_threads; OMP/MKL under relayrl run); 0: automatic.",
            "ge": 0,
            "le": MAX_THREADS,
        },
    )
    interop: int = field(
        default=0,
        metadata={
            "help": "torch inter-op threads (torch.set_num_interop_threads); 0: automatic.",
            "ge": 0,
            "le": MAX_THREADS,
        },
    )
    cpus: list[int] = field(
        default_factory=list,
        metadata={
            "help": "CPU ids this service runs on (every thread and child process it has or starts; "
            "os.sched_setaffinity at start-up); empty: automatic (relayrl run pins inference, reward and "
            "rollout to some of its cores and the trainer to the others when it divides them; otherwise "
            "the affinity the process inherited). Each must be a CPU the process may use."
        },
    )

    def validate(self) -> None:
        check_cpu_ids("cpus", self.cpus)


@dataclass
class TrainerThreadsConfig(ThreadsConfig):
    """The trainer's thread budget, and the cores it borrows while generation has nothing to do.

    With ``borrow_cpus`` set, once a step's forward and backward took at least ``borrow_min_compute_s``, rank 0 of a
    one-rank trainer asks inference for its status every ``borrow_poll_s``; while inference runs and queues no
    request (rollout has filled the staleness window, or the run waits for the trainer), the trainer runs on
    ``cpus`` and ``borrow_cpus`` with one more intra-op thread per borrowed core, and gives them back as soon as a
    request runs again. It switches between decoder layers, in the forward and the backward pass
    (relayrl.trainer.cores). ``relayrl run`` sets it to the generation cores when it pins the services itself (see
    ``cpus``)."""

    borrow_cpus: list[int] = field(
        default_factory=list,
        metadata={
            "help": "CPU ids the trainer also runs on while inference is idle (one more intra-op thread each); "
            "empty: never borrows. Needs cpus and intra_op set and distributed.world_size 1; relayrl run fills "
            "it with the generation cores when it pins the services itself."
        },
    )
    borrow_min_compute_s: float = field(
        default=1.0,
        metadata={
            "help": "Borrow only after a step whose forward and backward took at least this long (seconds): on a "
            "short step, switching costs more than the borrowed core gives.",
            "ge": 0,
        },
    )
    borrow_poll_s: float = field(
        default=0.2,
        metadata={"help": "How often the trainer asks inference whether it is idle, with borrow_cpus.", "gt": 0},
    )

    def validate(self) -> None:
        super().validate()
        check_cpu_ids("borrow_cpus", self.borrow_cpus)
        if not self.borrow_cpus:
            return
        if set(self.borrow_cpus) & set(self.cpus):
            raise ConfigError("borrow_cpus", self.borrow_cpus, "must not name one of cpus")
        if not self.cpus or not self.intra_op:
            raise ConfigError("borrow_cpus", self.borrow_cpus, "needs cpus and intra_op set (the trainer's own share)")
