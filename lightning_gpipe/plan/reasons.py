"""Why the planner chose what it chose: the reasons a :class:`~lightning_gpipe.plan.result.Plan` lists, one per
pipeline size, schedule, re-materialization mode and micro-batch count it did not choose, and why its replicas hold
the stages whole or sharded."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES
from lightning_gpipe.engine.schedule import SCHEDULES
from lightning_gpipe.plan.result import Candidate, format_bytes
from lightning_gpipe.plan.sharding import PlannedDataParallel

__all__ = ["data_parallel_reason", "not_weighed", "reasons"]


def reasons(best: Candidate, every: list[Candidate], budget: float, skipped: Sequence[str] = ()) -> list[str]:
    """Why ``best`` among ``every`` candidate weighed, for ``budget`` bytes per device, after the reasons ``skipped``
    gives for what was not weighed; the last one says why ``best``."""
    why = _Why(best, every, budget)
    return [
        *skipped,
        *why.pipe_sizes(),
        *why.schedules(),
        *why.checkpoints(),
        *why.chunks(),
        f"chosen: the fastest configuration that fits, {why.speed(best)}, bubble {best.bubble:.0%}, peak "
        f"{format_bytes(best.peak)} of {format_bytes(budget)}",
    ]


def data_parallel_reason(
    best: Candidate, requested: PlannedDataParallel, whole: Sequence[Candidate], budget: float
) -> list[str]:
    """Why ``best``'s replicas hold their stages whole or sharded, for a request of ``requested``; ``whole`` are the
    candidates with whole replicas that ``"auto"`` weighed first, when none of them fit ``budget``."""
    R = best.replicas
    if best.data_parallel == "fsdp":
        if not whole:
            return [f"data_parallel='fsdp', as asked: each stage is sharded over its {R} replicas"]
        least = min(whole, key=lambda c: c.peak)
        return [
            f"data_parallel='fsdp': nothing fits with whole replicas ('ddp': at best {format_bytes(least.peak)} per "
            f"device > {format_bytes(budget)}, with {least.label()}); sharded over its {R} replicas, a stage holds "
            f"1/{R} of its parameters, gradients and optimizer state between steps, and its parameters gathered "
            "whole during each step"
        ]
    if requested == "fsdp" and R == 1:
        return [f"data_parallel='ddp': at K={best.pipe_size} each stage has a single replica, nothing to shard over"]
    if requested == "auto" and R > 1:
        return [
            f"data_parallel='ddp': the stages fit whole on each of their {R} replicas; 'fsdp' is weighed only when "
            "nothing fits whole (ask for it with data_parallel='fsdp')"
        ]
    return []


def not_weighed(schedule: str, K: int, layers: int) -> str:
    """Why ``schedule``, several stages per process, was not weighed at the chosen K: ``K = 1``, or no
    ``virtual_stages`` and M whose stages the ``layers`` fill and whose rounds split M."""
    if K == 1:
        why = "at K=1 its stages would share one process, which only adds the engine's cost per stage"
    elif schedule == "zbv":
        why = f"its {2 * K} stages need at least as many layers, and the model has {layers}"
    else:
        why = (
            f"it needs K·v stages of at least one layer each ({layers} layers) and M in rounds of about K "
            f"micro-batches (M <= {K} or a multiple of {K}), which no weighed M and virtual_stages gave"
        )
    return f"schedule={schedule!r} is not weighed at K={K}: {why}"


class _Why:
    """The candidates compared with the chosen one, setting by setting."""

    def __init__(self, best: Candidate, every: list[Candidate], budget: float) -> None:
        self.best, self.every, self.budget = best, every, budget
        # With a batch per pipeline, K decides how many samples a step trains on: only times per sample compare.
        self.per_sample = len({c.samples for c in every}) > 1
        self.same_pipe = [c for c in every if c.pipe_size == best.pipe_size]
        self.same_schedule = [
            c for c in self.same_pipe if (c.schedule, c.virtual_stages) == (best.schedule, best.virtual_stages)
        ]

    def speed(self, candidate: Candidate) -> str:
        """A candidate's predicted speed, per sample first when candidates train on different numbers of samples."""
        step = f"{candidate.step_time * 1e3:.1f} ms per step"
        if not self.per_sample:
            return step
        pipelines = f"{candidate.replicas} pipelines of {candidate.samples // candidate.replicas}"
        shape = f", {pipelines}" if candidate.replicas > 1 else ""
        return f"{candidate.time_per_sample * 1e3:.3g} ms per sample ({step} of {candidate.samples} samples{shape})"

    def _fastest(self, pool: list[Candidate]) -> Candidate | None:
        fits = [c for c in pool if c.peak <= self.budget]
        return min(fits, key=lambda c: c.preference) if fits else None

    def _as_fast(self, candidate: Candidate) -> bool:
        return candidate.preference[0] == self.best.preference[0]

    def pipe_sizes(self) -> list[str]:
        found: list[str] = []
        for K in sorted({c.pipe_size for c in self.every} - {self.best.pipe_size}):
            pool = [c for c in self.every if c.pipe_size == K]
            fits = self._fastest(pool)
            if fits is None:
                least = min(pool, key=lambda c: c.peak)
                found.append(
                    f"K={K} does not fit: at best {format_bytes(least.peak)} per device > {format_bytes(self.budget)}"
                )
            elif self._as_fast(fits):
                found.append(
                    f"K={K} fits and is as fast, {self.speed(fits)}, but peaks at {format_bytes(fits.peak)}, at best "
                    f"with {fits.label()}"
                )
            else:
                found.append(f"K={K} fits but is slower: {self.speed(fits)}, at best with {fits.label()}")
        return found

    def schedules(self) -> list[str]:
        found: list[str] = []
        chosen = (self.best.schedule, self.best.virtual_stages)
        variants = {(c.schedule, c.virtual_stages) for c in self.same_pipe} - {chosen}
        for variant in sorted(variants, key=lambda s: (SCHEDULES.index(s[0]), s[1])):
            pool = [c for c in self.same_pipe if (c.schedule, c.virtual_stages) == variant]
            name, fits = pool[0].schedule_label, self._fastest(pool)
            if fits is None:
                least = min(pool, key=lambda c: c.peak)
                found.append(
                    f"{name} does not fit: at best {format_bytes(least.peak)} with M={least.chunks}, "
                    f"checkpoint={least.checkpoint!r}"
                )
            elif self._as_fast(fits):
                found.append(
                    f"{name} is as fast, peaking at {format_bytes(fits.peak)} with M={fits.chunks}, "
                    f"checkpoint={fits.checkpoint!r}"
                )
            else:
                found.append(
                    f"{name} is slower: {self.speed(fits)}, bubble {fits.bubble:.0%}, at best with "
                    f"M={fits.chunks}, checkpoint={fits.checkpoint!r}"
                )
        return found

    def checkpoints(self) -> list[str]:
        found: list[str] = []
        for mode in CHECKPOINT_MODES:
            pool = [c for c in self.same_schedule if c.checkpoint == mode]
            if mode == self.best.checkpoint or not pool:
                continue
            fits = self._fastest(pool)
            if fits is None:
                least = min(pool, key=lambda c: c.peak)
                least_bytes = format_bytes(least.peak)
                found.append(f"checkpoint={mode!r} does not fit: at best {least_bytes} with M={least.chunks}")
            elif self._as_fast(fits):
                peak = format_bytes(fits.peak)
                found.append(f"checkpoint={mode!r} is as fast, peaking at {peak} with M={fits.chunks}")
            else:
                found.append(
                    f"checkpoint={mode!r} is slower: {fits.step_time * 1e3:.1f} ms per step with M={fits.chunks}"
                )
        return found

    def chunks(self) -> list[str]:
        found: list[str] = []
        for count in sorted({c.chunks for c in self.same_schedule} - {self.best.chunks}):
            pool = [c for c in self.same_schedule if c.chunks == count and c.checkpoint == self.best.checkpoint]
            fits = self._fastest(pool)
            if fits is None and pool:
                found.append(f"M={count} does not fit ({format_bytes(min(c.peak for c in pool))})")
            elif fits is not None:
                found.append(f"M={count}: {fits.step_time * 1e3:.1f} ms per step, bubble {fits.bubble:.0%}")
        return found
