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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpipe.engine.schedule import Action, Phase, dependencies, stage_actions, validate_schedule

__all__ = ["SimulatedStep", "Span", "in_flight", "simulate_step"]


@dataclass(frozen=True)
class Span:
    """One action of one stage in a simulated step: ``[start, end)`` in seconds from the step's start."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulatedStep:
    """The outcome of :func:`simulate_step`: every span, the makespan, and each stage's busy time."""

    schedule: str
    num_microbatches: int
    spans: tuple[tuple[Span, ...], ...]  # per stage, in the stage's order
    makespan: float
    updates: tuple[float, ...] = ()  # per stage: the optimizer step's seconds after its last action

    @property
    def num_stages(self) -> int:
        """K, the number of stages."""
        return len(self.spans)

    @property
    def busy(self) -> tuple[float, ...]:
        """Seconds each stage spends computing (the sum of its spans and its optimizer step)."""
        updates = self.updates or (0.0,) * len(self.spans)
        return tuple(
            sum(span.end - span.start for span in spans) + update
            for spans, update in zip(self.spans, updates, strict=True)
        )

    @property
    def bubble(self) -> float:
        """The idle share of the K stages over the makespan: ``1 - sum(busy) / (K · makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.makespan)


def in_flight(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """The most micro-batches whose forward has run on ``stage`` while their backward has not: what it must keep.

    Fill-drain keeps all ``M``; one-forward-one-backward keeps ``min(K - stage, M)``.
    """
    held = most = 0
    for action in stage_actions(schedule, stage, num_stages, num_microbatches):
        held += 1 if action.phase is Phase.FORWARD else -1
        most = max(most, held)
    return most


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
) -> SimulatedStep:
    """Simulate one training step of a ``len(forward)``-stage pipeline.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        forward: seconds of one micro-batch's forward pass, per stage.
        backward: seconds of one micro-batch's backward pass, per stage (without recomputation).
        num_microbatches: M.
        transfer: seconds for a boundary value (and, backwards, its gradient) to cross from stage ``j`` to ``j + 1``;
            one number for every boundary or one per boundary (K - 1 entries).
        recompute: seconds the re-materialized forward adds to a backward pass, per stage; defaults to ``forward``.
        checkpoint_stop: micro-batches ``i < checkpoint_stop`` are re-materialized (see
            :func:`~lightning_gpipe.engine.rematerialization.checkpoint_stop`); 0 for none.
        update: seconds of each stage's optimizer step, which follows its last backward pass; the step ends when
            the last stage to finish has stepped (in fill-drain that is stage 0, whose backward ends the step).
        checkpoint_forward: seconds re-materialization adds to the forward pass of a re-materialized micro-batch,
            per stage (the checkpoint wrapper's work in the first pass); none by default.
        first_send_parked: the first value each stage sends forward in a step leaves only once that stage has
            finished its next forward, as over gloo: the receiver posts that receive after it has read the step's
            header, gloo parks a send whose receive is not posted yet, and the parked send moved when its sender
            next called the transport (one forward later: 6.4 ms against 0.5-0.8 ms for the step's other messages
            on this project's CPU machines).

    Raises:
        ValueError: unknown schedule, mismatched lengths, or negative or non-finite times.
        RuntimeError: the stages' orders are inconsistent with
            :func:`~lightning_gpipe.engine.schedule.dependencies` (a deadlock).
    """
    schedule = validate_schedule(schedule)
    K = len(forward)
    if K < 1:
        raise ValueError("forward is empty; give one forward time per stage (at least one stage)")
    fwd = _per_stage("forward", forward, K)
    bwd = _per_stage("backward", backward, K)
    extra = fwd if recompute is None else _per_stage("recompute", recompute, K)
    links = _per_stage("transfer", transfer, K - 1)
    updates = [0.0] * K if update is None else _per_stage("update", update, K)
    wrapped = [0.0] * K if checkpoint_forward is None else _per_stage("checkpoint_forward", checkpoint_forward, K)
    M = num_microbatches
    orders = [stage_actions(schedule, j, K, M) for j in range(K)]

    def duration(j: int, action: Action) -> float:
        rematerialized = action.microbatch < checkpoint_stop
        if action.phase is Phase.FORWARD:
            return fwd[j] + (wrapped[j] if rematerialized else 0.0)
        return bwd[j] + (extra[j] if rematerialized else 0.0)

    def released_by(j: int, dep: tuple[int, Action]) -> tuple[int, Action] | None:
        # The sender's action whose end lets a parked first send go: its next forward, if it has one.
        other, action = dep
        if not first_send_parked or other >= j or orders[other][0] != action or len(orders[other]) < 2:
            return None
        following = orders[other][1]
        return (other, following) if following.phase is Phase.FORWARD else None

    def arrival(j: int, dep: tuple[int, Action], end: float) -> float:
        # A value produced on another stage crosses the link between the two before it can be used.
        other = dep[0]
        if other == j:
            return end
        release = released_by(j, dep)
        return max(end + links[min(j, other)], finished[release] if release is not None else 0.0)

    finished: dict[tuple[int, Action], float] = {}
    spans: list[list[Span]] = [[] for _ in range(K)]
    ready = list(range(K))
    while ready:
        j = ready.pop()
        while len(spans[j]) < len(orders[j]):
            action = orders[j][len(spans[j])]
            deps = dependencies(j, action, K)
            releases = [release for dep in deps if (release := released_by(j, dep)) is not None]
            if any(dep not in finished for dep in [*deps, *releases]):
                break
            start = max([arrival(j, dep, finished[dep]) for dep in deps] + [spans[j][-1].end if spans[j] else 0.0])
            end = start + duration(j, action)
            finished[(j, action)] = end
            spans[j].append(Span(j, action, start, end))
            ready.extend(n for n in (j - 1, j + 1) if 0 <= n < K and n not in ready)
    stuck = {j: str(orders[j][len(done)]) for j, done in enumerate(spans) if len(done) < len(orders[j])}
    if stuck:
        raise RuntimeError(f"schedule {schedule!r} deadlocks with K={K}, M={M}: stuck {stuck}")
    makespan = max(stage[-1].end + updates[j] for j, stage in enumerate(spans))
    return SimulatedStep(schedule, M, tuple(tuple(stage) for stage in spans), makespan, tuple(updates))
