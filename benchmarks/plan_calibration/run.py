"""Calibrate :func:`lightning_gpipe.plan`: predicted against measured peak memory per stage and step time.

``python -m benchmarks.plan_calibration.run [--quick] [--memory-only] [--no-docs] [--device cuda] [--schedules ...]``

For each model (the zoo's Transformer-L and AmoebaNet-D, scaled down, and a timm ResNet) and each configuration (K in
{1, 2}, M in {1, 4, 8}, checkpoint modes, the five schedules: interleaved with two stages per process, and ZB-V's two,
over two processes), one job of two processes (one thread each, gloo on loopback):

1. rank 0 profiles the model with :func:`~lightning_gpipe.profile.profile_layers` (the planner's own profile) and
   predicts every configuration with :func:`~lightning_gpipe.plan.evaluate`, which also chooses the balance;
2. each configuration is built with that balance and trained with :class:`~lightning_gpipe.Pipeline` and Adam: one
   warm-up step, then one step whose peak is counted in exact tensor bytes (a ``TorchDispatchMode``, independent of
   the allocator and the machine's load), added to the stage's resident state and batch;
3. the step time is measured in interleaved rounds, as ``reference/pipelining-notes.md`` prescribes for this shared
   2-core machine: each round times every configuration once (``steps`` steps each) between two profiles of the
   model on rank 0 (rank 1 waits, as the planner runs alone), and a configuration's prediction for the round is the
   mean of what the two profiles predict, with the balance of step 1 (the profile closing one round opens the
   next). A prediction and the measurement it is compared with are thus taken seconds apart and on both sides, not
   minutes: the machine's speed drifts by up to 20% within minutes, and a profile taken once before all rounds
   carried that drift into every error. Each configuration first takes untimed steps for ``WARMUP_SECONDS`` (at
   least one), so that the configuration before it, and the profile that left rank 1 idle, do not count in its
   time. Each round's foreign load (other processes' CPU, from /proc) is recorded and rounds above ``MAX_FOREIGN``
   cores are dropped when enough quiet ones remain.

Prints a table and the headlines ``plan_memory_error`` and ``plan_time_error``: the worst relative error over all
stages and configurations. A configuration's time error is the median over rounds of ``predicted / measured``,
less one (the median of per-round ratios, the notes' statistic), its memory error ``|predicted - measured| /
measured``. A single round's ratio moves by 11-14% (its standard deviation) on the 2-core machine, so the worst of
27 medians moves too: the report adds the worst time error's 90% interval over the rounds drawn again with
replacement (a bootstrap).
``--memory-only`` skips the timed rounds (memory counts do not depend on the machine's load, so they can be taken on
a busy machine) and writes its own block of the page. ``--schedules zero_bubble interleaved zbv`` measures only the
configurations of those schedules (and ``--rounds`` sets how many rounds), into the page's block of its own.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import pathlib
import platform
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]

from benchmarks.docs_page import write_block  # noqa: E402
from benchmarks.engine_speed.cpuload import foreign_cores, snapshot  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from tools.launch import Launcher  # noqa: E402

__all__ = ["CONFIGS", "MODELS", "Config", "main"]

PAGE = REPO / "docs" / "benchmarks" / "plan.md"
BEGIN, END = "<!-- plan-calibration:begin -->", "<!-- plan-calibration:end -->"
SCHEDULES_BEGIN, SCHEDULES_END = "<!-- plan-calibration-schedules:begin -->", "<!-- plan-calibration-schedules:end -->"
MEMORY_BEGIN, MEMORY_END = "<!-- plan-memory:begin -->", "<!-- plan-memory:end -->"
GPU_PAGE = REPO / "docs" / "benchmarks" / "gpu.md"
GPU_BEGIN, GPU_END = "<!-- plan-calibration-cuda:begin -->", "<!-- plan-calibration-cuda:end -->"
MAX_FOREIGN = 0.3  # cores of other processes' load above which a round is dropped (if enough quiet ones remain)
WARMUP_SECONDS = 0.5  # untimed steps before each configuration's timed ones, at least one
ROUND_REPEATS = 3  # timed runs per layer and size in each round's profile (its median is what the planner uses)


@dataclass(frozen=True)
class Config:
    """One measured configuration."""

    pipe_size: int
    chunks: int
    checkpoint: str
    schedule: str = "gpipe"
    virtual_stages: int = 1  # stages per process under "interleaved"

    def label(self) -> str:
        v = f" v={self.virtual_stages}" if self.schedule == "interleaved" else ""
        return f"K={self.pipe_size} M={self.chunks} {self.checkpoint} {self.schedule}{v}"


CONFIGS: tuple[Config, ...] = (
    Config(1, 1, "never"),
    Config(1, 4, "never"),
    Config(1, 4, "always"),
    Config(2, 1, "never"),
    Config(2, 4, "never"),
    Config(2, 4, "always"),
    Config(2, 4, "except_last"),
    Config(2, 4, "never", "1f1b"),
    Config(2, 8, "except_last"),
    Config(2, 4, "never", "zero_bubble"),
    Config(2, 4, "never", "interleaved", 2),
    Config(2, 4, "never", "zbv"),
)
MODELS: tuple[str, ...] = ("transformer_lm", "amoebanet_d", "timm_resnet")


@dataclass(frozen=True)
class Scale:
    """The models' size and the batch on one kind of device."""

    batch: int
    sequence: int
    transformer: dict[str, int]
    amoebanet: dict[str, int]
    resnet_channels: tuple[int, ...]


# Small for the 2-core CPU machine; larger on a GPU, where the small models would time kernel launches, not arithmetic.
SCALES = {
    "cpu": Scale(
        batch=16,
        sequence=64,
        transformer={"num_layers": 4, "d_model": 128, "ff_dim": 512, "num_heads": 2},
        amoebanet={"num_layers": 3, "num_filters": 16},
        resnet_channels=(16, 32, 64, 128),
    ),
    "cuda": Scale(
        batch=64,
        sequence=256,
        transformer={"num_layers": 8, "d_model": 1024, "ff_dim": 4096, "num_heads": 16},
        amoebanet={"num_layers": 6, "num_filters": 128},
        resnet_channels=(64, 128, 256, 512),
    ),
}
VOCAB = 1000


def _configs(device: str, schedules: Any = None) -> tuple[Config, ...]:
    """Every configuration on a CPU (of ``schedules`` when given); K = 1 only on a GPU: one GPU cannot host the two
    NCCL ranks K = 2 needs."""
    chosen = tuple(c for c in CONFIGS if schedules is None or c.schedule in schedules)
    return chosen if device == "cpu" else tuple(c for c in chosen if c.pipe_size == 1)


def _build(name: str, scale: Scale) -> Any:
    import zoo

    if name == "transformer_lm":
        return zoo.create_model("transformer_lm", **scale.transformer, vocab_size=VOCAB, dropout=0.0)
    if name == "amoebanet_d":
        return zoo.create_model("amoebanet_d", **scale.amoebanet, num_classes=10, image_size=32)
    shape = {"layers": [1, 1, 1, 1], "channels": list(scale.resnet_channels)}
    return zoo.create_model("timm", model_name="resnet18", num_classes=10, image_size=32, model_kwargs=shape)


def _batch(name: str, scale: Scale, device: Any) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    if name == "transformer_lm":
        return torch.randint(4, VOCAB, (scale.batch, scale.sequence + 1), generator=generator).to(device)
    images = torch.randn(scale.batch, 3, 32, 32, generator=generator)
    return images.to(device), torch.randint(0, 10, (scale.batch,), generator=generator).to(device)


def _objective(name: str, module: Any) -> tuple[Any, Any, Any]:
    """``(input_fn, loss_fn, profile_loss)``: the engine's input and loss, and the planner's stand-in loss."""
    import torch

    if name == "transformer_lm":

        def lm_loss(logits: Any) -> Any:
            return module._loss(logits, torch.full(logits.shape[:2], 5, device=logits.device))

        return (lambda b: b[:, :-1]), (lambda out, b: module._loss(out, b[:, 1:])), lm_loss

    def image_loss(outputs: Any) -> Any:
        first = outputs[0] if isinstance(outputs, tuple) else outputs
        return module.loss(outputs, torch.zeros(first.shape[0], dtype=torch.long, device=first.device))[0]

    return (lambda b: b[0]), (lambda out, b: module.loss(out, b[1])[0]), image_loss


def _tensor_bytes(tensors: list[Any]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _predict(
    rank: int,
    configs: tuple[Config, ...],
    batch_size: int,
    layers: Any,
    sample: Any,
    loss_fn: Any,
    repeats: int,
    warmup: int,
    balances: list[Any] | None = None,
) -> tuple[list[Any], list[float | None]]:
    """Rank 0 profiles ``layers`` (the other rank waits, as the planner runs alone) and predicts each of ``configs``;
    every rank gets the predictions, and for the split schedules the step time the planner predicted before it timed
    their split backward (W half of the backward of the layers with weights; ``None`` for the other schedules).
    ``balances`` keeps each configuration's balance; ``None`` lets the planner choose."""
    from dataclasses import replace

    import torch.distributed as dist

    from lightning_gpipe.engine.schedule import SPLIT_BACKWARD
    from lightning_gpipe.plan import evaluate
    from lightning_gpipe.profile.layer_profile import profile_layers

    predictions: list[Any] = [None, None]
    if rank == 0:
        sizes = sorted({-(-batch_size // c.chunks) for c in configs} | {batch_size})
        # The split schedules' input and weight passes are timed as the engine runs them (as plan() does).
        split = any(c.schedule in SPLIT_BACKWARD for c in configs)
        profile = profile_layers(
            layers, sample, microbatch_sizes=sizes, loss_fn=loss_fn, repeats=repeats, warmup=warmup, split=split
        )
        unsplit = replace(profile, split_input={}, split_weight={}, split_walk={})

        def predicted(c: Config, index: int, timed: Any = profile) -> Any:
            return evaluate(
                timed,
                pipe_size=c.pipe_size,
                chunks=c.chunks,
                batch_size=batch_size,
                checkpoint=c.checkpoint,  # type: ignore[arg-type]
                schedule=c.schedule,
                balance=None if balances is None else balances[index],
                virtual_stages=c.virtual_stages,
            )

        candidates = [predicted(c, index) for index, c in enumerate(configs)]
        earlier = [
            predicted(c, index, unsplit).step_time if c.schedule in SPLIT_BACKWARD else None
            for index, c in enumerate(configs)
        ]
        predictions = [candidates, earlier]
    dist.broadcast_object_list(predictions, src=0)
    return list(predictions[0]), list(predictions[1])


def _stages(config: Config, rank: int, cells: list[Any], device: Any) -> tuple[Any, Any, Any]:
    """``(cells, transport, layers)`` of this rank's stages under a schedule that places several on each process: the
    pipeline's mapping of cells and of transports, and the held layers as one module (for their state)."""
    from torch import nn

    from lightning_gpipe.engine.layout import new_link_groups
    from lightning_gpipe.engine.schedule import stages_of
    from lightning_gpipe.engine.transport import ProcessGroupTransport

    K, v = config.pipe_size, config.virtual_stages
    held = {r: stages_of(config.schedule, r, K, v) for r in range(K)}
    ranks = [next(r for r in held if s in held[r]) for s in range(len(cells))]
    # Two groups per link between two processes, one per direction (every rank creates them in the same order), so
    # that the several links joining the same two processes do not mix their messages.
    links = new_link_groups(ranks)
    mine = {s: cells[s] for s in held[rank]}
    transports = ProcessGroupTransport.for_stages(ranks, held[rank], device, links=links)
    return mine, transports, nn.ModuleList(mine.values())


def _job(
    rank: int, world_size: int, names: tuple[str, ...], rounds: int, steps: int, device_name: str, schedules: Any
) -> dict[str, Any]:
    """Both ranks: profile (rank 0), predict, measure memory and time of every configuration of every model."""
    import torch
    import torch.distributed as dist

    from lightning_gpipe.engine.pipeline import Pipeline
    from lightning_gpipe.engine.thread_transport import ThreadTransport
    from lightning_gpipe.engine.transport import ProcessGroupTransport
    from lightning_gpipe.partition.balance import split
    from lightning_gpipe.profile.tensor_bytes import LiveTensorBytes

    device = torch.device(device_name)
    scale, configs = SCALES[device.type], _configs(device.type, schedules)
    # Our processes, whose CPU time is not foreign load: both ranks and the launcher.
    ranks: list[Any] = [None] * world_size
    dist.all_gather_object(ranks, os.getpid())
    ours = [*ranks, os.getppid()]
    results: dict[str, Any] = {}
    for name in names:
        torch.manual_seed(0)
        module = _build(name, scale).to(device)
        module.train()
        batch = _batch(name, scale, device)
        input_fn, loss_fn, profile_loss = _objective(name, module)

        # The balances and the memory predictions; without timed rounds one untimed pass per size is enough (the
        # bytes are exact).
        timed = rounds > 0
        predict = functools.partial(_predict, rank, configs, scale.batch, module.layers, input_fn(batch), profile_loss)
        first, _ = predict(5 if timed else 1, 2 if timed else 0)
        runs = []
        for config, predicted in zip(configs, first, strict=True):
            active = rank < config.pipe_size
            if config.pipe_size == 1:
                cell = stages = module.layers
                transport = ThreadTransport.create(1, [device])[0] if active else None
            elif len(predicted.balance) > config.pipe_size:
                stages, transport, cell = _stages(config, rank, split(module.layers, list(predicted.balance)), device)
            else:
                cell = stages = split(module.layers, list(predicted.balance))[rank]
                transport = ProcessGroupTransport([0, 1], device)
            pipeline = (
                Pipeline(
                    stages,
                    transport,
                    chunks=config.chunks,
                    checkpoint=config.checkpoint,
                    schedule=config.schedule,
                    virtual_stages=config.virtual_stages,
                )
                if active
                else None
            )
            parameters = [p for p in cell.parameters() if p.requires_grad]
            optimizer = torch.optim.Adam(parameters, lr=1e-4)
            runs.append((config, predicted, pipeline, optimizer, parameters, cell))

        def step(run: Any, batch: Any = batch, loss_fn: Any = loss_fn, input_fn: Any = input_fn) -> None:
            _, _, pipeline, optimizer, _, _ = run
            if pipeline is None:
                return
            optimizer.zero_grad(set_to_none=False)
            pipeline.train_step(batch, loss_fn, input_fn)
            optimizer.step()

        memory: list[int | None] = []
        allocator: list[int | None] = []  # on a GPU: the caching allocator's growth during the step
        for run in runs:
            config, _, pipeline, optimizer, parameters, cell = run
            dist.barrier()
            if pipeline is None:
                memory.append(None)
                allocator.append(None)
                continue
            step(run)  # gradients and optimizer state come to exist
            state = [*cell.parameters(), *cell.buffers(), *(p.grad for p in parameters if p.grad is not None)]
            state += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
            counter = LiveTensorBytes()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            with counter:
                step(run)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                allocator.append(torch.cuda.max_memory_allocated(device) - before)
            batch_tensors = [batch] if torch.is_tensor(batch) else list(batch)
            memory.append(_tensor_bytes(state) + _tensor_bytes(batch_tensors) + counter.peak)

        times: list[list[float]] = [[] for _ in runs]
        predicted_times: list[list[float]] = [[] for _ in runs]
        unsplit_times: list[list[float]] = [[] for _ in runs]  # the split schedules' W = B/2 predictions
        loads: list[float] = []
        balances = [run[1].balance for run in runs]
        closing, closing_unsplit = predict(ROUND_REPEATS, 1, balances) if timed else ([], [])
        for _ in range(rounds):
            opening, opening_unsplit = closing, closing_unsplit  # the profile that closed the previous round
            start = snapshot(ours)
            for index, run in enumerate(runs):
                # Warm-up steps, so that the previous configuration's caches (and a rank left idle through the
                # profile) do not count here; every rank reads the same prediction, so they agree on the count.
                for _ in range(max(1, math.ceil(WARMUP_SECONDS / opening[index].step_time))):
                    step(run)
                dist.barrier()
                _sync(device)
                begin = time.perf_counter()
                for _ in range(steps):
                    step(run)
                _sync(device)
                elapsed = torch.tensor([(time.perf_counter() - begin) / steps])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[index].append(float(elapsed))
            loads.append(foreign_cores(start, snapshot(ours)))
            closing, closing_unsplit = predict(ROUND_REPEATS, 1, balances)
            for index, (first, last) in enumerate(zip(opening, closing, strict=True)):
                predicted_times[index].append((first.step_time + last.step_time) / 2)
                opened, closed = opening_unsplit[index], closing_unsplit[index]
                if opened is not None and closed is not None:
                    unsplit_times[index].append((opened + closed) / 2)
        results[name] = {
            "configs": [run[0].label() for run in runs],
            "predicted_times": predicted_times,
            "unsplit_times": unsplit_times,
            "predicted_memory": [[m.peak for m in run[1].stage_memory] for run in runs],
            "memory": memory,
            "allocator": allocator,
            "predicted_growth": [[max(m.activations, m.optimizer) for m in run[1].stage_memory] for run in runs],
            "pipe_sizes": [run[0].pipe_size for run in runs],
            "times": times,
            "loads": loads,
        }
    return results


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name, result in per_rank[0].items():
        stage_memory = []
        for index, pipe_size in enumerate(result["pipe_sizes"]):
            stage_memory.append([per_rank[j][name]["memory"][index] for j in range(pipe_size)])
        merged[name] = {**result, "measured_memory": stage_memory}
    return merged


def _quiet(values: list[float], loads: list[float]) -> list[float]:
    """The values of the rounds whose foreign load stayed under ``MAX_FOREIGN``, if at least three did; else all."""
    quiet = [value for value, load in zip(values, loads, strict=True) if load <= MAX_FOREIGN]
    return quiet if len(quiet) >= 3 else values


def _time_error(predicted: list[float], measured: list[float], loads: list[float]) -> tuple[float, float, float]:
    """``(predicted, measured, error)``: the medians over the quiet rounds, and the median per-round ratio's distance
    from one."""
    ratios = _quiet([p / m for p, m in zip(predicted, measured, strict=True)], loads)
    return (
        statistics.median(_quiet(predicted, loads)),
        statistics.median(_quiet(measured, loads)),
        abs(statistics.median(ratios) - 1.0),
    )


def _worst_time_interval(merged: dict[str, Any], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the worst time error over rounds drawn again with replacement (per model,
    whole rounds, so that what a round shares across configurations stays together): how far the headline could
    move with the same code on the same machine."""
    rng = random.Random(seed)
    per_model = []
    for result in merged.values():
        loads = result["loads"]
        rounds = [r for r, load in enumerate(loads) if load <= MAX_FOREIGN]
        rounds = rounds if len(rounds) >= 3 else list(range(len(loads)))
        pairs = zip(result["predicted_times"], result["times"], strict=True)
        ratios = [[p / m for p, m in zip(predicted, measured, strict=True)] for predicted, measured in pairs]
        per_model.append((rounds, ratios))
    worst = []
    for _ in range(draws):
        errors = [0.0]
        for rounds, ratios in per_model:
            drawn = rng.choices(rounds, k=len(rounds))
            errors += [abs(statistics.median(config[r] for r in drawn) - 1.0) for config in ratios]
        worst.append(max(errors))
    worst.sort()
    return worst[int(0.05 * draws)], worst[int(0.95 * draws) - 1]


def _report(merged: dict[str, Any], timed: bool = True) -> tuple[list[str], float, float]:
    rows = [
        "| model | configuration | peak per stage, predicted / measured (MiB) | worst memory error | step time, "
        "predicted / measured (ms) | time error |",
        "|---|---|---|---|---|---|",
    ]
    if not timed:
        rows = [
            "| model | configuration | peak per stage, predicted / measured (MiB) | worst memory error |",
            "|---|---|---|---|",
        ]
    worst_memory = worst_time = 0.0
    for name, result in merged.items():
        for index, label in enumerate(result["configs"]):
            predicted = result["predicted_memory"][index]
            measured = result["measured_memory"][index]
            errors = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]
            pairs = ", ".join(f"{p / 2**20:.1f} / {m / 2**20:.1f}" for p, m in zip(predicted, measured, strict=True))
            worst_memory = max(worst_memory, *errors)
            if not timed:
                rows.append(f"| {name} | {label} | {pairs} | {max(errors):.2f} |")
                continue
            predicted_time, measured_time, time_error = _time_error(
                result["predicted_times"][index], result["times"][index], result["loads"]
            )
            worst_time = max(worst_time, time_error)
            rows.append(
                f"| {name} | {label} | {pairs} | {max(errors):.2f} | "
                f"{predicted_time * 1e3:.1f} / {measured_time * 1e3:.1f} | {time_error:.2f} |"
            )
    return rows, worst_memory, worst_time


def _unsplit_rows(merged: dict[str, Any]) -> list[str]:
    """The split schedules' step times as predicted before the profile timed their split backward (W half of the
    backward of the layers with weights), against the same rounds' measurements; none without such rows."""
    rows = []
    for name, result in merged.items():
        for index, label in enumerate(result["configs"]):
            earlier = result["unsplit_times"][index]
            if earlier:
                predicted, measured, error = _time_error(earlier, result["times"][index], result["loads"])
                rows.append(f"| {name} | {label} | {predicted * 1e3:.1f} / {measured * 1e3:.1f} | {error:.2f} |")
    if not rows:
        return []
    header = "| model | configuration | step time with W = B/2, predicted / measured (ms) | time error |"
    return ["", header, "|---|---|---|---|", *rows]


def _allocator_rows(merged: dict[str, Any]) -> list[str]:
    """On a GPU: each stage's growth over a step, predicted against the CUDA caching allocator's own peak (which adds
    its rounding, caching and library workspaces to the exact tensor bytes the headline compares)."""
    rows = [
        "| model | configuration | step growth, predicted / CUDA allocator (MiB) | allocator / predicted |",
        "|---|---|---|---|",
    ]
    for name, result in merged.items():
        for label, predicted, measured in zip(
            result["configs"], result["predicted_growth"], result["allocator"], strict=True
        ):
            if measured is None:
                continue
            rows.append(
                f"| {name} | {label} | {predicted[0] / 2**20:.1f} / {measured / 2**20:.1f} | "
                f"{measured / predicted[0]:.2f} |"
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_calibration.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    parser.add_argument("--device", default="cpu", help="where the stages run (cuda: K = 1 only, one GPU)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--memory-only", action="store_true", help="count memory only (load-independent); no timed rounds"
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=sorted({c.schedule for c in CONFIGS}),
        help="only the configurations of these schedules, into the page's block of its own",
    )
    parser.add_argument("--rounds", type=int, help="timed rounds (default 31, 3 with --quick)")
    args = parser.parse_args(argv)
    rounds, steps = (3, 2) if args.quick else (31, 3)
    rounds = args.rounds if args.rounds is not None else rounds
    if args.memory_only:
        rounds = 0
    started = time.monotonic()
    job = (tuple(args.models), rounds, steps, args.device, args.schedules)
    with Launcher(["torch", "zoo", "lightning_gpipe.plan", __name__]) as launcher:
        per_rank = launcher.run(_job, job, 2, timeout=3000, label="plan")
    merged = _merge(per_rank)
    rows, worst_memory, worst_time = _report(merged, timed=rounds > 0)
    if rounds > 0:
        rows += _unsplit_rows(merged)
    page, timed_block, memory_block = PAGE, (BEGIN, END), (MEMORY_BEGIN, MEMORY_END)
    if args.schedules:  # a few schedules' rows: their own block, beside the whole calibration's
        timed_block = memory_block = (SCHEDULES_BEGIN, SCHEDULES_END)
    command = "python -m benchmarks.plan_calibration.run" + "".join(
        f" {flag}"
        for flag, given in (
            ("--quick", args.quick),
            ("--memory-only", args.memory_only),
            (f"--device {args.device}", args.device != "cpu"),
            (f"--schedules {' '.join(args.schedules or ())}", bool(args.schedules)),
            (f"--rounds {args.rounds}", args.rounds is not None and not args.memory_only),
        )
        if given
    )
    device_lines = []
    if args.device != "cpu":  # GPU results have their own block, on the page of what a GPU showed
        import torch

        rows += ["", *_allocator_rows(merged)]
        page, timed_block, memory_block = GPU_PAGE, (GPU_BEGIN, GPU_END), (GPU_BEGIN, GPU_END)
        device_lines = [f"- device: {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    if rounds == 0:
        context = [
            "",
            f"- command: `{command}` ({(time.monotonic() - started) / 60:.1f} min)",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "",
            f"Worst relative memory error: {worst_memory:.2f} (target 0.10).",
        ]
        print("\n".join(rows + context))
        if not args.no_docs:
            write_block(page, *memory_block, "\n".join(rows + context))
        print()
        print(f"plan_memory_error={worst_memory:.2f}")
        return
    loads = [load for result in merged.values() for load in result["loads"]]
    low, high = _worst_time_interval(merged)
    context = [
        "",
        f"- command: `{command}` ({(time.monotonic() - started) / 60:.1f} min; {rounds} rounds of {steps} steps per "
        "configuration)",
        f"- machine: {os.cpu_count()} CPUs, {cpu_model()}, {platform.system()} {platform.release()}; "
        f"other processes' load per round: median {statistics.median(loads):.2f} cores, max {max(loads):.2f}",
        *device_lines,
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"Worst relative errors: memory {worst_memory:.2f} (target 0.10), time {worst_time:.2f} (target 0.15).",
        f"The worst time error's 90% interval over the rounds drawn again (bootstrap): {low:.2f}-{high:.2f}.",
    ]
    print("\n".join(rows + context))
    if not args.no_docs:
        write_block(page, *timed_block, "\n".join(rows + context))
    print()
    print(f"plan_memory_error={worst_memory:.2f}")
    print(f"plan_time_error={worst_time:.2f}")


if __name__ == "__main__":
    main()
