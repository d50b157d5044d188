"""Boundary values: what crosses from one stage to the next, and the gradients that come back.

A boundary value is a nest of tensors (tuples, lists, dicts, namedtuples, dataclasses; ``None`` leaves allowed), for
example an encoder output together with its attention mask. Its layout (structure, shapes, dtypes, which tensors need
gradients) is not hard-coded: the sender describes it in a header. Every gloo message costs a round trip, so the
header goes once per step, not per micro-batch:

- the first activation message of a step carries a header with the layout of that micro-batch's value and the sizes
  of all the step's micro-batches;
- a micro-batch's tensors travel as one message, its *frame* (:mod:`~lightning_gpipe.engine.frame`): a uint8 buffer
  holding each tensor at an aligned offset, which the receiver views in the tensors' dtypes and shapes;
- every later micro-batch of the step is predicted from it: the same layout, with dim 0 of the tensors that carry the
  batch dimension resized to that micro-batch's size (a tensor wrapped in :class:`~lightning_gpipe.Unbatched` never
  is). Its frame opens with a small control area: nothing missing, or the leaves it lacks (``None``, as an attention
  mask that is ``None`` when nothing is padded), or "a new header follows";
- a new header follows when the prediction fails: a leaf appeared that the prediction has as ``None`` (no buffer
  awaits it), or a shape or the structure differs (sequences padded per micro-batch, a bias whose dim 0 only
  happened to equal the micro-batch size). Every frame already posted is then filled with a placeholder (on
  devices, where receives are posted when needed, only that micro-batch's);
- after a shape changed, the step goes on *described*: each later micro-batch is preceded by its own layout message,
  and the receiver posts its frame's receive once that is in. The sending link remembers it, so its later steps
  are described from their first micro-batch and no placeholders are sent again;
- gradients need no header: they go back for exactly the received tensors that require grad, with their shapes,
  one micro-batch after the other in the order of the receiving stage's backward passes.

The header also carries the sender's batch fingerprint (:mod:`lightning_gpipe.engine.fingerprint`), when the caller
gives one: the receiver compares it with its own, so stages that read different batches are caught at the first step.

Once the header is in, the receiver posts the receives of the whole step at once: gloo parks a send until its
receive is posted, and a receive posted only when needed costs a rendezvous per message, several times a receive
posted ahead (measured in docs/benchmarks/engine.md). A described step can post only one micro-batch ahead:
its layout message, behind the current micro-batch's frame. Gradient receives can be posted ahead too
(:meth:`GradientLink.post`), in the order the peer sends them, once the outputs they are the gradients of exist.

Headers and control areas are pickled objects in :mod:`~lightning_gpipe.engine.framing`'s format: a header in a
``MESSAGE_BYTES`` head (with a tail when its layout is longer), a control area in ``FRAME_CONTROL_BYTES``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.fingerprint import Fingerprint, same_fingerprint
from lightning_gpipe.engine.frame import FRAME_CONTROL_BYTES, Frame, Layout, TensorLayout, describe, resize
from lightning_gpipe.engine.framing import MESSAGE_BYTES, pack, unpack
from lightning_gpipe.engine.transport import Transport

__all__ = ["ActivationLink", "GradientLink"]


class _Posted:
    """One micro-batch's posted receives: in a described step its layout message, and its frame.

    In a described step, the frame's receive is posted only once the layout message is in. A frame of no bytes has no
    message, hence no wait.
    """

    def __init__(self, layout: tuple[torch.Tensor, Callable[[], None]] | None) -> None:
        self.layout = layout
        self.frame: tuple[torch.Tensor, Callable[[], None] | None] | None = None

    def wait_frame(self) -> torch.Tensor:
        """Wait for the frame; its buffer."""
        assert self.frame is not None
        buffer, wait = self.frame
        if wait is not None:
            wait()
        return buffer

    def wait_all(self) -> None:
        """Wait for every receive, whatever arrives (used to drain receives made void by a new header)."""
        if self.layout is not None:
            self.layout[1]()
        if self.frame is not None:
            self.wait_frame()


class ActivationLink:
    """Sends (or receives) one stage's outputs to (or from) a neighbour, one header per step."""

    def __init__(self, transport: Transport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self._sizes: list[int] = []
        self._fingerprint: Fingerprint | None = None
        self._layout: Layout | None = None  # the prediction's base: set by the step's header (or a later one)
        self._expected: dict[tuple[int, bool], tuple[Layout, Frame]] = {}  # the prediction per size, built once
        self._first = 0  # the micro-batch the last header came with: later ones have control
        self._described = False  # whether the micro-batches after the header's each carry their own layout
        # Sending side: a shape changed within a step of this link, so its steps start described (see the module).
        self._ragged = False
        self._posted: dict[int, _Posted] = {}
        self._nothing_missing: torch.Tensor | None = None  # the common control area, packed once

    @property
    def stage(self) -> int:
        """The index of the stage this link belongs to."""
        return self.transport.stage

    @property
    def posted(self) -> list[int]:
        """The micro-batches whose activations are posted and not yet received."""
        return list(self._posted)

    def begin_step(self, sizes: Sequence[int], fingerprint: Fingerprint | None = None) -> None:
        """Start a step whose micro-batches have ``sizes`` samples; the next message carries a header.

        ``fingerprint`` summarizes this stage's batch; when both neighbours give one, the receiver checks they match.
        """
        self._sizes = list(sizes)
        self._fingerprint = fingerprint
        self._set_layout(None, 0, described=False)
        self._posted = {}

    def clear(self) -> None:
        """Forget the posted receives (after a failed step: the transport cannot take them back)."""
        self._posted = {}

    def _set_layout(self, layout: Layout | None, index: int, described: bool) -> None:
        """Take ``layout``, micro-batch ``index``'s (the header's), as the base of the step's predictions."""
        if layout is not None and self._sizes[index] != self._sizes[0]:
            layout = resize(layout, self._sizes[0])
        self._layout = layout
        self._expected = {}
        self._first = index
        self._described = described

    def _has_control(self, index: int) -> bool:
        """Whether micro-batch ``index`` comes with control: a control area, or its own layout message (described)."""
        return index > self._first

    def _prediction(self, index: int) -> tuple[Layout, Frame]:
        """Micro-batch ``index``'s layout predicted from the header, at its own size, and its frame."""
        key = (self._sizes[index], self._has_control(index))
        expected = self._expected.get(key)
        if expected is None:
            assert self._layout is not None
            layout = resize(self._layout, key[0])
            expected = self._expected[key] = (layout, Frame.of(layout[1], control=key[1]))
        return expected

    # --- sending side

    def send(self, index: int, value: Any) -> None:
        """Send micro-batch ``index``'s output."""
        layout, leaves = describe(self.stage, value, self._sizes[index])
        if self._layout is None:
            self._start(index, layout, self._fingerprint, described=self._ragged)
            self._send_frame(index, layout[1], Frame.of(layout[1], control=False), leaves)
            return
        if self._described:
            self._send_header({"layout": layout}, _layout_of(index))
            self._send_frame(index, layout[1], Frame.of(layout[1], control=False), leaves)
            return
        predicted, frame = self._prediction(index)
        if layout == predicted:
            if self._nothing_missing is None:
                self._nothing_missing = pack({"missing": []}, FRAME_CONTROL_BYTES)[0].to(self.transport.device)
            self._send_frame(index, predicted[1], frame, leaves, self._nothing_missing)
            return
        entries, expected = layout[1], predicted[1]
        pairs = list(zip(entries, expected, strict=True)) if layout[0] == predicted[0] else None
        if pairs is None or any(ours is not None and theirs is not None and ours != theirs for ours, theirs in pairs):
            # A shape (or the structure) differs from the prediction: describe every later micro-batch, from this
            # step on (variable lengths per micro-batch come back step after step).
            self._ragged = True
            self._restart(index, layout, leaves, described=True)
            return
        missing = [position for position, (ours, theirs) in enumerate(pairs) if ours != theirs]
        control, overflow = pack({"missing": missing}, FRAME_CONTROL_BYTES)
        if any(ours is not None and theirs is None for ours, theirs in pairs) or overflow is not None:
            # A leaf the receiver has no room for (a mask that was None so far), or more missing leaves than the
            # control area can name: a new header describes it.
            self._restart(index, layout, leaves, described=False)
            return
        self._send_frame(index, expected, frame, leaves, control.to(self.transport.device))

    def _restart(self, index: int, layout: Layout, leaves: Sequence[torch.Tensor | None], described: bool) -> None:
        """Fill the frames the receiver posted for the rest of the step with placeholders, then send a new header and
        micro-batch ``index``'s ``leaves`` as its first."""
        last = len(self._sizes) if self.transport.posts_ahead else index + 1  # else only this frame is posted
        for later in range(index, last):
            control = pack({"restart": True} if later == index else {"void": True}, FRAME_CONTROL_BYTES)[0]
            entries, frame = self._prediction(later)[0][1], self._prediction(later)[1]
            self._send_frame(later, entries, frame, [None] * len(entries), control.to(self.transport.device))
        self._start(index, layout, None, described)
        self._send_frame(index, layout[1], Frame.of(layout[1], control=False), leaves)

    def _start(self, index: int, layout: Layout, fingerprint: Fingerprint | None, described: bool) -> None:
        self._set_layout(layout, index, described)
        header = {"layout": layout, "index": index, "sizes": self._sizes, "fingerprint": fingerprint}
        self._send_header({**header, "described": described}, _header_of(index))

    def _send_frame(
        self,
        index: int,
        entries: Sequence[TensorLayout | None],
        frame: Frame,
        leaves: Sequence[torch.Tensor | None],
        control: torch.Tensor | None = None,
    ) -> None:
        """Send micro-batch ``index``'s frame (:meth:`Frame.write`); on the transport's device, so the send itself
        never fails on a device after the header is gone."""
        if frame.nbytes == 0:  # nothing to carry: no message either way (see _post_frame)
            return
        buffer = frame.write(entries, leaves, self.transport.device, control)
        self.transport.send(buffer, self.peer, _activations_of(index))

    def _send_header(self, payload: dict[str, Any], what: str) -> None:
        head, tail = pack(payload, MESSAGE_BYTES)
        for part in (head, tail) if tail is not None else (head,):
            self.transport.send(part.to(self.transport.device), self.peer, what)

    # --- receiving side

    def recv(self, index: int) -> Any:
        """Receive micro-batch ``index``'s input; float tensors that required grad upstream are leaves that do too."""
        if self._layout is None:
            self._receive_header(index)
            if self.transport.posts_ahead:
                self._post_from(index)
        if index not in self._posted:  # posted when needed (device streams), in the same forward order
            self._posted[index] = self._post(index)
        posted = self._posted.pop(index)
        if posted.layout is not None:
            # Described: its frame is posted now that its layout is known; the next micro-batch's layout message can
            # be posted behind it (the peer sends layout, frame, next layout, ...).
            buffer, wait = posted.layout
            wait()
            layout = self._read(buffer, _layout_of(index))["layout"]
            frame = Frame.of(layout[1], control=False)
            posted.frame = self._post_frame(index, frame)
            if self.transport.posts_ahead and index + 1 < len(self._sizes):
                self._posted[index + 1] = self._post(index + 1)
        else:
            layout, frame = self._prediction(index)
        buffer = posted.wait_frame()
        missing: Sequence[int] = ()
        if frame.control:
            message = unpack(buffer[: frame.control])
            if message.get("restart"):
                # The sender has filled every frame posted for this step with placeholders; a header follows.
                # (A wait is never repeated: on gloo a second wait of a receive waits for another message.)
                for later in sorted(self._posted):
                    self._posted.pop(later).wait_all()
                self._receive_header(index)
                if self.transport.posts_ahead:
                    self._post_from(index)
                return self.recv(index)
            missing = message["missing"]
        return frame.read(buffer, layout, missing)

    def post_rest(self, after: int) -> None:
        """Post the receives of the step's micro-batches after ``after`` that are not posted yet.

        For a receiver about to take other messages from the same peer (the further calls of a decoding step, which
        the peer sends after this step's): without, those receives would be matched with this step's messages.
        """
        if self._layout is None:
            return
        for index in range(after + 1, len(self._sizes)):
            if index not in self._posted:
                self._posted[index] = self._post(index)

    def _post_from(self, first: int) -> None:
        # The sender sends the step's micro-batches in forward order, starting with this one. Described steps post
        # one layout message ahead only: the frames' receives wait for their layout.
        last = first + 2 if self._described else len(self._sizes)
        for index in range(first, min(last, len(self._sizes))):
            self._posted[index] = self._post(index)

    def _post(self, index: int) -> _Posted:
        if self._described and self._has_control(index):
            buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=self.transport.device)
            return _Posted((buffer, self.transport.post_recv(buffer, self.peer, _layout_of(index))))
        posted = _Posted(None)
        posted.frame = self._post_frame(index, self._prediction(index)[1])  # at its own size, as in recv
        return posted

    def _post_frame(self, index: int, frame: Frame) -> tuple[torch.Tensor, Callable[[], None] | None]:
        buffer = torch.empty(frame.nbytes, dtype=torch.uint8, device=self.transport.device)
        if frame.nbytes == 0:  # nothing to carry: the sender sends no message
            return buffer, None
        return buffer, self.transport.post_recv(buffer, self.peer, _activations_of(index))

    def _read(self, header: torch.Tensor, what: str) -> dict[str, Any]:
        """The payload of a received header-format message, receiving its tail if it did not fit."""

        def tail(size: int) -> torch.Tensor:
            buffer = torch.empty(size, dtype=torch.uint8, device=self.transport.device)
            self.transport.recv(buffer, self.peer, what)
            return buffer

        message: dict[str, Any] = unpack(header, tail)
        return message

    def _receive_header(self, index: int) -> None:
        what = _header_of(index)
        header = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=self.transport.device)
        self.transport.recv(header, self.peer, what)
        message = self._read(header, what)
        if message["sizes"] != self._sizes or message["index"] != index:
            raise PipelineError(
                self.stage,
                f"stage {self.peer} sends micro-batch {message['index']} of sizes {message['sizes']}, but this stage "
                f"expects micro-batch {index} of sizes {self._sizes}: give every stage the same batch and chunks",
            )
        theirs = message.get("fingerprint")
        if theirs is not None and self._fingerprint is not None and not same_fingerprint(theirs, self._fingerprint):
            raise PipelineError(
                self.stage,
                f"stage {self.peer} and this stage read different batches at this step ({_show_fingerprint(theirs)} "
                f"there, {_show_fingerprint(self._fingerprint)} here): give every stage the same batches, in order",
            )
        self._set_layout(message["layout"], index, bool(message.get("described")))


class GradientLink:
    """Sends (or receives) the gradients of a boundary value's grad-requiring tensors; their layout is known.

    On the receiving side, :meth:`post` starts a micro-batch's receives ahead of its backward and :meth:`recv` waits
    for them. Receives take the peer's messages in posting order, so micro-batches must be posted in the order the peer
    sends their gradients: the peer's backward order.
    """

    def __init__(self, transport: Transport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        # Per micro-batch: receive buffer, its wait, and the device of the output it is the gradient of.
        self._posted: dict[int, list[tuple[torch.Tensor, Callable[[], None], torch.device]]] = {}
        self._posted_bytes = 0

    def send(
        self, inputs: Sequence[torch.Tensor], index: int, grads: Sequence[torch.Tensor | None] | None = None
    ) -> None:
        """Send the gradients of ``inputs`` (micro-batch ``index``'s leaves that require grad): ``grads`` where given,
        else those accumulated in ``.grad``; zeros where none arrived."""
        for k, tensor in enumerate(inputs):
            grad = tensor.grad if grads is None else grads[k]
            self.transport.send(torch.zeros_like(tensor) if grad is None else grad, self.peer, _gradients_of(index))

    @property
    def posted(self) -> list[int]:
        """The micro-batches whose gradients are posted and not yet received, in posting order."""
        return list(self._posted)

    @property
    def posted_bytes(self) -> int:
        """The size of the buffers of the receives posted and not yet received."""
        return self._posted_bytes

    def post(self, outputs: Sequence[torch.Tensor], index: int) -> None:
        """Start receiving the gradients of ``outputs``, micro-batch ``index``'s tensors that require grad."""
        assert index not in self._posted, f"the gradients of micro-batch {index} are posted twice"
        posted = []
        for tensor in outputs:
            # Contiguous whatever the output's strides (channels_last, a transpose): gloo and NCCL receive into
            # contiguous buffers only, and autograd accepts a gradient of any strides for the output.
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.transport.device)
            wait = self.transport.post_recv(buffer, self.peer, _gradients_of(index))
            posted.append((buffer, wait, tensor.device))
            self._posted_bytes += buffer.nbytes
        self._posted[index] = posted

    def recv(self, outputs: Sequence[torch.Tensor], index: int) -> list[torch.Tensor]:
        """The gradients of ``outputs``: waits for the receives :meth:`post` started, or receives them now."""
        if index not in self._posted:
            # Posted now, after any micro-batch still outstanding: the caller keeps the peer's order.
            self.post(outputs, index)
        grads = []
        for buffer, wait, device in self._posted.pop(index):
            self._posted_bytes -= buffer.nbytes
            wait()
            grads.append(buffer.to(device))  # an output left on the CPU by a stage on a GPU gets a CPU gradient
        return grads

    def clear(self) -> None:
        """Forget the posted receives (after a failed step: the transport cannot take them back)."""
        self._posted.clear()
        self._posted_bytes = 0


# How errors name each message, on the sending side as on the receiving one (the transport says which).


def _header_of(index: int) -> str:
    return f"the step header (micro-batch {index})"


def _layout_of(index: int) -> str:
    return f"the layout of micro-batch {index}"


def _activations_of(index: int) -> str:
    return f"activations of micro-batch {index}"


def _gradients_of(index: int) -> str:
    return f"gradients of micro-batch {index}"


def _show_fingerprint(fingerprint: Fingerprint) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {dtype} {checksum:.6g}" for shape, dtype, checksum in fingerprint) + "]"
