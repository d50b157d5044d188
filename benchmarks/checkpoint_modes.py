"""Step time and activation memory of every re-materialization mode on a Transformer-like stack, measured and predicted.

One stage (``Pipeline`` on a ``ThreadTransport``, K = 1) trains ``--layers`` pre-norm Transformer layers (attention by
``scaled_dot_product_attention``, a 4x MLP with GELU, dropout 0.1) on ``--batch`` sequences of ``--tokens`` tokens in
``--chunks`` micro-batches, with an MSE loss and no optimizer step. For each mode it reports:

- the median step time over ``--rounds`` rounds, the modes interleaved in each round so that a shared machine's load
  falls on all of them alike;
- the peak bytes of the tensors one step creates, counted from storages by ``LiveTensorBytes`` (the second step: the
  gradients exist already);
- the planner's predictions of both from one profile of the layers (:func:`~lightning_gpipe.plan.evaluate`).

``--compiled`` compares instead one forward and backward of the layers (dropout off) eager and compiled, under the
engine's wrapper and with a checkpoint inside each compiled layer (whole, or selective by
:func:`~lightning_gpipe.engine.rematerialization.selective_checkpoint`): the median time and the bytes autograd saves
for the backward (where the wrapper's own hooks do not hide them). A second table runs the strategy's path: a stage
(``Pipeline``, K = 1, ``--chunks`` micro-batches) over layers compiled as assembly compiles them
(:func:`~lightning_gpipe.partition.compile.compile_layers`) in each mode, with the step's peak tensor bytes.

Run ``python -m benchmarks.checkpoint_modes [--width 256] [--rounds 8] [--compiled]``; ``--tiny`` checks the script
in seconds.
GPU figures come from ``make bench-gpu`` (``benchmarks/gpu_speed``), which runs ``checkpoint="selective"`` too.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.machine import cpu_model
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.rematerialization import (
    CHECKPOINT_MODES,
    CheckpointMode,
    checkpointed,
    selective_checkpoint,
)
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.partition.compile import DEFAULT_OPTIONS, compile_layers
from lightning_gpipe.plan import evaluate
from lightning_gpipe.profile.layer_profile import profile_layers
from lightning_gpipe.profile.tensor_bytes import LiveTensorBytes

MiB = 2**20


class Block(nn.Module):
    """A pre-norm Transformer layer: ``x + attention(LN(x))``, then ``x + MLP(LN(x))``, each with dropout."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(rows, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(rows, tokens, width)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per mode: measured and predicted step seconds and activation bytes."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[Block(args.width, args.heads) for _ in range(args.layers)])
    data = (torch.randn(args.batch, args.tokens, args.width), torch.randn(args.batch, args.tokens, args.width))

    def loss(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
        return F.mse_loss(output, microbatch[1])

    modes: list[CheckpointMode] = list(CHECKPOINT_MODES)  # type: ignore[arg-type]
    pipelines = {
        mode: Pipeline(layers, ThreadTransport.create(1)[0], chunks=args.chunks, checkpoint=mode) for mode in modes
    }
    results: dict[str, dict[str, float]] = {}
    for mode, pipeline in pipelines.items():
        pipeline.train_step(data, loss)
        counter = LiveTensorBytes()
        with counter:
            pipeline.train_step(data, loss)
        results[mode] = {"bytes": float(counter.peak), "seconds": 0.0}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, pipeline in pipelines.items():
            start = time.perf_counter()
            pipeline.train_step(data, loss)
            times[mode].append(time.perf_counter() - start)
    size = args.batch // args.chunks
    profile = profile_layers(
        layers, data[0], microbatch_sizes=[size], repeats=args.rounds, warmup=1,
        loss_fn=lambda output: output.square().mean(), selective=True, optimizer=None,
    )  # fmt: skip
    for mode in modes:
        predicted = evaluate(profile, pipe_size=1, chunks=args.chunks, batch_size=args.batch, checkpoint=mode)
        results[mode]["seconds"] = statistics.median(times[mode])
        results[mode]["predicted_seconds"] = predicted.step_time
        results[mode]["predicted_bytes"] = predicted.stage_memory[0].activations
    return results


def compare_compiled(args: argparse.Namespace) -> str:
    """One forward and backward of the layers per variant: median milliseconds and MiB saved for backward."""
    torch.manual_seed(0)
    blocks = [Block(args.width, args.heads) for _ in range(args.layers)]
    for block in blocks:
        block.dropout.p = 0.0  # compiled dropout draws from other random streams than eager
    layers = nn.Sequential(*blocks)
    x = torch.randn(args.batch, args.tokens, args.width)

    def chain(calls: list[Any]) -> Any:
        def run(value: torch.Tensor) -> torch.Tensor:
            for call in calls:
                value = call(value)
            return value

        return run

    def whole(block: nn.Module) -> Any:
        return lambda value: torch.utils.checkpoint.checkpoint(block, value, use_reentrant=False)

    compiled = chain([torch.compile(block) for block in blocks])
    variants: dict[str, tuple[Any, bool]] = {  # name -> (run, whether autograd's saved tensors can be counted)
        "eager, nothing recomputed": (layers, True),
        "eager, the engine's whole wrapper": (lambda value: checkpointed(layers, value), False),
        "eager, the engine's selective wrapper": (lambda value: checkpointed(layers, value, selective=True), False),
        "compiled, nothing recomputed": (compiled, True),
        "compiled, the engine's whole wrapper": (lambda value: checkpointed(compiled, value), False),
        "compiled, the engine's selective wrapper": (
            lambda value: checkpointed(compiled, value, selective=True),
            False,
        ),
        "compiled, a whole checkpoint inside": (chain([torch.compile(whole(block)) for block in blocks]), True),
        "compiled, the selective policy inside": (
            chain([torch.compile(selective_checkpoint(block)) for block in blocks]),
            True,
        ),
    }
    state = {t.untyped_storage().data_ptr() for t in layers.parameters()}

    def step(run: Any, saved: dict[int, int] | None = None) -> None:
        def pack(t: torch.Tensor) -> torch.Tensor:
            if saved is not None and t.untyped_storage().data_ptr() not in state:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = run(x.clone().requires_grad_())
        torch.autograd.grad(output.square().mean(), list(layers.parameters()))

    saved_bytes: dict[str, float | None] = {}
    for name, (run, countable) in variants.items():
        saved: dict[int, int] = {}
        step(run, saved)  # compiles
        saved_bytes[name] = sum(saved.values()) / MiB if countable else None
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (run, _) in variants.items():
            start = time.perf_counter()
            step(run)
            times[name].append(time.perf_counter() - start)
    lines = ["| each layer | ms | saved for backward, MiB |", "|---|---:|---:|"]
    for name in variants:
        mib = saved_bytes[name]
        lines.append(f"| {name} | {statistics.median(times[name]) * 1e3:.1f} | {'' if mib is None else f'{mib:.1f}'} |")
    return "\n".join(lines)


def compare_compiled_stages(args: argparse.Namespace) -> str:
    """A compiled stage per mode, as the strategy assembles it: median step milliseconds and peak MiB of one step."""
    torch.manual_seed(0)
    blocks = [Block(args.width, args.heads) for _ in range(args.layers)]
    for block in blocks:
        block.dropout.p = 0.0
    data = (torch.randn(args.batch, args.tokens, args.width), torch.randn(args.batch, args.tokens, args.width))

    def loss(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
        return F.mse_loss(output, microbatch[1])

    pipelines: dict[str, Pipeline] = {}
    modes: list[CheckpointMode] = list(CHECKPOINT_MODES)  # type: ignore[arg-type]
    for mode in modes:
        layers = nn.Sequential(*[copy.deepcopy(block) for block in blocks])
        selective = mode == "selective"
        compile_layers(layers.children(), DEFAULT_OPTIONS, selective=selective)
        # What assembly does: compiled selective layers re-materialize themselves; the stage wraps nothing.
        engine_mode: CheckpointMode = "never" if selective else mode
        pipelines[mode] = Pipeline(layers, ThreadTransport.create(1)[0], chunks=args.chunks, checkpoint=engine_mode)
    peaks: dict[str, float] = {}
    for name, pipeline in pipelines.items():
        pipeline.train_step(data, loss)  # compiles
        counter = LiveTensorBytes()
        with counter:
            pipeline.train_step(data, loss)
        peaks[name] = counter.peak / MiB
    times: dict[str, list[float]] = {name: [] for name in pipelines}
    for _ in range(args.rounds):
        for name, pipeline in pipelines.items():
            start = time.perf_counter()
            pipeline.train_step(data, loss)
            times[name].append(time.perf_counter() - start)
    never = statistics.median(times["never"])
    lines = ["| compiled stage, checkpoint | step ms | vs never | peak MiB |", "|---|---:|---:|---:|"]
    for name in pipelines:
        ms = statistics.median(times[name])
        lines.append(f"| `{name}` | {ms * 1e3:.1f} | {ms / never:.2f} | {peaks[name]:.1f} |")
    return "\n".join(lines)


def describe(args: argparse.Namespace) -> str:
    """The workload and the machine, under a table."""
    return (
        f"{args.layers} layers, D={args.width}, {args.heads} heads, {args.batch} sequences of {args.tokens} tokens in "
        f"M={args.chunks} micro-batches; {cpu_model()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"
    )


def table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    never = results["never"]
    lines = [
        "| checkpoint | step ms | vs never | predicted ms | activations MiB | predicted MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| `{mode}` | {r['seconds'] * 1e3:.0f} | {r['seconds'] / never['seconds']:.2f} | "
            f"{r['predicted_seconds'] * 1e3:.0f} | {r['bytes'] / MiB:.1f} | {r['predicted_bytes'] / MiB:.1f} |"
        )
    lines.append("")
    lines.append(describe(args))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="2 layers, D=32, 16 tokens, 2 rounds: a check")
    parser.add_argument("--compiled", action="store_true", help="compare eager and compiled layers instead")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.tokens, args.batch, args.rounds = 2, 32, 16, 8, 2
    if args.compiled:
        print(f"{compare_compiled(args)}\n\n{compare_compiled_stages(args)}\n\n{describe(args)}")
    else:
        print(table(measure(args), args))


if __name__ == "__main__":
    main()
