"""What the GPU benchmark measures: the workloads (model and batch sizes) and the configurations that train them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CAUSAL_LM",
    "CAUSAL_LM_KEYS",
    "CAUSAL_LM_TINY",
    "FULL",
    "QUICK",
    "QUICK_KEYS",
    "TINY",
    "Config",
    "Workload",
    "configurations",
    "strategy_accepts_compile",
    "strategy_accepts_selective",
]

Runner = Literal["auto", "gpipe", "hand"]
Model = Literal["transformer_lm", "qwen2"]


@dataclass(frozen=True)
class Workload:
    """A model's shape and what one step trains.

    ``model``: ``"transformer_lm"``, the zoo's Transformer-L (``zoo.create_model("transformer_lm", ...)`` arguments,
    Adam under its warmup schedule), or ``"qwen2"``, a random-initialized Hugging Face Qwen2 with tied embeddings as
    ``zoo.PretrainedCausalLM`` (AdamW; :mod:`benchmarks.gpu_speed.causal_lm`), whose ``ff_dim`` is the MLP's
    intermediate size and ``kv_heads`` its key/value heads (grouped-query attention).
    """

    num_layers: int
    d_model: int
    ff_dim: int
    num_heads: int
    vocab_size: int
    batch: int  # sequences per step
    seq_len: int  # tokens the model reads per sequence (a Transformer-L sample holds seq_len + 1: inputs and targets)
    warmup: int  # steps before the timed ones (the compiled configurations compile in the first)
    steps: int  # timed steps; the result is their median
    model: Model = "transformer_lm"
    kv_heads: int | None = None  # None: one per attention head

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def describe(self) -> str:
        """The model, the batch and the optimizer, for the page."""
        batch = f"{self.batch} sequences of {self.seq_len:,} tokens a step"
        if self.model == "qwen2":
            return (
                f"a random-initialized Qwen2 (`zoo.PretrainedCausalLM`), L={self.num_layers}, D={self.d_model}, "
                f"intermediate {self.ff_dim}, {self.num_heads} heads over {self.kv_heads} key/value heads, "
                f"V={self.vocab_size}, tied embeddings; {batch} (`input_ids`, `attention_mask`, `labels`); AdamW"
            )
        return (
            f"the zoo's Transformer-L, L={self.num_layers}, D={self.d_model}, FF={self.ff_dim}, "
            f"{self.num_heads} heads, V={self.vocab_size}; {batch}; Adam"
        )


# Issue 33's table: 735M parameters, 16 x 1,024 tokens, about 200 ms a step under "auto" on an H100.
FULL = Workload(12, 2048, 8192, 16, 32000, batch=16, seq_len=1024, warmup=3, steps=10)
# make gpu-check's short form: large enough to keep a GPU busy, small enough to train in seconds.
QUICK = Workload(4, 1024, 4096, 16, 32000, batch=8, seq_len=512, warmup=2, steps=5)
# --tiny: every code path on a CPU in seconds (8 sequences, so that M = 8 still has one per micro-batch).
TINY = Workload(2, 32, 64, 2, 64, batch=8, seq_len=16, warmup=1, steps=2)
# --workload causal_lm (issue 32): Qwen2.5-0.5B's shape, 494M parameters, random weights; 8 x 1,024 tokens a step.
CAUSAL_LM = Workload(24, 896, 4864, 14, 151936, batch=8, seq_len=1024, warmup=3, steps=10, model="qwen2", kv_heads=2)
CAUSAL_LM_TINY = Workload(2, 32, 64, 4, 96, batch=8, seq_len=16, warmup=1, steps=2, model="qwen2", kv_heads=2)


@dataclass(frozen=True)
class Config:
    """One way to train the workload.

    ``runner``: ``"auto"`` (Lightning's default strategy), ``"gpipe"`` (``GPipeStrategy(pipe_size=1, chunks=M)``) or
    ``"hand"`` (a plain PyTorch loop over M micro-batches, no Lightning). ``checkpoint``: GPipeStrategy's mode, or for
    the hand loop ``"never"`` or ``"per_microbatch"`` (``torch.utils.checkpoint`` around each micro-batch's forward).
    ``priority``: 0 for issue 33's table, 1 for what the strategy gained since, 2 for the rest; runs go in that order,
    so a short budget drops the rest first.
    """

    runner: Runner
    chunks: int = 1
    checkpoint: str = "never"
    user_compile: bool = False  # every layer torch.compile'd by the user before training
    strategy_compile: bool = False  # GPipeStrategy(compile=True)
    priority: int = 0

    @property
    def key(self) -> str:
        """The name ``--only`` takes, e.g. ``gpipe-m4-except_last-compiled``."""
        parts = [self.runner] if self.runner == "auto" else [self.runner, f"m{self.chunks}", self.checkpoint]
        parts += ["compiled"] if self.user_compile else []
        parts += ["compile_arg"] if self.strategy_compile else []
        return "-".join(parts)

    @property
    def label(self) -> str:
        """The table's row name."""
        if self.runner == "auto":
            return "`auto`, each layer compiled by the user" if self.user_compile else '`strategy="auto"`'
        if self.runner == "hand":
            how = (
                "`torch.utils.checkpoint` per micro-batch"
                if self.checkpoint == "per_microbatch"
                else "no re-materialization"
            )
            return f"hand loop, M={self.chunks}, {how}"
        label = f"gpipe K=1, M={self.chunks}, {self.checkpoint}"
        label += ", each layer compiled by the user" if self.user_compile else ""
        return label + (", `compile=True`" if self.strategy_compile else "")


def strategy_accepts_selective() -> bool:
    """Whether this checkout's GPipeStrategy takes ``checkpoint="selective"`` (asked of the strategy itself)."""
    from lightning_gpipe import GPipeStrategy

    try:
        GPipeStrategy(pipe_size=1, chunks=1, checkpoint="selective")
    except (TypeError, ValueError):
        return False
    return True


def strategy_accepts_compile() -> bool:
    """Whether this checkout's GPipeStrategy takes a ``compile`` argument."""
    from lightning_gpipe import GPipeStrategy

    return "compile" in inspect.signature(GPipeStrategy).parameters


def configurations(selective: bool, compile_argument: bool) -> list[Config]:
    """Every configuration, in the table's order; ``selective`` and ``compile_argument`` add the strategy's options."""
    table = {(1, "never"), (4, "except_last"), (4, "always"), (8, "except_last")}  # issue 33's gpipe rows
    modes = ["never", "except_last", "always", *(["selective"] if selective else [])]
    configs = [Config("auto")]
    for chunks in (1, 4, 8):
        for mode in modes:
            if chunks == 1 and mode == "except_last":
                continue  # spares the only micro-batch: the same run as "never"
            priority = 0 if (chunks, mode) in table else 1 if (chunks, mode) == (4, "selective") else 2
            configs.append(Config("gpipe", chunks, mode, priority=priority))
    for chunks in (4, 8):
        for mode in ("never", "per_microbatch"):
            configs.append(Config("hand", chunks, mode, priority=2 if (chunks, mode) == (8, "never") else 0))
    configs += [Config("auto", user_compile=True), Config("gpipe", 4, "except_last", user_compile=True)]
    if compile_argument:
        configs.append(Config("gpipe", 4, "except_last", strategy_compile=True, priority=1))
        if selective:
            configs.append(Config("gpipe", 4, "selective", strategy_compile=True, priority=1))
    return configs


QUICK_KEYS = ("auto", "gpipe-m4-except_last")
"""``--quick`` (what ``make gpu-check`` runs): the strategy's default at M = 4 against ``auto``."""
CAUSAL_LM_KEYS = ("auto", "gpipe-m1-never", "gpipe-m4-except_last")
"""``--workload causal_lm``'s rows (issue 32): one micro-batch and the strategy's default at M = 4, against auto."""
