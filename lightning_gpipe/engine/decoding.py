"""Decoding rounds: one decoding call run by every stage in rounds, micro-batches in flight, each stage keeping a cache.

Legend: K stages, M micro-batches (index ``m``), a *round* ``r`` of a micro-batch runs its next token(s) through every
stage (round 0 reads the prompt).

A decoding call (a :class:`Decoding`, which the model's own code gives: the engine knows no model) is split by rows
into M micro-batches, each a :class:`DecodingPart` on every stage, which owns that micro-batch's rows of the stage's
key/value cache for the whole call. Every stage runs the same loop over a queue of micro-batches: take the next one,
run its round, put it back unless it is finished. So a stage works on micro-batch ``m`` while the next stage works on
``m - 1``: with M >= K every stage is busy, as in a pipeline's forward passes (the rounds of one micro-batch follow
one another, since round ``r + 1`` feeds the tokens that round ``r`` chose).

What crosses the links:

- down (stage ``j`` to ``j + 1``), per round of a micro-batch: the stage's output for it (the hidden state of its new
  token(s)), as one frame (:mod:`~lightning_gpipe.engine.frame`). The first two rounds of a micro-batch come with a
  header describing the layout (round 0 reads the prompt, round 1 one token); from round 2 on a micro-batch keeps the
  layout of its previous round (a stage that sends masks growing with the cache must rebuild them on the receiving
  stage instead), so each round is one message whose receive is posted before it is sent.
- up (stage ``j + 1`` to ``j``), per round of a micro-batch: the *control* the last stage computed from its output
  (:meth:`DecodingPart.choose`: the token ids it chose, for beam search the beams' parents; never logits) and whether
  the micro-batch is finished, relayed stage by stage to stage 0, which feeds the tokens to the next round.

Every stage applies each control (:meth:`DecodingPart.follow`: a beam search reorders the cache) before its next
round of that micro-batch, and stops a micro-batch when its control says it is finished: the stages agree on every
round without a message that is not sent. Each link carries its messages in the order of the queue, the same on every
stage, and every receive is posted in that order as soon as the message is known to come: a stage posts its next
round's receive when it learns that the micro-batch goes on, and the receive of a round's control when it sends that
round's output.

Before the first round the stages agree that the call fits: each one asks the decoding how many bytes its caches will
hold (:meth:`Decoding.cache_bytes`) and compares that with its device's free memory; a verdict travels down the
stages and back up, so that a call that would not fit fails on every rank, naming the stage, before any round.

A stage between two others (K > 2) relays a control as soon as it is likely there, which the transport cannot test:
once the stage has sent as many later outputs as there are stages after it (each takes about a round of its own to
pass a micro-batch on), rather than when its own next round of that micro-batch is due, when the stage before it
would have to wait for it. With K = 2 there is nothing to relay, every receive is posted ahead and both stages stay
busy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.frame import Frame, Layout, describe
from lightning_gpipe.engine.framing import MESSAGE_BYTES, pack, unpack
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.transport import Transport

__all__ = ["Decoding", "DecodingPart", "decode", "free_bytes"]

_OUTPUT_HEADERS = 2  # a micro-batch's first two outputs carry their layout: the prompt's round and the first token's
_CONTROL_HEADERS = 1  # its controls keep their layout from the first on


class DecodingPart(Protocol):
    """One micro-batch of a decoding call on one stage: its rows of the stage's caches, and its rows' progress."""

    def first(self) -> Any:
        """On stage 0: the input of round 0 (the prompt)."""

    def next(self) -> Any:
        """On stage 0: the input of the next round, from the controls followed so far (the tokens last chosen)."""

    def run(self, cell: nn.Module, value: Any) -> Any:
        """This stage's layers ``cell`` on ``value`` (its input for the round), with this micro-batch's cache."""

    def choose(self, output: Any) -> tuple[Any, bool]:
        """On the last stage: the round's control from ``output`` (tensors: the tokens chosen, ...), and whether the
        micro-batch is finished."""

    def follow(self, control: Any) -> None:
        """On every stage, in round order: take in a round's control (the tokens chosen; a cache reordered)."""

    def result(self) -> Any:
        """On the last stage, once finished: the micro-batch's decoded sequences."""


class Decoding(Protocol):
    """A decoding call, as a model's decoding code describes it to the stages: the same on every stage.

    ``rows`` sequences (prompts, sources) are split into micro-batches of consecutive rows, each one
    :meth:`part`; the last stage :meth:`join` s the parts' results.
    """

    rows: int

    def part(self, rows: slice) -> DecodingPart:
        """The micro-batch of the call's sequences ``rows`` on this stage."""

    def join(self, results: list[Any]) -> Any:
        """On the last stage: the call's result from the micro-batches' (in order of their rows)."""

    def cache_bytes(self, cell: nn.Module, rows: int) -> int:
        """The most bytes the caches of ``cell`` (a stage's layers) hold during the call for ``rows`` sequences."""


def decode(stage: Stage, decoding: Decoding, chunks: int) -> Any:
    """Run ``decoding`` on ``stage`` with the other stages of its pipeline; its result on the last stage, else None.

    The sequences are split into ``min(chunks, decoding.rows)`` micro-batches, decoded in flight (see the module).
    Every stage of the pipeline calls it with the same ``decoding`` and ``chunks``; the caller holds no gradient graph.

    Raises:
        ValueError: the caches would not fit a stage's free memory (on every stage, naming that stage).
    """
    rounds = _Rounds(stage, decoding, chunks)
    with torch.no_grad():
        try:
            verdict = rounds.agree_fits()
            if verdict is None:
                return rounds.run()
        except BaseException as error:
            stage.abort(repr(error), stranded=rounds.posted)
            raise
    raise ValueError(verdict)  # on every stage alike, before any round: nothing to abort


@dataclass
class _Slot:
    """One message a peer will send: micro-batch ``m``'s next value, its layout known (predicted) or to be read from a
    header; its posted receives."""

    m: int
    layout: Layout | None
    header: tuple[torch.Tensor, Callable[[], None]] | None = None
    frame: tuple[torch.Tensor, Callable[[], None] | None] | None = None


@dataclass
class _Incoming:
    """The messages a peer sends on one link during a decoding call, received in the order it sends them.

    :meth:`expect` is called in that order, once a message is known to come; receives are posted at once as far as
    their sizes are known (a header's frame only once the header is in), or, on a transport that does not post ahead
    (device streams), each when it is received.
    """

    transport: Transport
    peer: int
    headers: int  # how many of a micro-batch's first messages come with a header
    what: str
    slots: deque[_Slot] = field(default_factory=deque)
    layouts: dict[int, Layout] = field(default_factory=dict)  # each micro-batch's last layout
    counts: dict[int, int] = field(default_factory=dict)

    def expect(self, m: int) -> None:
        """Micro-batch ``m``'s next message will come, after every message expected so far."""
        count = self.counts.get(m, 0)
        self.counts[m] = count + 1
        self.slots.append(_Slot(m, self.layouts[m] if count >= self.headers else None))
        if self.transport.posts_ahead:
            self._post()

    def _post(self, first_only: bool = False) -> None:
        for slot in list(self.slots)[:1] if first_only else self.slots:
            if slot.header is None and slot.layout is None:
                slot.header = self._post_recv(MESSAGE_BYTES, slot.m)
            if slot.layout is None:
                return  # the frame's size, and so every later receive, waits for the header
            if slot.frame is None:
                nbytes = Frame.of(slot.layout[1], control=False).nbytes
                slot.frame = (
                    (torch.empty(0, dtype=torch.uint8), None) if nbytes == 0 else self._post_recv(nbytes, slot.m)
                )

    def _post_recv(self, nbytes: int, m: int) -> tuple[torch.Tensor, Callable[[], None]]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.transport.device)
        return buffer, self.transport.post_recv(buffer, self.peer, f"{self.what} of micro-batch {m}")

    def receive(self, m: int) -> Any:
        """Micro-batch ``m``'s next value, the first one expected."""
        slot = self.slots[0]
        assert slot.m == m, f"expected micro-batch {slot.m}'s message, not {m}'s"
        ahead = self.transport.posts_ahead
        self._post(first_only=not ahead)
        if slot.layout is None:
            assert slot.header is not None
            buffer, wait = slot.header
            wait()
            slot.layout = unpack(buffer, lambda size: self._tail(size, m))
            self._post(first_only=not ahead)
        assert slot.layout is not None
        assert slot.frame is not None
        buffer, frame_wait = slot.frame
        if frame_wait is not None:
            frame_wait()
        self.slots.popleft()
        self.layouts[m] = slot.layout
        return Frame.of(slot.layout[1], control=False).read(buffer, slot.layout)

    def _tail(self, size: int, m: int) -> torch.Tensor:
        buffer, wait = self._post_recv(size, m)
        wait()
        return buffer


@dataclass
class _Outgoing:
    """The messages this stage sends a peer on one link during a decoding call, in the order of its queue."""

    transport: Transport
    peer: int
    headers: int
    what: str
    layouts: dict[int, Layout] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def send(self, m: int, value: Any, rows: int) -> None:
        """Send micro-batch ``m``'s next ``value`` (``rows`` rows), after a header while the peer cannot predict it."""
        stage = self.transport.stage
        layout, leaves = describe(stage, value, rows)
        count = self.counts.get(m, 0)
        self.counts[m] = count + 1
        what = f"{self.what} of micro-batch {m}"
        if count < self.headers:
            head, tail = pack(layout)
            for part in (head, tail) if tail is not None else (head,):
                self.transport.send(part.to(self.transport.device), self.peer, what)
        elif layout != self.layouts[m]:
            raise PipelineError(
                stage,
                f"round {count} of micro-batch {m} sends its {self.what} in another layout than round {count - 1} "
                f"({_shapes(layout)} after {_shapes(self.layouts[m])}); build a growing value on the stage that "
                "uses it",
            )
        self.layouts[m] = layout
        frame = Frame.of(layout[1], control=False)
        if frame.nbytes:
            self.transport.send(frame.write(layout[1], leaves, self.transport.device), self.peer, what)


class _Rounds:
    """One stage's side of a decoding call: its parts, its links, and the queue of micro-batches."""

    def __init__(self, stage: Stage, decoding: Decoding, chunks: int) -> None:
        self.stage = stage
        self.decoding = decoding
        count = min(chunks, decoding.rows)
        if count < 1:
            raise ValueError(f"a decoding call of {decoding.rows} sequences has nothing to decode; give at least one")
        bounds = torch.arange(decoding.rows).tensor_split(count)  # the sizes split_batch gives a batch
        self.rows = [slice(int(part[0]), int(part[-1]) + 1) for part in bounds]
        self.parts = [decoding.part(rows) for rows in self.rows]
        transport, index = stage.transport, stage.index
        self.down_in = None if stage.is_first else _Incoming(transport, index - 1, _OUTPUT_HEADERS, "decoding output")
        self.down_out = None if stage.is_last else _Outgoing(transport, index + 1, _OUTPUT_HEADERS, "decoding output")
        self.up_in = None if stage.is_last else _Incoming(transport, index + 1, _CONTROL_HEADERS, "decoding control")
        self.up_out = None if stage.is_first else _Outgoing(transport, index - 1, _CONTROL_HEADERS, "decoding control")
        # A middle stage's outputs whose controls it awaits (in the order they come), and the controls it took early:
        # micro-batch -> whether finished. It takes one once it has sent `relay_lag` later outputs (see the module).
        self.awaited: deque[int] = deque()
        self.followed: dict[int, bool] = {}
        self.relay_lag = stage.num_stages - 1 - stage.index if not (stage.is_first or stage.is_last) else None

    @property
    def posted(self) -> bool:
        """Whether receives are left posted (after a failure: the transport cannot take them back)."""
        return any(link is not None and bool(link.slots) for link in (self.down_in, self.up_in))

    def agree_fits(self) -> str | None:
        """Why the call would not fit (the first stage's reason in stage order), the same on every stage; ``None``
        when it fits (see the module)."""
        stage, transport = self.stage, self.stage.transport
        verdict = self._fits()
        if not stage.is_first:
            verdict = _receive_object(transport, stage.index - 1, "the stages' memory verdict") or verdict
        if not stage.is_last:
            _send_object(transport, stage.index + 1, verdict, "the stages' memory verdict")
            verdict = _receive_object(transport, stage.index + 1, "the stages' memory verdict")
        if not stage.is_first:
            _send_object(transport, stage.index - 1, verdict, "the stages' memory verdict")
        transport.wait_sends()
        return verdict

    def _fits(self) -> str | None:
        """Why this stage's caches would not fit its device's free memory, or ``None``."""
        stage, rows = self.stage, self.decoding.rows
        need = self.decoding.cache_bytes(stage.cell, rows)
        free = free_bytes(stage.transport.device)
        if free is None or need <= free:
            return None
        return (
            f"decoding {rows} sequences at once needs {_gib(need)} of key/value cache on stage {stage.index}, but its "
            f"device ({stage.transport.device}) has {_gib(free)} free; decode fewer sequences at a time (a smaller "
            "batch) or fewer new tokens"
        )

    def run(self) -> Any:
        """Every round of every micro-batch on this stage; the joined result on the last stage."""
        stage, parts = self.stage, self.parts
        results: list[Any] = [None] * len(parts)
        rounds = [0] * len(parts)
        queue = deque(range(len(parts)))
        for m in queue:
            if self.down_in is not None:
                self.down_in.expect(m)
        while queue:
            m = queue.popleft()
            part = parts[m]
            if rounds[m] and not stage.is_last and self._finished(m):
                continue
            value = self._input(m, rounds[m])
            with stage.computing("forward", m):
                output = part.run(stage.cell, value)
                if stage.is_last:  # the tokens are chosen where the logits are: only they travel on
                    control, finished = part.choose(output)
            if stage.is_last:
                if self.up_out is not None:
                    self.up_out.send(m, (torch.tensor(finished), control), self._size(m))
                part.follow(control)
                if finished:
                    results[m] = part.result()
                    continue
                if self.down_in is not None:
                    self.down_in.expect(m)
            else:
                assert self.down_out is not None
                assert self.up_in is not None
                self.down_out.send(m, output, self._size(m))
                self.up_in.expect(m)
                self.awaited.append(m)
                while self.relay_lag is not None and len(self.awaited) > self.relay_lag:
                    early = self.awaited.popleft()
                    self.followed[early] = self._follow_received(early)
            rounds[m] += 1
            queue.append(m)
        stage.transport.wait_sends()
        return self.decoding.join(results) if stage.is_last else None

    def _size(self, m: int) -> int:
        rows = self.rows[m]
        return rows.stop - rows.start

    def _input(self, m: int, round_: int) -> Any:
        if self.down_in is not None:
            return self.down_in.receive(m)
        return self.parts[m].first() if round_ == 0 else self.parts[m].next()

    def _finished(self, m: int) -> bool:
        """Whether micro-batch ``m`` is finished, by its last control (taken now unless it was taken early)."""
        if m in self.followed:
            return self.followed.pop(m)
        awaited = self.awaited.popleft()
        assert awaited == m, f"micro-batch {m}'s control is not the next to come, {awaited}'s is"
        return self._follow_received(awaited)

    def _follow_received(self, m: int) -> bool:
        """Take micro-batch ``m``'s last control from the next stage (relaying it on) and follow it; whether the
        micro-batch is finished."""
        assert self.up_in is not None
        flag, control = self.up_in.receive(m)
        if self.up_out is not None:
            self.up_out.send(m, (flag, control), self._size(m))
        self.parts[m].follow(control)
        if bool(flag):
            return True
        if self.down_in is not None:
            self.down_in.expect(m)
        return False


def free_bytes(device: torch.device) -> int | None:
    """The bytes a new allocation can take on ``device``: on a GPU what the driver has free plus what torch's caching
    allocator holds unused, on the CPU the host's available memory (``MemAvailable``); ``None`` where unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _send_object(transport: Transport, peer: int, value: Any, what: str) -> None:
    head, tail = pack(value)
    for part in (head, tail) if tail is not None else (head,):
        transport.send(part.to(transport.device), peer, what)


def _receive_object(transport: Transport, peer: int, what: str) -> Any:
    def receive(size: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8, device=transport.device)
        transport.recv(buffer, peer, what)
        return buffer

    return unpack(receive(MESSAGE_BYTES), receive)


def _shapes(layout: Layout) -> str:
    return "[" + ", ".join("None" if e is None else f"{tuple(e.shape)} {e.dtype}" for e in layout[1]) + "]"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"
