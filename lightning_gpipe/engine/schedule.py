"""Pipeline schedules: the ordered actions of each stage.

A schedule says, for every stage of a pipeline, in which order it runs the forward and backward pass of each
micro-batch. It is pure Python (no torch) so that it can be reasoned about and tested without devices; the stage
executor walks :func:`stage_actions` and blocks on the transfers that :func:`dependencies` names.

- ``"gpipe"``: fill-drain, as in the paper and torchgpipe. Every stage runs all forwards, then all backwards in
  reverse micro-batch order: the last micro-batch's backward can start as soon as its forward ends, which is why
  re-materialization mode ``"except_last"`` spares that micro-batch.
- ``"1f1b"``: one-forward-one-backward (PipeDream-Flush). Same makespan, hence the same bubble, as fill-drain when
  every stage takes the same time per pass, but stage ``j`` holds at most ``min(K - j, M)`` micro-batches'
  activations at once instead of ``M``. Backwards run in micro-batch order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "SCHEDULES",
    "Action",
    "Phase",
    "bubble_fraction",
    "clock_cycles",
    "dependencies",
    "stage_actions",
    "validate_schedule",
]

# Index legend, used throughout the engine:
#   i: index of micro-batch, 0 <= i < M
#   j: index of stage (partition, cell), 0 <= j < K
#   K: number of stages in one pipeline (``pipe_size``)
#   M: number of micro-batches per mini-batch (``chunks``)
#   F(i) / B(i): forward / backward pass of micro-batch i on one stage

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
"""The schedules: GPipe's fill-drain (all forwards, then all backwards) and one-forward-one-backward."""


class Phase(str, Enum):
    """The pass an action runs on a micro-batch."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch on one stage; prints as ``F3`` or ``B0``."""

    phase: Phase
    microbatch: int

    def __post_init__(self) -> None:
        # Accept "forward"/"backward" so that actions rebuilt from plain records compare equal to the originals.
        object.__setattr__(self, "phase", Phase(self.phase))
        if isinstance(self.microbatch, bool) or not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ValueError(f"Action.microbatch must be an int >= 0, got {self.microbatch!r}")

    def __str__(self) -> str:
        return ("F" if self.phase is Phase.FORWARD else "B") + str(self.microbatch)


def validate_schedule(name: object) -> str:
    """Return ``name`` if it is a known schedule, else raise ``ValueError`` listing the valid ones."""
    if isinstance(name, str) and name in SCHEDULES:
        return name
    valid = ", ".join(repr(s) for s in SCHEDULES)
    raise ValueError(f"Unknown pipeline schedule {name!r}. HINT: use one of {valid}.")


_COUNT_HINTS = {
    "num_stages": "a pipeline has at least one stage (pipe_size >= 1)",
    "num_microbatches": "split each mini-batch into at least one micro-batch (chunks >= 1)",
}


def _check_count(name: str, value: object) -> int:
    # bool is an int subclass; True stages or micro-batches is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}. HINT: {_COUNT_HINTS[name]}.")
    return value


def _check_stage(stage: object, num_stages: object) -> tuple[int, int]:
    K = _check_count("num_stages", num_stages)
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"stage must be an int, got {stage!r} of type {type(stage).__name__}.")
    if not 0 <= stage < K:
        raise ValueError(
            f"stage must satisfy 0 <= stage < num_stages = {K}, got stage={stage}. HINT: stages count from 0."
        )
    return stage, K


def stage_actions(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """The ordered actions that stage ``stage`` of a ``num_stages``-stage pipeline runs for one mini-batch."""
    schedule = validate_schedule(schedule)
    j, K = _check_stage(stage, num_stages)
    M = _check_count("num_microbatches", num_microbatches)
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

    The order of a stage's own actions is not a dependency here: it is given by :func:`stage_actions`.
    """
    j, K = _check_stage(stage, num_stages)
    i = action.microbatch
    if action.phase is Phase.FORWARD:
        return [(j - 1, action)] if j > 0 else []
    deps = [(j, Action(Phase.FORWARD, i))]
    if j < K - 1:
        deps.append((j + 1, action))
    return deps


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
