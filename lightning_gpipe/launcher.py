"""The fork and spawn launcher: the launching process gets the whole trained module back, from every stage's part.

Lightning's ``_MultiProcessingLauncher`` (``start_method="fork"`` or ``"spawn"``, what ``strategy="gpipe_notebook"``
uses) hands the launching process global rank 0's ``state_dict()`` at the end of ``fit``, which it loads into the
user's module. Each rank keeps only its own stage, so that would be one stage. Here every rank of the first pipeline
writes its stage's part to a folder the launching process made, and the launching process loads each part into the
user's module, which it held whole all along: no rank ever holds the whole model. A stage sharded over its replicas
(``data_parallel="fsdp"``) is gathered whole by them first, each rank holding its stage for as long as it writes it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_gpipe.compat import MultiProcessingLauncher, worker_output
from lightning_gpipe.engine.sharding import whole

__all__ = ["StagesToLauncher"]


class StagesToLauncher(MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, with the trained module sent back stage by stage (see the module)."""

    _parts: Path | None = None

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        self._parts = Path(tempfile.mkdtemp(prefix="gpipe-stages-"))  # the workers inherit the path
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            shutil.rmtree(self._parts, ignore_errors=True)

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        strategy = self._strategy
        # On every rank, as Lightning's own does (metrics may sync); sharded tensors gathered by their replicas.
        state = {k: whole(v) if isinstance(v, Tensor) else v for k, v in trainer.lightning_module.state_dict().items()}
        if trainer.state.fn == TrainerFn.FITTING and strategy.global_rank < getattr(strategy, "pipe_size", 1):
            assert self._parts is not None
            torch.save(state, self._parts / f"stage-{strategy.global_rank}.pt")  # the first pipeline's stages
        if strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback is not None else None
        return worker_output(best, None, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: Any, trainer: Trainer) -> None:
        super()._recover_results_in_main_process(worker_output, trainer)
        assert self._parts is not None
        for part in sorted(self._parts.glob("stage-*.pt")):
            state = torch.load(part, mmap=True, weights_only=True, map_location="cpu")
            # Not strict, as Lightning's: the launching process's module may lack layers the workers built.
            trainer.lightning_module.load_state_dict(state, strict=False)
