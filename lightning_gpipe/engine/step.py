"""One step of one stage in phases: begin, forward, backward, end or abort, in the order the schedule gives.

:class:`StepRun` is the only place that turns a schedule into calls on a :class:`~lightning_gpipe.engine.stage.Stage`.
Its drivers differ in who calls the cell: :meth:`Pipeline.train_step
<lightning_gpipe.engine.pipeline.Pipeline.train_step>` walks :attr:`StepRun.actions` itself, while
:class:`~lightning_gpipe.strategy.GPipeStrategy` lets the user's ``training_step`` call :meth:`StepRun.forward` once per
micro-batch and runs the backward passes in Lightning's ``backward``. Every order comes from
:func:`~lightning_gpipe.engine.schedule.stage_actions`, and :class:`StepRun` refuses an action out of that order, so no
driver can run a schedule of its own.

Lightning zeroes gradients between ``training_step`` and ``backward``. A schedule that runs a backward pass before its
last forward (``"1f1b"``, ``"zero_bubble"``) therefore runs those passes in ``training_step``; :class:`HeldGradients`
keeps what they computed out of the parameters' ``.grad`` until Lightning's ``backward``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lightning_gpipe.engine.fingerprint import Fingerprint
from lightning_gpipe.engine.microbatch import Microbatch
from lightning_gpipe.engine.schedule import Action, Phase, cached_stage_actions
from lightning_gpipe.engine.stage import Stage

__all__ = ["HeldGradients", "StepRun"]

_SENDS_GRADIENT = (Phase.BACKWARD, Phase.INPUT)  # the passes after which a stage sends its input's gradient


class StepRun:
    """One step of ``stage`` over ``microbatches``, driven through :meth:`forward` and :meth:`backward`.

    Creating it begins the stage's step. A training step runs ``stage_actions(schedule, ...)``; an evaluation step
    runs the forwards alone, in micro-batch order. End it with :meth:`end` once every action ran, or :meth:`abort` it
    after a failure (the stage then tells its peers where the transport can, and refuses further steps if receives
    were left posted).

    Args:
        stage: the stage that runs the passes.
        schedule: the schedule's name; its actions are built and checked once per (schedule, stage, K, M)
            (:func:`~lightning_gpipe.engine.schedule.cached_stage_actions`), not each step.
        microbatches: the step's micro-batches, the same on every stage.
        training: run the schedule's forward and backward passes; else forwards only.
        fingerprint: this stage's copy of the batch, checked against the other stages' (see :class:`Stage`).
    """

    def __init__(
        self,
        stage: Stage,
        schedule: str,
        microbatches: Sequence[Microbatch],
        *,
        training: bool = True,
        fingerprint: Fingerprint | None = None,
    ) -> None:
        self.stage = stage
        self.schedule = schedule
        self.training = training
        self.microbatches = list(microbatches)
        K, M = stage.num_stages, len(self.microbatches)
        self.actions: tuple[Action, ...]
        if training:
            self.actions = cached_stage_actions(schedule, stage.index, K, M)
        else:
            self.actions = tuple(Action(Phase.FORWARD, i) for i in range(M))
        # The next stage sends gradients in its backward order; knowing it, this stage posts their receives early.
        gradient_order = None
        if training and not stage.is_last:
            later = cached_stage_actions(schedule, stage.index + 1, K, M)
            gradient_order = [action.microbatch for action in later if action.phase in _SENDS_GRADIENT]
        self._done = 0
        split = any(action.phase is Phase.INPUT for action in self.actions)
        stage.begin_step(
            [mb.size for mb in self.microbatches], fingerprint, gradient_order=gradient_order, split_backward=split
        )

    @property
    def forward_span(self) -> int:
        """How many of :attr:`actions` run up to and including the last forward: those a user's step drives."""
        forwards = [k for k, action in enumerate(self.actions) if action.phase is Phase.FORWARD]
        return forwards[-1] + 1 if forwards else 0

    @property
    def backward_before_last_forward(self) -> bool:
        """Whether a backward pass runs before the last forward (``"1f1b"``, ``"zero_bubble"``), hence in the forward
        phase's driver."""
        return any(action.phase is not Phase.FORWARD for action in self.actions[: self.forward_span])

    @property
    def next_action(self) -> Action | None:
        """The action the schedule runs next on this stage; ``None`` once all ran."""
        return self.actions[self._done] if self._done < len(self.actions) else None

    def remaining(self) -> list[Action]:
        """The actions that have not run yet, in order."""
        return list(self.actions[self._done :])

    def _advance(self, action: Action) -> None:
        expected = self.next_action
        if action != expected:
            raise RuntimeError(
                f"stage {self.stage.index} was asked for {action} but its schedule runs {expected or 'nothing more'} "
                f"next (its actions: {' '.join(map(str, self.actions))})"
            )
        self._done += 1

    def forward(self, index: int, value: Any = None) -> Any:
        """Forward of micro-batch ``index``: stage 0 is given ``value``, later stages receive theirs.

        Returns the cell's output (the loss is computed from it on the last stage).
        """
        self._advance(Action(Phase.FORWARD, index))
        return self.stage.forward(index, value)

    def backward(self, index: int, loss: torch.Tensor | None = None) -> None:
        """Backward of micro-batch ``index``; the last stage is given its loss, already weighted."""
        self._advance(Action(Phase.BACKWARD, index))
        self.stage.backward(index, loss)

    def input(self, index: int, loss: torch.Tensor | None = None) -> None:
        """A split backward's input pass of micro-batch ``index`` (see :meth:`Stage.input_backward`)."""
        self._advance(Action(Phase.INPUT, index))
        self.stage.input_backward(index, loss)

    def weight(self, index: int) -> None:
        """A split backward's weight pass of micro-batch ``index`` (see :meth:`Stage.weight_backward`)."""
        self._advance(Action(Phase.WEIGHT, index))
        self.stage.weight_backward(index)

    def end(self) -> None:
        """Finish the step once every action ran: wait for the sends, commit deferred BatchNorm statistics."""
        if self.next_action is not None:
            raise RuntimeError(
                f"stage {self.stage.index} ended its step with actions left: {' '.join(map(str, self.remaining()))}"
            )
        self.stage.end_step()

    def abort(self, reason: str) -> None:
        """Drop the step after a failure and tell the other stages (see :meth:`Stage.abort`)."""
        self._done = len(self.actions)
        self.stage.abort(reason)


class HeldGradients:
    """Gradients computed in one phase of a step, kept out of ``.grad`` until a later phase adds them back.

    Created before the first backward pass that must be held: the parameters' gradients are set aside and ``.grad``
    starts empty. :meth:`hold` takes what the passes accumulated since and puts the set-aside gradients back, so that
    whatever happens to ``.grad`` in between (Lightning's ``zero_grad``) leaves the held ones alone; :meth:`release`
    adds them to ``.grad`` as it is then. The sum equals accumulating in place, up to float round-off.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._parameters = list(parameters)
        self._aside: list[torch.Tensor | None] = [p.grad for p in self._parameters]
        self._held: list[torch.Tensor | None] = []
        for p in self._parameters:
            p.grad = None

    def hold(self) -> None:
        """Take the gradients accumulated since creation and restore those that were set aside."""
        self._held = [p.grad for p in self._parameters]
        for p, grad in zip(self._parameters, self._aside, strict=True):
            p.grad = grad
        self._aside = []

    def release(self) -> None:
        """Add the held gradients to the parameters' ``.grad``."""
        for p, held in zip(self._parameters, self._held, strict=True):
            if held is None:
                continue
            if p.grad is None:
                p.grad = held
            else:
                p.grad.add_(held)
        self._held = []
