"""The step driver: one process's step, from its caller's per-micro-batch step function to the last backward pass.

Both drivers of a pipeline run it: :meth:`Pipeline.train_step <lightning_gpipe.engine.pipeline.Pipeline.train_step>`
with ``loss_fn(output, micro-batch)`` as the step function, the Lightning strategy with the user's ``training_step``.
:class:`StepDriver` owns the micro-batch loop in the schedule's order (through :class:`StepRun`), the one rule that
weighs each micro-batch's loss, the gradients of backward passes run among the forwards (:class:`HeldGradients`), the
backward passes, the further calls of the sequence in an evaluation step (:class:`CallRelay`), and its decoding calls
(:mod:`~lightning_gpipe.engine.decoding`).

A step runs in two phases, so that a caller may put something between them (Lightning zeroes gradients there):
:meth:`StepDriver.forward_phase` runs the schedule's actions up to its last forward, :meth:`StepDriver.backward_phase`
(training) or :meth:`StepDriver.finish` (evaluation) the rest. The step function calls :meth:`StepDriver.call` with the
stage's input once per micro-batch; every action goes through :class:`StepRun`, which refuses one out of the schedule's
order, so the driver walks actions, whatever phase, micro-batch and stage they name.

A process that holds several stages (``"interleaved"``, ``"zbv"``) calls the step function once per micro-batch too, at
the forward of its *call stage* (:attr:`StepRun.call_stage`: the last stage where it holds it, else its first); the
driver runs its other stages' forwards itself. Where the process holds stage 0 but calls at another stage (ZB-V's
first process, or one process holding every stage), stage 0's input comes from ``feed(micro-batch)``.

An evaluation step's decoding call (:meth:`StepDriver.decode`) runs on every stage: where it is the first call of the
step's first micro-batch, every stage sees it, and the driver runs the step function once more on the whole batch
instead of once per micro-batch (:meth:`StepRun.decode_whole`), so that the decoding splits the batch's rows into
micro-batches of its own and decodes them in flight, with the tokens of the whole batch's decoding; a later decoding
call is the last stage's alone, and the relay takes it to the other stages.

The loss-weighting rule: micro-batch ``i`` weighs ``w_i``, declared from its batch before the step (a module's
``batch_loss_weight``), else the ``loss_weight`` its step returned where the schedule allows it, else its share of the
samples (:func:`~lightning_gpipe.engine.microbatch.loss_weights`); declared or returned counts that sum to zero (every
label ignored) weigh by samples too, never ``0 / 0`` (:func:`~lightning_gpipe.engine.microbatch.count_weights`). A
loss is weighed at its forward when its weight is known then (declared, by samples, or needed by a backward pass among
the forwards); else once the forwards are over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from lightning_gpipe.engine.anomaly import check_finite
from lightning_gpipe.engine.decoding import Decoding, decode
from lightning_gpipe.engine.microbatch import Microbatch, count_weights, loss_weights
from lightning_gpipe.engine.relay import CallRelay
from lightning_gpipe.engine.schedule import Action, Phase
from lightning_gpipe.engine.step import HeldGradients, StepRun

__all__ = ["StepDriver", "StepFn", "WholeBatchDecoding"]

StepFn = Callable[[Microbatch], Any]
"""One micro-batch's step: calls :meth:`StepDriver.call` once with the stage's input and returns, on the last stage of
a training step, the loss or a mapping with a ``"loss"`` (and, where the schedule allows it, a ``"loss_weight"``)."""


class WholeBatchDecoding(BaseException):  # noqa: N818 - a signal, not an error
    """Unwinds the step function of an evaluation step's first micro-batch whose first call decodes: the driver runs
    the step on the whole batch instead (see the module). A ``BaseException``, so that a user's ``except Exception``
    lets it through; a caller that records what the step did (its logs) drops that micro-batch's record."""


class StepDriver:
    """One step of ``run``'s stages: the step function per forward, the weighted losses, the backward passes.

    Args:
        run: the step begun on the process's stages (:meth:`Pipeline.begin
            <lightning_gpipe.engine.pipeline.Pipeline.begin>`).
        hook: what the step function is called in messages (``"training_step"``, ``"validation_step"``...).
        sequence: the pipelined sequence's name in messages.
        returns_weights: whether a step may return ``loss_weight``; without, every loss is weighed at its forward.
        declare: the module's ``batch_loss_weight(batch)``, which declares each micro-batch's weight before the step.
        hold: the parameters whose gradients a backward pass among the forwards computes (those of every stage the
            process holds), held until :meth:`backward_phase` (Lightning zeroes ``.grad`` in between); ``None`` to
            leave them in ``.grad``.
        scale_loss: applied to a weighted loss before its backward pass (accumulation, a loss scaler).
        check_losses: check each loss for NaN and Inf at its forward.
        relay: serves the sequence's further calls of an evaluation step (decoding); one stage per process only.
        feed: stage 0's input for a micro-batch, where the process holds stage 0 and its call stage is another one;
            required there, unused elsewhere.
    """

    def __init__(
        self,
        run: StepRun,
        *,
        hook: str = "step",
        sequence: str = "",
        returns_weights: bool = False,
        declare: object = None,
        hold: Iterable[torch.Tensor] | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        check_losses: bool = False,
        relay: CallRelay | None = None,
        feed: StepFn | None = None,
    ) -> None:
        self.run = run
        self.stage = run.call_stage  # where the step function is called: the loss, or the caller's input
        self.hook = hook
        self.sequence = sequence
        self.returns_weights = returns_weights
        self.declared: torch.Tensor | None = None  # the step's weights from `declare`, on the last stage
        self.step_weights: torch.Tensor | None = None  # every micro-batch's weight, once :meth:`weigh` knows them
        self.early = run.backward_before_last_forward and run.training
        self._declare = declare
        self._hold = hold
        self._held: HeldGradients | None = None
        self._scale_loss = scale_loss
        self._check_losses = check_losses
        self._relay = relay if len(run.stages) == 1 else None
        self._call_index = None if len(run.stages) == 1 else self.stage.index  # as the run's actions name it
        first = run.stages[0]
        self._feed = feed if first.is_first and self.stage is not first else None
        if first.is_first and self.stage is not first and feed is None:
            raise TypeError(
                f"this process steps at stage {self.stage.index} of its stages {[stage.index for stage in run.stages]}"
                ", so stage 0 needs its input: pass StepDriver(..., feed=fn)"
            )
        self._losses: dict[int, torch.Tensor] = {}  # the last stage's losses, weighted once their weight is known
        self._current: Microbatch | None = None
        self._calls = 0
        self._decoding_chunks: int | None = None  # set once the step decodes its whole batch

    # --- the forward phase

    def forward_phase(self, step: StepFn, *, keep_outputs: bool = True) -> list[Any]:
        """Run the schedule's actions up to its last forward, each forward a call of ``step``; its outputs in order.

        The backward passes among them (``"1f1b"``, ``"zero_bubble"``) run here, their gradients held when ``hold``
        was given. ``keep_outputs=False`` drops each output once its loss is taken (``None`` in its place), for a
        caller that needs only the step's loss (:meth:`weigh` without ``returns_weights``): a loss may hold a buffer the
        size of the last stage's output (``mse_loss`` on the CPU), which would stay alive through the backward passes.
        A kept output whose backward ran here holds its loss's value only (a detached copy), its other keys as returned.
        """
        run = self.run
        outputs: list[Any] = []
        at: dict[int, int] = {}  # micro-batch: the position of its output
        try:
            if self._declare is not None and self.stage.is_last:
                self.declared = self._declared_weights()  # known before the first forward: any schedule may use it
            if self.early and self._hold is not None:
                self._held = HeldGradients(self._hold)
            for action in run.actions[: run.forward_span]:
                mb = run.microbatches[action.microbatch]
                if action.phase is not Phase.FORWARD:
                    if self._backward(action) and keep_outputs and action.microbatch in at:
                        outputs[at[action.microbatch]] = _spent(outputs[at[action.microbatch]])
                    continue
                if action.stage is not None and action.stage != self.stage.index:  # another held stage: no step
                    value = self._feed(mb) if self._feed is not None and action.stage == 0 else None
                    run.forward(mb.index, value, action.stage)
                    continue
                try:
                    output = self._step(step, mb)
                except WholeBatchDecoding:
                    self._decoding_chunks = len(run.microbatches)
                    outputs = [self._step(step, run.decode_whole())]
                    break
                if run.training and self.stage.is_last:
                    self._losses[mb.index] = self._loss_at_forward(mb, output)
                at[mb.index] = len(outputs)
                outputs.append(output if keep_outputs else None)
                del output  # the weighted loss keeps what its backward needs
            if self._held is not None:
                self._held.hold()
        except BaseException as error:
            self.abort(error)
            raise
        return outputs

    def _step(self, step: StepFn, mb: Microbatch) -> Any:
        self._current, self._calls = mb, 0
        try:
            output = step(mb)
        finally:
            self._current = None
        if self._calls == 0:
            raise RuntimeError(
                f"{self.hook} returned without calling the pipelined sequence {self.sequence!r}; call it once per step"
            )
        return output

    def call(self, value: Any) -> Any:
        """The sequence's call in the running step function: the schedule's forward first, then further calls.

        ``value`` is the stage's input (used on stage 0 only). A further call of one micro-batch's step is relayed
        through every stage (:class:`CallRelay`, evaluation only).
        """
        mb = self._current
        if mb is None:
            raise RuntimeError("the pipelined sequence was called outside a step of the pipeline")
        self._calls += 1
        if self._calls == 1:
            return self.run.forward(mb.index, value if self.stage.is_first else None, self._call_index)
        if self._call_index is not None:
            raise RuntimeError(
                f"the step called the pipelined sequence twice for one batch under schedule={self.run.schedule!r}; "
                "evaluate with schedule='gpipe' or '1f1b'"
            )
        if self._relay is None:
            raise RuntimeError(
                "the step called the pipelined sequence twice for one batch; call it once per training step"
            )
        return self._relay.call(mb.index, value)  # decoding: only the last stage gets here

    def decode(self, decoding: Decoding) -> Any:
        """The running step function's decoding call (evaluation only); its result on the last stage.

        The first call of the step's first micro-batch decodes the whole batch (every stage sees it: the step function
        runs again, on the whole batch, see the module); a further call is relayed to the other stages.
        """
        mb = self._current
        if mb is None:
            raise RuntimeError("the pipelined sequence was asked to decode outside a step of the pipeline")
        if self.run.training:
            raise RuntimeError(
                f"{self.hook} asked the pipelined sequence {self.sequence!r} to decode; decode in evaluation steps only"
            )
        if self._call_index is not None:
            raise RuntimeError(f"{self.hook} cannot decode under schedule={self.run.schedule!r}; use 'gpipe' or '1f1b'")
        self._calls += 1
        if self._calls > 1:
            if self._relay is None:
                raise RuntimeError("a further decoding call needs the step's relay (StepDriver(..., relay=...))")
            return self._relay.decode(mb.index, decoding)
        if self._decoding_chunks is None:
            if mb.index != 0:
                raise RuntimeError(
                    f"{self.hook} decoded at its first call for micro-batch {mb.index} but not for micro-batch 0; "
                    "decode at the first call for every batch or none"
                )
            raise WholeBatchDecoding
        return decode(self.run.stage, decoding, self._decoding_chunks)

    # --- the one loss-weighting rule

    def _declared_weights(self) -> torch.Tensor:
        declare = self._declare
        if not callable(declare):
            raise TypeError(
                f"batch_loss_weight is a {type(declare).__name__}, not a method batch_loss_weight(batch); rename it"
            )
        microbatches = self.run.microbatches
        return count_weights([declare(mb.value) for mb in microbatches], microbatches, self.stage.transport.device)

    def _loss_at_forward(self, mb: Microbatch, output: Any) -> torch.Tensor:
        """The loss ``output`` holds for ``mb``, weighted if its weight is known at its forward."""
        loss = output["loss"] if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{self.hook} returned {type(output).__name__}; return the loss tensor or a dict with a 'loss' tensor"
            )
        if self._check_losses:
            check_finite(self.stage.index, mb.index, "the loss", loss)
        if isinstance(output, Mapping) and "loss_weight" in output:
            if self.declared is not None:
                raise ValueError(
                    f"{self.hook} returned 'loss_weight' and {_owner(self._declare)} declares batch_loss_weight(batch) "
                    "too; drop one"
                )
            if self.early:
                raise ValueError(
                    f"{self.hook} returned 'loss_weight' under schedule={self.run.schedule!r}; use schedule='gpipe', "
                    "or declare batch_loss_weight(batch) instead"
                )
        if self.returns_weights and not self.early:
            return loss  # weighed once every micro-batch's step has returned
        return loss * (mb.weight if self.declared is None else self.declared[mb.index].to(loss.dtype))

    def weights(self, outputs: list[Any], device: torch.device) -> torch.Tensor:
        """Each micro-batch's share of the step's loss and logs: declared, returned, or by samples (float64)."""
        if self.declared is not None:
            return self.declared
        return loss_weights(outputs, self.run.microbatches, device)

    def weigh(self, outputs: list[Any]) -> torch.Tensor:
        """After the forward phase on the last stage: the step's total loss (detached), its losses weighted.

        Where a step may return ``loss_weight``, every loss is weighed now, by :attr:`step_weights`, and the backward
        passes still to run start from these.
        """
        if not self.returns_weights:
            return torch.stack([self._losses[i].detach() for i in sorted(self._losses)]).sum()
        losses = [output["loss"] if isinstance(output, Mapping) else output for output in outputs]
        self.step_weights = weights = self.weights(outputs, losses[0].device)
        weighted = [loss * weight.to(loss.dtype) for loss, weight in zip(losses, weights, strict=True)]
        last = self.stage
        pending = {action.microbatch for action in self.run.remaining() if self.run.stage_of(action) is last}
        self._losses = {i: loss for i, loss in enumerate(weighted) if i in pending}
        return torch.stack([loss.detach() for loss in weighted]).sum()

    def _backward(self, action: Action) -> bool:
        """Run one of the schedule's backward actions: a whole backward, or a split backward's input pass (both start
        from the loss on the last stage) or weight pass (which reuses the input pass's graph). Whether it started from
        the loss."""
        index, stage = action.microbatch, action.stage
        if action.phase is Phase.WEIGHT:
            self.run.weight(index, stage)
            return False
        loss = self._backward_loss(action)
        if action.phase is Phase.INPUT:
            self.run.input(index, loss, stage)
        else:
            self.run.backward(index, loss, stage)
        if loss is not None:
            # Only its value from here: its spent graph holds the leaves a split backward cuts off the last stage's
            # output, and with them that output and its gradient, until the step's end.
            self._losses[index] = self._losses[index].detach()
        return loss is not None

    def _backward_loss(self, action: Action) -> torch.Tensor | None:
        """What the backward ``action`` starts from: its micro-batch's weighted loss on the last stage, scaled."""
        if not (self.stage if action.stage is None else self.run.stage_of(action)).is_last:
            return None
        index = action.microbatch
        loss = self._losses[index]
        return self._scale_loss(loss) if self._scale_loss is not None else loss

    # --- the backward phase, the end

    def backward_phase(self) -> None:
        """Add the held gradients back, run the schedule's remaining (backward) actions, and end the step."""
        run = self.run
        try:
            if self._held is not None:
                self._held.release()
                self._held = None
            for action in run.remaining():  # the schedule's actions after its last forward: backward passes only
                self._backward(action)
            run.end()
        except BaseException as error:
            self.abort(error)
            raise

    def finish(self) -> None:
        """End an evaluation step: the last stage ends its further calls, the others serve them, then the step ends."""
        try:
            if self._relay is not None:
                if self.stage.is_last:
                    self._relay.finish()
                else:
                    self._relay.serve()
            self.run.end()
        except BaseException as error:
            self.abort(error)
            if self._relay is not None:
                self._relay.abort(repr(error))
            raise

    def abort(self, error: BaseException) -> None:
        """Drop the step after ``error`` and tell the other stages (see :meth:`StepRun.abort`)."""
        self.run.abort(repr(error))


def _spent(output: Any) -> Any:
    """A step's ``output`` once the backward of its loss has run: the loss's value only (a copy: ``mse_loss``'s shares a
    buffer the size of the stage's output on the CPU), for its graph holds the leaves a split backward cuts off that
    output, and with them the output and its gradient. The other keys stay as they are."""
    if isinstance(output, Mapping):
        return {**output, "loss": output["loss"].detach().clone()}
    return output.detach().clone()


def _owner(method: object) -> str:
    """The class name of a bound method's object, as messages name the module that declares it."""
    owner = getattr(method, "__self__", None)
    return type(owner).__name__ if owner is not None else "the module"
