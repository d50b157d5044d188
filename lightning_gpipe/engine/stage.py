"""Stage execution: one cell of the pipeline running the forward and backward actions of its micro-batches.

A stage owns one cell (a slice of the layers). For micro-batch ``i`` its forward receives the boundary value from the
previous stage (stage 0 is handed its input), runs the cell, possibly under re-materialization, and sends the output
on; the last stage returns the output so that the caller can compute the loss. Its backward receives the gradient of
the output from the next stage (the last stage is handed the loss), back-propagates through the cell, accumulating
parameter gradients exactly as ``loss.backward()`` would, and sends the input's gradient back.

Only what backward needs is kept between the two: the grad-requiring input leaves and output tensors of each
micro-batch. Which actions run in which order is the schedule's business (:mod:`lightning_gpipe.engine.schedule`).

A zero-bubble schedule splits the backward in two: :meth:`Stage.input_backward` computes the input's gradient alone,
sends it at once and keeps the graph; :meth:`Stage.weight_backward` later accumulates the parameters' gradients from
it. A re-materialized micro-batch is recomputed once, by the input pass, from its input and the random state of its
forward; the weight pass reuses that graph.

Receives are posted ahead of the actions that need them (gloo parks a send until its receive is posted): the
activations of the whole step once its header is in (:class:`~lightning_gpipe.engine.boundary.ActivationLink`), and,
when the step's ``gradient_order`` is known, the gradients of the micro-batches whose outputs exist, in the order the
next stage sends them: :data:`GRADIENTS_AHEAD` of them, and more while their buffers fit in
:data:`GRADIENT_BYTES_AHEAD`, so that a stage of small outputs has every gradient receive of the step posted before its
first backward. Transports that run on device streams (NCCL) do not want receives posted long before use
(:attr:`~lightning_gpipe.engine.transport.Transport.posts_ahead`): there activations are posted one micro-batch at a
time and gradients from the first backward on, :data:`GRADIENTS_AHEAD` at a time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_gpipe.engine.anomaly import check_finite
from lightning_gpipe.engine.batchnorm import DeferredBatchNorm, commit_running_stats
from lightning_gpipe.engine.boundary import ActivationLink, GradientLink
from lightning_gpipe.engine.config import PipelineConfig, config_from
from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.fingerprint import Fingerprint
from lightning_gpipe.engine.rematerialization import (
    CheckpointMode,
    _recomputing,
    _selective_contexts,
    checkpoint_stop,
    checkpointed,
)
from lightning_gpipe.engine.sharding import ShardedCell
from lightning_gpipe.engine.split import WeightPass, input_pass
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import Transport
from lightning_gpipe.engine.tree import flatten, map_tensors, unflatten

__all__ = ["GRADIENTS_AHEAD", "GRADIENT_BYTES_AHEAD", "Stage"]

ComputeGuard = Callable[[], AbstractContextManager[None]]

GRADIENTS_AHEAD = 2
"""How many micro-batches' gradient receives a stage keeps posted ahead of its backward passes, at least.

Two let the next gradient arrive while the current backward computes, even when the next stage runs ahead.
"""

GRADIENT_BYTES_AHEAD = 4 * 2**20
"""How many bytes of buffers the gradient receives a stage keeps posted may hold in all, where the transport posts
ahead; the first :data:`GRADIENTS_AHEAD` are posted whatever their size.

Each posted receive holds a buffer the size of its micro-batch's outputs. A gloo message whose receive is posted late
pays a rendezvous (about 0.1 ms), which is most of what a small one costs and little beside a large one's transfer:
4 MiB takes in the whole step of small stages while bounding the memory that posting ahead adds.
"""


class _Alias(torch.autograd.Function):
    """The identity, returning a tensor that shares its input's memory but is not a leaf."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _alias_leaf(tensor: torch.Tensor) -> torch.Tensor:
    return _Alias.apply(tensor) if tensor.requires_grad and tensor.is_leaf else tensor


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    leaves, _spec = flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _unsaved(tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("a re-materialized forward's graph was back-propagated; its input pass replays it instead")


class _Replay:
    """A split backward's re-materialized micro-batch: its forward keeps its input and the random state it saw
    (under ``selective``, the outputs of :data:`~lightning_gpipe.engine.rematerialization.KEPT_OPS` too), and the
    input pass replays it once, building the graph that the weight pass then reuses."""

    def __init__(self, value: Any, copy_input: bool, selective: bool) -> None:
        self.value = value
        self.copy_input = copy_input
        leaves, _spec = flatten(value)
        self.devices = sorted({t.device.index for t in leaves if isinstance(t, torch.Tensor) and t.is_cuda})
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(device) for device in self.devices]
        self._first: AbstractContextManager[Any] = nullcontext()
        self._replay: AbstractContextManager[Any] = nullcontext()
        if selective:
            self._first, self._replay = _selective_contexts()

    def _call(self, cell: nn.Module) -> Any:
        return cell(map_tensors(torch.clone, self.value) if self.copy_input else self.value)

    def forward(self, cell: nn.Module) -> Any:
        """The first forward: its graph says which outputs need a gradient but saves nothing for a backward."""
        with self._first, torch.autograd.graph.saved_tensors_hooks(_unsaved, _never_unpacked):
            return self._call(cell)

    def run(self, cell: nn.Module) -> Any:
        """``cell``'s forward again, as a replay (BatchNorm statistics left alone), with the same random numbers."""
        with torch.random.fork_rng(devices=self.devices), _recomputing(cell), self._replay:
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            return self._call(cell)


class Stage:
    """Stage ``transport.stage`` of ``transport.num_stages``, running ``cell``.

    Args:
        cell: this stage's layers.
        transport: the links to the neighbouring stages; it also tells this stage's index.
        config: the pipeline's settings, validated already; a stage uses its ``checkpoint`` and
            ``detect_anomalies``. Without it, the two keywords below build one (and are validated there).
        checkpoint: re-materialization mode, ``"always"``, ``"except_last"`` (the default), ``"selective"`` or
            ``"never"``.
        timeline: records the start and end of every action when given.
        compute_guard: a context entered around this stage's computation (not around its waits); the in-process
            runner uses it to give each thread-stage its own random-number stream.
        detect_anomalies: check the cell's outputs, the loss and the gradients for NaN and Inf, and raise a
            :class:`PipelineError` naming the stage and the micro-batch where one first appears (default off).
    """

    def __init__(
        self,
        cell: nn.Module,
        transport: Transport,
        config: PipelineConfig | None = None,
        *,
        checkpoint: CheckpointMode | None = None,
        timeline: Timeline | None = None,
        compute_guard: ComputeGuard | None = None,
        detect_anomalies: bool | None = None,
    ) -> None:
        self.config = config_from(config, "Stage", checkpoint=checkpoint, detect_anomalies=detect_anomalies)
        self.cell = cell
        self.detect_anomalies = self.config.detect_anomalies
        self.transport = transport
        self.index = transport.stage
        self.num_stages = transport.num_stages
        self.checkpoint = self.config.checkpoint
        self.timeline = timeline
        self._guard: ComputeGuard = compute_guard or nullcontext
        self._inbox = ActivationLink(transport, self.index - 1) if not self.is_first else None
        self._outbox = ActivationLink(transport, self.index + 1) if not self.is_last else None
        self._grad_inbox = GradientLink(transport, self.index + 1) if not self.is_last else None
        self._grad_outbox = GradientLink(transport, self.index - 1) if not self.is_first else None
        # Found once, not by walking the modules every step: only cells with deferred BatchNorm commit statistics.
        self._commits_statistics = any(isinstance(m, DeferredBatchNorm) for m in cell.modules())
        self._sharded = ShardedCell.of(cell)  # layers sharded over the replicas: reduced and resharded per step
        self._backward_ran = False  # in this step: whether it has gradients to reduce
        self._num_microbatches = 0
        self._inputs: dict[int, list[torch.Tensor]] = {}
        self._outputs: dict[int, list[torch.Tensor]] = {}
        self._forwarded: set[int] = set()
        self._split = False  # whether the step splits its backward passes into input and weight passes
        self._replays: dict[int, _Replay] = {}  # split backward: the re-materialized micro-batches to recompute
        self._cut: dict[int, list[torch.Tensor]] = {}  # split, last stage: the leaves the loss starts from
        self._weights: dict[int, WeightPass] = {}  # split backward: the weight passes still to run
        self._unposted_gradients: deque[int] = deque()  # the rest of the step's gradient order, not posted yet
        self._stranded: str | None = None  # why receives of a failed step may still be posted on the transport

    @property
    def is_first(self) -> bool:
        """Whether this stage takes the mini-batch itself rather than a neighbour's activations."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the loss and starts the backward passes."""
        return self.index == self.num_stages - 1

    def begin_step(
        self,
        sizes: Sequence[int],
        fingerprint: Fingerprint | None = None,
        gradient_order: Sequence[int] | None = None,
        split_backward: bool = False,
    ) -> None:
        """Start a step of ``len(sizes)`` micro-batches with these sample counts (the same on every stage).

        With a ``fingerprint`` of this stage's batch, the stages check that they all read the same batch. With a
        ``gradient_order``, the order in which the next stage runs the backward passes of the step's micro-batches
        (hence sends their gradients), this stage posts its gradient receives ahead of its own backward passes;
        without one, each backward posts its receive when it starts. Either way backward may run in any order.
        With ``split_backward``, each micro-batch's backward runs as :meth:`input_backward`, then
        :meth:`weight_backward`, instead of :meth:`backward`.
        """
        if self._stranded is not None:
            raise PipelineError(
                self.index,
                f"a new step began after a failed one ({self._stranded}) left receives posted; restart the job",
            )
        if self._inputs or self._outputs or self._weights:
            pending = sorted(set(self._inputs) | set(self._outputs) | set(self._weights))
            raise PipelineError(self.index, f"a new step began while micro-batches {pending} still await backward")
        if gradient_order is not None and sorted(gradient_order) != list(range(len(sizes))):
            raise ValueError(
                f"gradient_order={list(gradient_order)} must list each of the step's {len(sizes)} micro-batches once "
                f"(0 to {len(sizes) - 1})"
            )
        self._num_microbatches = len(sizes)
        self._split = split_backward
        self._backward_ran = False
        self._forwarded.clear()
        self._unposted_gradients = deque(gradient_order if gradient_order is not None and not self.is_last else ())
        for link in (self._inbox, self._outbox):
            if link is not None:
                link.begin_step(sizes, fingerprint)
        if self._sharded is not None:
            self._sharded.begin_step()

    def _record(self, phase: str, index: int) -> AbstractContextManager[None]:
        return self.timeline.record(self.index, phase, index) if self.timeline is not None else nullcontext()

    @contextmanager
    def computing(self, phase: str, index: int) -> Iterator[None]:
        """Around this stage's own computation of ``phase`` for micro-batch ``index`` (not its waits): the compute
        guard, and the timeline's span. For passes that the stage does not run itself (a decoding round's)."""
        with self._guard(), self._record(phase, index):
            yield

    def forward(self, index: int, value: Any = None) -> Any:
        """Run micro-batch ``index`` through the cell. Stage 0 is given ``value``; later stages receive it.

        Returns the cell's output (on the last stage, what the loss is computed from).
        """
        if not self.is_first:
            assert self._inbox is not None
            value = self._inbox.recv(index)
        grad_enabled = torch.is_grad_enabled()
        rematerialize = (
            grad_enabled and self.cell.training and index < checkpoint_stop(self.checkpoint, self._num_microbatches)
        )
        # A received value's tensors are leaves, on which autograd refuses an in-place operation (a cell that starts
        # with ReLU(inplace=True)): the cell gets a copy when re-materialized, so the replay starts from the input as
        # it was, and otherwise aliases that share the leaves' memory but not their leaf status.
        received = grad_enabled and not self.is_first
        with self._guard(), self._record("forward", index):
            if rematerialize:
                selective = self.checkpoint == "selective"
                if self._split:  # replayed by the input pass, whose graph the weight pass reuses
                    replay = self._replays[index] = _Replay(value, copy_input=received, selective=selective)
                    output = replay.forward(self.cell)
                else:
                    output = checkpointed(self.cell, value, copy_input=received, selective=selective)
            else:
                output = self.cell(map_tensors(_alias_leaf, value) if received else value)
        if self.detect_anomalies:
            check_finite(self.index, index, "the output", output)
        if grad_enabled:
            inputs = _grad_tensors(value) if not self.is_first else []
            if inputs:
                self._inputs[index] = inputs
        if self.is_last and self._split and grad_enabled:
            # The loss starts from leaves cut off the output: the input pass back-propagates the loss's own graph
            # whole (freeing it), then splits the cell's, which a re-materialized micro-batch recomputes only then.
            self._outputs[index] = _grad_tensors(output)
            output = self._cut_off(index, output)
        if not self.is_last:
            assert self._outbox is not None
            self._outbox.send(index, output)
            if grad_enabled:
                outputs = _grad_tensors(output)
                if outputs:
                    self._outputs[index] = outputs
            self._forwarded.add(index)
            if self.transport.posts_ahead:
                # On NCCL the receives wait for backward: a receive posted now would sit on the GPU through whatever
                # the step does between its forwards and backwards (log syncs, allocator frees that synchronize).
                self._post_gradients()
        return output

    def _cut_off(self, index: int, output: Any) -> Any:
        """``output`` with each grad-requiring tensor replaced by an alias of a new leaf, kept in :attr:`_cut`."""
        leaves, spec = flatten(output)
        cut: list[torch.Tensor] = []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                cut.append(leaf.detach().requires_grad_())
                leaves[k] = _alias_leaf(cut[-1])
        self._cut[index] = cut
        return unflatten(leaves, spec)

    def post_activations(self, after: int) -> None:
        """Post the activation receives of this step's micro-batches after ``after`` now, wherever receives are
        otherwise posted when needed: other messages from the previous stage are about to be received."""
        if self._inbox is not None:
            self._inbox.post_rest(after)

    def _post_gradients(self, through: int | None = None) -> None:
        """Post gradient receives in the next stage's sending order: up to :data:`GRADIENTS_AHEAD` micro-batches, more
        while their buffers fit in :data:`GRADIENT_BYTES_AHEAD`, or every one up to and including micro-batch
        ``through``, whose backward needs its gradient now."""
        order, inbox = self._unposted_gradients, self._grad_inbox
        budget = GRADIENT_BYTES_AHEAD if self.transport.posts_ahead else 0
        while order:
            assert inbox is not None
            index = order[0]
            needed = through is not None and through in order
            if (
                not needed
                and len(inbox.posted) >= GRADIENTS_AHEAD
                and inbox.posted_bytes + _nbytes(self._outputs.get(index, [])) > budget
            ):
                return
            if index not in self._forwarded:
                if needed:
                    raise PipelineError(
                        self.index,
                        f"backward of micro-batch {through} ran before the forward of micro-batch {index}, earlier in "
                        "gradient_order; run that forward first",
                    )
                return
            order.popleft()
            outputs = self._outputs.get(index)
            if outputs:  # nothing comes back for outputs that need no gradient
                inbox.post(outputs, index)

    def backward(self, index: int, loss: torch.Tensor | None = None) -> None:
        """Back-propagate micro-batch ``index``. The last stage is given the (already weighted) loss."""
        self._backward_ran = True
        if self.is_last:
            if loss is None:
                raise PipelineError(self.index, f"the last stage needs the loss of micro-batch {index} for backward")
            if self.detect_anomalies:
                check_finite(self.index, index, "the loss", loss)
            with self._guard(), self._record("backward", index):
                torch.autograd.backward(loss)
        else:
            outputs = self._outputs.get(index, [])
            if outputs:  # nothing downstream needs a gradient otherwise
                assert self._grad_inbox is not None
                self._post_gradients(through=index)
                del self._outputs[index]
                grads = self._grad_inbox.recv(outputs, index)
                self._post_gradients()  # the next gradients arrive while this backward computes
                with self._guard(), self._record("backward", index):
                    torch.autograd.backward(outputs, grads)
        inputs = self._inputs.pop(index, [])
        if inputs:
            assert self._grad_outbox is not None
            if self.detect_anomalies:
                check_finite(self.index, index, "the gradient of the input", [t.grad for t in inputs])
            self._grad_outbox.send(inputs, index)

    def input_backward(self, index: int, loss: torch.Tensor | None = None) -> None:
        """The first half of a split backward of micro-batch ``index``: the gradient of the stage's input, sent on at
        once, and what :meth:`weight_backward` needs kept (:mod:`~lightning_gpipe.engine.split`). The last stage is
        given the (already weighted) loss."""
        self._backward_ran = True
        grads: list[torch.Tensor] | None = None
        if self.is_last:
            if loss is None:
                raise PipelineError(self.index, f"the last stage needs the loss of micro-batch {index} for backward")
            if self.detect_anomalies:
                check_finite(self.index, index, "the loss", loss)
        elif index in self._outputs:  # nothing downstream needs a gradient otherwise
            assert self._grad_inbox is not None
            self._post_gradients(through=index)
            grads = self._grad_inbox.recv(self._outputs[index], index)
            self._post_gradients()
        outputs = self._outputs.pop(index, [])
        inputs = self._inputs.pop(index, [])
        with self._guard(), self._record("input", index):
            if loss is not None:  # the loss's own graph, down to the leaves cut off the cell's output
                torch.autograd.backward(loss)
                grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in self._cut.pop(index, [])]
            replay = self._replays.pop(index, None)
            if replay is not None:
                outputs = _grad_tensors(replay.run(self.cell))
            dinputs, self._weights[index] = input_pass(outputs, grads, inputs)
        if inputs:
            assert self._grad_outbox is not None
            if self.detect_anomalies:
                check_finite(self.index, index, "the gradient of the input", list(dinputs))
            self._grad_outbox.send(inputs, index, dinputs)

    def weight_backward(self, index: int) -> None:
        """The second half of a split backward of micro-batch ``index``: the parameters' gradients, into ``.grad``."""
        weights = self._weights.pop(index)
        with self._guard(), self._record("weight", index):
            weights.run()

    def end_step(self) -> None:
        """Finish the step: wait for outgoing messages, commit deferred BatchNorm statistics, and end the step of a
        sharded cell (its gradients reduced over the replicas, its parameters resharded: :class:`ShardedCell`).

        Cells are expected to be converted (:meth:`DeferredBatchNorm.convert`) and sharded before the stage is built.
        """
        self.transport.wait_sends()
        if self.cell.training and self._commits_statistics:
            commit_running_stats(self.cell)
        if self._sharded is not None:
            self._sharded.end_step(reduce=self._backward_ran)

    def abort(self, reason: str, stranded: bool = False) -> None:
        """Drop the step's state and tell the other stages (where the transport can) that this one failed.

        Receives the step left posted cannot be taken back; if there are any (its own, or ``stranded`` ones of a
        decoding call), this stage refuses further steps.
        """
        if stranded or any(link is not None and link.posted for link in (self._inbox, self._grad_inbox)):
            self._stranded = reason
        for link in (self._inbox, self._grad_inbox):
            if link is not None:
                link.clear()
        self._inputs.clear()
        self._outputs.clear()
        self._replays.clear()
        self._cut.clear()
        self._weights.clear()
        self._forwarded.clear()
        self._unposted_gradients.clear()
        if self._sharded is not None:
            self._sharded.abort()
        self.transport.abort(reason)
