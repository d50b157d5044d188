"""The paper's Table 2 (speed-up against K and M) and Table 1 (largest model per memory budget), simulated.

``python -m benchmarks.plan_paper.run [--no-docs]``

Nothing here trains. The zoo's Transformer-L and AmoebaNet-D are built on the meta device at the paper's sizes and
profiled analytically (:func:`~lightning_gpipe.profile.profile_layers` with ``flops_per_second``: FLOPs and
exact saved-tensor bytes, no data); :func:`~lightning_gpipe.plan.evaluate` then simulates each configuration with
:func:`~lightning_gpipe.plan.simulate.simulate_step` and walks each stage's memory through its schedule.

- Table 2: throughput of AmoebaNet-D (18, 256) and Transformer-48 for K in {2, 4, 8} and M in {1, 4, 32},
  normalized to K = 2, M = 1, as in the paper (re-materialization on, fill-drain).
- Table 1: the largest AmoebaNet-D (18, D) that fits 8 GB devices (batch 128, 224 px) and the deepest Transformer-L
  that fits 16 GB devices (batch 32 of 1024 tokens) for Naive-1 (no GPipe: whole batch, every activation kept) and
  Pipeline-K (re-materialization, the best M); 12 bytes per parameter (RMSProp, as the paper says).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time
from typing import Any

import torch
import torch.nn.functional as F

import zoo
from benchmarks.docs_page import write_block
from lightning_gpipe.partition.balance import balance_by_cost
from lightning_gpipe.plan import ModelProfile, evaluate, profile_layers

__all__ = ["main"]

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "plan.md"
BEGIN, END = "<!-- plan-paper:begin -->", "<!-- plan-paper:end -->"
RATE = 40e12  # sustained FLOP/s of one accelerator; only the transfers' share depends on it
BANDWIDTH = 70e9  # bytes/s between neighbouring accelerators
GB = 1e9  # the paper's "8GB" and "16GB"
PAPER_TABLE2 = {
    "amoebanet_d": {1: (1.0, 1.13, 1.38), 4: (1.07, 1.26, 1.72), 32: (1.21, 1.84, 3.48)},
    "transformer_lm": {1: (1.0, 1.07, 1.3), 4: (1.7, 3.2, 4.8), 32: (1.8, 3.4, 6.3)},
}
PAPER_AMOEBA = {
    "Naive-1": ("(18, 208)", "82M"),
    "Pipeline-1": ("(18, 416)", "318M"),
    "Pipeline-2": ("(18, 544)", "542M"),
    "Pipeline-4": ("(36, 544)", "1.05B"),
    "Pipeline-8": ("(72, 512)", "1.8B"),
}
PAPER_TRANSFORMER = {
    "Naive-1": (3, "282.2M"),
    "Pipeline-1": (13, "785.8M"),
    "Pipeline-8": (103, "5.3B"),
    "Pipeline-32": (415, "21.0B"),
    "Pipeline-128": (1663, "83.9B"),
}
SEQUENCE = 1024


def _lm_loss(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, 1), targets)


def _image_loss(outputs: Any) -> torch.Tensor:
    logits = outputs[0] if isinstance(outputs, tuple) else outputs
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


@functools.cache
def _one_layer(sizes: tuple[int, ...]) -> ModelProfile:
    with torch.device("meta"):
        model = zoo.create_model("transformer_lm", num_layers=1, dropout=0.0)
    sample = torch.empty(1, SEQUENCE, dtype=torch.long, device="meta")
    return profile_layers(model.layers, sample, microbatch_sizes=sizes, loss_fn=_lm_loss, flops_per_second=RATE)


def transformer_profile(layers: int, sizes: list[int]) -> ModelProfile:
    """Transformer-L with ``layers`` layers: one layer profiled, then repeated (every layer is the same)."""
    one = _one_layer(tuple(sizes))
    picks = [0] + [1] * layers + [2]
    times = {n: (tuple(f[i] for i in picks), tuple(b[i] for i in picks)) for n, (f, b) in one.times.items()}
    return ModelProfile(
        tuple(one.layers[i] for i in picks),
        one.input_bytes,
        times,
        "meta",
        one.loss_saved_bytes,
        one.loss_transient_bytes,
    )


def amoebanet_profile(layers: int, filters: int, sizes: list[int]) -> tuple[ModelProfile, int]:
    """AmoebaNet-D (layers, filters) at 224 px with 1000 classes, and its parameter count."""
    with torch.device("meta"):
        model = zoo.create_model("amoebanet_d", num_layers=layers, num_filters=filters, num_classes=1000)
    model.train()
    sample = torch.empty(1, 3, 224, 224, device="meta")
    profile = profile_layers(model.layers, sample, microbatch_sizes=sizes, loss_fn=_image_loss, flops_per_second=RATE)
    return profile, sum(p.numel() for p in model.parameters())


def _throughput(profile: ModelProfile, K: int, M: int, batch: int) -> float:
    step = evaluate(
        profile,
        pipe_size=K,
        chunks=M,
        batch_size=batch,
        checkpoint="always",
        bandwidth=BANDWIDTH,
        latency=1e-5,
        optimizer_slots=1,
    )
    return batch / step.step_time


def table2() -> list[str]:
    batches = {"amoebanet_d": 128, "transformer_lm": 32}
    profiles = {
        "amoebanet_d": amoebanet_profile(18, 256, [4, 32, 128])[0],
        "transformer_lm": transformer_profile(48, [1, 8, 32]),
    }
    rows = [
        "| model | M | K = 2 simulated (paper) | K = 4 simulated (paper) | K = 8 simulated (paper) |",
        "|---|---|---|---|---|",
    ]
    for name, profile in profiles.items():
        base = _throughput(profile, 2, 1, batches[name])
        for M in (1, 4, 32):
            cells = [
                f"{_throughput(profile, K, M, batches[name]) / base:.2f} ({paper})"
                for K, paper in zip((2, 4, 8), PAPER_TABLE2[name][M], strict=True)
            ]
            label = "AmoebaNet-D (18, 256)" if name == "amoebanet_d" else "Transformer-48"
            rows.append(f"| {label} | {M} | " + " | ".join(cells) + " |")
    return rows


def _thriftiest(profile: ModelProfile, K: int, batch: int, naive: bool, smallest: int = 1) -> float:
    """The smallest predicted peak per device for Naive-1 or Pipeline-K.

    Naive-1 keeps every activation of the whole batch. Pipeline-K re-materializes, and its thriftiest M is the
    largest, micro-batches of ``smallest`` samples (2 where BatchNorm meets 1x1 maps): each micro-batch in flight
    keeps only its boundary (the batch's boundaries add up to the same bytes for any M), while the one being rebuilt
    and its workspace shrink with the micro-batch. Both balances are weighed: by time (what the planner prefers) and
    by the bytes each layer holds.
    """
    if naive:
        return evaluate(profile, pipe_size=1, chunks=1, batch_size=batch, checkpoint="never", optimizer_slots=1).peak
    options: dict[str, Any] = {
        "chunks": batch // smallest,
        "batch_size": batch,
        "checkpoint": "always",
        "optimizer_slots": 1,
    }
    by_time = evaluate(profile, pipe_size=K, **options)
    if K == 1:
        return by_time.peak
    held = [
        layer.param_bytes + layer.buffer_bytes + layer.trainable_bytes * 2 + layer.output_bytes
        for layer in profile.layers
    ]
    by_bytes = evaluate(profile, pipe_size=K, balance=balance_by_cost(held, K), **options)
    return min(by_time.peak, by_bytes.peak)


def _largest(fits: Any, low: int, high: int, step: int) -> int:
    """The largest value in ``low, low + step, ..., high`` for which ``fits`` holds (``low`` is taken to fit)."""
    low, high = low // step, high // step
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid * step):
            low = mid
        else:
            high = mid - 1
    return low * step


def table1_transformer() -> list[str]:
    rows = [
        "| setting (16 GB each) | deepest L simulated | parameters | paper L | paper parameters |",
        "|---|---|---|---|---|",
    ]
    low = 0
    for setting, (paper_layers, paper_params) in PAPER_TRANSFORMER.items():
        K = 1 if setting == "Naive-1" else int(setting.split("-")[1])
        naive = setting == "Naive-1"

        def fits(layers: int, K: int = K, naive: bool = naive) -> bool:
            profile = transformer_profile(layers, [1])
            return layers + 2 >= K and _thriftiest(profile, K, 32, naive) <= 16 * GB

        # More stages hold at least as many layers: the previous setting's answer is a lower bound (not Naive's).
        start = max(low if not naive else 0, K)
        found = _largest(fits, start, 4096, 1) if fits(start) else 0
        low = found if not naive else 0
        params = 50_358_336 * found + 131_104_000
        rows.append(f"| {setting} | {found} | {params / 1e9:.2f}B | {paper_layers} | {paper_params} |")
        print(rows[-1], flush=True)
    return rows


@functools.cache
def _amoebanet_peak(filters: int, K: int, naive: bool) -> tuple[float, int]:
    profile, count = amoebanet_profile(18, filters, [2])  # BatchNorm on 1x1 maps needs two samples
    return _thriftiest(profile, K, 128, naive, smallest=2), count


def table1_amoebanet() -> list[str]:
    rows = [
        "| setting (8 GB each) | largest (18, D) simulated | parameters | paper (L, D) | paper parameters |",
        "|---|---|---|---|---|",
    ]
    low = 8
    for setting, (paper_size, paper_params) in PAPER_AMOEBA.items():
        K = 1 if setting == "Naive-1" else int(setting.split("-")[1])
        naive = setting == "Naive-1"

        def fits(filters: int, K: int = K, naive: bool = naive) -> bool:
            return _amoebanet_peak(filters, K, naive)[0] <= 8 * GB

        # Coarse steps of 32 filters, then 8 within the last step.
        start = low if not naive else 8
        coarse = max(start, _largest(fits, start, 2048, 32)) if fits(start) else 0
        found = _largest(fits, coarse, coarse + 24, 8) if coarse else 0
        low = found if not naive else 8
        count = _amoebanet_peak(found, K, naive)[1] if found else 0
        rows.append(f"| {setting} | (18, {found}) | {count / 1e6:.0f}M | {paper_size} | {paper_params} |")
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_paper.run", description=__doc__.splitlines()[0])
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    args = parser.parse_args(argv)
    started = time.monotonic()
    blocks = ["### Table 2: normalized throughput, simulated (paper)", "", *table2(), ""]
    print("\n".join(blocks), flush=True)
    t1 = [
        "### Table 1: the largest model per setting, simulated (paper)",
        "",
        *table1_transformer(),
        "",
        *table1_amoebanet(),
    ]
    print("\n".join(t1), flush=True)
    text = "\n".join(
        blocks
        + t1
        + ["", f"- command: `python -m benchmarks.plan_paper.run` ({(time.monotonic() - started) / 60:.1f} min)"]
    )
    if not args.no_docs:
        write_block(PAGE, BEGIN, END, text)


if __name__ == "__main__":
    main()
