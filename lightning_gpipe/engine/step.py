"""One step of a process's stages in phases: begin, forward, backward, end or abort, in the order the schedule gives.

:class:`StepRun` is the only place that turns a schedule into calls on a :class:`~lightning_gpipe.engine.stage.Stage`.
A process holds one stage, or several under ``"interleaved"`` and ``"zbv"``; the run holds them all and dispatches each
action to the stage it names. Its drivers differ in who calls the cell: :meth:`Pipeline.train_step
<lightning_gpipe.engine.pipeline.Pipeline.train_step>` walks :attr:`StepRun.actions` itself, while
:class:`~lightning_gpipe.strategy.GPipeStrategy` lets the user's ``training_step`` call :meth:`StepRun.forward` once per
micro-batch and runs the backward passes in Lightning's ``backward``. Every order comes from
:func:`~lightning_gpipe.engine.schedule.stage_actions` (one stage per process) or
:func:`~lightning_gpipe.engine.schedule.process_actions` (several), and :class:`StepRun` refuses an action out of that
order, so no driver can run a schedule of its own.

Lightning zeroes gradients between ``training_step`` and ``backward``. A schedule that runs a backward pass before its
last forward (``"1f1b"``, ``"zero_bubble"``, ``"interleaved"``, ``"zbv"``) therefore runs those passes in
``training_step``; :class:`HeldGradients` keeps what they computed out of the parameters' ``.grad`` until Lightning's
``backward``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lightning_gpipe.engine.fingerprint import Fingerprint
from lightning_gpipe.engine.microbatch import Microbatch
from lightning_gpipe.engine.schedule import Action, Phase, StepOrder, step_order
from lightning_gpipe.engine.stage import Stage

__all__ = ["HeldGradients", "StepRun"]


class StepRun:
    """One step of ``stages``, a process's stages, over ``microbatches``, driven through :meth:`forward` and
    :meth:`backward` (or :meth:`input` and :meth:`weight`).

    Creating it begins the step on every stage. A training step runs the schedule's actions: ``stage_actions(schedule,
    ...)`` for one stage, whose actions name no stage, ``process_actions(schedule, r, K, M, v)`` for several, whose
    actions name theirs. An evaluation step runs the forwards alone: in micro-batch order for one stage, stage after
    stage for several (an order that needs no backward to make room, so it cannot deadlock). End it with :meth:`end`
    once every action ran, or :meth:`abort` it after a failure (the stages then tell their peers where the transport
    can, and refuse further steps if receives were left posted).

    Args:
        stages: the stage that runs the passes, or every stage the process holds (:func:`stages_of` of the
            schedule, in model order; ``r`` is the first one's index, ``v`` their number, ``K·v`` the pipeline's).
        schedule: the schedule's name; its actions are built and checked once per (schedule, process, K, M), not
            each step.
        microbatches: the step's micro-batches, the same on every stage.
        training: run the schedule's forward and backward passes; else forwards only.
        fingerprint: this process's copy of the batch, checked against the other stages' (see :class:`Stage`).
        batch: the batch the micro-batches were split from, for an evaluation step that decodes it whole
            (:meth:`decode_whole`).
    """

    def __init__(
        self,
        stages: Stage | Sequence[Stage],
        schedule: str,
        microbatches: Sequence[Microbatch],
        *,
        training: bool = True,
        fingerprint: Fingerprint | None = None,
        batch: Any = None,
    ) -> None:
        self.stages: tuple[Stage, ...] = (stages,) if isinstance(stages, Stage) else tuple(stages)
        self.schedule = schedule
        self.training = training
        self.microbatches = list(microbatches)
        self.batch = batch
        self._by_index = {stage.index: stage for stage in self.stages}
        self.order: StepOrder = _order(self.stages, schedule, len(self.microbatches), training)
        """The schedule's order for this process and step, built once per (schedule, process, K, M)."""
        self.actions: tuple[Action, ...] = self.order.actions
        self._done = 0
        for stage in self.stages:
            gradients = self.order.gradient_orders.get(stage.index)
            stage.begin_step(
                [mb.size for mb in self.microbatches],
                fingerprint,
                gradient_order=list(gradients) if gradients is not None else None,
                split_backward=self.order.split,
            )

    @property
    def stage(self) -> Stage:
        """The process's one stage; a process holding several has :attr:`stages` and :attr:`call_stage` instead."""
        if len(self.stages) > 1:
            raise AttributeError(
                f"this process holds stages {[s.index for s in self.stages]}, not one; use StepRun.stages, "
                "StepRun.call_stage or StepRun.stage_of(action)"
            )
        return self.stages[0]

    @property
    def call_stage(self) -> Stage:
        """The stage whose forward calls the step function: the last stage where the process holds it, else its first.

        The process's loss (on the last stage) or its input from the caller (on stage 0) belongs to it.
        """
        last = self.stages[-1]
        return last if last.is_last else self.stages[0]

    def stage_of(self, action: Action) -> Stage:
        """The stage that runs ``action``: the one it names, or the process's one stage."""
        return self.stages[0] if action.stage is None else self._by_index[action.stage]

    @property
    def forward_span(self) -> int:
        """How many of :attr:`actions` run up to and including the last forward: those a user's step drives."""
        return self.order.forward_span

    @property
    def backward_before_last_forward(self) -> bool:
        """Whether a backward pass runs before the last forward (all schedules but ``"gpipe"``), hence in the forward
        phase's driver."""
        return self.order.backward_before_last_forward

    @property
    def next_action(self) -> Action | None:
        """The action the schedule runs next on this process; ``None`` once all ran."""
        return self.actions[self._done] if self._done < len(self.actions) else None

    def remaining(self) -> list[Action]:
        """The actions that have not run yet, in order."""
        return list(self.actions[self._done :])

    def _advance(self, action: Action) -> Stage:
        expected = self.next_action
        if action != expected:
            who = f"stage {self.stages[0].index}" if len(self.stages) == 1 else f"the process of stages {self._held}"
            raise RuntimeError(
                f"{who} was asked for {action} but its schedule runs {expected or 'nothing more'} next (its actions: "
                f"{' '.join(map(str, self.actions))})"
            )
        self._done += 1
        return self.stages[0] if action.stage is None else self._by_index[action.stage]

    @property
    def _held(self) -> list[int]:
        return [stage.index for stage in self.stages]

    def forward(self, index: int, value: Any = None, stage: int | None = None) -> Any:
        """Forward of micro-batch ``index`` on ``stage`` (the one stage by default): stage 0 is given ``value``, later
        stages receive theirs.

        Returns the cell's output (the loss is computed from it on the last stage).
        """
        return self._advance(Action(Phase.FORWARD, index, stage)).forward(index, value)

    def backward(self, index: int, loss: torch.Tensor | None = None, stage: int | None = None) -> None:
        """Backward of micro-batch ``index`` on ``stage``; the last stage is given its loss, already weighted."""
        self._advance(Action(Phase.BACKWARD, index, stage)).backward(index, loss)

    def input(self, index: int, loss: torch.Tensor | None = None, stage: int | None = None) -> None:
        """A split backward's input pass of micro-batch ``index`` on ``stage`` (see :meth:`Stage.input_backward`)."""
        self._advance(Action(Phase.INPUT, index, stage)).input_backward(index, loss)

    def weight(self, index: int, stage: int | None = None) -> None:
        """A split backward's weight pass of micro-batch ``index`` on ``stage`` (see :meth:`Stage.weight_backward`)."""
        self._advance(Action(Phase.WEIGHT, index, stage)).weight_backward(index)

    def decode_whole(self) -> Microbatch:
        """Replace an evaluation step's forwards, none of which ran, by one call of the step function on the whole
        batch, which decodes it (:mod:`~lightning_gpipe.engine.decoding` splits its rows into micro-batches of its
        own); that one micro-batch, which the step's outputs and logs then belong to."""
        if self.training or self._done or self.batch is None:
            raise RuntimeError(
                "only an evaluation step whose first forward has not run, begun with its batch, can decode it whole"
            )
        size = sum(mb.size for mb in self.microbatches)
        self.microbatches = [Microbatch(0, self.batch, size, 1.0)]
        self.actions = ()
        return self.microbatches[0]

    def end(self) -> None:
        """Finish the step once every action ran: wait for the sends, commit deferred BatchNorm statistics."""
        if self.next_action is not None:
            who = f"stage {self.stages[0].index}" if len(self.stages) == 1 else f"the process of stages {self._held}"
            raise RuntimeError(f"{who} ended its step with actions left: {' '.join(map(str, self.remaining()))}")
        for stage in self.stages:
            stage.end_step()

    def abort(self, reason: str) -> None:
        """Drop the step after a failure and tell the other stages (see :meth:`Stage.abort`)."""
        self._done = len(self.actions)
        for stage in self.stages:
            stage.abort(reason)


def _order(stages: tuple[Stage, ...], schedule: str, num_microbatches: int, training: bool) -> StepOrder:
    """The order of the process holding ``stages``, refused unless they are the stages the schedule gives it."""
    held, v = tuple(stage.index for stage in stages), len(stages)
    total = stages[0].num_stages
    if total % v == 0:
        K = total // v
        order = step_order(schedule, held[0] % K, K, num_microbatches, v, training)
        if held == order.stages:
            return order
    raise ValueError(
        f"stages {list(held)} of {total} are not one process's under schedule={schedule!r}; pass a process's "
        "stages_of(schedule, rank, K, v)"
    )


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
