"""Peak memory of GPipeStrategy training runs on one device (CPU, or CUDA), each run in a fresh process.

:func:`measure_runs` runs each ``(mode, chunks)`` in a fresh process forked from a server that imported torch and
Lightning once (:class:`tools.launch.Launcher`); ``test_memory.py`` asserts on it and ``run.py`` tabulates it.
Each run trains ``GPipeStrategy(pipe_size=1, chunks=M, checkpoint=mode)`` for a few steps on a stack whose
memory is all activations, and measures the growth from just before the first step to the peak two ways:

- ``rss``: peak resident set size (``VmHWM``, what ``getrusage().ru_maxrss`` reports) minus the RSS before the first
  step; the high-water mark is reset there, so nothing from imports or setup can mask the training peak. glibc's
  mmap threshold is pinned (:func:`pin_mmap_threshold`) so that freed activations leave RSS instead of staying
  cached in the heap; what remains above the tensor count is allocator and interpreter overhead (~25-30 MiB).
- ``tensors``: the peak of the bytes held by tensor storages allocated during training, counted exactly by a
  ``TorchDispatchMode`` that sees every operator (forward, backward and recomputation) and frees each storage's
  bytes when the storage dies. It does not depend on the allocator, its caching or the machine's load.
- ``cuda``: with ``accelerator="cuda"``, the CUDA caching allocator's own peak
  (``torch.cuda.max_memory_allocated``, reset before the first step) minus what it held there. RSS cannot see GPU
  memory, so on CUDA this is the figure to read.

The result holds the model's shape, the GPipe paper's prediction counted in
bytes for these layer types, ``lightning_gpipe.profile.cost.memory_cost``'s count as a cross-check, and every run's
numbers.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader

from benchmarks.trainer import quiet_trainer
from lightning_gpipe import GPipeStrategy
from lightning_gpipe.profile.cost import memory_cost
from lightning_gpipe.profile.tensor_bytes import LiveTensorBytes

__all__ = ["hidden_activation_bytes", "measure", "measure_runs", "predicted_growth_bytes"]

# N samples of width D through BLOCKS x (Linear(D, D), GELU), then a Linear(D, OUT) head: 129 layers, 1.06 M
# parameters (4.0 MiB), 512 MiB of saved activations for the whole batch.
SAMPLES, WIDTH, BLOCKS, OUT = 8192, 128, 64, 8
STEPS = 2
FLOAT_BYTES = 4
MIB = 2**20


def build_layers() -> nn.Sequential:
    """The stack, initialized so that activations keep their scale through all 64 blocks.

    PyTorch's default Linear initialization shrinks the signal by about sqrt(3) per layer; after 64 layers every value
    is a denormal float, which x86 CPUs compute some ten times slower.
    """
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    layers.append(nn.Linear(WIDTH, OUT))
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.normal_(layer.weight, std=(2.0 / layer.in_features) ** 0.5)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


def hidden_activation_bytes(samples: int) -> int:
    """Bytes autograd keeps for backward inside the stack for ``samples`` samples, beyond its input and output.

    Every block leaves two ``samples x WIDTH`` float32 tensors: the Linear's output, saved by the GELU (its derivative
    needs its input), and the GELU's output, saved by the next Linear (the weight gradient needs the input). The first
    Linear's input is the batch, which the data loader holds anyway; the weights it saves are parameters.
    """
    return 2 * BLOCKS * samples * WIDTH * FLOAT_BYTES


def predicted_growth_bytes(mode: str, chunks: int) -> int:
    """The activation memory a stage holds at its peak, the GPipe paper's formula counted for this stack.

    Without re-materialization the stage keeps every layer's activations for all N samples, O(L * N). With it the stage
    keeps each micro-batch's boundary input and output, O(N), and rebuilds one micro-batch's L layers of activations at
    a time during backward, O(L * N / M). The boundary input is the data batch here, resident before the first step.
    """
    largest = -(-SAMPLES // chunks)  # the first micro-batches are the larger ones when M does not divide N
    output = SAMPLES * OUT * FLOAT_BYTES  # the MSE loss saves the stack's output of every micro-batch
    if mode == "never":
        return hidden_activation_bytes(SAMPLES) + output
    return hidden_activation_bytes(largest) + output


def memory_cost_activation_bytes(samples: int) -> int:
    """``profile.cost.memory_cost``'s activation count for the same stack, on the meta device (no memory).

    memory_cost counts, per layer, saved tensors plus parameters and gradients (no optimizer state with
    ``optimizer_slots=0``); the first layer's saved input is the stage input, which ``hidden_activation_bytes`` leaves
    out because it is the resident batch.
    """
    with torch.device("meta"):
        layers = build_layers()
        sample = torch.empty(samples, WIDTH)
    costs = memory_cost(layers, sample, optimizer_slots=0)
    parameters_and_grads = 2 * sum(p.numel() * p.element_size() for p in layers.parameters())
    return int(sum(costs)) - parameters_and_grads - samples * WIDTH * FLOAT_BYTES


def pin_mmap_threshold(threshold: int = 128 * 1024) -> None:
    """Serve every allocation of at least ``threshold`` bytes from its own mapping, returned to the OS when freed.

    glibc starts with a 128 KiB mmap threshold but raises it after the first large free (up to 32 MiB), so later
    activations come from the heap, whose freed pages stay resident: the same run's peak RSS then varied by 240 MiB
    with its allocation order. Setting the threshold explicitly turns that adaptation off, so RSS follows the live
    tensors (a micro-batch's activation here is 512 KiB at M = 8).
    """
    if platform.libc_ver()[0] == "glibc":
        m_mmap_threshold = -3  # from malloc.h
        ctypes.CDLL(None).mallopt(m_mmap_threshold, threshold)


def resident() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes since the last :func:`reset_peak`)."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def reset_peak() -> int:
    """Make the peak the current resident memory (Linux: ``echo 5 > /proc/self/clear_refs``); returns it."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return resident()[0]


class PeakMemory(Callback):
    """Measures memory growth from just before the first training step to the end of training."""

    def __init__(self) -> None:
        self.tensors = LiveTensorBytes()
        self.rss_before = 0
        self.rss_growth = 0
        self.cuda_before: int | None = None
        self.cuda_growth: int | None = None
        self.step_starts: list[float] = []
        self._tracking = False

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.step_starts.append(time.perf_counter())
        if batch_idx != 0:
            return
        gc.collect()
        self.rss_before = resident()[0]
        # Writing 5 resets the peak RSS (VmHWM, ru_maxrss) to the current RSS: the peak measured is training's own.
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
            torch.cuda.reset_peak_memory_stats(module.device)
            self.cuda_before = torch.cuda.memory_allocated(module.device)
        self.tensors.__enter__()
        self._tracking = True

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.stop()

    def stop(self) -> None:
        if self._tracking:
            self.tensors.__exit__(None, None, None)
            self._tracking = False
            self.rss_growth = resident()[1] - self.rss_before
            if self.cuda_before is not None:
                self.cuda_growth = torch.cuda.max_memory_allocated() - self.cuda_before


class StackModule(L.LightningModule):
    """A plain LightningModule around the stack: MSE regression, SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = build_layers()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def measure(mode: str, chunks: int, root: str, accelerator: str = "cpu") -> dict[str, Any]:
    """Train ``STEPS`` steps with ``GPipeStrategy(pipe_size=1, chunks=chunks, checkpoint=mode)`` and measure memory."""
    # Lightning's launcher would otherwise set torch's threads to cpu_count / processes.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pin_mmap_threshold()
    # One rank: an in-process store instead of a TCP one, so nothing listens on any port; gloo binds loopback only.
    # LOCAL_RANK tells Lightning's launcher that this process was started from outside: it looks for no free port
    # (which it would probe on every interface) and starts no other rank.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("LOCAL_RANK", "0")
    backend = "nccl" if accelerator == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        generator = torch.Generator().manual_seed(1)
        batch = (torch.randn(SAMPLES, WIDTH, generator=generator), torch.randn(SAMPLES, OUT, generator=generator))
        # batch_size=None hands the prepared batch over as it is: no collation copy inside the measured window.
        loader: DataLoader[tuple[Tensor, Tensor]] = DataLoader([batch] * STEPS, batch_size=None)  # type: ignore[arg-type]
        probe = PeakMemory()
        trainer = quiet_trainer(
            accelerator=accelerator,
            devices=1,
            strategy=GPipeStrategy(pipe_size=1, chunks=chunks, checkpoint=mode),  # type: ignore[arg-type]
            max_steps=STEPS,
            callbacks=[probe],
            use_distributed_sampler=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )
        try:
            trainer.fit(StackModule(), loader)
        finally:
            probe.stop()
    finally:
        dist.destroy_process_group()
    step_seconds = [b - a for a, b in zip(probe.step_starts, probe.step_starts[1:], strict=False)]
    return {
        "mode": mode,
        "chunks": chunks,
        "rss_growth": probe.rss_growth,
        "tensor_peak": probe.tensors.peak,
        "cuda_growth": probe.cuda_growth,
        "rss_before": probe.rss_before,
        "first_step_seconds": step_seconds[0] if step_seconds else None,
    }


def _measure_rank(rank: int, world_size: int, mode: str, chunks: int, root: str, accelerator: str) -> dict[str, Any]:
    return measure(mode, chunks, root, accelerator)


def measure_runs(
    runs: Sequence[tuple[str, int]], root: str, *, accelerator: str = "cpu", timeout: float = 600.0
) -> dict[str, Any]:
    """Every ``(mode, chunks)`` run in a fresh process (``timeout`` seconds each), the model and the predictions."""
    from tools.launch import Launcher

    with Launcher(["torch", "lightning", __name__]) as launcher:
        measured = [
            launcher.run(_measure_rank, (mode, chunks, root, accelerator), 1, timeout, label=f"{mode}:{chunks}")[0]
            for mode, chunks in runs
        ]
    model = build_layers()
    return {
        "model": {
            "samples": SAMPLES,
            "width": WIDTH,
            "blocks": BLOCKS,
            "out": OUT,
            "layers": len(model),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "steps": STEPS,
        },
        "hidden_activation_bytes": hidden_activation_bytes(SAMPLES),
        "memory_cost_activation_bytes": memory_cost_activation_bytes(SAMPLES),
        "runs": [{**run, "predicted": predicted_growth_bytes(run["mode"], run["chunks"])} for run in measured],
    }
