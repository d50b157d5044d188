"""Pipeline schedules: the ordered actions of each stage.

A schedule says, for every stage of a pipeline, in which order it runs the forward and backward pass of each
micro-batch. It is pure Python (no torch) so that it can be reasoned about and tested without devices; each process's
step (:class:`~lightning_gpipe.engine.step.StepRun`) walks its actions and blocks on the transfers that
:func:`dependencies` names.

- ``"gpipe"``: fill-drain, as in the paper and torchgpipe. Every stage runs all forwards, then all backwards in
  reverse micro-batch order: the last micro-batch's backward can start as soon as its forward ends, which is why
  re-materialization mode ``"except_last"`` spares that micro-batch.
- ``"1f1b"``: one-forward-one-backward (PipeDream-Flush). Same makespan, hence the same bubble, as fill-drain when
  every stage takes the same time per pass, but stage ``j`` holds at most ``min(K - j, M)`` micro-batches'
  activations at once instead of ``M``. Backwards run in micro-batch order.

Three more schedules split the backward or place several stages on each process, so their actions name their stage
and come per process (:func:`process_actions`, the stages of each process :func:`stages_of`); ``"zero_bubble"`` holds
one stage per process (:func:`stage_actions` gives its actions too):

- ``"interleaved"``: Megatron-LM's interleaved 1F1B (Narayanan et al., 2021). Each of the K processes holds
  ``v = virtual_stages`` stages, process ``r`` the stages ``r, r + K, r + 2K, ...``; the bubble shrinks ``v`` times
  to ``(K-1)/(v·M + K-1)`` of the step, for more activations in flight and ``v`` times the transfers.
- ``"zero_bubble"``: ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"). 1F1B with each backward split into
  the input gradient I (sent on at once) and the weight gradient W, which nothing waits for: stage ``r`` defers its
  W by ``r`` micro-batches into the drain's bubble, which shrinks to a third of 1F1B's when F, I and W take equal time.
- ``"zbv"``: ZB-V (same paper). Two stages per process in a V, process ``r`` holding stages ``r`` and ``2K-1-r``,
  with split backwards: no bubble in the steady state when F, I and W take equal time, at 1F1B's activation memory.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "MULTI_STAGE",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "Action",
    "Phase",
    "StepOrder",
    "bubble_fraction",
    "cached_process_actions",
    "clock_cycles",
    "dependencies",
    "interleaved_round",
    "process_actions",
    "process_of",
    "stage_actions",
    "stage_table",
    "stages_of",
    "stages_per_process",
    "step_order",
    "validate_schedule",
]

# Index legend, used throughout the engine:
#   i: index of micro-batch, 0 <= i < M
#   j: index of stage (partition, cell), 0 <= j < K
#   K: number of stages in one pipeline (``pipe_size``)
#   M: number of micro-batches per mini-batch (``chunks``)
#   F(i) / B(i): forward / backward pass of micro-batch i on one stage
#   I(i) / W(i): the two halves of B(i) in zero-bubble schedules: input gradient, then weight gradient
#   r: index of process (rank in the pipeline), 0 <= r < K; v: stages per process (``virtual_stages``)
#   s: index of stage when a process holds several, 0 <= s < K·v

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "zero_bubble", "interleaved", "zbv")
"""The schedules: GPipe's fill-drain (all forwards, then all backwards), one-forward-one-backward, ZB-H1, and the two
that place several stages on each process, interleaved 1F1B and ZB-V."""

SPLIT_BACKWARD: frozenset[str] = frozenset({"zero_bubble", "zbv"})
"""The schedules whose backward is split into the input gradient I and the weight gradient W."""

MULTI_STAGE: frozenset[str] = frozenset({"interleaved", "zbv"})
"""The schedules whose processes hold several stages, so that their actions come per process."""


class Phase(str, Enum):
    """The pass an action runs on a micro-batch."""

    FORWARD = "forward"
    BACKWARD = "backward"  # the whole backward pass
    INPUT = "input"  # zero-bubble: the backward for the stage's input gradient, which the previous stage waits for
    WEIGHT = "weight"  # zero-bubble: the backward for the parameters' gradients, which no other stage waits for


_LETTERS = {Phase.FORWARD: "F", Phase.BACKWARD: "B", Phase.INPUT: "I", Phase.WEIGHT: "W"}


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch on one stage; prints as ``F3`` or ``B0``, and ``I2@5`` when it names its stage.

    :func:`stage_actions` leaves ``stage`` out (the stage is the one asking); :func:`process_actions` sets it, since
    a process may hold several stages.
    """

    phase: Phase
    microbatch: int
    stage: int | None = None

    def __post_init__(self) -> None:
        # Accept "forward"/"backward" so that actions rebuilt from plain records compare equal to the originals.
        object.__setattr__(self, "phase", Phase(self.phase))
        if isinstance(self.microbatch, bool) or not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ValueError(f"Action.microbatch must be an int >= 0, got {self.microbatch!r}")
        if self.stage is not None and (
            isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0
        ):
            raise ValueError(f"Action.stage must be an int >= 0 or None, got {self.stage!r}")

    def __str__(self) -> str:
        name = _LETTERS[self.phase] + str(self.microbatch)
        return name if self.stage is None else f"{name}@{self.stage}"


def validate_schedule(name: object) -> str:
    """Return ``name`` if it is a known schedule, else raise ``ValueError`` listing the valid ones."""
    if isinstance(name, str) and name in SCHEDULES:
        return name
    valid = ", ".join(repr(s) for s in SCHEDULES)
    raise ValueError(f"Unknown pipeline schedule {name!r}; use one of {valid}")


_COUNT_HINTS = {
    "num_stages": "a pipeline has at least one stage (pipe_size >= 1)",
    "num_microbatches": "split each mini-batch into at least one micro-batch (chunks >= 1)",
    "num_processes": "a pipeline has at least one process (pipe_size >= 1)",
}


def _check_count(name: str, value: object) -> int:
    # bool is an int subclass; True stages or micro-batches is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}; {_COUNT_HINTS[name]}")
    return value


def _check_stage(stage: object, num_stages: object) -> tuple[int, int]:
    K = _check_count("num_stages", num_stages)
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"stage must be an int, got {stage!r} of type {type(stage).__name__}.")
    if not 0 <= stage < K:
        raise ValueError(f"stage must satisfy 0 <= stage < num_stages = {K}, got stage={stage}")
    return stage, K


def stage_actions(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """The ordered actions that stage ``stage`` of a ``num_stages``-stage pipeline runs for one mini-batch."""
    schedule = validate_schedule(schedule)
    if schedule in MULTI_STAGE:
        raise ValueError(f"schedule={schedule!r} places several stages on each process; use process_actions()")
    j, K = _check_stage(stage, num_stages)
    return _stage_actions(schedule, j, K, _check_count("num_microbatches", num_microbatches))


def _stage_actions(schedule: str, j: int, K: int, M: int) -> list[Action]:
    """:func:`stage_actions` of checked values (a schedule of one stage per process)."""
    if schedule == "zero_bubble":
        return [Action(action.phase, action.microbatch) for action in _zero_bubble_h1(j, K, M)]
    forwards = [Action(Phase.FORWARD, i) for i in range(M)]
    if schedule == "gpipe":
        return forwards + [Action(Phase.BACKWARD, i) for i in reversed(range(M))]

    # 1F1B: stage j must have K-1-j forwards in flight before the first backward can come back down to it.
    backwards = [Action(Phase.BACKWARD, i) for i in range(M)]
    warmup = min(K - 1 - j, M)
    actions = forwards[:warmup]
    for i in range(M - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[M - warmup :]


def dependencies(stage: int, action: Action, num_stages: int) -> list[tuple[int, Action]]:
    """The ``(stage, action)`` pairs that must finish before ``action`` can run on ``stage``.

    F(i) on stage ``s`` follows F(i) on ``s - 1``; B(i), or I(i), follows F(i) on ``s`` and B(i), or I(i), on ``s + 1``;
    W(i) follows I(i) on ``s``. ``num_stages`` counts every stage (``K·v`` when each process holds ``v``). The
    returned actions name their stage when ``action`` does. The order of a process's own actions is not a dependency
    here: it is given by :func:`stage_actions` or :func:`process_actions`.
    """
    j, K = _check_stage(stage, num_stages)
    if action.stage is not None and action.stage != j:
        raise ValueError(f"{action} runs on stage {action.stage}, not on stage={j}; pass stage=action.stage")
    i = action.microbatch

    def on(s: int, phase: Phase) -> tuple[int, Action]:
        return s, Action(phase, i, None if action.stage is None else s)

    if action.phase is Phase.FORWARD:
        return [on(j - 1, Phase.FORWARD)] if j > 0 else []
    if action.phase is Phase.WEIGHT:
        return [on(j, Phase.INPUT)]
    deps = [on(j, Phase.FORWARD)]
    if j < K - 1:
        deps.append(on(j + 1, action.phase))
    return deps


def stages_per_process(schedule: str, virtual_stages: object) -> int:
    """The number of stages each process holds under ``schedule``, from the user's ``virtual_stages`` (checked here:
    ``"interleaved"`` takes 2 or more, ``"zbv"`` 1 or 2 and always holds two, the others take 1)."""
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise TypeError(
            f"virtual_stages must be an int, got {virtual_stages!r} of type {type(virtual_stages).__name__}."
        )
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ValueError(
                f"schedule='interleaved' needs virtual_stages >= 2 (stages per process), got {virtual_stages}; pass "
                "virtual_stages=2"
            )
        return virtual_stages
    if schedule == "zbv" and virtual_stages in (1, 2):
        return 2  # the V always places two stages on each process
    if virtual_stages != 1:
        fixed = "; schedule='zbv' always places 2" if schedule == "zbv" else ""
        raise ValueError(
            f"virtual_stages={virtual_stages} applies to schedule='interleaved' only{fixed}; leave it at 1"
        )
    return 1


def _check_process(
    schedule: object, rank: object, num_processes: object, virtual_stages: object
) -> tuple[str, int, int, int]:
    schedule = validate_schedule(schedule)
    v = stages_per_process(schedule, virtual_stages)
    K = _check_count("num_processes", num_processes)
    return schedule, _check_rank(rank, K), K, v


def _check_rank(rank: object, K: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {rank!r} of type {type(rank).__name__}.")
    if not 0 <= rank < K:
        raise ValueError(f"rank must satisfy 0 <= rank < num_processes = {K}, got rank={rank}")
    return rank


def stages_of(schedule: str, rank: int, num_processes: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The stages process ``rank`` of ``num_processes`` holds, first to last in the model.

    One stage per process (``(rank,)``) but for ``"interleaved"`` (``rank, rank + K, ..., rank + (v-1)·K``) and
    ``"zbv"`` (``rank, 2K-1-rank``). The pipeline has ``num_processes · len(stages_of(...))`` stages in all.
    """
    return _stages_of(*_check_process(schedule, rank, num_processes, virtual_stages))


@functools.lru_cache(maxsize=None, typed=True)
def stage_table(schedule: str, num_processes: int, virtual_stages: int = 1) -> tuple[tuple[int, ...], ...]:
    """Every process's :func:`stages_of`, process ``r``'s at ``r``: built and checked once per arguments, and what
    the layout, the pipeline and the step orders read (the schedule is checked once, not at each of them)."""
    K = _check_count("num_processes", num_processes)
    return tuple(stages_of(schedule, r, K, virtual_stages) for r in range(K))


def _stages_of(schedule: str, r: int, K: int, v: int) -> tuple[int, ...]:
    """:func:`stages_of` of checked values."""
    if schedule == "zbv":
        return (r, 2 * K - 1 - r)
    return tuple(r + c * K for c in range(v))


def interleaved_round(num_processes: int, num_microbatches: int) -> int:
    """Micro-batches that go through one of a process's stages before it moves to the next (a round's size).

    Megatron-LM's interleaved schedule asks for M a multiple of K (Megatron-Core's
    ``forward_backward_pipelining_with_interleaving``: "number of microbatches is not divisible by
    pipeline-model-parallel-size"), and uses rounds of K. We follow the relaxed rule of torch's
    ``ScheduleInterleaved1F1B`` (torch 2.13, ``schedules.py``), which takes every such M and more: rounds of
    ``M // max(1, M // K)`` micro-batches, so M must be a multiple of ``max(1, M // K)`` (any M <= K, or M a multiple
    of K, or e.g. K=4, M=10).
    """
    K, M = num_processes, num_microbatches
    rounds = max(1, M // K)
    if M % rounds:
        fits = sorted({M - M % K, M - M % K + K} - {0})
        raise ValueError(
            f"schedule='interleaved' cannot split chunks={M} into rounds of about pipe_size={K}; use chunks <= {K} or "
            f"a multiple of {K}, such as {' or '.join(str(m) for m in fits)}"
        )
    return M // rounds


def _interleaved(r: int, K: int, M: int, v: int) -> list[Action]:
    # The k-th forward (and backward) of the process walks its v stages in rounds of g micro-batches; backwards walk
    # the stages from the last. The warm-up runs enough forwards that the first backward is back before the 1F1B part.
    g = interleaved_round(K, M)

    def nth(k: int, phase: Phase) -> Action:
        chunk = (k // g) % v
        microbatch = (k // (g * v)) * g + k % g
        return Action(phase, microbatch, r + K * (chunk if phase is Phase.FORWARD else v - 1 - chunk))

    total = v * M
    warmup = min((v - 1) * g + 2 * (K - 1 - r), total)
    actions = [nth(k, Phase.FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [nth(warmup + k, Phase.FORWARD), nth(k, Phase.BACKWARD)]
    return actions + [nth(k, Phase.BACKWARD) for k in range(total - warmup, total)]


def _zero_bubble_h1(r: int, K: int, M: int) -> list[Action]:
    # 1F1B's order with B(i) split into I(i), W(i): stage r runs its W r micro-batches late, so that the last stages'
    # W fill the drain while I, the critical path, goes down the pipeline at once. In flight (F done, W not): K.
    warmup = min(K - 1 - r, M)
    actions = [Action(Phase.FORWARD, i, r) for i in range(warmup)]
    weights = 0
    for i in range(M):
        if warmup + i < M:
            actions.append(Action(Phase.FORWARD, warmup + i, r))
        actions.append(Action(Phase.INPUT, i, r))
        if i >= r:
            actions.append(Action(Phase.WEIGHT, weights, r))
            weights += 1
    return actions + [Action(Phase.WEIGHT, i, r) for i in range(weights, M)]


def _zbv(r: int, K: int, M: int) -> list[Action]:
    # ZB-V (Qi et al., 2024, section 6): the down stage a = r and the up stage b = 2K-1-r. Built for at least
    # 2K-1 micro-batches, the ones beyond M then dropped (a subset of a deadlock-free order stays deadlock-free).
    a, b = r, 2 * K - 1 - r
    n = max(2 * K - 1, M)
    count = {(phase, stage): 0 for phase in (Phase.FORWARD, Phase.INPUT, Phase.WEIGHT) for stage in (a, b)}
    order: list[Action] = []

    def run(phase: Phase, stage: int) -> None:
        order.append(Action(phase, count[phase, stage], stage))
        count[phase, stage] += 1

    for _ in range(2 * (K - r) - 1):  # down the V until the first micro-batch turns at the bottom
        run(Phase.FORWARD, a)
    for _ in range(r):
        run(Phase.FORWARD, b)
        run(Phase.FORWARD, a)
    for _ in range(K - r):  # up stage's first backwards come at once
        for phase in (Phase.FORWARD, Phase.INPUT, Phase.WEIGHT):
            run(phase, b)
    while count[Phase.FORWARD, b] < count[Phase.FORWARD, a] or count[Phase.FORWARD, a] < n:  # steady: F I W, twice
        if count[Phase.FORWARD, a] < n:
            run(Phase.FORWARD, a)
        run(Phase.INPUT, a)
        run(Phase.WEIGHT, a)
        for phase in (Phase.FORWARD, Phase.INPUT, Phase.WEIGHT):
            run(phase, b)
    for _ in range(r):  # drain: input gradients first, the weight gradients fill in after
        run(Phase.INPUT, a)
        run(Phase.INPUT, b)
    for _ in range(K - r):
        run(Phase.INPUT, a)
        run(Phase.WEIGHT, a)
    for stage in (b, a):
        while count[Phase.WEIGHT, stage] < count[Phase.INPUT, stage]:
            run(Phase.WEIGHT, stage)
    return [action for action in order if action.microbatch < M]


def process_actions(
    schedule: str, rank: int, num_processes: int, num_microbatches: int, virtual_stages: int = 1
) -> list[Action]:
    """The ordered actions, each naming its stage, that process ``rank`` of ``num_processes`` runs for one mini-batch.

    For ``"gpipe"``, ``"1f1b"`` and ``"zero_bubble"`` these are :func:`stage_actions` with the stage set. The
    process's stages are :func:`stages_of`; every action of every stage it holds appears once, in an order that never
    deadlocks under :func:`dependencies` across all processes.

    Raises:
        ValueError: an unknown schedule, ``virtual_stages`` that the schedule does not take, or (``"interleaved"``) a
            number of micro-batches its rounds cannot split.
    """
    schedule, r, K, v = _check_process(schedule, rank, num_processes, virtual_stages)
    return _process_actions(schedule, r, K, _check_count("num_microbatches", num_microbatches), v)


def _process_actions(schedule: str, r: int, K: int, M: int, v: int) -> list[Action]:
    """:func:`process_actions` of checked values."""
    if schedule == "interleaved":
        return _interleaved(r, K, M, v)
    if schedule == "zbv":
        return _zbv(r, K, M)
    return [Action(a.phase, a.microbatch, r) for a in _stage_actions(schedule, r, K, M)]


@functools.lru_cache(maxsize=None, typed=True)
def cached_process_actions(
    schedule: str, rank: int, num_processes: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[Action, ...]:
    """:func:`process_actions`, built and checked once per ``(schedule, rank, K, M, v)`` and shared by every step."""
    return tuple(process_actions(schedule, rank, num_processes, num_microbatches, virtual_stages))


@functools.lru_cache(maxsize=None, typed=True)
def process_of(schedule: str, stage: int, num_processes: int, virtual_stages: int = 1) -> int:
    """The process that holds ``stage`` (of ``K·v``) under ``schedule``: the ``rank`` whose :func:`stages_of` has it."""
    table = stage_table(schedule, num_processes, virtual_stages)
    for rank, held in enumerate(table):
        if stage in held:
            return rank
    per_process = len(table[0])
    raise ValueError(
        f"stage={stage!r} is not among stages 0 to {num_processes * per_process - 1} of schedule={schedule!r} on "
        f"{num_processes} processes"
    )


_SENDS_GRADIENT = (Phase.BACKWARD, Phase.INPUT)  # the passes after which a stage sends its input's gradient


@dataclass(frozen=True)
class StepOrder:
    """A process's actions for one step, and what its step reads of them, derived once (:func:`step_order`)."""

    stages: tuple[int, ...]  # the stages the process holds, in model order
    actions: tuple[Action, ...]  # naming their stage where the process holds several
    forward_span: int  # the actions up to and including the last forward: those a user's step drives
    backward_before_last_forward: bool  # a backward runs among those (all training orders but "gpipe"'s)
    split: bool  # the backwards are split into input and weight passes
    gradient_orders: dict[int, tuple[int, ...]]  # per held stage but the last, the next stage's backward order


@functools.lru_cache(maxsize=None, typed=True)  # typed: rank=True must not find rank=1's order
def step_order(
    schedule: str, rank: int, num_processes: int, num_microbatches: int, virtual_stages: int = 1, training: bool = True
) -> StepOrder:
    """The :class:`StepOrder` of process ``rank`` of ``num_processes`` for a step of ``num_microbatches``, built and
    checked once per arguments and shared by every step.

    A training step runs the schedule's actions: :func:`stage_actions` (no stage named) where each process holds one
    stage, :func:`process_actions` where it holds several. An evaluation step runs forwards only: in micro-batch
    order, stage after stage where the process holds several (an order that needs no backward to make room).
    """
    table = stage_table(schedule, num_processes, virtual_stages)
    K, v = len(table), len(table[0])
    r, M = _check_rank(rank, K), _check_count("num_microbatches", num_microbatches)
    held = table[r]
    several = schedule in MULTI_STAGE
    if not training:
        actions = tuple(Action(Phase.FORWARD, i, s if several else None) for s in held for i in range(M))
        return StepOrder(held, actions, len(actions), False, False, {})
    actions = tuple(_process_actions(schedule, r, K, M, v) if several else _stage_actions(schedule, r, K, M))
    forwards = [k for k, action in enumerate(actions) if action.phase is Phase.FORWARD]
    span = forwards[-1] + 1
    owner = {s: p for p, stages in enumerate(table) for s in stages}
    orders = {}
    for stage in held:
        if stage + 1 in owner:  # the next stage's backward order, as its process runs it
            later = _process_actions(schedule, owner[stage + 1], K, M, v)
            orders[stage] = tuple(a.microbatch for a in later if a.stage == stage + 1 and a.phase in _SENDS_GRADIENT)
    early = any(action.phase is not Phase.FORWARD for action in actions[:span])
    return StepOrder(held, actions, span, early, any(action.phase is Phase.INPUT for action in actions), orders)


def clock_cycles(num_microbatches: int, num_stages: int) -> Iterator[list[tuple[int, int]]]:
    """The forward passes that run together in each clock cycle of a lockstep pipeline, as ``(i, j)`` pairs.

    ::

        k  (i,j) (i,j) (i,j)        M = 3 micro-batches, K = 3 stages
        -  ----- ----- -----
        0  (0,0)
        1  (1,0) (0,1)
        2  (2,0) (1,1) (0,2)
        3        (2,1) (1,2)
        4              (2,2)
    """
    M = _check_count("num_microbatches", num_microbatches)
    K = _check_count("num_stages", num_stages)
    for k in range(M + K - 1):
        yield [(k - j, j) for j in range(max(0, k - M + 1), min(k + 1, K))]


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction ``(K-1)/(M+K-1)`` of each stage under fill-drain with equal-length passes."""
    K = _check_count("num_stages", num_stages)
    M = _check_count("num_microbatches", num_microbatches)
    return (K - 1) / (M + K - 1)
