"""GPipeStrategy's own cost at K = 1, M = 1: training throughput against ``strategy="auto"`` on the same model.

Usage: ``python -m benchmarks.strategy_overhead.run [--quick] [--profile]`` (see this folder's README).

Both configurations train the same MLP for a few warm-up steps and a timed window, one thread each, every run in a
fresh process forked after the imports (``tools/launch.py``: importing Lightning costs more than a run).
Rounds interleave the two (auto, gpipe, auto, gpipe, ...); the ratio of each round's median step times compares
adjacent windows, so slow drift of the machine cancels, and the result is the median of the per-round ratios.
Each window records the cores other processes used (from /proc/stat); rounds where that was noticeable are left out
of the ratio when enough quiet ones remain.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import pathlib
import platform
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader

from benchmarks.engine_speed.cpuload import CpuSnapshot, foreign_cores, snapshot
from benchmarks.machine import cpu_model
from benchmarks.trainer import quiet_trainer
from lightning_gpipe import GPipeStrategy
from tools.launch import Launcher

__all__ = ["Plan", "main"]

HERE = pathlib.Path(__file__).resolve().parent
CONFIGS = ("auto", "gpipe")
# 8 x Linear(1024, 1024) + ReLU and a 10-way head on batches of 256: 8.4 M parameters, ~130 ms per step on one
# thread of a quiet 2.8 GHz Xeon, long enough that per-step Python overhead shows at the percent level, no more.
WIDTH, DEPTH, BATCH, CLASSES = 1024, 8, 256, 10
DISTINCT_BATCHES = 4
GOAL = 0.97


@dataclass(frozen=True)
class Plan:
    """How much to measure: warm-up and timed steps per run, rounds, and the time and load limits."""

    warmup: int
    steps: int
    min_rounds: int  # always run; more rounds only while the time budget allows
    max_rounds: int
    budget_seconds: float  # from the first round on; importing torch and Lightning before it takes another ~20 s
    foreign_threshold: float = 0.3  # cores of other load in a window above which a round counts as noisy
    min_quiet_rounds: int = 3
    job_timeout: float = 180.0


FULL = Plan(warmup=5, steps=30, min_rounds=6, max_rounds=24, budget_seconds=245.0)
QUICK = Plan(warmup=3, steps=15, min_rounds=3, max_rounds=5, budget_seconds=65.0)


class MLPModule(L.LightningModule):
    """An MLP in one ``nn.Sequential``, trained with cross-entropy and SGD with momentum, logging its loss."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        layers.append(nn.Linear(WIDTH, CLASSES))
        self.layers = nn.Sequential(*layers)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepClock(Callback):
    """Times the steps after the warm-up (start of one step to the start of the next) and the window's CPU load.

    Besides wall time it records this process's CPU time per step: when other processes want more than the spare
    core, the scheduler slices them in, which lengthens wall time but not CPU time.
    """

    def __init__(self, warmup: int, steps: int, profiler: cProfile.Profile | None) -> None:
        self.warmup, self.steps = warmup, steps
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.window: list[CpuSnapshot] = []
        self.profiler = profiler

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx in (self.warmup, self.warmup + self.steps):
            if self.profiler is not None:
                (self.profiler.enable if batch_idx == self.warmup else self.profiler.disable)()
            self.window.append(snapshot([os.getpid()]))
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())


def _strategy(config: str) -> Any:
    if config == "auto":
        return "auto"
    # One rank: an in-process store, so nothing listens on a port; gloo's own listener binds loopback only.
    # LOCAL_RANK says this process was started from outside, so Lightning probes no free port and starts no rank.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return GPipeStrategy(pipe_size=1, chunks=1, checkpoint="never")


def measure(config: str, warmup: int, steps: int, profile: bool = False) -> dict[str, Any]:
    """Train ``warmup + steps + 1`` steps with ``strategy=config``; returns the timed steps and the window's load."""
    # Lightning's launchers (GPipeStrategy has one, "auto" on one device has none) set torch's threads to
    # cpu_count / processes unless OMP_NUM_THREADS is set: without it, the gpipe runs would use 2 threads.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # one inter-op thread too: the launcher sized that pool before this call
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator))
        for _ in range(DISTINCT_BATCHES)
    ]
    total = warmup + steps + 1  # the last step only closes the timed window
    # batch_size=None hands the prepared batches over as they are: no collation cost in either configuration.
    sequence = [batches[i % DISTINCT_BATCHES] for i in range(total)]
    loader: DataLoader[tuple[Tensor, Tensor]] = DataLoader(sequence, batch_size=None)  # type: ignore[arg-type]
    profiler = cProfile.Profile() if profile else None
    clock = StepClock(warmup, steps, profiler)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        strategy=_strategy(config),
        max_steps=total,
        callbacks=[clock],
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        default_root_dir=os.getcwd(),
    )
    try:
        trainer.fit(MLPModule(), loader)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    timed = clock.starts[warmup : warmup + steps + 1]
    timed_cpu = clock.cpu_starts[warmup : warmup + steps + 1]
    start, end = clock.window
    result: dict[str, Any] = {
        "config": config,
        "step_seconds": [b - a for a, b in zip(timed, timed[1:], strict=False)],
        "step_cpu_seconds": [b - a for a, b in zip(timed_cpu, timed_cpu[1:], strict=False)],
        "foreign_cores": foreign_cores(start, end),
        "own_cores": (end.own - start.own) / max(end.wall - start.wall, 1e-9),
    }
    if profiler is not None:
        result["profile"] = _profile_report(profiler, steps)
    return result


def _profile_report(profiler: cProfile.Profile, steps: int) -> list[tuple[str, int, float, float]]:
    """(function, calls per step, own ms per step, cumulative ms per step) of the timed window, by cumulative time."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, name), (_calls, primitive, own, cumulative, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = filename.split("site-packages/")[-1].split("/work/main/")[-1]
        rows.append((f"{where}:{line}({name})", round(primitive / steps), 1e3 * own / steps, 1e3 * cumulative / steps))
    return sorted(rows, key=lambda row: -row[3])


def _measure_rank(rank: int, world_size: int, config: str, warmup: int, steps: int, profile: bool) -> dict[str, Any]:
    return measure(config, warmup, steps, profile)


def run_job(config: str, plan: Plan, profile: bool = False) -> dict[str, Any]:
    """One run in a fresh process forked after the imports (:class:`tools.launch.Launcher`), with a deadline."""
    with Launcher(["torch", "lightning", "lightning_gpipe"]) as launcher:
        args = (config, plan.warmup, plan.steps, profile)
        return launcher.run(_measure_rank, args, 1, plan.job_timeout, label=config)[0]


WALL, CPU = "step_seconds", "step_cpu_seconds"


@dataclass
class Summary:
    """The rounds, which of them count, and the ratios: wall-clock (the result) and CPU time (a load-robust check)."""

    rounds: list[dict[str, dict[str, Any]]]
    used: list[int]
    quiet_only: bool
    ratio: float
    cpu_ratio: float
    spread: tuple[float, float]  # first and third quartile of the used rounds' wall-clock ratios
    interval: tuple[float, float]  # 95 % confidence interval of their median

    def median_step(self, config: str, clock: str = WALL) -> float:
        return statistics.median(s for i in self.used for s in self.rounds[i][config][clock])


def summarize(rounds: list[dict[str, dict[str, Any]]], plan: Plan) -> Summary:
    """Median of per-round ratios (auto step / gpipe step = gpipe throughput / auto throughput), quiet rounds first."""
    quiet = [i for i, r in enumerate(rounds) if max(r[c]["foreign_cores"] for c in CONFIGS) <= plan.foreign_threshold]
    quiet_only = len(quiet) >= plan.min_quiet_rounds
    used = quiet if quiet_only else list(range(len(rounds)))
    ratios = sorted(round_ratio(rounds[i]) for i in used)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    cpu_ratio = statistics.median(round_ratio(rounds[i], CPU) for i in used)
    # Distribution-free interval of a median: the order statistics 1.96 sqrt(n) / 2 ranks either side of the middle.
    k = max(int((len(ratios) - 1.96 * len(ratios) ** 0.5) / 2), 0)
    interval = (ratios[k], ratios[len(ratios) - 1 - k])
    return Summary(
        rounds, used, quiet_only, statistics.median(ratios), cpu_ratio, (quartiles[0], quartiles[2]), interval
    )


def round_ratio(round_: dict[str, dict[str, Any]], clock: str = WALL) -> float:
    """auto's median step over gpipe's in one round: gpipe's throughput relative to auto's."""
    return statistics.median(round_["auto"][clock]) / statistics.median(round_["gpipe"][clock])


def markdown(summary: Summary, plan: Plan, command: str, started: datetime.datetime, seconds: float) -> str:
    """The results page: per-config medians, every round with its load, the ratio line and the setup."""
    line = f"strategy_overhead_ratio={summary.ratio:.3f}"
    verdict = "meets" if summary.ratio >= GOAL else "misses"
    lines = [
        "# GPipeStrategy overhead at K = 1, M = 1",
        "",
        f'`GPipeStrategy(pipe_size=1, chunks=1, checkpoint="never")` against `strategy="auto"` on '
        f'`Trainer(accelerator="cpu", devices=1)`: {DEPTH} x (Linear({WIDTH}, {WIDTH}) + ReLU) + '
        f"Linear({WIDTH}, {CLASSES}), batch {BATCH}, cross-entropy, SGD with momentum, `self.log` of the loss; one "
        f"thread per process; {plan.warmup} warm-up steps, then {plan.steps} timed steps per run; every run a fresh "
        "process; rounds interleave auto, gpipe.",
        "",
        "| config | rounds used | median step, wall (ms) | throughput (samples/s) | median step, CPU time (ms) |",
        "|---|---|---|---|---|",
    ]
    for config in CONFIGS:
        step, cpu = summary.median_step(config), summary.median_step(config, CPU)
        lines.append(f"| {config} | {len(summary.used)} | {1e3 * step:.1f} | {BATCH / step:,.0f} | {1e3 * cpu:.1f} |")
    which = (
        f"rounds where other processes used at most {plan.foreign_threshold} cores in both windows"
        if summary.quiet_only
        else f"all rounds (fewer than {plan.min_quiet_rounds} had at most {plan.foreign_threshold} cores of other load)"
    )
    lines += [
        "",
        f"Ratio = gpipe throughput / auto throughput, the median over {which} of the per-round ratios of median "
        f"wall-clock step times (quartiles of the per-round ratios: {summary.spread[0]:.3f} to "
        f"{summary.spread[1]:.3f}; 95 % confidence interval of their median: {summary.interval[0]:.3f} to "
        f"{summary.interval[1]:.3f}). Goal ≥ {GOAL}: the result {verdict} it. The same ratio from CPU time per step, "
        f"which other load inflates less (it does not count the time the scheduler gives to other processes): "
        f"{summary.cpu_ratio:.3f}.",
        "",
        "```",
        line,
        "```",
        "",
        "| round | auto (ms) | gpipe (ms) | ratio | CPU-time ratio | other load, auto / gpipe window (cores) | used |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, round_ in enumerate(summary.rounds):
        auto, gpipe = (statistics.median(round_[c][WALL]) for c in CONFIGS)
        load = " / ".join(f"{round_[c]['foreign_cores']:.2f}" for c in CONFIGS)
        used = "yes" if i in summary.used else "no"
        lines.append(
            f"| {i + 1} | {1e3 * auto:.1f} | {1e3 * gpipe:.1f} | {auto / gpipe:.3f} | "
            f"{round_ratio(round_, CPU):.3f} | {load} | {used} |"
        )
    lines += [
        "",
        f"- command: `{command}` ({seconds:.0f} s)",
        f"- machine: {os.cpu_count()} CPUs (nproc), {cpu_model()}, {platform.system()} {platform.release()}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, lightning {L.__version__}",
        f"- date: {started:%Y-%m-%d %H:%M} UTC",
        "",
    ]
    return "\n".join(lines)


def profile(plan: Plan) -> None:
    """Profile the timed window of one run per configuration and print where each step's time goes."""
    for config in CONFIGS:
        result = run_job(config, plan, profile=True)
        median = statistics.median(result["step_seconds"])
        print(f"\n== {config}: median step {1e3 * median:.1f} ms under cProfile; per step: calls, own ms, cum ms")
        for name, calls, own, cumulative in result["profile"][:45]:
            print(f"{cumulative:9.2f} {own:9.2f} {calls:6d}  {name}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (about a minute)")
    parser.add_argument("--profile", action="store_true", help="cProfile one run per configuration instead")
    parser.add_argument("--output", type=pathlib.Path, default=HERE / "RESULTS.md")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.profile:
        profile(plan)
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    clock = time.monotonic()
    rounds: list[dict[str, dict[str, Any]]] = []
    while len(rounds) < plan.max_rounds:
        elapsed = time.monotonic() - clock
        per_round = elapsed / len(rounds) if rounds else 0.0
        if len(rounds) >= plan.min_rounds and elapsed + per_round > plan.budget_seconds:
            break
        round_ = {config: run_job(config, plan) for config in CONFIGS}
        rounds.append(round_)
        print(
            f"round {len(rounds)}: ratio {round_ratio(round_):.3f} (CPU time {round_ratio(round_, CPU):.3f}), "
            "other load " + " / ".join(f"{round_[c]['foreign_cores']:.2f}" for c in CONFIGS),
            flush=True,
        )
    summary = summarize(rounds, plan)
    command = "python -m benchmarks.strategy_overhead.run" + (" --quick" if args.quick else "")
    args.output.write_text(markdown(summary, plan, command, started, time.monotonic() - clock))
    low, high = summary.interval
    print(f"{len(summary.used)} rounds; 95 % interval {low:.3f}-{high:.3f}; CPU-time ratio {summary.cpu_ratio:.3f}")
    print(f"strategy_overhead_ratio={summary.ratio:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
