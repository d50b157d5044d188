"""The Lightning-side step: the user's step hook run once per micro-batch, the pipelined sequence standing in for its
layers, and the step's loss, outputs and logs handed back to Lightning on every stage (:class:`UserSteps`).

Every stage runs the user's ``training_step`` (or validation, test, predict step) for each micro-batch up to its call of
the sequence, which the step driver turns into this stage's forward. On a stage that is not the last the user's step
ends there; on the last stage it goes on with the output, as in a plain step (a decoder may call the sequence again).
A decoding call (``sequence.decode(decoding)``) runs on every stage; one at the step's first call makes the driver run
the step once on the whole batch instead, whose logs then replace those of the first micro-batch's unfinished run.

A process holding several stages (``schedule="interleaved"`` or ``"zbv"``) runs the user's step once per micro-batch,
at its call stage (the last stage where it holds it, else its first held stage); the driver runs its other stages.
Where it holds stage 0 but calls at the last stage (ZB-V's first process), stage 0's input comes from a run of the
user's step up to its call of the sequence, which then ends: the code before the call runs twice per micro-batch
there, the second time with its ``self.log`` calls recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gpipe.compat import recording_log
from lightning_gpipe.engine.config import PipelineConfig
from lightning_gpipe.engine.driver import StepDriver, WholeBatchDecoding
from lightning_gpipe.engine.fingerprint import batch_fingerprint
from lightning_gpipe.engine.microbatch import Microbatch, batch_size, gather, step_extras
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.relay import CallRelay
from lightning_gpipe.engine.schedule import interleaved_round
from lightning_gpipe.log_mirror import LogRecorder, mirror_logs
from lightning_gpipe.optimization import StageGradients
from lightning_gpipe.partition.sequence import Partition, PipelinedSequential
from lightning_gpipe.plan.auto import check_planned_batch

__all__ = ["BatchChecks", "UserSteps", "check_automatic_optimization", "check_rounds"]


def check_automatic_optimization(module: LightningModule) -> None:
    """Refuse manual optimization: the pipeline's forwards run in ``training_step``, its backwards in ``backward``.

    Raises:
        ValueError: ``module.automatic_optimization`` is off; the message says how to train with one optimizer.
    """
    if not module.automatic_optimization:
        raise ValueError(
            "GPipeStrategy supports automatic optimization only: set self.automatic_optimization = True and return "
            "the loss"
        )


class _StageDone(BaseException):
    """Ends the user's step on a stage that is not the last once its cell's output is sent.

    A ``BaseException`` so that a user's ``except Exception`` around the call does not swallow it.
    """


class UserSteps:
    """One process's Lightning-side step: the user's step hooks run over each batch's micro-batches through the step
    driver, and their loss, outputs and logs handed back as Lightning expects them on every stage.

    The strategy's step hooks delegate here: :meth:`training_step` runs the forward phase, :meth:`backward` the
    backward phase of the same step (its driver kept in between), :meth:`eval_step` a validation, test or predict step.

    Args:
        module: the LightningModule whose hooks run.
        pipeline: this process's pipeline (its stage, or its stages).
        partition: how the module was cut; its stand-in sequence is routed to the driver during a step.
        relay: serves an evaluation step's further calls of the sequence (decoding).
        batches: the checks of each step's batch.
        precision: Lightning's precision plugin: the inputs' conversion, the step contexts, the loss scaler.
        share: sends the last stage's loss and logs to the pipeline's other stages
            (:func:`~lightning_gpipe.log_mirror.sharing_from_last_stage`); ``None`` for a pipeline of one stage.
        device: this process's device, where the step's loss is returned.
        verify_batches: check that every stage reads the same batch (a fingerprint in the step header).
        detect_anomalies: check each loss for NaN and Inf.
    """

    def __init__(
        self,
        module: LightningModule,
        pipeline: Pipeline,
        partition: Partition,
        relay: CallRelay,
        batches: BatchChecks,
        *,
        precision: Precision,
        share: Callable[[Any], Any] | None,
        device: torch.device,
        verify_batches: bool,
        detect_anomalies: bool,
    ) -> None:
        self.module = module
        self.pipeline = pipeline
        self.partition = partition
        self.relay = relay
        self.batches = batches
        self.precision = precision
        self.share = share
        self.device = device
        self.verify_batches = verify_batches
        self.detect_anomalies = detect_anomalies
        self.last = pipeline.stages[-1].is_last  # this process holds the last stage: the loss, the metrics, the logs
        self._driver: StepDriver | None = None  # the training step between its two phases

    # --- the three step hooks

    def training_step(self, args: tuple, kwargs: dict) -> torch.Tensor | dict[str, Any]:
        """The strategy's ``training_step``: the step's forward phase, its loss (every stage gets the last stage's) and
        the other keys of the user's step, as Lightning passes them to ``on_train_batch_end``."""
        args, kwargs = self.precision.convert_input((args, kwargs))
        scale = StageGradients.scale_loss(self.precision, self.module.trainer)
        outputs, recorder = self._forward_phase("training_step", args, kwargs, self.precision.train_step_context, scale)
        if not self.last:
            scalars, extras = self._mirror(recorder)
            return _with_extras(scalars["loss"].to(self.device, torch.float32), extras)
        total, extras = self._training_result(outputs, recorder)  # extras go to every stage's hooks
        self._mirror(recorder, {"loss": total}, other=extras)
        return _with_extras(total.to(self.device), extras)

    def backward(self) -> None:
        """The strategy's ``backward``: the backward phase of the step :meth:`training_step` began."""
        driver, self._driver = self._driver, None
        assert driver is not None, "backward without a training_step before it"
        driver.backward_phase()

    def eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """The strategy's ``validation_step``, ``test_step`` or ``predict_step`` (``hook``): the user's step on every
        micro-batch, its outputs gathered; predictions reach every stage."""
        args, kwargs = self.precision.convert_input((args, kwargs))
        context = {
            "validation_step": self.precision.val_step_context,
            "test_step": self.precision.test_step_context,
            "predict_step": self.precision.predict_step_context,
        }[hook]
        with context():
            outputs, recorder = self._forward_phase(hook, args, kwargs)
        driver, self._driver = self._driver, None
        assert driver is not None
        gathered = self._evaluation_result(driver, outputs, recorder)
        shared = self._mirror(recorder, other=gathered if hook == "predict_step" else None)[1]
        return shared if hook == "predict_step" else gathered

    # --- the step's phases

    def _forward_phase(
        self,
        hook: str,
        args: tuple,
        kwargs: dict,
        context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[list[Any], LogRecorder]:
        """Begin a step on ``args[0]`` and run its forward phase, each forward a call of the module's ``hook``.

        Returns the user's step outputs in micro-batch order (``None`` on a stage that is not the last) and the recorded
        logs; the step's driver, for its backward phase or its end, is kept.
        """
        module, num_stages = self.module, self.pipeline.stages[0].num_stages
        batch, rest = args[0], args[1:]
        training = hook == "training_step"
        processes, samples = num_stages // len(self.pipeline.stages), batch_size(batch)
        self.batches.check(hook, samples, self.pipeline.chunks)
        if training and samples < self.pipeline.chunks:
            check_rounds(self.pipeline.config, samples, processes)
        # Every stage computes the fingerprint of its own copy of the batch; the step header carries it to the next.
        fingerprint = batch_fingerprint(batch) if self.verify_batches and num_stages > 1 else None
        self._driver = driver = StepDriver(
            self.pipeline.begin(batch, training=training, fingerprint=fingerprint),
            hook=hook,
            sequence=self.partition.path,
            returns_weights=True,
            declare=getattr(module, "batch_loss_weight", None) if hook != "predict_step" else None,
            hold=module.parameters() if training else None,
            scale_loss=scale_loss,
            check_losses=self.detect_anomalies,
            relay=None if training else self.relay,
            feed=lambda mb: self._stage_input(hook, mb, rest, kwargs, context),
        )
        recorder = LogRecorder(module, step_values=training)

        def step(mb: Microbatch) -> Any:
            with context(), recorder.capture(mb.index):
                try:
                    return getattr(module, hook)(mb.value, *rest, **kwargs)
                except _StageDone:
                    return None
                except WholeBatchDecoding:
                    recorder.forget(mb.index)
                    raise

        with _routed(self.partition.stand_in, driver):
            outputs = driver.forward_phase(step)
        return outputs, recorder

    def _training_result(self, outputs: list[Any], recorder: LogRecorder) -> tuple[torch.Tensor, Any]:
        """On the last stage after the forward phase: the step's loss (its losses weighted), and the step's other keys
        gathered as Lightning passes them to ``on_train_batch_end``; the logs combined by the same weights."""
        driver = self._driver
        assert driver is not None
        total = driver.weigh(outputs)
        assert driver.step_weights is not None
        recorder.combine(driver.step_weights)
        return total, step_extras(outputs, [mb.size for mb in driver.run.microbatches])

    def _evaluation_result(self, driver: StepDriver, outputs: list[Any], recorder: LogRecorder) -> Any:
        """End an evaluation step (serving or ending its further calls); on the last stage, its gathered outputs."""
        driver.finish()
        if not driver.stage.is_last:
            return None
        recorder.combine(driver.weights(outputs, self.device))
        return gather(outputs, [mb.size for mb in driver.run.microbatches]) if outputs[0] is not None else None

    def _mirror(
        self, recorder: LogRecorder, scalars: Mapping[str, torch.Tensor] | None = None, other: Any = None
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """The last stage's logs logged on every stage, with ``scalars`` and ``other`` (see :func:`mirror_logs`)."""
        return mirror_logs(recorder, self.last, self.share, scalars, other)

    def _stage_input(
        self,
        hook: str,
        mb: Microbatch,
        rest: tuple,
        kwargs: dict,
        context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> Any:
        """Stage 0's input for ``mb`` on a process that calls the user's step at a later stage: the value the step
        passes to the pipelined sequence, its ``self.log`` calls dropped (the step's second run records them)."""
        stand_in, runner = self.partition.stand_in, self.partition.stand_in.runner
        captured: list[Any] = []

        def capture(value: Any) -> Any:
            captured.append(value)
            raise _StageDone

        stand_in.runner = capture
        try:
            with context(), recording_log(self.module, _ignore):
                getattr(self.module, hook)(mb.value, *rest, **kwargs)
        except _StageDone:
            pass
        finally:
            stand_in.runner = runner
        if not captured:
            raise RuntimeError(
                f"{hook} returned without calling the pipelined sequence {self.partition.path!r} (micro-batch "
                f"{mb.index}); call it"
            )
        return captured[0]


def _ignore(*args: Any, **kwargs: Any) -> None:
    """``self.log`` while stage 0's input is taken: the step's second run records the values."""


def check_rounds(config: PipelineConfig, samples: int, processes: int) -> None:
    """Refuse a training batch of fewer samples than ``chunks`` whose micro-batches (one per sample) the schedule cannot
    order: ``"interleaved"`` runs them in rounds over the processes (:meth:`PipelineConfig.check_chunks`).

    Raises:
        ValueError: names the batch, the rule, and the fix (``drop_last=True``, or a batch size the rule allows).
    """
    if config.schedule != "interleaved":
        return
    try:
        interleaved_round(processes, samples)
    except ValueError as error:
        raise ValueError(
            f"a training batch of {samples} samples, fewer than chunks={config.chunks}, cannot run under "
            f"schedule={config.schedule!r}: use drop_last=True"
        ) from error


@contextlib.contextmanager
def _routed(stand_in: PipelinedSequential, driver: StepDriver) -> Iterator[None]:
    """Within, calling the pipelined sequence (or its ``decode``) is ``driver``'s call; on a stage that is not the last
    it ends the step."""
    last = driver.stage.is_last

    def run(value: Any) -> Any:
        output = driver.call(value)
        if not last:
            raise _StageDone
        return output

    def decode(decoding: Any) -> Any:
        result = driver.decode(decoding)
        if not last:
            raise _StageDone
        return result

    stand_in.runner, stand_in.decoder = run, decode
    try:
        yield
    finally:
        stand_in.runner = stand_in.decoder = None


class BatchChecks:
    """A step's batch checked: the planned size, and (a warning, once) fewer samples than ``chunks``.

    A batch of fewer samples than stages trains: its micro-batches (one per sample) run through every stage as
    ``chunks < pipe_size`` does, each schedule ordering any number of them (``"interleaved"``'s rounds aside, refused
    by :func:`check_rounds`).
    """

    def __init__(self) -> None:
        self.planned: int | None = None  # plan="auto"'s batch per pipeline, until the first training batch
        self._sized: set[str] | None = set()  # the step hooks whose first batch was checked against chunks

    def check(self, hook: str, samples: int, chunks: int) -> None:
        """Refuse a batch that the plan did not plan; warn once about one of fewer samples than ``chunks``."""
        if hook == "training_step" and self.planned is not None:
            check_planned_batch(self.planned, samples)
            self.planned = None
        if self._sized is not None and hook not in self._sized:  # warned once at most: a later batch may be the last
            self._sized.add(hook)
            if samples < chunks:
                self._sized = None
                rank_zero_warn(
                    f"chunks={chunks}, but the first {hook.removesuffix('_step')} batch holds {samples} samples: it "
                    f"runs {samples} micro-batches of one sample. Set chunks={samples}, or use batches of {chunks}."
                )


def _with_extras(loss: torch.Tensor, extras: dict[str, Any] | None) -> torch.Tensor | dict[str, Any]:
    return loss if extras is None else {"loss": loss, **extras}
