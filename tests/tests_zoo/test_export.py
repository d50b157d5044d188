"""``export_pretrained`` at size: what ``save_pretrained`` writes, written a group of layers at a time, from a model in
memory, from one whose weights wait in a checkpoint (a sharded one included: ``python -m zoo export``), and never over
a directory that is not an export. Exports from pipeline stages: tests_zoo/test_pretrained_sources.py.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import zoo

transformers = pytest.importorskip("transformers")

from zoo.hf.causal_lm_tiny import save_tiny_causal_lm  # noqa: E402
from zoo.hf.tiny import save_tiny_translation_model  # noqa: E402

TEXTS = ["the cat sat on the mat.", "a dog runs in the park.", "hello world, this is a small test."]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2", "marian", "m2m_100"])
def source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of each kind: untied, tied, GPT-2's names, and two translators (Marian's position tables are
    never saved)."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param in ("marian", "m2m_100"):
        return save_tiny_translation_model(directory, TEXTS, request.param)
    return save_tiny_causal_lm(directory, request.param, init_std=0.3)


def _auto_class(directory: Path) -> Any:
    config = transformers.AutoConfig.from_pretrained(directory)
    return transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM


def _logits(directory: Path) -> torch.Tensor:
    model = _auto_class(directory).from_pretrained(directory).eval()
    ids = torch.randint(3, model.config.vocab_size - 1, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
        return model(ids).logits


def _weight_names(directory: Path) -> set[str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def test_the_export_writes_what_save_pretrained_writes_in_shards(source: Path, tmp_path: Path) -> None:
    reference = tmp_path / "save_pretrained"
    _auto_class(source).from_pretrained(source).save_pretrained(reference)
    exported = zoo.load_pretrained(source).export_pretrained(tmp_path / "export", max_shard_size="20KB")
    assert len(list(exported.glob("model-*-of-*.safetensors"))) > 1
    assert _weight_names(exported) == _weight_names(reference)  # a tied tensor once, under the name kept
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == json.loads((reference / "config.json").read_text())["architectures"]
    assert config["dtype"] == "float32"
    torch.testing.assert_close(_logits(exported), _logits(source), atol=1e-5, rtol=0)
    assert not list(tmp_path.glob(".*")), "no staging directory is left behind"
    again = zoo.load_pretrained(exported).load_weights()  # and the zoo reads it back: every weight as exported
    for key, value in zoo.load_pretrained(source).state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_pending_weights_are_exported_one_group_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The model is never read whole: each group of layers (at most max_shard_size bytes) is read, written, released.
    source = save_tiny_causal_lm(tmp_path / "source", "llama", init_std=0.3, layers=4)
    model = zoo.load_pretrained(source)
    held: dict[str, int] = {}
    peak = [0]
    read_pending, release = type(model).read_pending, type(model).release

    def reading(self: Any, module: Any, prefix: str) -> list[str]:
        keys = read_pending(self, module, prefix)
        for key in keys:
            tensor = module.get_parameter(key[len(prefix) :])
            held[key] = tensor.nelement() * tensor.element_size()
        peak[0] = max(peak[0], sum(held.values()))
        return keys

    def releasing(self: Any, module: Any, keys: Any, prefix: str) -> None:
        release(self, module, keys, prefix)
        for key in keys:
            del held[key]

    monkeypatch.setattr(type(model), "read_pending", reading)
    monkeypatch.setattr(type(model), "release", releasing)
    whole = sum(p.nelement() * p.element_size() for p in model.parameters())
    exported = model.export_pretrained(tmp_path / "export", max_shard_size=whole // 4)
    assert 0 < peak[0] <= whole // 4 + max(p.nelement() * 4 for p in model.parameters())  # a layer may exceed it
    assert held == {}
    assert model.weights_pending, "the export read and released; the model still waits"
    assert all(p.is_meta for p in model.parameters())
    torch.testing.assert_close(_logits(exported), _logits(source), atol=1e-5, rtol=0)


def _lora_checkpoint(source: Path, path: Path) -> zoo.PretrainedCausalLM:
    """A zoo checkpoint of a language model with trained (non-zero) LoRA adapters."""
    torch.manual_seed(0)
    model = zoo.load_pretrained(source, lora={"r": 4, "lora_alpha": 8}).load_weights()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return model


def test_python_m_zoo_export_streams_a_sharded_checkpoint_to_the_hugging_face_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint as dcp

    source = save_tiny_causal_lm(tmp_path / "source", "qwen2", TEXTS, init_std=0.3)
    model = _lora_checkpoint(source, tmp_path / "model.ckpt")
    checkpoint = torch.load(tmp_path / "model.ckpt", weights_only=True)
    sharded = tmp_path / "sharded"  # Lightning's layout: DCP tensors under model.<key>, the rest in meta.pt
    dcp.save({"model": checkpoint.pop("state_dict")}, checkpoint_id=sharded, no_dist=True)
    torch.save(checkpoint, sharded / "meta.pt")
    out = tmp_path / "export"
    arguments = ["zoo", "export", str(sharded), str(out), "--max-shard-size", "30000"]
    monkeypatch.setattr(sys, "argv", arguments)
    runpy.run_module("zoo", run_name="__main__")  # python -m zoo export ..., in this process
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    library = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():  # the adapters merged: the adapted model's logits
        torch.testing.assert_close(library(ids).logits, model.eval()(ids), atol=1e-4, rtol=0)
        torch.testing.assert_close(zoo.load_pretrained(out).eval()(ids), model(ids), atol=1e-4, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(out)("the cat")["input_ids"], "the source's tokenizer went too"


def test_a_checkpoint_of_another_kind_of_model_is_refused_by_the_export_command(tmp_path: Path) -> None:
    from helpers.zoo_tiny import tiny_model

    from zoo.export import export_checkpoint

    model = tiny_model("transformer_lm")
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    with pytest.raises(ValueError, match=r"holds a 'transformer_lm' model, which has no Hugging Face format to export"):
        export_checkpoint(tmp_path / "lm.ckpt", tmp_path / "out")


def test_an_export_replaces_an_export_whole_and_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zoo.hf.export

    source = save_tiny_causal_lm(tmp_path / "source", "llama", init_std=0.3)
    model = zoo.load_pretrained(source).load_weights()
    out = model.export_pretrained(tmp_path / "export")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with torch.no_grad():
        model.layers[1].layer.mlp.up_proj.weight.add_(1.0)
    calls = [0]
    write = zoo.hf.export._write_shard

    def failing(*args: Any) -> Any:  # the second shard fails to write: a full disk, a lost mount
        calls[0] += 1
        if calls[0] == 2:
            raise OSError("No space left on device")
        return write(*args)

    monkeypatch.setattr(zoo.hf.export, "_write_shard", failing)
    with pytest.raises(OSError, match="No space left on device"):
        model.export_pretrained(out, max_shard_size="20KB")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before, "the previous export is whole"
    assert not list(tmp_path.glob(".export.*")), "nor is the failed one's staging directory left behind"
    monkeypatch.undo()
    model.export_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists(), "the previous export's files went with it"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"'.*notes' exists and is not a model directory \(no config.json\)"):
        model.export_pretrained(tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
