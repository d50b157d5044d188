"""What a stage boundary costs in the engine: the figures behind ``DEFAULT_LATENCY``, ``DEFAULT_BANDWIDTH`` and
``DEFAULT_BOUNDARY_OVERHEAD``.

``python -m benchmarks.plan_calibration.link [--device cuda] [--repeats 15]``

Two stages (two processes, the process-group transport, one thread each) each hold one layer that scales its input by
a learned scalar, so almost nothing but the boundary costs time:

- **Boundary overhead**: what a stage's own thread spends per micro-batch on a boundary (describing, posting,
  sending and receiving a micro-batch's tensors, which one stage alone, ``benchmarks.plan_calibration.overhead``,
  never does): the slope of each stage's thread CPU time per step from M = 1 to M = 33 micro-batches, less the
  layer's profiled passes and the engine's ``DEFAULT_MICROBATCH_OVERHEAD``, averaged over the two stages. CPU time,
  not the step's wall time: with nothing to compute, a stage that waits for each message measures the messages'
  latency, which layers that compute hide; the thread's CPU time is what they cannot hide.
- **Latency and bandwidth**: at M = 1 a step sends one activation forward and one gradient back, each on the step's
  critical path; the step time less both layers' passes and both stages' per-micro-batch costs is two messages.
  Measured for a small and a large boundary, the two give the fixed cost per message and the bytes per second.

Every configuration is timed once per round, in interleaved rounds, and each figure comes from the medians over
``--repeats`` rounds: the planner predicts a typical step, and the minimum would predict the luckiest one. Prints
``link_latency=SECONDS``, ``link_bandwidth=BYTES_PER_SECOND`` and ``boundary_overhead=SECONDS``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

__all__ = ["main"]

SMALL, LARGE = 256, 1 << 20  # elements per boundary: 1 KiB and 4 MiB of float32
MANY = 33  # micro-batches of the steps that give the boundary overhead
STEPS = 5  # timed steps per configuration and round
IDLE = 0.005  # seconds each pass of the layers that time the messages sleeps
Passes = tuple[list[float], list[float]]  # per stage: forward and backward seconds of one micro-batch


def _job(rank: int, world_size: int, device_name: str, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_gpipe.engine.pipeline import Pipeline
    from lightning_gpipe.engine.transport import ProcessGroupTransport
    from lightning_gpipe.profile.layer_profile import profile_layers

    class Idle(torch.autograd.Function):
        """Sleeps ``IDLE`` seconds in both passes: a stage whose host waits, as it does for a GPU or a peer."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            time.sleep(IDLE)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(IDLE)
            return grad

    class Scale(nn.Module):
        def __init__(self, idle: bool) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))
            self.idle = idle

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # After the weight: its gradient needs the backward, so the profile's passes sleep as the stage's do.
            return Idle.apply(x * self.weight) if self.idle else x * self.weight

    device = torch.device(device_name)
    plain, idle = nn.Sequential(Scale(idle=False).to(device)), nn.Sequential(Scale(idle=True).to(device))
    transport = ProcessGroupTransport([0, 1], device)
    # (layers, boundary elements, M): the plain layer for the threads' CPU time, the idle one for the messages.
    configurations = {"cpu_1": (plain, SMALL, 1), "cpu_many": (plain, SMALL, MANY)}
    configurations.update({"small": (idle, SMALL, 1), "large": (idle, LARGE, 1)})
    profiled: dict[tuple[int, int], Passes] = {}  # by layers and boundary: the two CPU configurations share one
    for layers, elements, _ in configurations.values():
        if (id(layers), elements) in profiled:
            continue
        profile = profile_layers(
            layers,
            torch.randn(1, elements, device=device),
            microbatch_sizes=[1],
            repeats=9,
            warmup=2,
            rematerialized=False,
            optimizer=None,
        )
        forward, backward = profile.pass_times(1)
        stages: list[Any] = [None] * world_size
        dist.all_gather_object(stages, (forward[0], backward[0]))
        profiled[(id(layers), elements)] = ([f for f, _ in stages], [b for _, b in stages])
    passes = {key: profiled[(id(layers), elements)] for key, (layers, elements, _) in configurations.items()}
    pipelines = {
        key: (
            Pipeline(layers, transport, chunks=chunks),
            (torch.randn(chunks, elements, device=device), torch.zeros(chunks, device=device)),
        )
        for key, (layers, elements, chunks) in configurations.items()
    }

    def loss_fn(output: torch.Tensor, value: Any) -> torch.Tensor:
        return output.mean()

    steps: dict[str, list[float]] = {key: [] for key in pipelines}
    cpu: dict[str, list[float]] = {key: [] for key in pipelines}
    for _ in range(repeats):
        for key, (pipeline, batch) in pipelines.items():
            pipeline.train_step(batch, loss_fn)  # warm-up
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(STEPS):
                pipeline.train_step(batch, loss_fn)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / STEPS])
            cpu[key].append((time.thread_time() - start_cpu) / STEPS)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            steps[key].append(float(elapsed))
    # Per stage: its thread's CPU seconds per further micro-batch.
    slope = (statistics.median(cpu["cpu_many"]) - statistics.median(cpu["cpu_1"])) / (MANY - 1)
    slopes: list[Any] = [None] * world_size
    dist.all_gather_object(slopes, slope)
    return {
        "passes": passes,
        "steps": {key: statistics.median(values) for key, values in steps.items()},
        "cpu_per_microbatch": slopes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_calibration.link", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    from lightning_gpipe.plan import DEFAULT_MICROBATCH_OVERHEAD
    from tools.launch import Launcher

    with Launcher(["torch", "lightning_gpipe.plan", __name__]) as launcher:
        result = launcher.run(_job, (args.device, args.repeats), 2, timeout=900, label="link")[0]
    passes, steps = result["passes"], result["steps"]
    engine = DEFAULT_MICROBATCH_OVERHEAD.get(args.device.split(":")[0], 0.0)
    forward, backward = passes["cpu_1"]
    boundary = max(
        0.0,
        statistics.mean(
            cpu - f - b - engine for cpu, f, b in zip(result["cpu_per_microbatch"], forward, backward, strict=True)
        ),
    )

    def message(key: str) -> float:
        """One message's seconds at M = 1: the step less both stages' passes and per-micro-batch costs, halved."""
        return max(0.0, (steps[key] - sum(map(sum, passes[key])) - 2 * (engine + boundary)) / 2)

    latency = message("small")
    extra = message("large") - latency  # the large boundary's time beyond the small one's: the extra bytes
    bandwidth = (LARGE - SMALL) * 4 / extra if extra > 0 else float("inf")
    for key, seconds in steps.items():
        print(f"step_seconds_{key}={seconds:.6f}")
    print("stage_cpu_seconds_per_microbatch=" + ",".join(f"{cpu:.6f}" for cpu in result["cpu_per_microbatch"]))
    print(f"link_latency={latency:.6f}")
    print(f"link_bandwidth={bandwidth:.3e}")
    print(f"boundary_overhead={boundary:.6f}")


if __name__ == "__main__":
    main()
