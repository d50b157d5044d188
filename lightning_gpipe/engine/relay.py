"""Repeated calls of the pipelined sequence in one evaluation step, driven by the last stage (autoregressive decoding).

A decoder calls the sequence once per generated token, and what it feeds each call (the prefix so far) depends on what
the previous call produced. Every stage runs the user's step up to its first call of the sequence, as in any step, and
only the last stage runs the code after it. So the last stage drives: when its step calls the sequence again, it sends
the call's input back along the pipeline to stage 0 as a control message (relayed stage by stage, against the
direction of the activations, over the same links), and every stage runs its cell for the call as for a micro-batch.
When the last stage's steps are over it sends ``done``, and the other stages, which serve calls from the end of their
own steps on, go on. The stages thus agree on the number of calls by construction, and stage 0 gets exactly the
tokens the last stage chose, without the last stage's outputs (logits of the whole vocabulary) ever being copied.

Each further call is a step of one micro-batch on links of its own (a header per call, so the prefix may grow), sent
after the first calls of the step: the other stages run ahead through those as usual, so an evaluation step that
never calls twice costs one ``done`` message per link more than before. The calls of a micro-batch run one after
another through the stages (the next call's input needs the last stage's output), so while a micro-batch decodes,
one stage computes at a time.

A further call may also be a decoding call (:meth:`CallRelay.decode`): the last stage relays the call itself, and every
stage then runs it in rounds, keeping its caches (:mod:`~lightning_gpipe.engine.decoding`).

A control message is a packed object (:mod:`~lightning_gpipe.engine.framing`, a ``MESSAGE_BYTES`` head and a tail when
longer): ``("call", value)`` or ``("decode", decoding)`` with their tensors on the CPU, or ``("done", None)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from lightning_gpipe.engine.collectives import portable, to_device
from lightning_gpipe.engine.decoding import Decoding, decode
from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.framing import MESSAGE_BYTES, pack, unpack
from lightning_gpipe.engine.microbatch import Microbatch
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.step import StepRun

__all__ = ["CallRelay"]

_CALL = Microbatch(0, None, 1, 1.0)  # a further call is an evaluation step of one micro-batch


class CallRelay:
    """The further calls of one stage: the last stage asks for them (:meth:`call`), the others :meth:`serve` them.

    Args:
        stage: the stage whose first calls the step runs; its cell, transport, timeline and anomaly checks are shared.
        compute_guard: entered around the cell's computation (the in-process runner's random-stream scope).
        chunks: how many micro-batches a decoding call's sequences are split into (the pipeline's ``chunks``).
    """

    def __init__(
        self,
        stage: Stage,
        compute_guard: Callable[[], AbstractContextManager[Any]] | None = None,
        chunks: int | None = None,
    ) -> None:
        self.stage = stage
        self.chunks = chunks or stage.config.chunks or 1
        # A stage of its own for the further calls, each run as a step (StepRun): its links keep a step's state
        # (header, posted receives) apart from the first calls' links, whose receives may still be posted.
        self._calls = Stage(
            stage.cell,
            stage.transport,
            dataclasses.replace(stage.config, checkpoint="never"),
            timeline=stage.timeline,
            compute_guard=compute_guard,
        )
        self.count = 0  # further calls in the current step

    # --- last stage

    def call(self, index: int, value: Any) -> Any:
        """Run one further call of the sequence on ``value`` through every stage; the last stage's output.

        On the last stage only, in the step of micro-batch ``index``, after that micro-batch's first call.
        """
        if self._relayed(index, ("call", portable(value))):
            return self._run(None)
        return self._run(value)

    def decode(self, index: int, decoding: Decoding) -> Any:
        """Run the decoding call ``decoding`` on every stage (:func:`~lightning_gpipe.engine.decoding.decode`); its
        result. On the last stage only, in the step of micro-batch ``index``, after that micro-batch's first call."""
        self._relayed(index, ("decode", portable(decoding)))
        return decode(self.stage, decoding, self.chunks)

    def _relayed(self, index: int, payload: tuple[str, Any]) -> bool:
        """Check a further call of micro-batch ``index`` and send ``payload`` up the stages; whether there are any."""
        stage = self.stage
        if not stage.is_last:
            raise PipelineError(stage.index, "only the last stage drives further calls of the sequence")
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the step called the pipelined sequence a second time with gradients enabled; call it again only in "
                "evaluation"
            )
        self.count += 1
        if stage.num_stages == 1:
            return False
        if self.count == 1:
            # The previous stage sent the first calls of the whole step before this one; where receives are posted
            # only when needed (device streams), this call's would take one of theirs: post theirs first.
            stage.post_activations(after=index)
        self._send_control(payload)
        return True

    def finish(self) -> None:
        """Tell the other stages that this step asks for no further calls (last stage, once per step)."""
        if self.stage.num_stages > 1:
            self._send_control(("done", None))
            self.stage.transport.wait_sends()
        self.count = 0

    # --- other stages

    def serve(self) -> int:
        """Run the further calls the last stage asks for until it says ``done``; how many there were."""
        stage = self.stage
        if stage.is_last:
            raise PipelineError(stage.index, "the last stage drives further calls; it does not serve them")
        served = 0
        while True:
            kind, value = self._receive_control()
            if kind == "done":
                self.stage.transport.wait_sends()
                return served
            served += 1
            if kind == "decode":
                decode(stage, to_device(value, stage.transport.device), self.chunks)
            else:
                self._run(to_device(value, stage.transport.device) if stage.is_first else None)

    # --- both

    def abort(self, reason: str) -> None:
        """Drop the further calls' state after a failed step."""
        self.count = 0
        self._calls.abort(reason)

    def _run(self, value: Any) -> Any:
        # One micro-batch per call: its size only names the header's batch dimension, which nothing predicts from.
        run = StepRun(self._calls, self._calls.config.schedule, [_CALL], training=False)
        return run.forward(0, value)

    def _send_control(self, payload: tuple[str, Any]) -> None:
        """Send ``payload`` to the previous stage (this stage's own or relayed from the next)."""
        transport = self.stage.transport
        what = "the end of the step's calls" if payload[0] == "done" else "the last stage's next call of the sequence"
        head, tail = pack(payload, MESSAGE_BYTES)
        for part in (head, tail) if tail is not None else (head,):
            transport.send(part.to(transport.device), self.stage.index - 1, what)

    def _receive_control(self) -> tuple[str, Any]:
        """The next control message from the next stage, relayed on to the previous one."""
        transport, peer = self.stage.transport, self.stage.index + 1
        what = "the last stage's next call of the sequence (or its end of the step)"

        def receive(size: int) -> torch.Tensor:
            buffer = torch.empty(size, dtype=torch.uint8, device=transport.device)
            transport.recv(buffer, peer, what)
            return buffer

        kind, value = unpack(receive(MESSAGE_BYTES), receive)
        if not self.stage.is_first:
            self._send_control((kind, value))
        return kind, value
