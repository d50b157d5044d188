"""Event-level simulation of one pipeline step from per-stage pass times.

:func:`simulate_step` replays a schedule's actions (:func:`~lightning_gpipe.engine.schedule.stage_actions`) on a machine
where stage ``j``'s forward of one micro-batch takes ``forward[j]`` seconds and its backward ``backward[j]`` (plus
``recompute[j]`` for a re-materialized micro-batch), where a boundary value or its gradient takes ``transfer[j]``
seconds to cross from stage ``j`` to ``j + 1``, and where each stage ends the step with its optimizer's step,
``update[j]`` seconds. Every action starts as soon as its stage is free and its inputs have arrived, which is what the
engine does with asynchronous sends. No devices are involved, so it answers "what would K stages and M micro-batches
give?" for models far larger than the machine it runs on.

With equal stages and free transfers the fill-drain makespan is ``(M + K - 1)·(f + b)`` and the bubble is
``(K - 1)/(M + K - 1)``, the paper's figure; unequal stages, recomputation and transfers move both, which is what the
planner needs to know.

The same replay runs the schedules whose processes hold several stages or split the backward pass
(``"interleaved"``, ``"zero_bubble"``, ``"zbv"``): times are then given per stage, a process runs its
stages' actions (:func:`~lightning_gpipe.engine.schedule.process_actions`) one at a time, and a zero-bubble backward
takes ``backward - weight`` seconds for its input gradient and ``weight`` for its weight gradient.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpipe.engine.schedule import Action, Phase, cached_process_actions, dependencies, stages_of

__all__ = ["SimulatedStep", "Span", "in_flight", "simulate_step"]


@dataclass(frozen=True)
class Span:
    """One action of one process in a simulated step: ``[start, end)`` in seconds from the step's start."""

    stage: int  # the process that runs it, which is its stage when each process holds one (else ``action.stage``)
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulatedStep:
    """The outcome of :func:`simulate_step`: every span, the makespan, and each stage's busy time."""

    schedule: str
    num_microbatches: int
    spans: tuple[tuple[Span, ...], ...]  # per process, in the process's order
    makespan: float
    updates: tuple[float, ...] = ()  # per process: the optimizer step's seconds after its last action

    @property
    def num_stages(self) -> int:
        """K, the number of processes (of stages, when each process holds one)."""
        return len(self.spans)

    @property
    def busy(self) -> tuple[float, ...]:
        """Seconds each process spends computing (the sum of its spans and its optimizer step)."""
        updates = self.updates or (0.0,) * len(self.spans)
        return tuple(
            sum(span.end - span.start for span in spans) + update
            for spans, update in zip(self.spans, updates, strict=True)
        )

    @property
    def bubble(self) -> float:
        """The idle share of the K processes over the makespan: ``1 - sum(busy) / (K · makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.makespan)


def in_flight(schedule: str, stage: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """The most micro-batches whose forward has run on ``stage`` while their backward has not: what it must keep.

    Fill-drain keeps all ``M``; one-forward-one-backward keeps ``min(K - stage, M)``. When a process holds several
    stages (``stage`` is then the process, ``num_stages`` the number of processes), each stage's micro-batch counts
    one; a split backward frees its micro-batch at its weight gradient, the last pass that reads it.
    """
    held = most = 0
    for action in cached_process_actions(schedule, stage, num_stages, num_microbatches, virtual_stages):
        if action.phase is Phase.FORWARD:
            held += 1
        elif action.phase is not Phase.INPUT:
            held -= 1
        most = max(most, held)
    return most


@functools.lru_cache(maxsize=1 << 16)
def _needs(action: Action, num_stages: int) -> tuple[Action, ...]:
    """The actions ``action`` waits for (:func:`~lightning_gpipe.engine.schedule.dependencies`), built once: the
    planner simulates thousands of configurations of the same few shapes."""
    assert action.stage is not None
    return tuple(dep for _, dep in dependencies(action.stage, action, num_stages))


def _per_stage(name: str, values: float | Sequence[float], count: int) -> list[float]:
    items = [values] * count if isinstance(values, (int, float)) else list(values)
    if len(items) != count:
        raise ValueError(f"{name} has {len(items)} entries; give one per stage boundary or stage ({count})")
    for value in items:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
            raise ValueError(f"{name} holds {value!r}; every entry must be a finite number of seconds >= 0")
    return [float(value) for value in items]


def simulate_step(
    schedule: str,
    forward: Sequence[float],
    backward: Sequence[float],
    num_microbatches: int,
    *,
    transfer: float | Sequence[float] = 0.0,
    recompute: Sequence[float] | None = None,
    checkpoint_stop: int = 0,
    update: Sequence[float] | None = None,
    checkpoint_forward: Sequence[float] | None = None,
    first_send_parked: bool = False,
    weight: Sequence[float] | None = None,
    virtual_stages: int = 1,
    ready: Sequence[float] | None = None,
) -> SimulatedStep:
    """Simulate one training step of a ``len(forward)``-stage pipeline.

    Args:
        schedule: one of :data:`~lightning_gpipe.engine.schedule.SCHEDULES`.
        forward: seconds of one micro-batch's forward pass, per stage.
        backward: seconds of one micro-batch's backward pass, per stage (without recomputation).
        num_microbatches: M.
        transfer: seconds for a boundary value (and, backwards, its gradient) to cross from stage ``j`` to ``j + 1``;
            one number for every boundary or one per boundary (K - 1 entries). Stages on one process pass values
            for free.
        recompute: seconds the re-materialized forward adds to a backward pass, per stage; defaults to ``forward``.
            A split backward pays it in its input gradient only: the weight gradient reuses what it rebuilt.
        checkpoint_stop: micro-batches ``i < checkpoint_stop`` are re-materialized (see
            :func:`~lightning_gpipe.engine.rematerialization.checkpoint_stop`); 0 for none.
        update: seconds of each stage's optimizer step, which follows its last backward pass; the step ends when
            the last stage to finish has stepped (in fill-drain that is stage 0, whose backward ends the step). A
            process holding several stages steps them all after its last action.
        checkpoint_forward: seconds re-materialization adds to the forward pass of a re-materialized micro-batch,
            per stage (the checkpoint wrapper's work in the first pass); none by default.
        first_send_parked: the first value each stage sends forward in a step leaves only once that stage has
            finished its next forward, as over gloo: the receiver posts that receive after it has read the step's
            header, gloo parks a send whose receive is not posted yet, and the parked send moved when its sender
            next called the transport, one forward later (measured in docs/benchmarks/plan.md).
        weight: seconds of the weight-gradient part of each stage's backward, which ``"zero_bubble"`` and ``"zbv"``
            run as an action of its own; the input gradient takes the rest of ``backward``. Defaults to half of it.
        virtual_stages: stages per process for ``"interleaved"`` (the pipeline then has ``len(forward) // v``
            processes; ``"zbv"`` always has two).
        ready: seconds from the step's start before each process can run its first action (its parameters gathered,
            under ``data_parallel="fsdp"``), one per process; none by default.

    Raises:
        ValueError: unknown schedule, mismatched lengths, or negative or non-finite times.
        RuntimeError: the processes' orders are inconsistent with
            :func:`~lightning_gpipe.engine.schedule.dependencies` (a deadlock).
    """
    per_process = len(stages_of(schedule, 0, 1, virtual_stages))  # also refuses an unknown schedule
    S = len(forward)
    if S < 1:
        raise ValueError("forward is empty; give one forward time per stage (at least one stage)")
    if S % per_process:
        raise ValueError(
            f"forward has {S} entries, but schedule={schedule!r} needs a multiple of {per_process} (stages per process)"
        )
    fwd, bwd = _per_stage("forward", forward, S), _per_stage("backward", backward, S)
    weights = [b / 2 for b in bwd] if weight is None else _per_stage("weight", weight, S)
    if any(w > b for w, b in zip(weights, bwd, strict=True)):
        raise ValueError(f"weight holds {weights}, more than backward {bwd}; the weight gradient is part of backward")
    times = _Times(
        fwd,
        bwd,
        fwd if recompute is None else _per_stage("recompute", recompute, S),
        [0.0] * S if checkpoint_forward is None else _per_stage("checkpoint_forward", checkpoint_forward, S),
        weights,
        _per_stage("transfer", transfer, S - 1),
    )
    K = S // per_process
    replay = _Replay(schedule, K, num_microbatches, virtual_stages, times, checkpoint_stop, first_send_parked)
    spans = replay.run([0.0] * K if ready is None else _per_stage("ready", ready, K))
    updates = [0.0] * S if update is None else _per_stage("update", update, S)
    stepped = [sum(updates[s] for s, r in replay.owner.items() if r == p) for p in range(K)]
    makespan = max(process[-1].end + step for process, step in zip(spans, stepped, strict=True))
    return SimulatedStep(schedule, num_microbatches, tuple(map(tuple, spans)), makespan, tuple(stepped))


@dataclass(frozen=True)
class _Times:
    """Seconds of each stage's passes (see :func:`simulate_step`), and of each boundary's transfer."""

    forward: list[float]
    backward: list[float]
    recompute: list[float]  # a re-materialized micro-batch's backward adds this
    wrapped: list[float]  # and its forward this
    weight: list[float]  # the weight-gradient share of a backward
    links: list[float]  # per boundary


class _Replay:
    """One step replayed on the processes: each runs its actions in order, each as soon as its process is free and
    its inputs have arrived."""

    def __init__(
        self, schedule: str, K: int, M: int, virtual_stages: int, times: _Times, checkpoint_stop: int, parked: bool
    ) -> None:
        self.schedule, self.K, self.M = schedule, K, M
        self.times, self.stop, self.parked = times, checkpoint_stop, parked
        self.orders = [cached_process_actions(schedule, r, K, M, virtual_stages) for r in range(K)]
        self.owner = {s: r for r in range(K) for s in stages_of(schedule, r, K, virtual_stages)}
        self.finished: dict[Action, float] = {}

    def duration(self, action: Action) -> float:
        """Seconds ``action`` computes."""
        s, rematerialized, times = action.stage, action.microbatch < self.stop, self.times
        assert s is not None
        if action.phase is Phase.FORWARD:
            return times.forward[s] + (times.wrapped[s] if rematerialized else 0.0)
        if action.phase is Phase.WEIGHT:
            return times.weight[s]
        own = times.backward[s] - times.weight[s] if action.phase is Phase.INPUT else times.backward[s]
        return own + (times.recompute[s] if rematerialized else 0.0)

    def released_by(self, stage: int, dep: Action) -> Action | None:
        """The sender's action whose end lets a parked first send go forward: its next forward on the same stage, if
        it has one (a forward on another of its stages may wait for the very value that is parked)."""
        assert dep.stage is not None
        sender = self.orders[self.owner[dep.stage]]
        if not self.parked or dep.stage >= stage or sender[0] != dep or len(sender) < 2:
            return None
        following = sender[1]
        return following if following.phase is Phase.FORWARD and following.stage == dep.stage else None

    def arrival(self, stage: int, dep: Action) -> float:
        """When ``dep``'s value can be used on ``stage``: one produced on another process crosses their link."""
        assert dep.stage is not None
        end = self.finished[dep]
        if self.owner[dep.stage] == self.owner[stage]:
            return end
        release = self.released_by(stage, dep)
        return max(
            end + self.times.links[min(stage, dep.stage)], self.finished[release] if release is not None else 0.0
        )

    def run(self, starts: list[float]) -> list[list[Span]]:
        """Every process's spans, in its order, each process starting no earlier than its ``starts`` seconds.

        Raises:
            RuntimeError: the processes' orders deadlock.
        """
        spans: list[list[Span]] = [[] for _ in range(self.K)]
        ready = list(range(self.K))
        while ready:
            r = ready.pop()
            while len(spans[r]) < len(self.orders[r]):
                action = self.orders[r][len(spans[r])]
                s = action.stage
                assert s is not None
                deps = _needs(action, len(self.owner))
                releases = [release for dep in deps if (release := self.released_by(s, dep)) is not None]
                if any(dep not in self.finished for dep in [*deps, *releases]):
                    break
                start = max([self.arrival(s, dep) for dep in deps] + [spans[r][-1].end if spans[r] else starts[r]])
                self.finished[action] = end = start + self.duration(action)
                spans[r].append(Span(r, action, start, end))
                ready.extend(n for n in range(self.K) if n != r and n not in ready)
        stuck = {r: str(self.orders[r][len(done)]) for r, done in enumerate(spans) if len(done) < len(self.orders[r])}
        if stuck:
            raise RuntimeError(f"schedule {self.schedule!r} deadlocks with K={self.K}, M={self.M}: stuck {stuck}")
        return spans
