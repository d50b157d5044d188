"""What per-micro-batch shapes cost: `ours` steps with and without a layout message per micro-batch, alternated.

Usage: ``python -m benchmarks.engine_speed.metadata [--workload transformer|small] [--steps N] [--chunks M]
[--baseline DIR [--rounds R]]``.

Two fresh ranks (``tools/launch.py``) train the engine workload's two halves (``checkpoint="never"``, as `ours` in
``run.py``), alternating step by step between the common path (one header per step, a control area in each later
micro-batch's message) and the *described* path that shapes varying per micro-batch take (a layout message per
micro-batch, each receive posted when its layout arrives). Alternating steps in the same processes compares the two
side by side under the same load; the arithmetic is identical. The last line is ``shape_metadata_ratio=R``: described
throughput over common-path throughput (median step times of rank 0, the sender).

``--baseline DIR`` compares the common path with another engine (the one before a change): rounds alternate a run of
the common path alone with this checkout's ``lightning_gpipe`` and one importing it from ``DIR`` (each a fresh process
starting its two ranks), and the last line is ``shape_metadata_vs_baseline_ratio=R``, this checkout's throughput over
the baseline's (the median over rounds of each run's median step of rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.engine_speed.workloads import WORKLOADS, K
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.transport import ProcessGroupTransport
from tools.launch import Launcher, importing_package_from, run_command

__all__ = ["main"]


def _rank(rank: int, world_size: int, workload: str, chunks: int, steps: int, alternate: bool) -> Any:
    """Rank ``rank``'s half of the workload (its gloo group up): {described: [(wall, cpu) per step]}."""
    torch.manual_seed(0)
    work = WORKLOADS[workload]
    layers = work.build_layers()
    half = len(layers) // K
    cell = nn.Sequential(*layers[rank * half : (rank + 1) * half])
    pipeline = Pipeline(cell, ProcessGroupTransport(range(K)), chunks=chunks, checkpoint="never")
    optimizer = torch.optim.SGD(cell.parameters(), lr=1e-3)
    batch = work.batch()
    outbox = pipeline.stage._outbox
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for step in range(2 * steps + 2):
        described = alternate and step % 2 == 1
        if outbox is not None and alternate:
            outbox._ragged = described  # the header of the step tells the receiver which path it takes
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        pipeline.train_step(batch, lambda output, mb: torch.nn.functional.mse_loss(output, mb[1]))
        optimizer.step()
        if step >= 2:  # one warm-up step of each
            times[described].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def _run_ranks(workload: str, chunks: int, steps: int, alternate: bool) -> dict[int, Any]:
    """The two ranks in fresh processes (:class:`tools.launch.Launcher`); rank -> {described: [(wall, cpu)]}."""
    with Launcher(["torch"]) as launcher:
        times = launcher.run(_rank, (workload, chunks, steps, alternate), K, timeout=1800, label=workload)
    return dict(enumerate(times))


def _compare_with_baseline(args: argparse.Namespace) -> None:
    """Common path only, this checkout against ``args.baseline``, in alternating rounds of fresh processes."""
    runs: dict[str, list[float]] = {"ours": [], "baseline": []}
    places = {"ours": importing_package_from(None), "baseline": importing_package_from(args.baseline)}
    for round_ in range(args.rounds):
        for name in runs:
            cwd, env = places[name]
            command = [sys.executable, "-m", "benchmarks.engine_speed.metadata", "--common-json"]
            command += ["--workload", args.workload, "--chunks", str(args.chunks), "--steps", str(args.steps)]
            output = run_command(command, cwd=cwd, env=env, timeout=1800)
            if output.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")
            wall = json.loads(output.stdout.splitlines()[-1])["wall"]
            runs[name].append(wall)
            print(f"round {round_ + 1} {name}: {1e3 * wall:.1f} ms per step")
    ours, baseline = statistics.median(runs["ours"]), statistics.median(runs["baseline"])
    print(f"{WORKLOADS[args.workload].title}, K = {K}, M = {args.chunks}, common path, median of {args.rounds} rounds:")
    print(f"| engine | step, wall (ms) |\n|---|---:|\n| this checkout | {1e3 * ours:.1f} |")
    print(f"| baseline ({args.baseline}) | {1e3 * baseline:.1f} |")
    print(f"shape_metadata_vs_baseline_ratio={baseline / ours:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="transformer")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each path")
    parser.add_argument("--baseline", help="a checkout whose lightning_gpipe the common path is compared with")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the comparison with --baseline")
    parser.add_argument("--common-json", action="store_true", help=argparse.SUPPRESS)  # one run of a comparison
    args = parser.parse_args(argv)
    if args.baseline:
        _compare_with_baseline(args)
        return
    if args.common_json:
        steps = _run_ranks(args.workload, args.chunks, args.steps, alternate=False)[0][False]
        print(json.dumps({"wall": statistics.median(w for w, _ in steps)}))
        return
    collected = _run_ranks(args.workload, args.chunks, args.steps, alternate=True)
    print(f"{WORKLOADS[args.workload].title}, K = {K}, M = {args.chunks}, {args.steps} steps of each path, rank 0:")
    print("| path | step, wall (ms) | step, CPU (ms) |")
    print("|---|---:|---:|")
    medians, cpus = {}, {}
    for described, name in ((False, "common (header + control area)"), (True, "described (layout per micro-batch)")):
        wall = statistics.median(w for w, _ in collected[0][described])
        cpu = statistics.median(c for _, c in collected[0][described])
        medians[described], cpus[described] = wall, cpu
        print(f"| {name} | {1e3 * wall:.1f} | {1e3 * cpu:.1f} |")
    # CPU time barely moves with other load; wall time also counts the waits for receives posted late.
    print(f"shape_metadata_cpu_ratio={cpus[False] / cpus[True]:.3f}")
    print(f"shape_metadata_ratio={medians[False] / medians[True]:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
