"""A torch.save file written and read one tensor at a time, in place: what torch.load reads back is what was meant."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from pathlib import Path

import pytest
import torch

from lightning_gpipe.engine.collectives import TensorSpec
from lightning_gpipe.full_checkpoint import WholeCheckpoint, stage_part, stage_specs
from lightning_gpipe.partition.state_dict import ModelNames
from lightning_gpipe.torch_file import TensorFile, placeholder, tensor_leaves, write_layout


def _value() -> dict[str, object]:
    base = torch.arange(20.0)
    return {
        "state_dict": OrderedDict(weight=torch.randn(3, 4), step=torch.tensor(3), empty=torch.empty(0)),
        "bf16": torch.randn(2, 7).to(torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "groups": [{"lr": 0.1, "params": ["weight"]}],
        "view": base[5:9],  # a view: its storage is saved whole
        "epoch": 2,
    }


def test_a_layout_filled_in_place_reads_back_as_torch_save_would_write_it(tmp_path: Path) -> None:
    value = _value()
    path = tmp_path / "file.pt"
    layout = {**value, "bf16": placeholder(TensorSpec.of(value["bf16"]))}  # one tensor not here yet
    write_layout(layout, path)
    with TensorFile(path, writable=True) as file:
        for meant, mapped in zip(tensor_leaves(value), tensor_leaves(file.value), strict=True):
            if mapped.is_contiguous():
                file.write(mapped, meant)
        file.close(sync=True)
    loaded = torch.load(path, weights_only=True)
    assert loaded["epoch"] == 2
    assert loaded["groups"] == value["groups"]
    for meant, got in zip(tensor_leaves(value), tensor_leaves(loaded), strict=True):
        assert got.dtype == meant.dtype
        assert torch.equal(got, meant)


def test_a_placeholder_has_no_memory_and_the_layout_reserves_its_space(tmp_path: Path) -> None:
    huge = placeholder(TensorSpec((2**30,), torch.float32))  # 4 GiB that are never allocated
    write_layout({"huge": huge}, tmp_path / "layout.pt")
    assert (tmp_path / "layout.pt").stat().st_size > 2**32
    assert (tmp_path / "layout.pt").stat().st_blocks * 512 < 2**20  # a sparse file: nothing written yet


def test_reading_one_tensor_copies_it_from_a_plain_torch_save_file(tmp_path: Path) -> None:
    value = _value()
    torch.save(value, tmp_path / "plain.pt")
    with TensorFile(tmp_path / "plain.pt") as file:
        weight = file.value["state_dict"]["weight"]
        into = torch.empty(3, 4)
        assert file.read(weight, into) is not None
        assert torch.equal(into, value["state_dict"]["weight"])
        copy = file.read(file.value["bf16"])
        assert torch.equal(copy, value["bf16"])
        assert copy.untyped_storage().data_ptr() != file.value["bf16"].untyped_storage().data_ptr()  # fresh memory


def test_a_truncated_file_is_reported(tmp_path: Path) -> None:
    torch.save({"weight": torch.randn(1000)}, tmp_path / "file.pt")
    file = TensorFile(tmp_path / "file.pt")
    with open(tmp_path / "file.pt", "r+b") as handle:
        handle.truncate(1024)  # after the mapping was made: the read comes up short
    with pytest.raises(OSError, match=r"file.pt ends \d+ bytes early: the file is truncated"):
        file.read(file.value["weight"])
    file.close()


def test_the_whole_checkpoint_merges_every_stages_part_in_the_models_order(tmp_path: Path) -> None:
    order = ["a.weight", "b.weight", "c.weight"]
    names = ModelNames(keys=order, shapes={}, parameter_order=order, aliases={})

    def part(keys: list[str]) -> dict[str, object]:
        state = {key: torch.full((2,), float(order.index(key))) for key in keys}
        groups = [{"lr": 0.1, "params": keys}]
        adam = {key: {"exp_avg": state[key] * 10, "step": torch.tensor(1.0)} for key in keys}
        return {"state_dict": state, "optimizer_states": [{"state": adam, "param_groups": groups}]}

    mine, theirs = part(["b.weight", "c.weight"]), part(["a.weight"])
    checkpoint = {**mine, "loops": defaultdict(int, {"step": 1})}  # torch.save takes what weights_only refuses
    whole = WholeCheckpoint(checkpoint, [None, stage_specs(theirs)], 0, names)
    sent = tensor_leaves(stage_part(theirs))
    whole.write(tmp_path / "whole.pt", lambda process, specs: enumerate(sent))
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert loaded["loops"].default_factory is int
    assert list(loaded["state_dict"]) == order
    assert [float(t[0]) for t in loaded["state_dict"].values()] == [0.0, 1.0, 2.0]
    (optimizer,) = loaded["optimizer_states"]
    assert optimizer["param_groups"][0]["params"] == order
    assert float(optimizer["state"]["a.weight"]["exp_avg"][0]) == 0.0
    assert float(optimizer["state"]["c.weight"]["exp_avg"][0]) == 20.0
    materialized = WholeCheckpoint(checkpoint, [None, stage_specs(theirs)], 0, names).materialize(
        lambda process, specs: enumerate(sent)
    )
    assert torch.equal(materialized["state_dict"]["a.weight"], theirs["state_dict"]["a.weight"])  # type: ignore[index]
