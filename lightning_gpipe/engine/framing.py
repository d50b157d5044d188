"""The one wire format of objects between ranks: a pickled value, length first, in a buffer of fixed size.

A receiver must post a buffer of the message's exact size before it knows what the message holds, so every object
travels in a buffer whose size both sides know: its *head*, of ``size`` bytes, holds the payload's length
(:data:`LENGTH_BYTES`, little endian) and then as much of the pickled payload as fits; when the payload is longer, the
rest follows as a second message, its *tail*, whose size the head gave. A step header, a control area of a frame, a
relayed call, a decoding round's control and a broadcast object all travel so (:mod:`.boundary`, :mod:`.relay`,
:mod:`.decoding`, :mod:`.collectives`); they differ only in ``size``.

Pickle is only ever exchanged between the ranks of one job, which already trust each other with their code.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LENGTH_BYTES", "MESSAGE_BYTES", "pack", "room", "unpack"]

LENGTH_BYTES = 8
"""The payload's length at the start of every head: an unsigned little-endian integer of this many bytes."""
MESSAGE_BYTES = 1024
"""The head of a header or control message: a step's layout, a relayed call, a decoding round's tokens."""


def room(size: int) -> int:
    """How many bytes of payload a head of ``size`` bytes holds."""
    return size - LENGTH_BYTES


def pack(value: Any, size: int = MESSAGE_BYTES) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``value`` pickled into a head of ``size`` bytes and a tail with what did not fit (``None`` when it all fits),
    both uint8 CPU tensors."""
    data = pickle.dumps(value)
    head = bytearray(size)
    content = len(data).to_bytes(LENGTH_BYTES, "little") + data[: room(size)]
    head[: len(content)] = content
    rest = data[room(size) :]
    tail = torch.frombuffer(bytearray(rest), dtype=torch.uint8) if rest else None
    return torch.frombuffer(head, dtype=torch.uint8), tail


def unpack(head: torch.Tensor, receive_tail: Callable[[int], torch.Tensor] | None = None) -> Any:
    """The value :func:`pack` put in ``head``; ``receive_tail(n)`` gives the ``n`` bytes of its tail if there is one.

    Raises:
        ValueError: the payload did not fit and no ``receive_tail`` was given.
    """
    raw = head.cpu().numpy().tobytes()
    length = int.from_bytes(raw[:LENGTH_BYTES], "little")
    data = raw[LENGTH_BYTES : LENGTH_BYTES + min(length, room(len(raw)))]
    if length > room(len(raw)):
        if receive_tail is None:
            raise ValueError(f"a packed payload of {length} bytes overflows its {len(raw)}-byte head, and has no tail")
        data += receive_tail(length - room(len(raw))).cpu().numpy().tobytes()
    return pickle.loads(data)
