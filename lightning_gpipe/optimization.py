"""A stage's optimizer step under Lightning: its optimizers, and its gradients' one path to the step.

Lightning's automatic optimization runs, per optimizer step: the closure (``training_step``, ``zero_grad``,
``backward``), the precision plugin's unscaling, its clipping, then the optimizer's step. A pipeline stage holds a
slice of the model, so three things change on that path, each in one place here: the backward passes start from the
loss scaled as Lightning scales the closure's (:meth:`StageGradients.scale_loss`); after the closure, tied weights'
gradients are summed over their stages and every gradient is averaged over the stage's data-parallel replicas
(:meth:`StageGradients.after_closure`); the plugin's loss scaler agrees on found infs over the world and its clipping
uses the norm over every stage (:meth:`StageGradients.install`). Under ``data_parallel="fsdp"`` the stage's sharded
gradients were reduce-scattered over the replicas already, at the end of each step's backward passes
(:mod:`lightning_gpipe.engine.sharding`): only the tensors kept whole are averaged here, and the norm sums the shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lightning_gpipe.compat import replace_clipping
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.gradients import WorldGradScaler, average_gradients, clip_grad_norm
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.sharding import is_sharded
from lightning_gpipe.partition.sequence import Partition
from lightning_gpipe.partition.tied import TiedCopies

__all__ = ["StageGradients", "setup_stage_optimizers"]


class StageGradients:
    """The gradients of one stage on their way from the backward passes to the optimizer's step.

    Args:
        layout: which stage of which replica this process runs.
        pipeline_group: the stages of this pipeline (the clipping norm is summed over it).
        replica_group: this stage's data-parallel replicas (gradients are averaged over it).
        ties: the copies of tensors shared by several stages, if any.
        sharded: whether the stage is sharded over its replicas (``data_parallel="fsdp"``).
    """

    def __init__(
        self,
        layout: ProcessLayout,
        pipeline_group: dist.ProcessGroup | None,
        replica_group: dist.ProcessGroup | None,
        ties: TiedCopies | None,
        sharded: bool = False,
    ) -> None:
        self.layout = layout
        self.pipeline_group = pipeline_group
        self.replica_group = replica_group
        self.ties = ties
        self.sharded = sharded

    def install(self, plugin: Precision, device: torch.device, fitting: bool) -> None:
        """Make ``plugin``'s loss scaler skip the same steps on every rank, and its clipping use the global norm.

        Each stage sees only its own gradients: a plain GradScaler would skip the step on the stage that found an inf
        while the others step, and their scales would drift apart (:class:`WorldGradScaler` agrees first).
        """
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, WorldGradScaler):
            plugin.scaler = WorldGradScaler.like(scaler, device.type, self.layout.stage)  # type: ignore[attr-defined]
        if fitting:
            replace_clipping(plugin, self._clip)

    def _clip(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        duplicates = self.ties.duplicates() if self.ties is not None else ()
        if self.sharded:  # each rank holds a shard of each gradient: the norm sums over every rank
            first_replica = self.layout.replica == 0  # a tensor every replica holds whole counts once
            with collective_errors(self.layout.stage, "summing the gradients' norm over every rank (gradient_clip)"):
                clip_grad_norm(parameters, clip_val, dist.group.WORLD, duplicates, count_whole=first_replica)
            return
        group = self.pipeline_group if self.layout.pipe_size > 1 else None
        with collective_errors(self.layout.stage, "summing the gradients' norm over the stages (gradient_clip_val)"):
            clip_grad_norm(parameters, clip_val, group, duplicates)

    @staticmethod
    def scale_loss(plugin: Precision, trainer: Trainer) -> Callable[[Tensor], Tensor]:
        """What a weighted loss becomes before its backward pass: divided and scaled as Lightning's closure loss is."""
        scaler = getattr(plugin, "scaler", None)
        accumulate = trainer.accumulate_grad_batches

        def scale(loss: Tensor) -> Tensor:
            loss = loss / accumulate
            return scaler.scale(loss) if scaler is not None else loss

        return scale

    def after_closure(self, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, then the tied weights' gradients summed and every gradient averaged over the replicas."""
        stage = self.layout.stage

        def closure_then_average() -> Any:
            result = closure()
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            if self.ties is not None:
                with collective_errors(stage, "summing the gradients of tied weights over the stages that share them"):
                    self.ties.sum_gradients()
            if self.sharded:  # the shards' gradients were reduced at the end of each step: the whole tensors are left
                parameters = [p for p in parameters if not is_sharded(p)]
            replicas = self.layout.replica_ranks()
            with collective_errors(stage, f"averaging gradients with the replicas of this stage {replicas}"):
                average_gradients(parameters, self.replica_group, self.layout.num_replicas)  # type: ignore[arg-type]
            return result

        return closure_then_average


def setup_stage_optimizers(
    setup: Callable[[Trainer], None], trainer: Trainer, module: LightningModule, partition: Partition
) -> None:
    """Run Lightning's ``setup_optimizers`` on this process, its errors explained for a pipeline.

    ``configure_optimizers`` runs on every process with its stages' layers only (each of them once, a tensor its
    stages share too). A stage whose layers are all frozen (a
    frozen backbone split over several stages) gives an optimizer built from trainable parameters nothing, and
    torch's error would not say which stage or why.
    """
    try:
        setup(trainer)
    except RuntimeError as error:
        if "multiple optimizers" not in str(error):
            raise
        raise ValueError(f"{error} But GPipeStrategy takes one optimizer: use one with parameter groups") from error
    except ValueError as error:
        if "empty parameter list" not in str(error):
            raise
        stage = ", ".join(map(str, partition.stages))
        if any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                f"an optimizer got no parameters on stage {stage}: use one optimizer over all parameters, in groups"
            ) from error
        layers = ", ".join(f"{bound[0]}-{bound[-1]}" for bound in (partition.bounds[s] for s in partition.stages))
        sizes = [len(bound) for bound in partition.bounds]
        raise ValueError(
            f"stage {stage} (layers {layers} of {partition.path!r}) has no trainable parameters: move some to it "
            f"with balance= (now {sizes}), or use fewer stages"
        ) from error
