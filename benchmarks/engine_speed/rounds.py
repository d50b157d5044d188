"""Interleaved rounds of measurements under a time budget, with a quiet-machine gate and retries of loaded windows.

Shared by the throughput benchmarks (``engine_speed``, ``zoo_throughput``): a round runs every job of a fixed list
once, in order, each in fresh processes; windows with foreign load are retried while the budget allows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from benchmarks.engine_speed.cpuload import idle_foreign_cores
from benchmarks.engine_speed.results import Measurement
from benchmarks.engine_speed.worker import Job, JobRunner
from tools.launch import JobError, JobTimeoutError

__all__ = ["Budget", "Session", "progress_bar", "run_rounds"]


class Budget(Protocol):
    """How many rounds to run, in how much time, and when a window counts as loaded."""

    @property
    def rounds(self) -> int: ...
    @property
    def min_rounds(self) -> int: ...  # always run; further rounds only while the time budget allows
    @property
    def budget_seconds(self) -> float: ...
    @property
    def foreign_threshold(self) -> float: ...  # cores of foreign load above which a window is retried
    @property
    def max_retries(self) -> int: ...
    @property
    def max_quiet_wait(self) -> float: ...  # seconds to wait for a quiet machine before a window
    @property
    def job_timeout(self) -> float: ...


class Session:
    """Runs jobs with a quiet-machine gate and retries, within the time budget; keeps every attempt.

    ``step_guess(job)`` is the seconds one step of ``job`` is expected to take, used to budget a job before it has
    run once.
    """

    def __init__(
        self, plan: Budget, launcher: JobRunner, log: Callable[[str], None], step_guess: Callable[[Job], float]
    ) -> None:
        self.plan = plan
        self.launcher = launcher
        self.log = log
        self.step_guess = step_guess
        self.started = time.monotonic()
        self.measurements: list[Measurement] = []
        self.durations: dict[Job, float] = {}  # last wall time of each job, to budget what remains
        self.timeouts: list[Job] = []  # jobs of a round left out because every attempt missed the deadline

    def remaining(self) -> float:
        return self.plan.budget_seconds - (time.monotonic() - self.started)

    def estimate(self, jobs: Sequence[Job]) -> float:
        return sum(
            self.durations.get(job, 1.0 + (job.warmup_steps + job.timed_steps) * self.step_guess(job)) for job in jobs
        )

    def _wait_for_quiet(self, spare: float) -> float:
        # Waiting costs budget only; starting a window under load would waste the window.
        deadline = time.monotonic() + min(self.plan.max_quiet_wait, max(spare, 0.0))
        load = idle_foreign_cores([os.getpid()], 0.3)
        while load > self.plan.foreign_threshold and time.monotonic() < deadline:
            load = idle_foreign_cores([os.getpid()], 0.5)
        return load

    def measure(self, round_index: int, job: Job, spare: Callable[[], float]) -> None:
        """Measure ``job`` for ``round_index``, retrying windows with foreign load while ``spare()`` seconds last."""
        self._wait_for_quiet(spare())
        for attempt in range(self.plan.max_retries + 1):
            started = time.monotonic()
            try:
                result = self.launcher.run(job, self.plan.job_timeout)
            except JobError as error:
                if attempt < self.plan.max_retries:
                    self.log(f"[yellow]{job} failed, retrying:[/] {str(error).splitlines()[-1]}")
                    continue
                if not isinstance(error, JobTimeoutError):
                    raise
                # Only the deadline, every time: the machine is too loaded for this window; its cells show n/a.
                self.timeouts.append(job)
                self.log(f"[red]round {round_index + 1} {job}: missed the deadline {attempt + 1} times, left out[/]")
                return
            self.durations[job] = time.monotonic() - started
            clean = result.foreign_cores <= self.plan.foreign_threshold
            self.measurements.append(Measurement(round_index, job, attempt, result, clean))
            if clean:
                return
            # Retry only once the machine is quiet again: under lasting load a retry costs time and is no cleaner.
            retry = attempt < self.plan.max_retries and spare() > self.durations[job]
            retry = retry and self._wait_for_quiet(spare()) <= self.plan.foreign_threshold
            self.log(
                f"[yellow]round {round_index + 1} {job}: foreign load {result.foreign_cores:.2f} cores, window "
                f"{'discarded, retrying' if retry else 'kept but flagged'}[/]"
            )
            if not retry:
                return


def progress_bar(console: Console) -> Progress:
    """The progress display of a benchmark run (on ``console``, which should write to stderr)."""
    columns: list[ProgressColumn] = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    columns += [MofNCompleteColumn(), TimeElapsedColumn()]
    return Progress(*columns, console=console, refresh_per_second=2)


def run_rounds(
    plan: Budget,
    jobs: Sequence[Job],
    launcher: JobRunner,
    progress: Progress,
    task: TaskID,
    step_guess: Callable[[Job], float],
) -> list[Measurement]:
    """Every round of ``jobs`` (fewer when the time budget runs out after ``plan.min_rounds``)."""
    session = Session(plan, launcher, progress.console.log, step_guess)
    for round_index in range(plan.rounds):
        mandatory = max(plan.min_rounds - round_index, 0)
        if not mandatory and session.remaining() < session.estimate(jobs) + session.estimate(jobs[:1]) * 2:
            progress.console.log(f"time budget reached: stopping after {round_index} rounds")
            break
        for position, job in enumerate(jobs):
            progress.update(task, description=f"round {round_index + 1}/{plan.rounds}: {job}")

            def spare(position: int = position, mandatory: int = mandatory) -> float:
                # Time left after what must still run: the rest of this round and the mandatory rounds after it.
                rest = session.estimate(jobs[position + 1 :]) + session.estimate(jobs) * max(mandatory - 1, 0)
                return session.remaining() - rest - 15.0

            session.measure(round_index, job, spare)
            progress.advance(task)
    return session.measurements
