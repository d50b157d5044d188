"""A backward pass in two: the input's gradient now, the parameters' gradients later, each computed once.

Zero-bubble schedules (Qi et al., 2024) send a stage's input gradient upstream as soon as they can and compute the
weight gradients later, when the stage would otherwise idle. :func:`input_pass` back-propagates from a stage's outputs
to its inputs only, keeping the graph, and notes the gradient that reaches each *boundary node*: a node that depends on
an input and feeds a parameter's gradient through nodes that do not. :meth:`WeightPass.run` starts from those nodes
with those gradients and runs only the parameter side (a matrix multiplication's ``dW``, not its ``dX`` again); the
nodes between the outputs and the boundary nodes are no longer referenced and freed at once. The outputs that do not
depend on an input at all, and every parameter gradient when the stage has no input that requires one (the first
stage), are back-propagated by the weight pass whole.

A boundary node that computes its parameter side even when only its input side is asked for cannot be split: a
region under ``torch.compile`` is one autograd node (``CompiledFunctionBackward``) whose backward yields every
gradient at once, as does a custom ``autograd.Function`` that ignores ``needs_input_grad`` (torch's own nodes compute
only what is asked). A hook on each boundary node of a Python function sees what it computed in the input pass; where
that is its whole parameter side, the input pass keeps those gradients and the weight pass starts below the node with
them instead of running it again. They still reach ``.grad`` through autograd, in the weight pass. The weight pass
holds no reference to such a node, so what it saved is freed after the input pass, unless an eager node above it is
kept for its own weight pass (the graph links each node to the ones below). The cost is memory: from its input pass to
its weight pass a micro-batch holds a gradient the size of each such region's parameters, where a split node holds
the gradient of its output and what it saved for ``dW``; a stage with ``P`` bytes of compiled parameters holds ``P``
per micro-batch whose weight pass is pending. A node of this kind that another boundary node of its parameters reaches
from above (a weight tied across an eager and a compiled layer) runs again in the weight pass, walked to from the
other.

The walk follows ``torch.distributed.pipelining._backward`` (``stage_backward_input`` and ``stage_backward_weight``,
torch 2.13), which misses the parameters reached only through outputs that do not depend on an input; here the
weight pass runs those outputs' backward whole. Gradients accumulate into ``.grad`` through autograd, as
``loss.backward()`` would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightPass", "input_pass"]


def _node(tensor: torch.Tensor) -> Node | None:
    """The node that back-propagates into ``tensor``: its ``grad_fn``, or the gradient accumulator of a leaf."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    grad_fn = tensor.view_as(tensor).grad_fn  # a leaf's accumulator exists once a view of it is made
    assert grad_fn is not None
    return grad_fn.next_functions[0][0]


class _Group:
    """Parameters and the boundary nodes their gradients come through; groups share no boundary node."""

    def __init__(self) -> None:
        self.nodes: set[Node] = set()
        self.parameters: list[torch.Tensor] = []


class _Backward:
    """One backward call of the weight pass: one group's starting edges and their gradients.

    The edges lead into the group's boundary nodes, or out of one that computed its parameter side in the input pass
    (to the nodes below it). ``held`` maps the boundary nodes that run again to the gradients they had in the input
    pass, which a hook gives back when one of them is reached again from another (one such node needs no hook).
    """

    def __init__(
        self,
        edges: list[GradientEdge],
        grads: list[torch.Tensor],
        parameters: list[torch.Tensor],
        held: dict[Node, tuple[torch.Tensor | None, ...]],
    ) -> None:
        self.edges, self.grads, self.parameters, self.held = edges, grads, parameters, held


class WeightPass:
    """The parameters' half of a split backward, from what :func:`input_pass` kept; run it once."""

    def __init__(self, backwards: list[_Backward], whole: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._backwards = backwards
        self._whole = whole

    def run(self) -> None:
        """Accumulate the parameters' gradients into ``.grad``; the graph is freed once this pass is dropped."""
        backwards, whole = self._backwards, self._whole
        self._backwards, self._whole = [], []
        for backward in backwards:  # one per group: none walks from its edges down to another group's
            handles = [node.register_prehook(lambda _g, k=grads: k) for node, grads in backward.held.items()]
            try:
                torch.autograd.backward(backward.edges, backward.grads, inputs=backward.parameters, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()
        if whole:
            torch.autograd.backward([t for t, _ in whole], [g for _, g in whole])


def input_pass(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None, inputs: Sequence[torch.Tensor]
) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """The gradients of ``inputs`` from ``outputs`` (given ``grads``, ones for a ``None``), and the weight pass.

    ``inputs`` are leaves that require grad; their gradients are returned, not accumulated (``None`` where no
    gradient reaches one). Every other leaf that requires grad is a parameter whose gradient the weight pass adds.
    """
    pairs = [
        (t, torch.ones_like(t) if g is None else g)
        for t, g in zip(outputs, grads if grads is not None else [None] * len(outputs), strict=True)
        if t.requires_grad
    ]
    consumers = _consumers([node for t, _ in pairs if (node := _node(t)) is not None])
    starts = {node for t in inputs if (node := _node(t)) is not None and node in consumers}
    dependent = _closure(starts, consumers)  # the nodes whose gradient depends on an input's
    group_of = _groups(consumers, starts, dependent)
    # The boundary nodes of Python autograd functions (a compiled region's among them) may compute their parameter
    # side unasked (torch's own nodes compute only what is asked); their edges to that side.
    sides = {
        node: [k for k, (child, _) in enumerate(node.next_functions) if child is not None and child not in dependent]
        for node in group_of
        if isinstance(node, BackwardCFunction)
    }
    dependent_pairs = [(t, g) for t, g in pairs if _node(t) in dependent]
    dinputs, kept, made = _input_gradients(dependent_pairs, inputs, group_of, sides)
    # A node that computed its parameter side unasked (a compiled region) is not run again: the weight pass starts
    # below it with what it computed, unless a boundary node of its group that does run again reaches it from above.
    unasked = {node for node, out in made.items() if out and all(g is not None for g in out)}
    groups = list({id(g): g for g in group_of.values()}.values())
    backwards = [
        backward
        for group in groups
        if (backward := _weight_backward(group, unasked, kept, made, sides, dependent)) is not None
    ]
    return dinputs, WeightPass(backwards, [(t, g) for t, g in pairs if _node(t) not in dependent])


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """The graph below ``roots``, each node with its consumers (the direction in which inputs feed the outputs)."""
    consumers: dict[Node, list[Node]] = {node: [] for node in roots}
    stack = list(consumers)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            users = consumers.get(child)
            if users is None:
                consumers[child] = [node]
                stack.append(child)
            else:
                users.append(node)
    return consumers


def _groups(consumers: dict[Node, list[Node]], starts: set[Node], dependent: set[Node]) -> dict[Node, _Group]:
    """Each boundary node's group: the parameters whose gradients come through it, merged where they share one."""
    # With no input in the graph (the first stage) no parameter has a boundary node: skip walking up from each.
    leaves = [node for node in consumers if node not in starts and hasattr(node, "variable")] if dependent else []
    group_of: dict[Node, _Group] = {}
    for leaf in leaves:
        met = _closure({leaf}, consumers, stop=dependent)
        if not met:
            continue  # reached only through outputs that do not depend on an input: the whole backward's
        group = _Group()
        for other in {id(g): g for node in met if (g := group_of.get(node)) is not None}.values():
            group.nodes |= other.nodes
            group.parameters += other.parameters
        group.nodes |= met
        group.parameters.append(leaf.variable)
        for node in group.nodes:
            group_of[node] = group
    return group_of


def _input_gradients(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    group_of: dict[Node, _Group],
    sides: dict[Node, list[int]],
) -> tuple[
    tuple[torch.Tensor | None, ...], dict[Node, tuple[torch.Tensor | None, ...]], dict[Node, list[torch.Tensor | None]]
]:
    """The input pass: the inputs' gradients from ``pairs`` of outputs and gradients, the graph kept; the gradient
    each boundary node received, and what each node of ``sides`` computed for its parameter side."""
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    made: dict[Node, list[torch.Tensor | None]] = {}
    handles = [
        node.register_prehook(lambda node_grads, node=node: kept.__setitem__(node, tuple(node_grads)))
        for node in group_of
    ] + [
        node.register_hook(lambda out, _in, node=node: made.__setitem__(node, [out[k] for k in sides[node]]))
        for node in sides
    ]
    try:
        dinputs: tuple[torch.Tensor | None, ...] = (None,) * len(inputs)
        if pairs and inputs:
            dinputs = torch.autograd.grad(
                [t for t, _ in pairs], list(inputs), [g for _, g in pairs], retain_graph=True, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    return dinputs, kept, made


def _weight_backward(
    group: _Group,
    unasked: set[Node],
    kept: dict[Node, tuple[torch.Tensor | None, ...]],
    made: dict[Node, list[torch.Tensor | None]],
    sides: dict[Node, list[int]],
    dependent: set[Node],
) -> _Backward | None:
    """The weight pass's backward call for ``group``: from its boundary nodes that run again, with what they received,
    and from below those of ``unasked`` that computed their parameter side already; ``None`` if nothing starts it."""
    done = group.nodes & unasked
    if done and len(done) < len(group.nodes):
        done -= _below(group.nodes - done, dependent)
    again = group.nodes - done
    edges: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    for node in again:
        for k, grad in enumerate(kept.get(node, ())):
            if grad is not None:
                edges.append(GradientEdge(node, k))
                values.append(grad)
    for node in done:
        for k, grad in zip(sides[node], made[node], strict=True):
            child, slot = node.next_functions[k]
            assert child is not None
            assert grad is not None
            edges.append(GradientEdge(child, slot))
            values.append(grad)
    held = {node: kept[node] for node in again if node in kept} if len(again) > 1 else {}
    return _Backward(edges, values, group.parameters, held) if edges else None


def _closure(starts: set[Node], consumers: dict[Node, list[Node]], stop: set[Node] | None = None) -> set[Node]:
    """The nodes reached from ``starts`` through consumers; with ``stop``, only the first ones met in ``stop``."""
    reached, stack, met = set(starts), list(starts), set()
    while stack:
        for consumer in consumers.get(stack.pop(), ()):
            if stop is not None and consumer in stop:
                met.add(consumer)
            elif consumer not in reached:
                reached.add(consumer)
                stack.append(consumer)
    return met if stop is not None else reached


def _below(starts: Iterable[Node], within: set[Node]) -> set[Node]:
    """The nodes of ``within`` that a backward from ``starts`` reaches (``starts`` not included unless reached)."""
    reached: set[Node] = set()
    stack = list(starts)
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child in within and child not in reached:
                reached.add(child)
                stack.append(child)
    return reached
