"""Deferred BatchNorm: running statistics committed once per mini-batch from all of its micro-batches.

GPipe runs a mini-batch of N samples as M micro-batches, so a training forward only ever sees one micro-batch and
must normalize it with that micro-batch's own statistics. Plain ``nn.BatchNorm`` would also move its running
statistics M times per step, each time from a fraction of the samples, so the running statistics (and every eval
output) would depend on M. :class:`DeferredBatchNorm` instead gathers each micro-batch's per-channel count, mean and
sum of squared deviations, merges them with Chan's parallel formula, and :meth:`DeferredBatchNorm.commit` moves the
running statistics once, exactly as plain BatchNorm run on the whole mini-batch would have (same momentum or
cumulative average, unbiased running variance). A forward replayed by re-materialization is not gathered again.

Shapes: ``N`` samples, ``C`` channels, any number of trailing spatial dimensions (``(N, C)`` up to ``(N, C, D, H, W)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gpipe.engine.rematerialization import is_recomputing
from lightning_gpipe.engine.torch_compat import BatchNormBase

__all__ = ["DeferredBatchNorm", "commit_running_stats"]

# Exact classes only: a subclass may override ``forward`` (a fused BatchNorm + activation, for instance), and replacing
# it would silently drop that behaviour. SyncBatchNorm is left alone too: its training forward normalizes over the
# samples of every process in its group, which a per-micro-batch normalization would silently change.
_CONVERTIBLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class DeferredBatchNorm(BatchNormBase):
    """BatchNorm whose running statistics are committed once per mini-batch from all of its micro-batches.

    In training mode each forward normalizes its input with the input's own batch statistics (outputs and gradients
    are those of plain BatchNorm on that input) and only gathers the statistics; :meth:`commit` folds everything
    gathered since the last commit into ``running_mean``, ``running_var`` and ``num_batches_tracked``. Eval mode uses
    the running statistics exactly like plain BatchNorm. The state dict has the same keys as plain BatchNorm, so
    checkpoints load both ways with ``strict=True``.

    Call :meth:`commit` (or :func:`commit_running_stats`) once per mini-batch: whatever is gathered before a commit
    counts as one batch.
    """

    _gathered_mean: Tensor
    _gathered_m2: Tensor
    _plain_type: type[BatchNormBase] = nn.BatchNorm2d  # the class it replaced, for revert()

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # torch added the ``bias`` keyword in 2.13; pass it only when it matters so older torch keeps working.
        without_bias = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **without_bias)
        # Non-persistent: they follow ``.to()`` but never reach a state dict, which stays that of plain BatchNorm.
        # The sample count is derived from shapes, so it lives on the host and a commit never waits on the device.
        self.register_buffer("_gathered_mean", torch.zeros(num_features, device=device, dtype=dtype), persistent=False)
        self.register_buffer("_gathered_m2", torch.zeros(num_features, device=device, dtype=dtype), persistent=False)
        self._gathered_count = 0

    def _check_input_dim(self, input: Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"expected 2D, 3D, 4D or 5D input (got {input.dim()}D input)")

    def reset_running_stats(self) -> None:
        """Reset the running statistics and drop whatever was gathered but not committed."""
        super().reset_running_stats()
        # Called from ``_NormBase.__init__`` before the accumulators exist.
        if "_gathered_mean" in self._buffers:
            self._discard_gathered()

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input``; in training mode also gather its statistics for the next :meth:`commit`."""
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        # No running buffers are passed, so nothing moves here; F.batch_norm also rejects one value per channel.
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.training and self.track_running_stats:
            self._gather(input)
        return output

    # Eager under torch.compile: the count is a host int (a compiled graph would be specialized on each value), and a
    # replay must run the very graphs of its forward, so the recomputation is told apart here, outside them.
    @torch.compiler.disable
    def _gather(self, input: Tensor) -> None:
        """Merge the per-channel count, mean and M2 of ``input`` into the accumulators (Chan et al.'s formula)."""
        # Plain BatchNorm moves running statistics under no_grad too, so grad mode is no signal; a recomputation is.
        if is_recomputing():
            return
        with torch.no_grad():
            x = input.detach()
            dims = [0, *range(2, x.dim())]
            count = x.numel() // x.size(1)
            # Reduce in float32 at least: half-precision sums of squared deviations lose the variance.
            stat_dtype = torch.promote_types(x.dtype, torch.float32)
            var, mean = torch.var_mean(x.to(stat_dtype), dim=dims, correction=0)
            self._promote_accumulators(stat_dtype)
            acc_dtype = self._gathered_mean.dtype
            mean, m2 = mean.to(acc_dtype), var.to(acc_dtype) * count
            if self._gathered_count == 0:
                self._gathered_mean.copy_(mean)
                self._gathered_m2.copy_(m2)
            else:
                # Merging means and deviations, never raw sums of squares, avoids catastrophic cancellation when
                # the mean is large next to the spread.
                total = self._gathered_count + count
                delta = mean - self._gathered_mean
                self._gathered_mean.add_(delta, alpha=count / total)
                self._gathered_m2.add_(m2).add_(delta.square(), alpha=self._gathered_count * count / total)
            self._gathered_count += count

    def _promote_accumulators(self, dtype: torch.dtype) -> None:
        # ``.half()`` on the module casts the accumulators too; widening them back is lossless and keeps M2 accurate.
        wanted = torch.promote_types(self._gathered_mean.dtype, dtype)
        if self._gathered_mean.dtype != wanted:
            self._gathered_mean = self._gathered_mean.to(wanted)
            self._gathered_m2 = self._gathered_m2.to(wanted)

    def commit(self) -> None:
        """Fold the statistics gathered since the last commit into the running statistics; no-op if none were."""
        if self._gathered_count == 0:
            return
        running_mean, running_var, tracked = self.running_mean, self.running_var, self.num_batches_tracked
        # Statistics are gathered only when they are tracked, so the running buffers exist.
        assert running_mean is not None
        assert running_var is not None
        assert tracked is not None
        count = self._gathered_count
        mean = self._gathered_mean
        # Unbiased, as plain BatchNorm's running variance; every gathered micro-batch had more than one sample.
        var = self._gathered_m2 / (count - 1)
        with torch.no_grad():
            tracked.add_(1)
            # Cumulative moving average for momentum=None; a tensor factor keeps the device from being synchronized.
            factor = tracked.to(mean.dtype).reciprocal() if self.momentum is None else self.momentum
            # Same association as plain BatchNorm: (1 - m) * running + m * batch.
            running_mean.copy_((1 - factor) * running_mean.to(mean.dtype) + factor * mean)
            running_var.copy_((1 - factor) * running_var.to(var.dtype) + factor * var)
        self._discard_gathered()

    def _discard_gathered(self) -> None:
        self._gathered_mean.zero_()
        self._gathered_m2.zero_()
        self._gathered_count = 0

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replace every ``BatchNorm1d/2d/3d`` that tracks running statistics by a :class:`DeferredBatchNorm`.

        Works recursively and in place; returns ``module``, or its replacement if ``module`` itself is converted. The
        replacement holds the very same parameter and buffer tensors (so optimizers, ``meta`` tensors and shared
        modules stay valid) and the same ``eps``, ``momentum``, ``affine`` and training flag. Left alone: BatchNorms
        with ``track_running_stats=False`` (there is nothing to defer), subclasses of the BatchNorm classes (they may
        override ``forward``), ``SyncBatchNorm`` (its normalization spans processes), uninitialized lazy BatchNorms,
        and modules already converted, so converting twice changes nothing. Hooks registered on a replaced BatchNorm
        are not carried over.
        """
        return cls._convert(module, {})

    @classmethod
    def _convert(cls, module: nn.Module, converted: dict[int, nn.Module]) -> nn.Module:
        if id(module) in converted:
            return converted[id(module)]
        if type(module) in _CONVERTIBLE and isinstance(module, BatchNormBase) and module.track_running_stats:
            result: nn.Module = cls._replacement(module)
        else:
            # Not ``named_children()``: it yields a module shared under two names once, leaving the second name behind.
            for name, child in list(module._modules.items()):
                new_child = None if child is None else cls._convert(child, converted)
                if new_child is not child:
                    module.add_module(name, new_child)
            result = module
        converted[id(module)] = result
        return result

    @classmethod
    def _replacement(cls, module: BatchNormBase) -> DeferredBatchNorm:
        assert module.running_mean is not None
        # Build on the meta device: every tensor is replaced by the original's right after.
        with torch.device("meta"):
            deferred = cls(
                module.num_features,
                eps=module.eps,
                momentum=module.momentum,
                affine=module.affine,
                track_running_stats=True,
                bias=module.bias is not None,
            )
        deferred.weight = module.weight
        deferred.bias = module.bias
        deferred.running_mean = module.running_mean
        deferred.running_var = module.running_var
        deferred.num_batches_tracked = module.num_batches_tracked
        deferred._gathered_mean = torch.zeros_like(module.running_mean)
        deferred._gathered_m2 = torch.zeros_like(module.running_mean)
        deferred.train(module.training)
        deferred._plain_type = type(module)
        return deferred

    @classmethod
    def revert(cls, module: nn.Module) -> nn.Module:
        """Undo :meth:`convert`: every :class:`DeferredBatchNorm` becomes the BatchNorm class it replaced, holding the
        same tensors, so that a model trained in a pipeline trains as usual afterwards. Returns ``module`` or, if it
        is itself deferred, its replacement. Gathered but uncommitted statistics are dropped."""
        if isinstance(module, DeferredBatchNorm):
            with torch.device("meta"):
                plain = module._plain_type(
                    module.num_features, eps=module.eps, momentum=module.momentum, affine=module.affine
                )
            plain.weight, plain.bias = module.weight, module.bias
            plain.running_mean, plain.running_var = module.running_mean, module.running_var
            plain.num_batches_tracked = module.num_batches_tracked
            plain.train(module.training)
            return plain
        for name, child in list(module._modules.items()):
            if child is not None:
                new_child = cls.revert(child)
                if new_child is not child:
                    module.add_module(name, new_child)
        return module


def commit_running_stats(module: nn.Module) -> None:
    """Commit every :class:`DeferredBatchNorm` inside ``module`` (``module`` included); call once per mini-batch."""
    for submodule in module.modules():
        if isinstance(submodule, DeferredBatchNorm):
            submodule.commit()
