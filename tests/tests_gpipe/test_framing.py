"""The one wire format of objects between ranks: a fixed-size head, the overflow in a tail."""

from __future__ import annotations

import pytest
import torch

from lightning_gpipe.engine.framing import LENGTH_BYTES, pack, room, unpack


@pytest.mark.parametrize("value", [None, ("call", {"x": [1, 2, 3]}), ("done", None), {"missing": []}])
def test_a_value_that_fits_travels_in_its_head_alone(value: object) -> None:
    head, tail = pack(value, 128)
    assert head.dtype == torch.uint8
    assert head.shape == (128,)
    assert tail is None
    assert unpack(head) == value


def test_a_longer_value_overflows_into_a_tail_of_the_size_the_head_gives() -> None:
    value = ("call", torch.arange(500))
    head, tail = pack(value, 64)
    assert tail is not None
    asked: list[int] = []

    def receive(size: int) -> torch.Tensor:
        asked.append(size)
        return tail

    kind, tensor = unpack(head, receive)
    assert kind == "call"
    assert torch.equal(tensor, torch.arange(500))
    assert asked == [tail.numel()]
    assert int.from_bytes(head[:LENGTH_BYTES].numpy().tobytes(), "little") == room(64) + tail.numel()


def test_an_overflowing_head_without_a_tail_is_refused() -> None:
    head, _tail = pack(list(range(100)), 32)
    with pytest.raises(ValueError, match="overflows its 32-byte head, and has no tail"):
        unpack(head)
