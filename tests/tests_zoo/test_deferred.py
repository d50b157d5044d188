"""Pretrained weights that wait: ``zoo.load_pretrained`` reads no weight, the first use outside a pipeline reads them
all, a pipeline strategy claims them; the readers of each checkpoint format read exactly the tensors asked for.

Nothing downloads: models are tiny, random, and saved in their libraries' real formats.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import zoo
from zoo.weights import CheckpointReader, DistributedCheckpoint, SafetensorsFiles, TorchFile

transformers = pytest.importorskip("transformers")

from zoo.hf.causal_lm_tiny import save_tiny_causal_lm, tiny_causal_config  # noqa: E402


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (tied embedding) saved in bfloat16 in three shards, as hub checkpoints ship."""
    directory = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_causal_config("qwen2"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="12KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys of every read of every checkpoint reader, one list per read."""
    calls: list[list[str]] = []
    original = CheckpointReader.read_into

    def read_into(self: CheckpointReader, tensors: Any) -> None:
        calls.append(list(tensors))
        original(self, tensors)

    monkeypatch.setattr(CheckpointReader, "read_into", read_into)
    return calls


def library(directory: Path) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def ids() -> torch.Tensor:
    return torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))


def test_loading_reads_no_weight_and_says_when_they_will_be(qwen2: Path, reads: list[list[str]]) -> None:
    model = zoo.load_pretrained(qwen2)
    assert reads == []
    assert model.weights_pending
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.layers[0].rotary.inv_freq.device.type == "cpu", "what the model computes for itself is computed"
    assert f"weights: read on first use from '{qwen2}" in repr(model)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in library(qwen2).parameters())
    model.load_weights()
    assert len(reads) == 1
    assert not model.weights_pending
    assert "read on first use" not in repr(model)


FIRST_USES: dict[str, Callable[[Any], Any]] = {
    "forward": lambda model: model(ids()),
    "the layers": lambda model: model.layers((ids(), torch.ones_like(ids()))),
    "one layer": lambda model: model.layers[0](ids()),
    "state_dict": lambda model: model.state_dict(),
    "load_state_dict": lambda model: model.load_state_dict(library_state(model), strict=False),
    ".to()": lambda model: model.to(torch.float64),
    ".float()": lambda model: model.float(),
    "generate": lambda model: model.generate(ids(), max_new_tokens=2),
    "configure_model": lambda model: model.configure_model(),
}


def library_state(model: Any) -> dict[str, torch.Tensor]:
    return {"layers.3.norm.weight": torch.full_like(model.layers[3].norm.weight, 2.0, device="cpu")}


@pytest.mark.parametrize("use", list(FIRST_USES))
def test_the_first_use_outside_a_pipeline_reads_every_weight(qwen2: Path, use: str) -> None:
    model = zoo.load_pretrained(qwen2)
    FIRST_USES[use](model)
    assert not model.weights_pending
    expected = library(qwen2)
    if use == "load_state_dict":  # the read weights, then the given ones over them
        assert torch.equal(model.layers[3].norm.weight, torch.full_like(model.layers[3].norm.weight, 2.0))
        assert torch.equal(model.layers[2].layer.mlp.up_proj.weight, expected.model.layers[1].mlp.up_proj.weight)
        return
    torch.testing.assert_close(model.to(torch.float32).eval()(ids()), expected(ids()).logits, atol=1e-4, rtol=0)


def test_a_trainer_of_another_strategy_reads_the_weights_in_configure_model(qwen2: Path) -> None:
    model = zoo.load_pretrained(qwen2, lr=1e-3)
    batch = {"input_ids": ids(), "labels": ids()}
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader([batch], batch_size=None))
    assert not model.weights_pending
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_an_optimizer_built_before_the_read_holds_the_read_parameters(qwen2: Path) -> None:
    model = zoo.load_pretrained(qwen2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tied = model.layers[0].tokens.weight
    model.load_weights()
    assert model.layers[0].tokens.weight is tied is model.layers[-1].lm_head.weight
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert all(p.device.type == "cpu" for p in optimizer.param_groups[0]["params"])


def test_a_claimed_reader_is_left_to_the_claimer(qwen2: Path, reads: list[list[str]]) -> None:
    model = zoo.load_pretrained(qwen2)
    reader = model.claim_weights_reader()
    assert isinstance(reader, CheckpointReader)
    assert not model.weights_pending
    assert model.claim_weights_reader() is None
    assert all(not module._forward_pre_hooks for module in [model, model.layers, *model.layers])
    assert {"layers.0.tokens.weight", "layers.4.lm_head.weight"} <= set(reader.keys())
    target = torch.empty(tuple(model.layers[3].norm.weight.shape))
    reader.read_into({"layers.3.norm.weight": target})
    assert reads == [["layers.3.norm.weight"]]
    assert torch.equal(target, library(qwen2).model.norm.weight.detach())


def test_a_pending_model_pickles_and_copies_with_its_reader(qwen2: Path) -> None:
    # The spawn and fork launchers send the user's model to the ranks: each then reads (or claims) on its own.
    model = zoo.load_pretrained(qwen2)
    for copy in (pickle.loads(pickle.dumps(model)), __import__("copy").deepcopy(model)):
        assert copy.weights_pending
        torch.testing.assert_close(copy.eval()(ids()), library(qwen2)(ids()).logits, atol=1e-4, rtol=0)
    assert model.weights_pending


def test_weights_convert_to_the_asked_dtype_as_they_are_read(qwen2: Path) -> None:
    stored = library(qwen2).model.layers[0].mlp.up_proj.weight.detach()  # bfloat16 values, widened
    for dtype, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("auto", torch.bfloat16)):
        model = zoo.load_pretrained(qwen2, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {expected}
        assert torch.equal(model.load_weights().layers[1].layer.mlp.up_proj.weight.float(), stored)


def test_lora_adapters_start_as_peft_starts_them_beside_pending_weights(qwen2: Path) -> None:
    torch.manual_seed(0)
    model = zoo.load_pretrained(qwen2, lora={"r": 4, "lora_alpha": 8})
    adapters = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert adapters
    assert all(not p.is_meta for p in adapters.values()), "no file holds them: made at load"
    assert all(torch.count_nonzero(p) == 0 for name, p in adapters.items() if "lora_B" in name)
    assert all(p.abs().sum() > 0 for name, p in adapters.items() if "lora_A" in name)
    assert model.weights_pending
    assert model.layers[1].layer.self_attn.q_proj.base_layer.weight.is_meta
    torch.testing.assert_close(model.eval()(ids()), library(qwen2)(ids()).logits, atol=1e-4, rtol=0)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == list(adapters)


def test_freeze_backbone_holds_through_the_read(qwen2: Path) -> None:
    model = zoo.load_pretrained(qwen2, freeze_backbone=True).load_weights()
    trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert trained == {"layers.0.tokens.weight", "layers.3.norm.weight", "layers.4.lm_head.weight"}


def test_meta_device_building_keeps_working(qwen2: Path) -> None:
    config = zoo.load_pretrained(qwen2).hparams["config"]
    with torch.device("meta"):
        sized = zoo.PretrainedCausalLM("unused", config=config, pretrained=False)  # reads nothing at all
        pending = zoo.load_pretrained(qwen2)  # the same as outside: pending, its computed buffers real
    assert {p.device.type for p in sized.parameters()} == {"meta"}
    assert not sized.weights_pending
    assert pending.weights_pending
    assert pending.layers[0].rotary.inv_freq.device.type == "cpu"
    torch.testing.assert_close(pending.eval()(ids()), library(qwen2)(ids()).logits, atol=1e-4, rtol=0)


def test_a_model_refused_for_its_structure_is_refused_before_its_weights_are_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The structure was checked on the library model from_pretrained returned, every weight read (a new user's
    # fourth trial: GPT-NeoX, Falcon, Phi-2, Mamba, BERT). It is now checked on the meta build: here the weights
    # file is not even there, and the refusal names the structure.
    config = transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    opened: list[str] = []
    monkeypatch.setattr(SafetensorsFiles, "__init__", lambda self, *args, **kwargs: opened.append(str(args)))
    with pytest.raises(ValueError, match=r"is a 'gpt_neox' model made of \['gpt_neox', 'lm_head'\] and \[\]; "):
        zoo.load_pretrained(tmp_path)
    assert opened == []


def test_a_checkpoint_of_another_shape_is_refused_before_a_weight_is_read(
    qwen2: Path, tmp_path: Path, reads: list[list[str]]
) -> None:
    wider = save_tiny_causal_lm(tmp_path / "wider", "qwen2", hidden_size=48)
    config = transformers.AutoConfig.from_pretrained(qwen2)
    config.save_pretrained(wider)  # the config of one model beside the weights of another
    with pytest.raises(ValueError, match=r"does not fit the model: shapes \(checkpoint vs model\) layers.0.tokens"):
        zoo.load_pretrained(wider)
    assert reads == []


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 3, generator=generator).to(torch.bfloat16),
        "b.bias": torch.randn(5, generator=generator),
        "steps": torch.tensor(7),
    }


def _check_partial_reads(files: Any, state: dict[str, torch.Tensor]) -> None:
    assert files.entries["a.weight"].shape == (4, 3)
    assert files.entries["a.weight"].dtype == torch.bfloat16
    target = torch.empty(4, 3, dtype=torch.float64)
    files.read_into({"a.weight": target})
    assert torch.equal(target, state["a.weight"].double())
    with pytest.raises(ValueError, match=r"'b.bias' in .* has shape \(5,\), the model \(6,\): the file holds another"):
        files.read_into({"b.bias": torch.empty(6)})


def test_each_format_reads_the_tensors_asked_for_converted(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    state = _state()
    save_file(state, tmp_path / "model.safetensors")
    _check_partial_reads(SafetensorsFiles(tmp_path / "model.safetensors"), state)
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "model.ckpt")
    _check_partial_reads(TorchFile(tmp_path / "model.ckpt", "state_dict"), state)
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # cannot be memory-mapped
    _check_partial_reads(TorchFile(tmp_path / "legacy.pt"), state)
    dcp.save({"model": state, "optimizer_0": {"x": torch.ones(2)}}, checkpoint_id=tmp_path / "sharded", no_dist=True)
    files = DistributedCheckpoint(tmp_path / "sharded")
    assert set(files.entries) == set(state)  # the model's tensors, by their state-dict names
    _check_partial_reads(files, state)
