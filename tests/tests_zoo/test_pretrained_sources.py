"""Every kind of pretrained source trains under ``GPipeStrategy`` from exactly the weights the plain model has, each
rank reading only its own stage's tensors: a Hugging Face language model in bfloat16 shards (as float32, as bfloat16,
with LoRA, with a frozen backbone, loaded under the meta device), a translator, a timm safetensors file, a zoo
checkpoint and the same checkpoint as a sharded directory. A model exported from its stages at the end of training
loads in ``transformers`` and in ``zoo.load_pretrained`` with the logits of the plainly trained model.

The library's forward is the oracle; nothing downloads (``helpers.pretrained_job`` writes every source).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.jobs import run_job
from helpers.pretrained_job import CASES, batch, fit, load, write_sources
from helpers.runif import RunIf

import zoo

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sources and, for every case, what the K = 2 run recorded and saved (``helpers.pretrained_job``)."""
    root = tmp_path_factory.mktemp("pretrained")
    write_sources(root)
    results = run_job("helpers.pretrained_job", [str(root), *CASES], 2, timeout=1100)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    return root


def _logits(model: Any, data: Any) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(data, dict):
            return model.eval()(data["input_ids"], data["attention_mask"])
        return model.eval().layers((data[0], data[1][:, :-1]))


def _library_logits(directory: Path, data: Any) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(data, dict):
            library = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
            mask = data["attention_mask"]
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            return library(data["input_ids"], attention_mask=mask, position_ids=positions).logits
        library = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
        return library(input_ids=data[0], decoder_input_ids=data[1][:, :-1]).logits


@RunIf(multiprocess=True)
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(CASES))
def test_each_source_trains_as_a_pipeline_from_the_plain_models_weights(
    pipelined: Path, tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    model = load(pipelined, case)
    provided = set(load(pipelined, case).claim_weights_reader().keys())
    start = {key: value.clone() for key, value in model.state_dict().items()}  # the first use: every weight read
    stages = [torch.load(pipelined / f"{name}-start-{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert set(stages[0]) | set(stages[1]) == set(start)
    for stage in stages:
        for key, value in stage.items():
            assert torch.equal(value, start[key]), f"{key} does not start from the plain model's value"
    for rank, stage in enumerate(stages):
        read = json.loads((pipelined / f"{name}-start-{rank}.json").read_text())
        assert read == sorted(provided & set(stage)), f"rank {rank} read other stages' tensors or missed some"

    data = batch(pipelined, case)
    fit(model, data, "auto", 1, tmp_path, [])
    trained = torch.load(pipelined / f"{name}.ckpt", weights_only=True)["state_dict"]
    assert trained.keys() == model.state_dict().keys()
    moved = [key for key, value in model.state_dict().items() if not torch.equal(value, start[key])]
    assert moved, "the steps trained nothing"
    for key, expected in model.state_dict().items():
        # The zoo Transformer's key projection bias has a zero gradient in exact arithmetic (softmax ignores a shift
        # shared by all keys): Adam turns round-off into full-size steps (tests_zoo/test_models.py).
        if case.trains_exactly and not key.endswith("key.bias"):
            difference = (trained[key].double() - expected.double()).abs().max().item()
            assert difference <= 1e-5, f"{key}: max abs difference {difference:.2e}"
        assert trained[key].dtype == expected.dtype, key
    if case.export:
        exported = pipelined / f"{name}-export"
        expected_logits = _logits(model, data)
        torch.testing.assert_close(_library_logits(exported, data), expected_logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(_logits(zoo.load_pretrained(exported), data), expected_logits, atol=1e-4, rtol=0)
        assert len(list(exported.glob("model-*.safetensors"))) >= 2, "one shard per stage at least"
    if case.export and "lora" in case.options:
        # The stages' adapters gathered on rank 0 (each rank held its own after fit), in peft's format: they used to
        # be read from the sequence's peft_config, which the cut leaves behind.
        peft = pytest.importorskip("peft")
        base = transformers.AutoModelForCausalLM.from_pretrained(
            pipelined / "sources" / case.source, dtype=torch.float32
        )
        adapted = peft.PeftModel.from_pretrained(base, pipelined / f"{name}-export-adapter").eval()
        mask = data["attention_mask"]
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        with torch.no_grad():
            logits = adapted(data["input_ids"], attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(logits, _logits(model, data), atol=1e-4, rtol=0)
