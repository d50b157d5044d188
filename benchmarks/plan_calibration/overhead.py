"""The engine's seconds per micro-batch beyond its layers' own: the figure behind ``DEFAULT_MICROBATCH_OVERHEAD``.

``python -m benchmarks.plan_calibration.overhead [--device cuda] [--repeats 7]``

One stage (K = 1, the threads transport) trains one tiny ``Linear`` layer on micro-batches of one sample, with
M = 1 and M = 33 micro-batches, and the planner profiles the same layer at one sample. The step time's slope in M,
less the profiled forward and backward of the layer, is what the engine adds per micro-batch (Python, scatter, the
step's bookkeeping, the re-materialization wrapper). One layer, because the profile times each layer with its own
``autograd.grad`` call, whose fixed cost the engine pays once per stage: with several tiny layers the difference
would charge the engine less than it costs. Each figure is the minimum over ``--repeats`` measurements: load
on a shared machine only ever adds time. Prints ``microbatch_overhead_<mode>=SECONDS`` per checkpoint mode.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.profile.layer_profile import profile_layers

__all__ = ["main", "per_microbatch_seconds"]

FEW, MANY = 1, 33


def _layers(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8)).to(device)


def _step_seconds(layers: nn.Sequential, chunks: int, checkpoint: str, device: torch.device, steps: int) -> float:
    transport = ThreadTransport.create(1, [device])[0]
    pipeline = Pipeline(layers, transport, chunks=chunks, checkpoint=checkpoint)  # type: ignore[arg-type]
    batch = (torch.randn(chunks, 8, device=device), torch.randn(chunks, 8, device=device))

    def loss_fn(output: torch.Tensor, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (output - value[1]).square().mean()

    pipeline.train_step(batch, loss_fn)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        pipeline.train_step(batch, loss_fn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def per_microbatch_seconds(device: torch.device, checkpoint: str, repeats: int = 7) -> float:
    """The engine's seconds per micro-batch on ``device`` under ``checkpoint``, beyond the layers' profiled times."""
    layers = _layers(device)
    profile = profile_layers(layers, torch.randn(1, 8, device=device), microbatch_sizes=[1], repeats=9, warmup=2)
    forward, backward = profile.pass_times(1)
    own = sum(forward) + sum(backward) + (sum(forward) if checkpoint == "always" else 0.0)
    slopes = []
    for _ in range(repeats):
        few = _step_seconds(layers, FEW, checkpoint, device, steps=20)
        many = _step_seconds(layers, MANY, checkpoint, device, steps=5)
        slopes.append((many - few) / (MANY - FEW))
    return max(0.0, min(slopes) - own)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_calibration.overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    for mode in ("never", "always"):
        print(f"microbatch_overhead_{mode}={per_microbatch_seconds(device, mode, args.repeats):.6f}", flush=True)


if __name__ == "__main__":
    main()
