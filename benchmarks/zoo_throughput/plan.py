"""What one run of the zoo throughput benchmark measures: its jobs, in round order, and its time budget."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.engine_speed.worker import Job
from benchmarks.zoo_throughput.models import WORKLOADS
from benchmarks.zoo_throughput.steps import PROCESSES, Step, build_step
from lightning_gpipe.engine.timeline import Timeline

__all__ = ["FULL", "QUICK", "REALISTIC", "SMOKE", "TINY", "TINY_CHUNKS", "Plan", "ZooJob"]

REALISTIC = ("transformer", "amoebanet")  # the models of the Table 2 layout
TINY = "tiny"  # the overhead-bound workload S comes from
TINY_CHUNKS = 16
PIPELINES = ("ours_k1", "ours", "torch_pipelining", "torchgpipe")


@dataclass(frozen=True)
class ZooJob(Job):
    """A job of the engine benchmark's worker that trains a zoo workload split by ``balance`` (layers per stage)."""

    balance: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return PROCESSES[self.config]

    @property
    def threads(self) -> int:
        return 2 if self.config == "two_threads" else 1

    def build_step(self, rank: int, timeline: Timeline | None) -> Step:
        return build_step(WORKLOADS[self.workload], self.config, self.chunks, self.balance, rank, timeline)


@dataclass(frozen=True)
class Plan:
    """How much to measure: rounds, micro-batch counts, steps per window, and the time and load limits."""

    rounds: int
    min_rounds: int  # always run; further rounds only while the time budget allows
    chunks: tuple[int, ...]
    realistic_steps: tuple[int, int]  # warm-up, timed
    tiny_steps: tuple[int, int]
    budget_seconds: float
    foreign_threshold: float = 0.15  # cores; jiffy resolution and kernel threads stay well below this
    max_retries: int = 2
    max_quiet_wait: float = 20.0
    job_timeout: float = 180.0
    models: tuple[str, ...] = REALISTIC  # the workloads of the Table 2 layout; the first gives R and E

    def round_jobs(self, balances: dict[str, tuple[int, ...]]) -> list[ZooJob]:
        """One round in a fixed order: per model, the whole-batch references, then each M's configurations side by
        side (its accumulation reference first), then the tiny stages."""
        jobs: list[ZooJob] = []
        for workload in self.models:

            def job(config: str, chunks: int, workload: str = workload) -> ZooJob:
                return ZooJob(workload, config, chunks, *self.realistic_steps, balance=balances[workload])

            jobs += [job("unpipelined", 1), job("two_threads", 1)]
            for chunks in self.chunks:
                if chunks > 1:  # 1-way accumulation is the unpipelined step
                    jobs.append(job("accumulation", chunks))
                jobs += [job(config, chunks) for config in PIPELINES]
        tiny = [("unpipelined", 1), ("accumulation", TINY_CHUNKS), ("two_threads", 1)]
        tiny += [(config, TINY_CHUNKS) for config in PIPELINES]
        jobs += [ZooJob(TINY, config, chunks, *self.tiny_steps, balance=balances[TINY]) for config, chunks in tiny]
        return jobs


# A full round is ~5 minutes on a quiet 2-core machine (42 realistic windows, 7 tiny ones): 6 rounds at least, up to
# 10 while the 35-minute budget allows. More, shorter rounds average out the VM's speed drift better.
FULL = Plan(
    rounds=10, min_rounds=6, chunks=(1, 4, 8, 32), realistic_steps=(1, 5), tiny_steps=(10, 60), budget_seconds=2100
)
# M in {1, 8} only (R and E are read at M = 8): ~3 minutes per round on a quiet machine, so 2 rounds (a third only
# if it fits the budget): about 7 minutes with the worker server's start.
QUICK = Plan(rounds=4, min_rounds=2, chunks=(1, 8), realistic_steps=(1, 3), tiny_steps=(5, 30), budget_seconds=330)
# For the tests: one round of the tiny stages only (every configuration, one step each), no waiting for a quiet
# machine and no retries, to keep the run module from rotting in seconds.
SMOKE = Plan(
    rounds=1,
    min_rounds=1,
    chunks=(),
    realistic_steps=(0, 1),
    tiny_steps=(0, 1),
    budget_seconds=120,
    max_retries=0,
    max_quiet_wait=0.0,
    job_timeout=60.0,
    models=(),
)
