"""GPipeStrategy's per-step cost on a tiny model over two ranks, against DDP, side by side in one run.

Usage: ``python -m benchmarks.strategy_overhead.tiny [--rounds N] [--baseline DIR] [--profile]``.

The model is issue 17's trial classifier (16 -> 32 -> 32 -> 4, batch 16): its arithmetic is a few microseconds, so a
step's time is what each strategy adds around it. Configurations, two ranks each (``devices=2`` on the CPU):

- ``ddp``: ``strategy="ddp"``;
- ``gpipe``: ``GPipeStrategy(pipe_size=2, chunks=8)``, the trial's settings (re-materialization ``except_last``);
- ``gpipe_never``: the same with ``checkpoint="never"``, to separate re-materialization from the rest;
- ``gpipe_m1``: ``chunks=1`` and ``checkpoint="never"``: the strategy's cost per step, without the per-micro-batch
  work that ``chunks=8`` repeats;
- ``gpipe_baseline`` (with ``--baseline DIR``): ``gpipe`` importing ``lightning_gpipe`` from another checkout, for a
  before/after comparison in the same run.

Every run is a fresh process (so that a baseline can import its own ``lightning_gpipe``) that starts its two ranks after
the imports (``tools/launch.py``); rounds interleave the configurations, and the result per configuration is the
median over rounds of each run's median step (wall and CPU time of rank 0, the last stage). ``--profile`` prints, per
configuration, where rank 0's CPU time goes (cProfile with a CPU-time clock, so other load on the machine does not
inflate it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

from benchmarks.trainer import quiet_trainer
from tools.launch import Launcher, importing_package_from, run_command

WARMUP, STEPS, BATCH = 20, 150, 16
CONFIGS = ("ddp", "gpipe", "gpipe_never", "gpipe_m1")


def _rank(rank: int, world_size: int, config: str, profile: bool) -> tuple[float, float, str | None]:
    """Rank ``rank`` of a 2-rank fit of ``config`` (its group up): median step wall and CPU time, the profile."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gpipe import GPipeStrategy

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning's sign that the ranks were started from outside

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.layers(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    profiler = cProfile.Profile(time.process_time) if profile else None

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
            if profiler is not None and index in (WARMUP, WARMUP + STEPS):
                (profiler.enable if index == WARMUP else profiler.disable)()
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    generator = torch.Generator().manual_seed(1)
    total = WARMUP + STEPS + 1
    data = TensorDataset(torch.randn(BATCH * total, 16, generator=generator), torch.randint(0, 4, (BATCH * total,)))
    strategy: Any = "ddp"
    if config.startswith("gpipe"):
        chunks, mode = (1, "never") if config == "gpipe_m1" else (8, "except_last")
        mode = "never" if config == "gpipe_never" else mode
        strategy = GPipeStrategy(pipe_size=2, chunks=chunks, checkpoint=mode)  # type: ignore[arg-type]
    clock = Clock()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=total,
        callbacks=[clock],
    )
    trainer.fit(Classifier(), DataLoader(data, batch_size=BATCH))
    wall = [b - a for a, b in zip(clock.wall[WARMUP:], clock.wall[WARMUP + 1 :], strict=False)]
    cpu = [b - a for a, b in zip(clock.cpu[WARMUP:], clock.cpu[WARMUP + 1 :], strict=False)]
    report = None
    if profiler is not None:
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        stats.sort_stats("cumulative").print_stats(r"lightning_gpipe|checkpoint\.py|distributed_c10d", 30)
        report = stream.getvalue()
    return statistics.median(wall), statistics.median(cpu), report


def worker(config: str, profile: bool) -> dict[str, Any]:
    """One run of ``config``: two fresh ranks forked after the imports; rank 0's median step, wall and CPU."""
    with Launcher(["torch", "lightning", "lightning_gpipe"]) as launcher:
        (wall, cpu, report), (_, cpu_rank1, _) = launcher.run(_rank, (config, profile), 2, timeout=600, label=config)
    return {"config": config, "wall": wall, "cpu": cpu, "cpu_rank1": cpu_rank1, "profile": report}


def _run(config: str, baseline: str | None, profile: bool) -> dict[str, Any]:
    # The baseline's lightning_gpipe, and this checkout's benchmark (a PYTHONPATH alone would not do: see the helper).
    cwd, env = importing_package_from(baseline if config == "gpipe_baseline" else None)
    name = "gpipe" if config == "gpipe_baseline" else config
    command = [sys.executable, "-m", "benchmarks.strategy_overhead.tiny", "--worker", name]
    output = run_command(command + (["--profile"] if profile else []), cwd=cwd, env=env, timeout=900)
    lines = [line for line in output.stdout.splitlines() if line.startswith("{")]
    if output.returncode != 0 or not lines:
        raise RuntimeError(f"{config} failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")
    return dict(json.loads(lines[-1]), config=config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a checkout whose lightning_gpipe runs as gpipe_baseline")
    parser.add_argument("--profile", action="store_true", help="print where rank 0's CPU time goes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.profile)))
        return
    configs = [*CONFIGS, "gpipe_baseline"] if args.baseline else list(CONFIGS)
    runs: dict[str, list[dict[str, Any]]] = {config: [] for config in configs}
    for round_ in range(args.rounds):
        for config in configs:
            result = _run(config, args.baseline, args.profile and round_ == 0)
            runs[config].append(result)
            print(f"round {round_ + 1} {config}: {1e3 * result['wall']:.2f} ms wall, {1e3 * result['cpu']:.2f} ms CPU")
            if result["profile"]:
                print(result["profile"])
    print(f"\nTiny model, 2 ranks, batch {BATCH}, median of {args.rounds} runs of {STEPS} steps (rank 0 = last stage):")
    print("| config | step, wall (ms) | step, CPU rank 0 (ms) | step, CPU rank 1 (ms) | wall / ddp |")
    print("|---|---:|---:|---:|---:|")
    ddp = statistics.median(r["wall"] for r in runs["ddp"])
    for config in configs:
        wall = statistics.median(r["wall"] for r in runs[config])
        cpu = statistics.median(r["cpu"] for r in runs[config])
        cpu1 = statistics.median(r["cpu_rank1"] for r in runs[config])
        print(f"| {config} | {1e3 * wall:.2f} | {1e3 * cpu:.2f} | {1e3 * cpu1:.2f} | {wall / ddp:.2f} |")
    if args.baseline:
        ratios = [b["wall"] / a["wall"] for a, b in zip(runs["gpipe"], runs["gpipe_baseline"], strict=True)]
        print(f"tiny_gpipe_speedup_vs_baseline={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
