"""Collectives beside the pipeline: objects travel on the CPU and land on the receiver's device; tensors in buckets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from helpers.runif import RunIf

from lightning_gpipe.engine.collectives import (
    TensorSpec,
    broadcast_object,
    broadcast_tensors,
    buckets,
    byte_buckets,
    portable,
    receive_tensors,
    send_tensors,
    to_device,
)
from tools.launch import run_processes


@dataclass
class _Record:
    name: str
    value: torch.Tensor


def _payload(device: str) -> object:
    loss = torch.ones((), device=device, requires_grad=True) * 2
    logs = [("loss", loss, {"prog_bar": True})]
    return (logs, {"preds": [torch.zeros(3, device=device)], "n": 4}, _Record("m", loss))


def _tensors(value: object) -> list[torch.Tensor]:
    from lightning_gpipe.engine.tree import flatten

    return [leaf for leaf in flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def test_portable_payload_holds_only_detached_cpu_tensors() -> None:
    # R5: a CUDA tensor pickled into an object collective is restored on the sender's GPU; the payload must be CPU.
    sent = portable(_payload("cpu"))
    assert all(t.device.type == "cpu" and not t.requires_grad for t in _tensors(sent))
    assert sent[1]["n"] == 4  # non-tensor leaves and containers kept
    assert sent[2].name == "m"


def test_arrivals_move_to_the_local_device() -> None:
    # The meta device stands in for the receiver's GPU: what arrives from the CPU lands there, containers intact.
    arrived = to_device(portable(_payload("cpu")), torch.device("meta"))
    assert [t.device.type for t in _tensors(arrived)] == ["meta", "meta", "meta"]
    assert isinstance(arrived[2], _Record)
    assert arrived[0][0][2] == {"prog_bar": True}


def test_buckets_split_by_size_and_dtype_in_order() -> None:
    grads = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4), torch.zeros(20), torch.zeros(1)]
    split = buckets(grads, bucket_bytes=32)
    assert [[id(g) for g in bucket] for bucket in split] == [
        [id(grads[0]), id(grads[2])],  # 16 + 16 bytes fill the float32 bucket
        [id(grads[3])],  # larger than a bucket: alone
        [id(grads[4])],
        [id(grads[1])],  # float64, its own bucket
    ]


def _broadcast_from_rank_1(rank: int, world_size: int) -> list[torch.Tensor]:
    tensors = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank, dtype=torch.float64)]
    tensors.append(torch.ones(5) * rank)
    broadcast_tensors(tensors, src=1, group=dist.group.WORLD, bucket_bytes=16)
    return tensors


@RunIf(multiprocess=True)
@pytest.mark.slow  # by default the replica broadcast of test_two_stages_times_two_replicas_equals_ddp covers it
def test_broadcast_tensors_copies_the_source_rank_everywhere() -> None:
    for tensors in run_processes(_broadcast_from_rank_1, 2, timeout=300, pg_timeout=120):
        assert [torch.as_tensor(t).tolist() for t in tensors] == [[1.0] * 3, [[11.0, 11.0]] * 2, [1.0] * 5]


def _broadcast_objects_from_rank_1(rank: int, world_size: int) -> list[object]:
    small = {"loss": torch.tensor(float(rank)), "stop": rank == 1}
    large = list(range(10_000)) if rank == 1 else None  # pickled, well over OBJECT_BYTES: a second broadcast
    return [broadcast_object(value, 1, dist.group.WORLD) for value in (small, large, None)]


@RunIf(multiprocess=True)
@pytest.mark.slow  # by default every 2-rank Lightning test shares its step's logs with it
def test_broadcast_object_sends_the_source_ranks_value_small_or_large() -> None:
    for small, large, nothing in run_processes(_broadcast_objects_from_rank_1, 2, timeout=300, pg_timeout=120):
        assert float(small["loss"]) == 1.0
        assert small["stop"] is True
        assert large == list(range(10_000))
        assert nothing is None


def test_byte_buckets_pack_tensors_in_order_aligned_leaving_out_empty_ones() -> None:
    # Sizes 10, 0, 7, 40 and 3 bytes into buckets of 32: starts aligned to 16 bytes; one larger tensor alone.
    assert byte_buckets([10, 0, 7, 40, 3], bucket_bytes=32) == [[(0, 0, 10), (2, 16, 7)], [(3, 0, 40)], [(4, 0, 3)]]
    assert byte_buckets([]) == []


_SENT = [
    torch.arange(6.0).reshape(2, 3),
    torch.tensor([True, False, True]),
    torch.empty(0),
    torch.tensor(2.5, dtype=torch.float64),
    torch.arange(5, dtype=torch.bfloat16),
    torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous: sent as its values
]


def _send_a_stage_to_rank_0(rank: int, world_size: int) -> list[list[float]]:
    if rank == 1:
        send_tensors(_SENT, 0, dist.group.WORLD, bucket_bytes=32)
        return []
    received = {}
    for index, tensor in receive_tensors([TensorSpec.of(t) for t in _SENT], 1, dist.group.WORLD, bucket_bytes=32):
        received[index] = tensor.clone()  # a view into the bucket: valid until the next one arrives
    return [received[i].double().flatten().tolist() if i in received else [] for i in range(len(_SENT))]


@RunIf(multiprocess=True)
def test_a_stages_tensors_arrive_whole_of_every_dtype_and_shape_one_bucket_at_a_time() -> None:
    received, _ = run_processes(_send_a_stage_to_rank_0, 2, timeout=300, pg_timeout=120)
    assert received == [t.double().flatten().tolist() for t in _SENT]
