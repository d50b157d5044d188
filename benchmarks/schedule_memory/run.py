"""Peak activation memory per stage under ``"1f1b"`` and ``"gpipe"``, for a growing number of micro-batches M.

Usage: ``python -m benchmarks.schedule_memory.run [--quick]`` (seconds; a part of ``make bench-schedules``). Each step
runs the engine's stages as threads of this process (:class:`~lightning_gpipe.engine.pipeline.Pipeline` over
:class:`~lightning_gpipe.engine.transport.ThreadTransport`) without re-materialization, so a stage keeps every layer's
activations of each micro-batch from its forward to its backward. Each stage thread counts the bytes of the tensors
autograd saves for backward while they are alive (a thread-local ``saved_tensors_hooks`` pair; a storage counts once
however many tensors share it; parameters and the batch, resident before the step, not at all) and reports its
peak. The count is exact and does not depend on the allocator or the machine's load.

GPipe holds all M micro-batches' activations on every stage; 1F1B holds at most ``min(K - j, M)`` on stage ``j``. The
table prints both peaks and their ratio per stage; the ``key=value`` lines at the end give stage 0's ratio per M.
"""

from __future__ import annotations

import argparse
import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.thread_transport import ThreadTransport

__all__ = ["SavedBytes", "main", "memory_table", "peak_per_stage"]

K, SAMPLES, WIDTH, BLOCKS = 4, 2048, 256, 4  # blocks of (Linear, GELU) per stage
MIB = 2**20


class SavedBytes:
    """The bytes of the storages autograd saves for backward in this thread while alive, and their peak."""

    def __init__(self, resident: Any = ()) -> None:
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        # Storages that exist before the step (the batch) are memory the data already holds, not activations.
        self._resident = {tensor.untyped_storage().data_ptr() for tensor in resident}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad):  # parameters are not activations
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._sizes and key not in self._resident and storage.nbytes() > 0:
                self._sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, key)
                self.peak = max(self.peak, self.live)
            # Without its graph: a node saving its own output would hold itself, and a backward that keeps the
            # graph (a split one) never frees that cycle, as autograd's own saving of an output avoids.
            return tensor.detach()
        return tensor

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def build_stage() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def peak_per_stage(schedule: str, chunks: int, stages: int = K) -> list[int]:
    """One training step of ``stages`` stages in threads; the peak saved-activation bytes of each stage."""
    torch.manual_seed(0)
    cells = [build_stage() for _ in range(stages)]
    batch = (torch.randn(SAMPLES, WIDTH), torch.randn(SAMPLES, WIDTH))
    transports = ThreadTransport.create(stages)
    counters = [SavedBytes(resident=batch) for _ in range(stages)]
    errors: list[BaseException] = []

    def work(j: int) -> None:
        pipeline = Pipeline(cells[j], transports[j], chunks=chunks, checkpoint="never", schedule=schedule)
        try:
            with counters[j].hooks():
                pipeline.train_step(batch, lambda output, mb: F.mse_loss(output, mb[1]))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(stages)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [counter.peak for counter in counters]


def memory_table(chunks: tuple[int, ...]) -> tuple[list[str], dict[str, str]]:
    """The markdown table of both schedules' peaks per stage for each M in ``chunks``, and stage 0's ratio per M."""
    torch.set_num_threads(1)
    lines = [
        f"K={K} stages of {BLOCKS} x (Linear({WIDTH}, {WIDTH}), GELU), batch {SAMPLES}, checkpoint='never'",
        "",
        "| M | stage | gpipe MiB | 1f1b MiB | 1f1b / gpipe | min(K-j, M) / M |",
        "|---|---|---|---|---|---|",
    ]
    headlines = {}
    for m in chunks:
        gpipe, one_f_one_b = peak_per_stage("gpipe", m), peak_per_stage("1f1b", m)
        for j in range(K):
            ratio = one_f_one_b[j] / gpipe[j]
            expected = min(K - j, m) / m
            lines.append(
                f"| {m} | {j} | {gpipe[j] / MIB:.1f} | {one_f_one_b[j] / MIB:.1f} | {ratio:.3f} | {expected:.3f} |"
            )
        headlines[f"stage0_1f1b_vs_gpipe_m{m}"] = f"{one_f_one_b[0] / gpipe[0]:.3f}"
    return lines, headlines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.schedule_memory.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="M in (4, 16) only")
    args = parser.parse_args(argv)
    lines, headlines = memory_table((4, 16) if args.quick else (1, 4, 8, 16, 32))
    print("\n".join(lines))
    for key, value in headlines.items():
        print(f"{key}={value}")


if __name__ == "__main__":
    main()
