"""Peak memory of one pipeline stage, walked through the stage's schedule from per-layer profiles.

A stage holds, for the whole step, its model state (parameters, gradients, optimizer state, buffers) and the
mini-batch every stage is handed. On top, each micro-batch whose forward has run and whose backward has not keeps:

- re-materialized (:func:`~lightning_gpipe.checkpoint.checkpoint_stop`): its boundary input and output only;
- otherwise: every activation its layers saved for backward, and its output.

The backward pass of a re-materialized micro-batch first rebuilds its activations; any backward pass then needs its
incoming gradient and the largest layer's transient workspace. Walking the stage's actions
(:func:`~lightning_gpipe.schedule.stage_actions`) in order gives the peak, which is how fill-drain (all M
micro-batches in flight) and 1F1B (at most ``K - j`` on stage ``j``) differ. The optimizer step adds, at its own
moment when activations are gone, temporaries of about one copy of the trainable parameters (``foreach`` kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_gpipe.checkpoint import CheckpointMode, checkpoint_stop
from lightning_gpipe.plan.profile import ModelProfile
from lightning_gpipe.schedule import Phase, stage_actions

__all__ = ["StageMemory", "stage_memory"]


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes of one stage: resident state, the mini-batch, and the peak of everything per micro-batch."""

    state: float  # parameters + gradients + optimizer state + buffers
    batch: float  # the mini-batch's input, handed to every stage
    activations: float  # the peak of micro-batch activations, gradients and workspaces over the step
    optimizer: float  # temporaries of the optimizer step (activations are freed by then)

    @property
    def peak(self) -> float:
        """The stage's predicted peak bytes."""
        return self.state + self.batch + max(self.activations, self.optimizer)


def stage_memory(
    profile: ModelProfile,
    cell: range,
    *,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    microbatch_size: int,
    batch_size: int,
    checkpoint: CheckpointMode,
    schedule: str = "gpipe",
    optimizer_slots: float = 2.0,
) -> StageMemory:
    """Predict the memory of stage ``stage``, which holds layers ``cell`` of ``profile``.

    Args:
        profile: the model's per-layer profile.
        cell: the indices of this stage's layers.
        stage, num_stages: j and K.
        num_microbatches: M.
        microbatch_size: samples per micro-batch (the largest one, when they differ by one).
        batch_size: samples of the mini-batch this pipeline is handed.
        checkpoint: the re-materialization mode.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        optimizer_slots: parameter-sized optimizer tensors per trainable parameter (2 for Adam, 1 for SGD with
            momentum, 0 for plain SGD).
    """
    layers = [profile.layers[i] for i in cell]
    n = microbatch_size
    trainable = sum(layer.trainable_bytes for layer in layers)
    state = sum(layer.param_bytes + layer.buffer_bytes for layer in layers) + trainable * (1.0 + optimizer_slots)
    # A layer that saves its input and a previous layer that saved its output hold one tensor: count it once.
    overlap = sum(min(b.saved_input_bytes, a.saved_output_bytes) for a, b in zip(layers, layers[1:], strict=False))
    saved = n * (sum(layer.saved_bytes for layer in layers) - overlap)
    received = n * (profile.layers[cell.start - 1].output_bytes if cell.start > 0 else 0.0)
    output = n * layers[-1].output_bytes
    widest = n * max(layer.output_bytes for layer in layers)
    workspace = n * max(layer.transient_bytes for layer in layers)
    stop = checkpoint_stop(checkpoint, num_microbatches)
    last = stage == num_stages - 1
    loss = n * profile.loss_saved_bytes if last else 0.0
    if last:
        workspace = max(workspace, n * profile.loss_transient_bytes)

    # The last stage hands its output to the loss, which keeps what it needs (``loss``); other stages keep the output
    # they sent until its gradient comes back.
    sent = 0.0 if last else output

    def kept(i: int) -> float:
        return loss + (received + sent if i < stop else saved + sent)

    live = peak = 0.0
    for action in stage_actions(schedule, stage, num_stages, num_microbatches):
        i = action.microbatch
        if action.phase is Phase.FORWARD:
            # A re-materialized forward still builds each layer's output from the one before.
            peak = max(peak, live + loss + (received + 2 * widest if i < stop else saved + output))
            live += kept(i)
        else:
            rebuilt = saved if i < stop else 0.0
            gradient = 0.0 if last else output
            peak = max(peak, live + rebuilt + gradient + workspace)
            live -= kept(i)
    assert math.isclose(live, 0.0, abs_tol=1e-6 * max(peak, 1.0)), "every micro-batch's backward frees what it kept"
    optimizer = float(trainable) if optimizer_slots > 0 else 0.0
    return StageMemory(float(state), batch_size * profile.input_bytes, peak, optimizer)
