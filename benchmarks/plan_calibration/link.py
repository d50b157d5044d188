"""What a stage boundary costs per message in the engine: the figures behind ``DEFAULT_LATENCY`` and
``DEFAULT_BANDWIDTH``.

``python -m benchmarks.plan_calibration.link [--device cuda] [--repeats 7]``

Two stages (two processes, the process-group transport) each hold one layer that scales its input by a learned
scalar, so almost nothing but the boundary costs time. At M = 1 a step sends one activation forward and one gradient
back, and each message lies on the step's critical path; the step time, less the layers' profiled passes and the
engine's per-micro-batch overhead on both stages, is two messages. Measured for a small and a large boundary, the two
give the fixed cost per message (latency: the transport's calls, the control message, Python on both sides) and the
bytes per second. Each figure is the minimum over ``--repeats`` measurements: load on a shared machine only ever adds
time. Prints ``link_latency=SECONDS`` and ``link_bandwidth=BYTES_PER_SECOND``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

__all__ = ["main"]

SMALL, LARGE = 256, 1 << 20  # elements per boundary: 1 KiB and 4 MiB of float32


def _job(rank: int, world_size: int, device_name: str, repeats: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_gpipe.pipeline import Pipeline
    from lightning_gpipe.plan import DEFAULT_MICROBATCH_OVERHEAD
    from lightning_gpipe.plan.profile import profile_layers
    from lightning_gpipe.transport import ProcessGroupTransport

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    torch.set_num_threads(1)
    device = torch.device(device_name)
    overhead = DEFAULT_MICROBATCH_OVERHEAD.get(device.type, 0.0)
    found: dict[str, float] = {}
    for elements in (SMALL, LARGE):
        layer = Scale().to(device)
        sample = torch.randn(1, elements, device=device)
        profile = profile_layers(
            nn.Sequential(layer), sample, microbatch_sizes=[1], repeats=9, warmup=2, rematerialized=False
        )
        forward, backward = profile.pass_times(1)
        own = torch.tensor([sum(forward) + sum(backward)])
        dist.all_reduce(own)  # both stages' layers lie on the critical path at M = 1
        pipeline = Pipeline(nn.Sequential(layer), ProcessGroupTransport([0, 1], device), chunks=1)
        batch = (sample, torch.zeros((), device=device))

        def loss_fn(output: torch.Tensor, value: Any) -> torch.Tensor:
            return output.mean()

        best = float("inf")
        for _ in range(repeats):
            pipeline.train_step(batch, loss_fn)  # warm-up
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(10):
                pipeline.train_step(batch, loss_fn)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / 10])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            best = min(best, float(elapsed))
        found[f"message_{elements}"] = max(0.0, (best - float(own) - 2 * overhead) / 2)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_calibration.link", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    from benchmarks.launch import Launcher

    with Launcher(["torch", "lightning_gpipe.plan", __name__]) as launcher:
        per_rank = launcher.run(_job, (args.device, args.repeats), 2, timeout=600, label="link")
    small, large = per_rank[0][f"message_{SMALL}"], per_rank[0][f"message_{LARGE}"]
    bytes_between = (LARGE - SMALL) * 4
    bandwidth = bytes_between / (large - small) if large > small else float("inf")
    latency = max(0.0, small - SMALL * 4 / bandwidth)
    print(f"message_seconds_{SMALL * 4}B={small:.6f}")
    print(f"message_seconds_{LARGE * 4}B={large:.6f}")
    print(f"link_latency={latency:.6f}")
    print(f"link_bandwidth={bandwidth:.3e}")


if __name__ == "__main__":
    main()
