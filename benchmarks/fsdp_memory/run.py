"""``data_parallel="fsdp"`` against ``"ddp"``: two pipelines of two stages on 4 CPU ranks, side by side in one run.

Usage: ``python -m benchmarks.fsdp_memory.run [--rounds N] [--steps N] [--no-write]`` (``make bench-fsdp``; about
3 minutes on a quiet 2-core machine). Each run trains one configuration in 4 fresh rank processes forked after the
imports (:class:`tools.launch.Launcher`). Each round times both configurations, one after the other: the median
step wall and CPU time of rank 0 (the first pipeline's last stage) after warm-up. A last pair of runs measures memory
per rank, with glibc's mmap threshold pinned so that freed tensors leave the RSS (which costs every allocation a
mapping, hence not in the timed runs):

- the bytes of parameters, gradients and optimizer state (Adam) the rank holds between steps (its shards' under
  ``"fsdp"``), counted from its tensors after the last step;
- the peak RSS growth from setup to the end of training (``VmHWM`` reset when setup begins; the model is built on
  the meta device, so the rank allocates its stage in setup): the stage's parameters, gradients and optimizer state,
  activations, communication buffers and, under ``"fsdp"``, what a step holds besides: the stage's parameters
  gathered whole and its gradients accumulated whole, until the end of the step's backward passes.

The last line is ``fsdp_speed_vs_ddp=R``: the median over rounds of ddp's step time over fsdp's (goal: at least 0.8).
Writes this folder's ``RESULTS.md`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_line
from tools.launch import Launcher

__all__ = ["main"]

HERE = Path(__file__).resolve().parent
WIDTH, LAYERS, OUT, BATCH, CHUNKS, WARMUP = 1024, 8, 16, 256, 4, 3
CONFIGS = ("ddp", "fsdp")
MIB = 2**20


def _rank(rank: int, world_size: int, data_parallel: str, steps: int, memory: bool, batch: int) -> dict[str, Any]:
    """Rank ``rank`` of a 2 x 2 fit under ``data_parallel``: its bytes held, its peak RSS growth (if ``memory``), its
    median step times."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.strategy_memory.measure import pin_mmap_threshold
    from benchmarks.trainer import quiet_trainer
    from lightning_gpipe import GPipeStrategy
    from lightning_gpipe.engine.sharding import local_shard

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning's sign that the ranks were started from outside
    if memory:
        pin_mmap_threshold()

    class Stack(L.LightningModule):
        def __init__(self, measure: Measure) -> None:
            super().__init__()
            self.measure = measure
            self.layers: nn.Sequential | None = None

        def setup(self, stage: str) -> None:
            self.measure.start()

        def configure_model(self) -> None:  # on the meta device: each rank allocates its stage's share in setup
            blocks = [module for _ in range(LAYERS) for module in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
            self.layers = nn.Sequential(*blocks, nn.Linear(WIDTH, OUT))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            assert self.layers is not None
            return F.mse_loss(self.layers(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    def rss(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.starts: list[tuple[float, float]] = []  # each step's start: wall, CPU
            self.rss_before = self.rss_growth = 0
            self.held: dict[str, int] = {}

        def start(self) -> None:
            self.rss_before = rss("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # the peak from here on is setup's and training's

        def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
            self.starts.append((time.perf_counter(), time.process_time()))

        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            self.starts.append((time.perf_counter(), time.process_time()))
            self.rss_growth = rss("VmHWM") - self.rss_before
            parameters = list(module.parameters())
            state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)]

            def nbytes(tensors: list[torch.Tensor]) -> int:
                return sum(local_shard(t).numel() * t.element_size() for t in tensors)

            self.held = {
                "parameters": nbytes(parameters),
                "gradients": nbytes([p.grad for p in parameters if p.grad is not None]),
                "optimizer": nbytes(state),
            }

    torch.manual_seed(0)
    samples = batch * (steps + WARMUP) * world_size // 2  # one epoch: each pipeline reads its half
    data = TensorDataset(torch.randn(samples, WIDTH), torch.randn(samples, OUT))
    measure = Measure()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=GPipeStrategy(pipe_size=2, chunks=CHUNKS, data_parallel=data_parallel),  # type: ignore[arg-type]
        max_steps=steps + WARMUP,
        callbacks=[measure],
    )
    trainer.fit(Stack(measure), DataLoader(data, batch_size=batch))
    timed = measure.starts[WARMUP:]
    wall = statistics.median(b[0] - a[0] for a, b in itertools.pairwise(timed))
    cpu = statistics.median(b[1] - a[1] for a, b in itertools.pairwise(timed))
    return {"held": measure.held, "rss_growth": measure.rss_growth, "step": wall, "cpu": cpu}


def _mib(value: float) -> str:
    return f"{value / MIB:.1f}"


Runs = dict[str, list[dict[str, Any]]]  # configuration: every rank's result


def markdown(rounds: list[Runs], memory: Runs, steps: int, batch: int, command: str) -> str:
    """The results page: per rank and configuration, bytes held and peak RSS growth (``memory``); the step times."""
    parameters = LAYERS * (WIDTH * WIDTH + WIDTH) + WIDTH * OUT + OUT
    lines = [
        '# `data_parallel="fsdp"` against `"ddp"`: memory per rank and step time',
        "",
        f"Model: {LAYERS} x (Linear({WIDTH}, {WIDTH}) + Tanh) + Linear({WIDTH}, {OUT}), {parameters / 1e6:.1f} M "
        f"parameters ({parameters * 4 / MIB:.1f} MiB in float32); MSE, Adam; batch {batch}, "
        f'`GPipeStrategy(pipe_size=2, chunks={CHUNKS}, data_parallel=...)` on `Trainer(accelerator="cpu", '
        f"devices=4)`: two pipelines of two stages, one thread per rank, {WARMUP} warm-up steps and {steps} measured; "
        f"{len(rounds)} timed rounds alternating the two, then one pair of runs measuring memory.",
        "",
        f"Machine: {machine_line()}. Command: `{command}`.",
        "",
        '*Held* = bytes of the rank\'s own tensors after the last step (its shards under `"fsdp"`). *Peak RSS '
        "growth* = VmHWM (reset when setup begins; the model is built on the meta device) minus the RSS there: the "
        'stage allocated, its gradients, Adam\'s state, activations and communication buffers; under `"fsdp"` a '
        "step also holds its stage's parameters gathered whole and its gradients accumulated whole until the end of "
        "its backward passes.",
        "",
        "| rank | stage | config | parameters (MiB) | gradients (MiB) | optimizer (MiB) | held, total (MiB) | "
        "peak RSS growth (MiB) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rank in range(4):
        for config in CONFIGS:
            run = memory[config][rank]
            held = run["held"]
            total = sum(held.values())
            lines.append(
                f"| {rank} | {1 - rank % 2} | {config} | {_mib(held['parameters'])} | {_mib(held['gradients'])} | "
                f"{_mib(held['optimizer'])} | {_mib(total)} | {_mib(run['rss_growth'])} |"
            )
    totals = {c: sum(sum(r["held"].values()) for r in memory[c]) for c in CONFIGS}
    peaks = {c: max(r["rss_growth"] for r in memory[c]) for c in CONFIGS}
    ratios = [r["ddp"][0]["step"] / r["fsdp"][0]["step"] for r in rounds]
    steps_ms = {c: statistics.median(r[c][0]["step"] for r in rounds) * 1e3 for c in CONFIGS}
    cpu_ms = {c: statistics.median(r[c][0]["cpu"] for r in rounds) * 1e3 for c in CONFIGS}
    lines += [
        "",
        f"Held by the 4 ranks together: fsdp / ddp = **{totals['fsdp'] / totals['ddp']:.3f}** (ideal 0.5, goal "
        f"at most 0.6). Largest peak RSS growth of a rank: ddp {_mib(peaks['ddp'])} MiB, fsdp "
        f"{_mib(peaks['fsdp'])} MiB.",
        "",
        f"Step time of rank 0, median over rounds: ddp {steps_ms['ddp']:.1f} ms, fsdp {steps_ms['fsdp']:.1f} ms "
        f"(CPU time {cpu_ms['ddp']:.1f} and {cpu_ms['fsdp']:.1f} ms); ddp / fsdp per round "
        f"{', '.join(f'{r:.2f}' for r in ratios)}: **fsdp_speed_vs_ddp = {statistics.median(ratios):.2f}** (goal: at "
        "least 0.8).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per pipeline and step")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    rounds: list[Runs] = []
    started = datetime.datetime.now()
    with Launcher(["torch", "lightning", "lightning_gpipe"]) as launcher:
        for index in range(args.rounds):
            results = {}
            for config in CONFIGS:
                run = (config, args.steps, False, args.batch)
                results[config] = launcher.run(_rank, run, 4, timeout=900, label=config)
                print(f"round {index + 1} {config}: {1e3 * results[config][0]['step']:.1f} ms per step", flush=True)
            rounds.append(results)
        memory = {c: launcher.run(_rank, (c, 2, True, args.batch), 4, timeout=900, label=c) for c in CONFIGS}
    command = "python -m benchmarks.fsdp_memory.run" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    page = markdown(rounds, memory, args.steps, args.batch, command)
    print(page)
    if not args.no_write:
        (HERE / "RESULTS.md").write_text(page)
    ratios = [r["ddp"][0]["step"] / r["fsdp"][0]["step"] for r in rounds]
    print(f"took {datetime.datetime.now() - started}")
    print(f"fsdp_speed_vs_ddp={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
