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

Under ``data_parallel="fsdp"`` (:mod:`~lightning_gpipe.plan.sharding`) the state is each replica's shard, and the walk
adds what a step holds whole: the gathered parameters throughout, each stage's gradients from its first backward pass
on (layer by layer as that pass creates them), the unit being reduce-scattered at the step's end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpipe.engine.rematerialization import CheckpointMode, checkpoint_stop
from lightning_gpipe.engine.schedule import MULTI_STAGE, Action, Phase, cached_process_actions, stages_of
from lightning_gpipe.partition.config import DataParallel
from lightning_gpipe.plan.sharding import Sharing
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile

__all__ = ["StageBytes", "StageMemory", "process_memory", "stage_bytes", "stage_memory"]


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes of one stage: resident state, the mini-batch, and the peak of everything per micro-batch."""

    state: float  # parameters + gradients + optimizer state + buffers (under "fsdp": the replica's shards of the three)
    batch: float  # the mini-batch's input, handed to every stage
    # The peak over the step of micro-batch activations, gradients and workspaces; under "fsdp" with the parameters'
    # gradients accumulated whole and the reduce-scatter's buffers.
    activations: float
    optimizer: float  # temporaries of the optimizer step (activations are freed by then)
    gathered: float = 0.0  # under "fsdp": the parameters gathered whole, from the step's start to its end

    @property
    def peak(self) -> float:
        """The stage's predicted peak bytes."""
        return self.state + self.batch + max(self.gathered + self.activations, self.optimizer)


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
    backward_layers: tuple[float, ...] = ()  # ``backward`` at each layer's own backward, in the stage's order


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
        saved, forward_end, kept, kept_rematerialized, rebuilt, by_layer = tracked
        return StageBytes(
            saved, received, output, forward_end, kept, kept_rematerialized, rebuilt, max(by_layer), selective, by_layer
        )
    overlap = sum(min(b.saved_input_bytes, a.saved_output_bytes) for a, b in zip(layers, layers[1:], strict=False))
    saved = sum(layer.saved_bytes for layer in layers) - overlap
    sent = 0.0 if last else output
    return StageBytes(
        saved, received, output, saved + output, saved + sent, received + sent, saved, selective=selective
    )


def _tracked(
    layers: list[LayerProfile], before: LayerProfile | None, last: bool
) -> tuple[float, float, float, float, float, tuple[float, ...]] | None:
    """(saved, forward_end, kept, kept_rematerialized, rebuilt, the backward's peak at each layer) from the per-leaf
    records, or ``None`` when some layer has none or they do not line up (a layer's input leaves are not its
    predecessor's outputs).

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
    by_layer = tuple(
        kept + total(ids_so_far | engine) + layer.transient_bytes + (gradient if k < len(layers) - 1 else 0.0)
        for k, (layer, (kept, ids_so_far)) in enumerate(zip(layers, upto, strict=True))
    )
    return (
        internal + total(held),
        internal + total(held | outputs | inputs),
        internal + total(held | engine),
        total(engine),
        internal + total(held - engine),
        by_layer,
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
    data_parallel: DataParallel = "ddp",
    replicas: int = 1,
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
        data_parallel, replicas: how the stage's ``replicas`` replicas share it (:class:`~lightning_gpipe.plan.sharding.
            Sharing`): whole (``"ddp"``) or sharded (``"fsdp"``, over more than one replica).
    """
    if schedule in MULTI_STAGE:
        raise ValueError(
            f"stage_memory predicts one stage per process; schedule={schedule!r} has several: use process_memory"
        )
    actions = cached_process_actions(schedule, stage, num_stages, num_microbatches)
    step = _Step(num_stages, num_microbatches, microbatch_size, batch_size, checkpoint, optimizer_slots, compiled)
    return _Walk(profile, {stage: cell}, step, Sharing.of(data_parallel, replicas)).run(actions)


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
    data_parallel: DataParallel = "ddp",
    replicas: int = 1,
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
            f"{num_processes * len(held)} stages: give one per stage"
        )
    actions = cached_process_actions(schedule, rank, num_processes, num_microbatches, virtual_stages)
    step = _Step(len(cells), num_microbatches, microbatch_size, batch_size, checkpoint, optimizer_slots, compiled)
    return _Walk(profile, {s: cells[s] for s in held}, step, Sharing.of(data_parallel, replicas)).run(actions)


@dataclass(frozen=True)
class _Step:
    """The step a process's memory is walked through: its shape, re-materialization and optimizer."""

    num_stages: int
    num_microbatches: int
    microbatch_size: int
    batch_size: int
    checkpoint: CheckpointMode
    optimizer_slots: float
    compiled: bool


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
    # Per layer: the whole gradients a sharded stage's first backward has created once it reaches the layer (zeros
    # under "ddp", where they are state), and the largest of its parameters' gradients, which every other backward
    # computes afresh before adding it to the one held.
    created: tuple[float, ...] = ()
    computed: tuple[float, ...] = ()
    transients: tuple[float, ...] = ()  # per layer: its backward's workspace for a micro-batch


class _Walk:
    """The peak of one process holding stages ``cells`` (stage -> layers), walked through its actions.

    ``live`` is what the micro-batches in flight hold; ``whole`` the gradients accumulated whole under ``"fsdp"`` (each
    stage's from its first backward pass on); a candidate for the peak is what is held at some moment beside both.
    """

    def __init__(self, profile: ModelProfile, cells: dict[int, range], step: _Step, sharing: Sharing) -> None:
        self.profile, self.step, self.sharing = profile, step, sharing
        self.layers = [profile.layers[i] for cell in cells.values() for i in cell]
        n = step.microbatch_size
        self.stop = checkpoint_stop(step.checkpoint, step.num_microbatches, compiled=step.compiled)
        self.selective = step.checkpoint == "selective"
        self.stages: dict[int, _Held] = {}
        for s, cell in cells.items():
            last = s == step.num_stages - 1
            cell_layers = [profile.layers[i] for i in cell]
            workspace = n * max(layer.transient_bytes for layer in cell_layers)
            each = stage_bytes(profile, cell, last=last)
            self.stages[s] = _Held(
                each=each,
                last=last,
                received=n * each.received,
                widest=n * max(layer.output_bytes for layer in cell_layers),
                workspace=max(workspace, n * profile.loss_transient_bytes) if last else workspace,
                # The last stage hands its output to the loss, which keeps what it needs; other stages keep the output
                # they sent until its gradient comes back.
                loss=n * profile.loss_saved_bytes if last else 0.0,
                weight_grads=0.0 if s == 0 else n * sum(layer.weighted_output_bytes for layer in cell_layers),
                created=sharing.gradients(cell_layers),
                computed=tuple(float(layer.computed_gradient_bytes) for layer in cell_layers),
                transients=tuple(n * layer.transient_bytes for layer in cell_layers),
            )
        self.live = self.whole = self.peak = 0.0
        self.started: set[int] = set()  # the stages whose parameters' gradients have been computed in this step

    def kept(self, held: _Held, i: int) -> float:
        """What micro-batch ``i`` keeps on the stage from its forward to its backward."""
        n = self.step.microbatch_size
        if i >= self.stop:
            return held.loss + n * held.each.kept
        return held.loss + n * (held.each.kept_rematerialized + (held.each.selective if self.selective else 0.0))

    def hold(self, nbytes: float) -> None:
        """A moment of the step at which ``nbytes`` are held beside the micro-batches' and the whole gradients."""
        self.peak = max(self.peak, self.live + self.whole + nbytes)

    def run(self, actions: Sequence[Action]) -> StageMemory:
        """Walk ``actions`` in order; the memory at the peak."""
        n, profile, selective = self.step.microbatch_size, self.profile, self.selective
        self.hold(self.sharing.gathering(self.layers))  # as the step begins, a unit's gather is copied out
        for action in actions:
            assert action.stage is not None, "process_actions names each action's stage"
            i, held = action.microbatch, self.stages[action.stage]
            each = held.each
            # What a selective backward finds kept, it does not rebuild.
            rebuilt = n * max(0.0, each.rebuilt - (each.selective if selective else 0.0)) if i < self.stop else 0.0
            if action.phase is Phase.FORWARD:
                # A re-materialized forward still builds each layer's output from the one before (and keeps what
                # selective re-materialization keeps as it goes).
                wrapped = held.received + 2 * held.widest + (n * each.selective if selective else 0.0)
                self.hold(held.loss + (wrapped if i < self.stop else n * each.forward_end))
                self.live += self.kept(held, i)
            elif action.phase is Phase.WEIGHT:
                # The weight gradients read what I left; then the micro-batch is gone.
                self.hold(held.workspace)
                self._gradients(action.stage, held.transients)
                self.live -= self.kept(held, i) + rebuilt + held.weight_grads
            else:
                self._backward(action, held, rebuilt)
        assert math.isclose(self.live, 0.0, abs_tol=1e-6 * max(self.peak, 1.0)), "backward frees what forward kept"
        self.hold(self.sharing.reducing(self.layers))  # as it ends, the whole gradients are reduced unit by unit
        return StageMemory(
            self.sharing.state(self.layers, self.step.optimizer_slots),
            self.step.batch_size * profile.input_bytes,
            self.peak,
            self.sharing.optimizer(self.layers, self.step.optimizer_slots),
            self.sharing.gathered(self.layers),
        )

    def _gradients(self, stage: int, by_layer: Sequence[float]) -> None:
        """A pass that computes ``stage``'s parameters' gradients, holding ``by_layer`` at each layer on top of them: a
        sharded stage's first pass creates them whole, and they stay to the step's end (``whole``); every other pass
        computes each layer's gradient before adding it to the one held."""
        held = self.stages[stage]
        first = self.sharing.sharded and stage not in self.started
        self.started.add(stage)
        gradients = held.created if first else held.computed
        self.hold(max(b + g for b, g in zip(by_layer, gradients, strict=True)))
        if first:
            self.whole += held.created[0]

    def _backward(self, action: Action, held: _Held, rebuilt: float) -> None:
        """A backward pass (whole, or a split one's input pass I) of micro-batch ``action.microbatch``."""
        assert action.stage is not None
        n, i, each = self.step.microbatch_size, action.microbatch, held.each
        gradient = 0.0 if held.last else n * each.output
        # A whole backward computes the parameters' gradients too; a split one's input pass leaves them to its W.
        if each.backward is None:
            self.hold(rebuilt + gradient + held.workspace)
            by_layer = [rebuilt + gradient + transient for transient in held.transients]
        else:
            # The loss's backward runs first, with all of this micro-batch held; then the layers', last to first (a
            # re-materialized micro-batch is rebuilt when its cell's backward begins).
            self.hold(n * self.profile.loss_transient_bytes if held.last else -self.kept(held, i))
            peaks = each.backward_layers or (each.backward,) * len(held.transients)
            by_layer = [n * peak - self.kept(held, i) for peak in peaks]
        if action.phase is Phase.BACKWARD:
            self._gradients(action.stage, by_layer)
        else:
            self.hold(max(by_layer))
        self.live += rebuilt + held.weight_grads if action.phase is Phase.INPUT else -self.kept(held, i)
