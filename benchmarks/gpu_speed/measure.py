"""One configuration's measurement: train the workload, time the steps after warm-up and read the peak memory.

Meant to run in a fresh process (``run_config`` is a :class:`tools.launch.Launcher` rank function), so that each
configuration starts with its own CUDA context, allocator, peak counter and compile caches in memory.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

import zoo
from benchmarks.gpu_speed.configs import Config, Workload
from benchmarks.trainer import quiet_trainer
from lightning_gpipe import GPipeStrategy
from zoo import ZooModule
from zoo.transformer.objective import sequence_cross_entropy

__all__ = ["run_config"]

DISTINCT_BATCHES = 2


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _StepClock(Callback):
    """The start of every training step, after the device finished the work queued before it."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        _synchronize(self.device)
        self.starts.append(time.perf_counter())


def _batches(workload: Workload) -> list[Any]:
    """Random token ids, none of them the padding id 0, so that every token counts in the loss: [B, T + 1] (inputs and
    next tokens) for Transformer-L, collator-style mappings of [B, T] for the causal LM."""
    if workload.model == "qwen2":
        from benchmarks.gpu_speed.causal_lm import collated_batches

        return collated_batches(workload, DISTINCT_BATCHES)
    generator = torch.Generator().manual_seed(0)
    shape = (workload.batch, workload.seq_len + 1)
    return [torch.randint(1, workload.vocab_size, shape, generator=generator) for _ in range(DISTINCT_BATCHES)]


def _model(workload: Workload) -> L.LightningModule:
    """``workload``'s model, random weights, on the current default device."""
    if workload.model == "qwen2":
        from benchmarks.gpu_speed.causal_lm import qwen2_module

        return qwen2_module(workload)
    return zoo.create_model(
        "transformer_lm",
        num_layers=workload.num_layers,
        d_model=workload.d_model,
        ff_dim=workload.ff_dim,
        num_heads=workload.num_heads,
        vocab_size=workload.vocab_size,
    )


def _lightning_steps(module: ZooModule, config: Config, batches: list[Any], total: int, device: str) -> list[float]:
    """``total`` steps under Lightning; the times of the ``total + 1`` step boundaries (each step's start, one more)."""
    if config.runner == "auto":
        strategy: Any = "auto"
    else:
        options = {"compile": True} if config.strategy_compile else {}
        strategy = GPipeStrategy(pipe_size=1, chunks=config.chunks, checkpoint=config.checkpoint, **options)  # type: ignore[arg-type]
    clock = _StepClock(device)
    trainer = quiet_trainer(
        accelerator=device,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=total + 1,  # the last step's start closes the timed window; teardown is not timed
        callbacks=[clock],
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    sequence = [batches[i % len(batches)] for i in range(total + 1)]
    try:  # batch_size=None hands the prepared batches over as they are: no collation in any configuration
        trainer.fit(module, DataLoader(sequence, batch_size=None))  # type: ignore[arg-type]
    finally:
        if dist.is_initialized():  # GPipeStrategy's one-rank group; a next configuration in this process makes its own
            dist.destroy_process_group()
    return clock.starts


def _hand_steps(module: ZooModule, config: Config, batches: list[torch.Tensor], total: int, device: str) -> list[float]:
    """``total`` steps of a plain PyTorch loop, as a user writes it: M micro-batches accumulate gradients, then one
    optimizer step. The times of the ``total + 1`` step boundaries."""
    optimization: Any = module.configure_optimizers()
    optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    layers, label_smoothing = module.layers, module.hparams["label_smoothing"]
    module.train()
    starts = []
    for step in range(total):
        _synchronize(device)
        starts.append(time.perf_counter())
        batch = batches[step % len(batches)].to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        for chunk in batch.chunk(config.chunks):
            with torch.autocast(device_type=device, dtype=torch.bfloat16):  # what precision="bf16-mixed" does
                inputs, targets = chunk[:, :-1], chunk[:, 1:]
                if config.checkpoint == "per_microbatch":
                    logits = checkpoint(layers, inputs, use_reentrant=False)
                else:
                    logits = layers(inputs)
                loss = sequence_cross_entropy(logits, targets, label_smoothing=label_smoothing) / config.chunks
            loss.backward()
        optimizer.step()
        schedule.step()
    _synchronize(device)
    return [*starts, time.perf_counter()]


def run_config(rank: int, world_size: int, config: Config, workload: Workload, device: str) -> dict[str, Any]:
    """Train ``workload`` under ``config`` on ``device``; the timed steps, peak memory and what ran them.

    Returns ``{"status": "ok" | "out of memory", "step_seconds": [...], "peak_bytes": int | None, "parameters": int,
    "device_name": str, "software": str}``; any other error propagates.
    """
    # Lightning gives GPipeStrategy's processes cpu_count / processes threads unless this is set; "auto" none.
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gpipe"):
        logging.getLogger(name).setLevel(logging.WARNING)  # a dozen lines of setup per configuration otherwise
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):  # built in place: initializing 735M parameters on the host takes longer than training
        module: Any = _model(workload)
    assert config.runner != "hand" or workload.model == "transformer_lm", "the hand loops train Transformer-L only"
    if config.user_compile:
        for layer in module.layers:
            layer.compile()  # in place: the parameter names, and so the strategy's partition, stay those of the model
    total = workload.warmup + workload.steps
    result: dict[str, Any] = {
        "status": "ok",
        "step_seconds": [],
        "peak_bytes": None,
        "parameters": sum(p.numel() for p in module.parameters()),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "software": f"torch {torch.__version__}, Lightning {L.__version__}",
    }
    steps = _hand_steps if config.runner == "hand" else _lightning_steps
    try:
        starts = steps(module, config, _batches(workload), total, device)
    except Exception as error:
        if "out of memory" not in str(error):
            raise
        result["status"] = "out of memory"
    else:
        timed = starts[workload.warmup :]
        result["step_seconds"] = [end - start for start, end in zip(timed, timed[1:], strict=False)]
    if device == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    return result
