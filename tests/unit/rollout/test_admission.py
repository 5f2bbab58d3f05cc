"""Admission control under random timings of generation and training (hypothesis simulations).

The simulation drives the real Admission class with a model of the rest of the system: groups are
generated with the version inference serves when they start; they complete in an order hypothesis
chooses; the trainer takes B groups at a time from the stream (FIFO), drops and counts groups whose
staleness exceeds the bound, and publishes a new version per step. With ``overlap`` (the trainer's default,
``trainer.publication.overlap``) the new version is the trainer's at once but reaches inference only when its
push lands, at a time hypothesis chooses (at the latest before the next publication); meanwhile the trainer
reports the served step and admission goes on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.rollout.admission import Admission, TrainerView

LAND = 5  # the action: a push in flight lands (4 is rollout's poll of the trainer)


@dataclass
class Sim:
    max_staleness: int
    batch: int
    max_running: int
    in_order: bool
    overlap: bool = False
    admission: Admission = field(init=False)
    version: int = 1  # published by the trainer at start; the trainer measures staleness from it
    step: int = 0
    served: int = 1  # the version inference serves (generation starts with it)
    served_step: int = 0
    pending: bool = False  # a push in flight (overlap)
    running: list[int] = field(default_factory=list)  # version each in-flight group started with
    stream: deque[int] = field(default_factory=deque)
    trained_staleness: list[int] = field(default_factory=list)
    produced: int = 0
    dropped: int = 0
    max_outstanding: int = 0
    stale_view: bool = False  # rollout sees the trainer only through polls (action 4), as the producer does
    polled: TrainerView | None = None

    def __post_init__(self) -> None:
        self.admission = Admission(self.max_staleness)
        self.polled = self.view()

    def view(self) -> TrainerView:
        step = self.served_step if self.pending else self.step  # what the trainer reports while it publishes
        return TrainerView(
            step=step,
            weight_version=self.version,
            groups_per_step=self.batch,
            reachable=True,
            serving=True,
            groups_dropped=self.dropped,
            publishing=self.pending,
        )

    def rollout_view(self) -> TrainerView:
        assert self.polled is not None
        return self.polled if self.stale_view else self.view()

    def act(self, action: int, pick: int) -> None:
        if action == 4:
            self.polled = self.view()
        if action == 0 and len(self.running) < self.max_running and self.admission.can_admit(self.rollout_view()):
            self.admission.admit()
            self.running.append(self.served)
        elif action == 1 and self.running:
            idx = 0 if self.in_order else pick % len(self.running)
            self.stream.append(self.running.pop(idx))
            self.produced += 1
        elif action == 2 and self.running:  # a failed group is released, not appended
            self.running.pop(pick % len(self.running))
            self.admission.release()
        elif action == 3:
            self.train()
        elif action == LAND:
            self.land()
        self.max_outstanding = max(self.max_outstanding, len(self.running) + len(self.stream))

    def train(self) -> None:
        fresh: list[int] = []
        while self.stream and len(fresh) < self.batch:
            v = self.stream.popleft()
            if self.version - v > self.max_staleness:
                self.dropped += 1
            else:
                fresh.append(v)
        if len(fresh) < self.batch:  # not enough yet: put them back at the front, as the trainer buffers them
            self.stream.extendleft(reversed(fresh))
            return
        self.trained_staleness.extend(self.version - v for v in fresh)
        self.land()  # the previous push is settled before the next publication
        self.step += 1
        self.version += 1
        self.pending = True
        if not self.overlap:
            self.land()

    def land(self) -> None:
        """The push in flight lands: inference serves the trainer's version."""
        if self.pending:
            self.served, self.served_step, self.pending = self.version, self.step, False


actions = st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, LAND]), st.integers(0, 1000)), min_size=1, max_size=400)


@settings(max_examples=150, deadline=None)
@given(
    s=st.integers(0, 3), batch=st.integers(1, 4), max_running=st.integers(1, 8), steps=actions, overlap=st.booleans()
)
def test_bound_holds_and_no_group_is_lost_under_any_timing(
    s: int, batch: int, max_running: int, steps: list[tuple[int, int]], overlap: bool
) -> None:
    sim = Sim(max_staleness=s, batch=batch, max_running=max_running, in_order=False, overlap=overlap)

    for action, pick in steps:
        sim.act(action, pick)

    assert all(0 <= lag <= s for lag in sim.trained_staleness)
    trained = len(sim.trained_staleness)
    assert sim.produced == trained + sim.dropped + len(sim.stream)  # produced = trained + dropped + pending
    assert sim.admission.admitted == sim.produced + len(sim.running)
    assert sim.max_outstanding <= (s + 1) * batch


@settings(max_examples=150, deadline=None)
@given(
    s=st.integers(0, 2), batch=st.integers(1, 4), max_running=st.integers(1, 8), steps=actions, overlap=st.booleans()
)
def test_drops_never_starve_the_trainer(
    s: int, batch: int, max_running: int, steps: list[tuple[int, int]], overlap: bool
) -> None:
    sim = Sim(max_staleness=s, batch=batch, max_running=max_running, in_order=False, overlap=overlap)
    for action, pick in steps:
        sim.act(action, pick)

    # drain: finish everything in flight, train what can be trained, let the push land, then try to admit again
    while sim.running:
        sim.act(1, 0)
    sim.act(3, 0)
    sim.act(LAND, 0)

    assert sim.admission.can_admit(sim.view()) or len(sim.stream) >= batch


@settings(max_examples=150, deadline=None)
@given(
    s=st.integers(0, 3), batch=st.integers(1, 4), max_running=st.integers(1, 8), steps=actions, overlap=st.booleans()
)
def test_groups_completing_in_admission_order_are_never_dropped(
    s: int, batch: int, max_running: int, steps: list[tuple[int, int]], overlap: bool
) -> None:
    sim = Sim(max_staleness=s, batch=batch, max_running=max_running, in_order=True, overlap=overlap)

    for action, pick in steps:
        if action != 2:  # failures reorder admission accounting; covered by the test above
            sim.act(action, pick)

    assert sim.dropped == 0
    assert all(0 <= lag <= s for lag in sim.trained_staleness)


@settings(max_examples=150, deadline=None)
@given(s=st.integers(0, 3), batch=st.integers(1, 4), max_running=st.integers(1, 8), steps=actions)
def test_generation_never_waits_while_less_than_the_bound_is_outstanding(
    s: int, batch: int, max_running: int, steps: list[tuple[int, int]]
) -> None:
    """Work conservation: with a current view the window closes exactly when (s + 1) * B groups are in flight or
    waiting in the stream, never earlier, whatever the timings, failures and drops."""
    sim = Sim(max_staleness=s, batch=batch, max_running=max_running, in_order=False)

    for action, pick in steps:
        sim.act(action, pick)
        outstanding = len(sim.running) + len(sim.stream)
        assert sim.admission.can_admit(sim.view()) == (outstanding < (s + 1) * batch)


polled_actions = st.lists(st.tuples(st.integers(0, LAND), st.integers(0, 1000)), min_size=1, max_size=400)


@settings(max_examples=150, deadline=None)
@given(
    s=st.integers(0, 3),
    batch=st.integers(1, 4),
    max_running=st.integers(1, 8),
    steps=polled_actions,
    overlap=st.booleans(),
)
def test_a_view_that_lags_the_trainer_only_admits_less_and_a_poll_reopens_the_window(
    s: int, batch: int, max_running: int, steps: list[tuple[int, int]], overlap: bool
) -> None:
    """Rollout learns the trainer's step by polling (more often while the window is closed): a lagging view never
    breaks the bound, and the window it shows is the current one minus what the poll has not seen yet."""
    sim = Sim(max_staleness=s, batch=batch, max_running=max_running, in_order=False, stale_view=True, overlap=overlap)

    for action, pick in steps:
        sim.act(action, pick)
        assert sim.admission.limit(sim.rollout_view()) <= sim.admission.limit(sim.view())

    assert all(0 <= lag <= s for lag in sim.trained_staleness)
    assert sim.produced == len(sim.trained_staleness) + sim.dropped + len(sim.stream)
    assert sim.max_outstanding <= (s + 1) * batch
    sim.act(LAND, 0)  # a push in flight lands (overlap) ...
    sim.act(4, 0)  # ... and a poll: the rollout's window is the current one again
    assert sim.admission.can_admit(sim.rollout_view()) == (len(sim.running) + len(sim.stream) < (s + 1) * batch)


def test_groups_dropped_as_stale_are_released_so_the_trainer_never_starves() -> None:
    sim = Sim(max_staleness=1, batch=1, max_running=4, in_order=False)
    for _ in range(2):  # twice: a slow group is overtaken until it is too stale and gets dropped
        sim.act(0, 0)  # admit the slow group
        for _ in range(3):
            sim.act(0, 0)  # admit, complete and train a fast one
            sim.act(1, 1)
            sim.act(3, 0)
        sim.act(1, 0)  # the slow group finally completes ...
        sim.act(3, 0)  # ... and is dropped

    assert sim.dropped == 2
    assert not sim.running and not sim.stream
    assert sim.admission.can_admit(sim.view())  # without the release this window would be closed for good


def test_max_staleness_zero_admits_exactly_one_step_of_groups() -> None:
    adm = Admission(max_staleness=0)
    view = TrainerView(step=3, weight_version=4, groups_per_step=2, reachable=True, serving=True)
    adm.admitted = 3 * 2  # everything of the first three steps

    admitted = 0
    while adm.can_admit(view):
        adm.admit()
        admitted += 1

    assert admitted == 2


def test_nothing_is_admitted_while_the_trainer_warms_up_and_a_publication_keeps_the_served_steps_window() -> None:
    adm = Admission(max_staleness=2)
    base = dict(step=0, weight_version=1, groups_per_step=4, reachable=True)

    assert not adm.can_admit(TrainerView(**base, serving=False))
    assert not adm.can_admit(TrainerView())
    assert adm.can_admit(TrainerView(**base, serving=True))
    publishing = TrainerView(**base, serving=True, publishing=True)  # step: the one inference serves
    assert adm.limit(publishing) == adm.limit(TrainerView(**base, serving=True)) == (2 + 0 + 1) * 4


def test_generation_goes_on_while_a_push_is_in_flight_and_in_order_groups_are_never_dropped() -> None:
    sim = Sim(max_staleness=1, batch=2, max_running=8, in_order=True, overlap=True)
    for _ in range(4):  # admit and complete a step's worth, train it: its push stays in flight
        sim.act(0, 0), sim.act(0, 0), sim.act(1, 0), sim.act(1, 0)
        sim.act(3, 0)
    admitted_before = sim.admission.admitted
    assert sim.pending

    sim.act(0, 0)  # a push is in flight: the window of the served step still admits

    assert sim.admission.admitted == admitted_before + 1
    assert sim.running[-1] == sim.served < sim.version  # generated by the served weights, not the pushed ones
    assert sim.dropped == 0 and all(0 <= lag <= 1 for lag in sim.trained_staleness)
