"""Peak memory of one pipeline stage, walked through the stage's schedule from per-layer profiles.

A stage holds, for the whole step, its model state (parameters, gradients, optimizer state, buffers) and the
mini-batch every stage is handed. On top, each micro-batch whose forward has run and whose backward has not keeps:

- re-materialized (:func:`~lightning_gpipe.engine.rematerialization.checkpoint_stop`): its boundary input and output
only, and under ``checkpoint="selective"`` also the outputs of the matrix multiplications and attention kernels the
profiler counted (``LayerProfile.selective_bytes``), which its backward then does not rebuild;
- otherwise: every activation its layers saved for backward, its boundary input and its output.

:func:`stage_bytes` counts those per sample, following every tensor that crosses a layer boundary by identity (a
tensor saved by several layers, or passed on unchanged, counts once). A backward pass first rebuilds a
re-materialized micro-batch's activations, then runs the loss's backward (last stage) and the layers' from the last to
the first: each layer needs its workspace on top of what the layers before it still hold. Walking the stage's actions
(:func:`~lightning_gpipe.engine.schedule.stage_actions`) in order gives the peak, which is how fill-drain (all M
micro-batches in flight) and 1F1B (at most ``K - j`` on stage ``j``) differ. The optimizer step adds, at its own
moment when activations are gone, temporaries of about one copy of the trainable parameters (``foreach`` kernels).

:func:`process_memory` walks a process that holds several stages (``"interleaved"``, ``"zbv"``) through its actions
over all of them (:func:`~lightning_gpipe.engine.schedule.process_actions`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpipe.engine.rematerialization import CheckpointMode, checkpoint_stop
from lightning_gpipe.engine.schedule import MULTI_STAGE, Action, Phase, cached_process_actions, stages_of
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile

__all__ = ["StageBytes", "StageMemory", "process_memory", "stage_bytes", "stage_memory"]


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


@dataclass(frozen=True)
class StageBytes:
    """Per sample, what one micro-batch of a stage holds, each tensor counted once (see :func:`stage_bytes`)."""

    saved: float  # every activation the stage's layers save for backward
    received: float  # the stage's input from the previous stage (0 on the first)
    output: float  # the stage's output
    forward_end: float  # alive as a forward without re-materialization ends: the saved activations and the output
    kept: float  # held until backward without re-materialization: the saved activations and the output sent on
    kept_rematerialized: float  # held until backward with it: the boundary input and the output sent on
    rebuilt: float  # what a re-materialized backward recomputes: the saved activations not already held
    backward: float | None = None  # the peak of this micro-batch's backward through the layers (None: not known)
    selective: float = 0.0  # what selective re-materialization keeps besides the boundary: the kept operators' outputs


def stage_bytes(profile: ModelProfile, cell: range, *, last: bool) -> StageBytes:
    """Per-sample bytes of one micro-batch on the stage that holds layers ``cell``, each tensor counted once.

    With per-leaf profiles (:func:`~lightning_gpipe.profile.layer_profile.profile_layers` records which input and output
    leaves each layer saves, and which outputs are inputs passed on unchanged), every tensor that crosses a layer
    boundary is followed through the stage by an identity: a tensor saved by several layers (an AmoebaNet cell's
    input, which the cell two layers on uses again), saved and also sent on, or received and passed on to the
    output, counts once. Without them (a hand-made profile), a layer's saved input and the previous layer's saved
    output are taken to be one tensor, and nothing else is shared.
    """
    layers = [profile.layers[i] for i in cell]
    before = profile.layers[cell.start - 1] if cell.start > 0 else None
    received = before.output_bytes if before is not None else 0.0
    output = layers[-1].output_bytes
    # A kept operator's output that is the stage's output is held already when it is sent on.
    selective = sum(layer.selective_bytes + layer.selective_output_bytes for layer in layers)
    selective -= 0.0 if last else layers[-1].selective_output_bytes
    tracked = _tracked(layers, before, last)
    if tracked is not None:
        saved, forward_end, kept, kept_rematerialized, rebuilt, backward = tracked
        return StageBytes(saved, received, output, forward_end, kept, kept_rematerialized, rebuilt, backward, selective)
    overlap = sum(min(b.saved_input_bytes, a.saved_output_bytes) for a, b in zip(layers, layers[1:], strict=False))
    saved = sum(layer.saved_bytes for layer in layers) - overlap
    sent = 0.0 if last else output
    return StageBytes(
        saved, received, output, saved + output, saved + sent, received + sent, saved, selective=selective
    )


def _tracked(layers: list[LayerProfile], before: LayerProfile | None, last: bool) -> tuple[float, ...] | None:
    """(saved, forward_end, kept, kept_rematerialized, rebuilt, backward) from the per-leaf records, or ``None``
    when some layer has none or they do not line up (a layer's input leaves are not its predecessor's outputs).

    The engine keeps a stage's received input until its backward (to send its gradient back), and the output it sent
    until the gradient comes back, whatever the layers save. ``backward`` walks the layers from the last to the first:
    when a layer's backward runs, the layers after it have freed what only they saved, and it needs its own
    workspace (its profiled transient, which includes the gradient arriving from above) on top of what is left.
    """
    first = before.output_leaves if before is not None else layers[0].saved_input_leaves
    if not first or not all(layer.output_leaves for layer in layers):
        return None
    size: dict[int, float] = dict(enumerate(first))  # bytes per sample of each tensor, by identity
    ids = list(range(len(first)))  # the identities of the current layer's input leaves
    inputs = set(ids) if before is not None else set()
    saved: dict[int, float] = {}
    internal = 0.0  # saved tensors that are neither a layer's input nor its output
    upto: list[tuple[float, set[int]]] = []  # after each layer: the internal bytes and the ids saved so far
    for layer in layers:
        if len(layer.saved_input_leaves) != len(ids) or len(layer.passthrough) != len(layer.output_leaves):
            return None
        for i, nbytes in enumerate(layer.saved_input_leaves):
            if nbytes:
                saved[ids[i]] = max(saved.get(ids[i], 0.0), nbytes)
        out: list[int] = []
        for j, source in enumerate(layer.passthrough):
            if source >= 0:
                out.append(ids[source])
            else:
                out.append(len(size))
                size[len(size)] = layer.output_leaves[j]
        for j, nbytes in enumerate(layer.saved_output_leaves):
            if nbytes:
                saved[out[j]] = max(saved.get(out[j], 0.0), nbytes)
        internal += max(0.0, layer.saved_bytes - sum(layer.saved_input_leaves) - sum(layer.saved_output_leaves))
        upto.append((internal, set(saved)))
        ids = out

    def total(group: set[int]) -> float:
        return sum(saved.get(i, size[i]) for i in group)

    outputs, held = set(ids), set(saved)
    sent = set() if last else outputs
    engine = inputs | sent  # what the engine holds for the boundary, saved or not
    gradient = 0.0 if last else total(outputs)  # the gradient received for the output, alive through the backward
    backward = max(
        kept + total(ids_so_far | engine) + layer.transient_bytes + (gradient if k < len(layers) - 1 else 0.0)
        for k, (layer, (kept, ids_so_far)) in enumerate(zip(layers, upto, strict=True))
    )
    return (
        internal + total(held),
        internal + total(held | outputs | inputs),
        internal + total(held | engine),
        total(engine),
        internal + total(held - engine),
        backward,
    )


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
    compiled: bool = False,
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
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"zero_bubble"``, the schedules with one stage per process (see
            :func:`process_memory` for the others).
        optimizer_slots: parameter-sized optimizer tensors per trainable parameter (2 for Adam, 1 for SGD with
            momentum, 0 for plain SGD).
        compiled: the layers are compiled (``compile=True``): ``"selective"`` then keeps its share of every
            micro-batch, the last included.
    """
    if schedule in MULTI_STAGE:
        raise ValueError(
            f"stage_memory predicts one stage per process; schedule={schedule!r} places several on each. "
            "HINT: use process_memory with every stage's cell."
        )
    actions = cached_process_actions(schedule, stage, num_stages, num_microbatches)
    return _walk(
        profile, {stage: cell}, actions, num_stages, num_microbatches, microbatch_size, batch_size, checkpoint,
        optimizer_slots, compiled,
    )  # fmt: skip


def process_memory(
    profile: ModelProfile,
    cells: Sequence[range],
    *,
    rank: int,
    num_processes: int,
    num_microbatches: int,
    microbatch_size: int,
    batch_size: int,
    checkpoint: CheckpointMode,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
    optimizer_slots: float = 2.0,
    compiled: bool = False,
) -> StageMemory:
    """Predict the memory of process ``rank``, which holds the stages :func:`~lightning_gpipe.engine.schedule.stages_of`
    gives, stage ``s`` with the layers ``cells[s]``.

    The process's state is its stages' state together, and its actions over all of them are walked in order: an
    interleaved process keeps ``(v - 1)`` rounds of micro-batches more than 1F1B on its first stage, of ``1/v`` of its
    layers each. Under ``"zero_bubble"`` and ``"zbv"`` a micro-batch keeps what its forward kept until its weight
    gradient W, and from its input gradient I on also the gradients W starts from: the output gradient of each
    operation with a weight (a convolution, a matrix multiplication, a normalization's affine step), the size of its
    output (``LayerProfile.weighted_output_bytes``). The first stage keeps none: with no input gradient to send, its W
    runs the whole backward. A re-materialized micro-batch, rebuilt for I, stays rebuilt until W, which does not
    recompute.

    Args:
        cells: the layers of every stage of the pipeline, ``num_processes · stages per process`` ranges in order.
        rank, num_processes: r and K.
        virtual_stages: v, for ``"interleaved"``.
        Others: as :func:`stage_memory`.
    """
    held = stages_of(schedule, rank, num_processes, virtual_stages)
    if len(cells) != num_processes * len(held):
        raise ValueError(
            f"cells has {len(cells)} ranges; schedule={schedule!r} with {num_processes} processes has "
            f"{num_processes * len(held)} stages. HINT: give one range of layers per stage."
        )
    actions = cached_process_actions(schedule, rank, num_processes, num_microbatches, virtual_stages)
    return _walk(
        profile, {s: cells[s] for s in held}, actions, len(cells), num_microbatches, microbatch_size, batch_size,
        checkpoint, optimizer_slots, compiled,
    )  # fmt: skip


@dataclass(frozen=True)
class _Held:
    """What one stage of a process needs for the walk: its per-sample bytes and its micro-batch-sized extremes."""

    each: StageBytes
    last: bool
    received: float
    widest: float
    workspace: float
    loss: float
    weight_grads: float = 0.0  # what a split backward's I keeps for W: the output gradients of its weighted operations


def _walk(
    profile: ModelProfile,
    cells: dict[int, range],
    actions: Sequence[Action],
    num_stages: int,
    num_microbatches: int,
    microbatch_size: int,
    batch_size: int,
    checkpoint: CheckpointMode,
    optimizer_slots: float,
    compiled: bool = False,
) -> StageMemory:
    """The peak of one process holding stages ``cells`` (stage -> layers) walked through its ``actions``."""
    n = microbatch_size
    layers = [profile.layers[i] for cell in cells.values() for i in cell]
    trainable = sum(layer.trainable_bytes for layer in layers)
    state = sum(layer.param_bytes + layer.buffer_bytes for layer in layers) + trainable * (1.0 + optimizer_slots)
    stop = checkpoint_stop(checkpoint, num_microbatches, compiled=compiled)
    selective = checkpoint == "selective"
    stages: dict[int, _Held] = {}
    for s, cell in cells.items():
        last = s == num_stages - 1
        cell_layers = [profile.layers[i] for i in cell]
        workspace = n * max(layer.transient_bytes for layer in cell_layers)
        each = stage_bytes(profile, cell, last=last)
        stages[s] = _Held(
            each=each,
            last=last,
            received=n * each.received,
            widest=n * max(layer.output_bytes for layer in cell_layers),
            workspace=max(workspace, n * profile.loss_transient_bytes) if last else workspace,
            # The last stage hands its output to the loss, which keeps what it needs; other stages keep the output
            # they sent until its gradient comes back.
            loss=n * profile.loss_saved_bytes if last else 0.0,
            weight_grads=0.0 if s == 0 else n * sum(layer.weighted_output_bytes for layer in cell_layers),
        )  # fmt: skip

    def kept(held: _Held, i: int) -> float:
        if i >= stop:
            return held.loss + n * held.each.kept
        return held.loss + n * (held.each.kept_rematerialized + (held.each.selective if selective else 0.0))

    live = peak = 0.0
    for action in actions:
        assert action.stage is not None, "process_actions names each action's stage"
        i, held = action.microbatch, stages[action.stage]
        each = held.each
        # What a selective backward finds kept, it does not rebuild.
        rebuilt = n * max(0.0, each.rebuilt - (each.selective if selective else 0.0)) if i < stop else 0.0
        if action.phase is Phase.FORWARD:
            # A re-materialized forward still builds each layer's output from the one before (and keeps what
            # selective re-materialization keeps as it goes).
            wrapped = held.received + 2 * held.widest + (n * each.selective if selective else 0.0)
            peak = max(peak, live + held.loss + (wrapped if i < stop else n * each.forward_end))
            live += kept(held, i)
        elif action.phase is Phase.WEIGHT:
            # The weight gradients read what I left; then the micro-batch is gone.
            peak = max(peak, live + held.workspace)
            live -= kept(held, i) + rebuilt + held.weight_grads
        elif each.backward is None:
            gradient = 0.0 if held.last else n * each.output
            peak = max(peak, live + rebuilt + gradient + held.workspace)
            live += rebuilt + held.weight_grads if action.phase is Phase.INPUT else -kept(held, i)
        else:
            # The loss's backward runs first, with all of this micro-batch held; then the layers', last to first
            # (a re-materialized micro-batch is rebuilt when its cell's backward begins).
            others = live - kept(held, i)
            loss_backward = kept(held, i) + n * profile.loss_transient_bytes if held.last else 0.0
            peak = max(peak, others + loss_backward, others + n * each.backward)
            live += rebuilt + held.weight_grads if action.phase is Phase.INPUT else -kept(held, i)
    assert math.isclose(live, 0.0, abs_tol=1e-6 * max(peak, 1.0)), "every micro-batch's backward frees what it kept"
    optimizer = float(trainable) if optimizer_slots > 0 else 0.0
    return StageMemory(float(state), batch_size * profile.input_bytes, peak, optimizer)
