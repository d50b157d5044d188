"""Pretrained weights read per stage, launched as users launch: ``model = zoo.load_pretrained(source)`` then
``fit`` under ``GPipeStrategy`` through Lightning's own launcher, where global rank 0 is the user's process and loads
the model before any Trainer exists. Each rank's resident memory and the tensors it reads are measured
(``helpers.load_job``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.jobs import launch
from helpers.runif import RunIf

import zoo

transformers = pytest.importorskip("transformers")


def _saved(directory: Path, config: Any, max_shard_size: str) -> tuple[Path, int]:
    """A model of ``config`` saved in bfloat16 as hub checkpoints ship, in shards; and its parameter count."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size=max_shard_size)
    return directory, sum(parameter.numel() for parameter in model.parameters())


def _ranks(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(world)]


def _launched(source: Path, out: Path, pipe_size: int) -> list[dict[str, Any]]:
    result, _, _ = launch("helpers.load_job", [str(source), str(out), str(pipe_size)], timeout=480)
    assert result.returncode == 0, result.stdout[-4000:]
    return _ranks(out, pipe_size)


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_no_rank_grows_by_the_whole_model_when_a_bfloat16_checkpoint_loads_as_float32(tmp_path: Path) -> None:
    # Every rank used to build the whole model with from_pretrained and convert it to float32 before the strategy
    # kept its stage: 1.56x the whole float32 model on each of both ranks here (K = 2), where now each reads and
    # converts its own stage's tensors only (0.64-0.66x: half the model, plus the setup's own allocations).
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=8000, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    source, parameters = _saved(tmp_path / "llama", config, "20MB")  # 31M parameters, four shards
    whole = 4 * parameters  # bytes of the whole model in float32
    with torch.device("meta"):  # the zoo model's own names, as each rank records the keys it holds
        shapes = zoo.PretrainedCausalLM("unused", config=config.to_dict(), pretrained=False).state_dict()
    for rank, record in enumerate(_launched(source, tmp_path / "out", 2)):
        # The balance decides the stage's size (by FLOPs the embedding's stage holds more than half): each rank grows
        # by its own stage in float32 and setup's own allocations, never by the whole model.
        stage = 4 * sum(shapes[key].numel() for key in record["held"]) / whole
        growth = record["growth"] / whole
        assert growth < min(stage + 0.25, 0.9), (
            f"rank {rank} grew by {growth:.2f}x the whole model (stage {stage:.2f}x)"
        )
        assert record["read_at_load"] == [], f"rank {rank}: zoo.load_pretrained read weights"
        assert record["load"] < 0.25 * whole, f"rank {rank}: zoo.load_pretrained took {record['load']} bytes"


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_at_four_stages_each_rank_reads_its_own_stage_and_the_tied_embedding_where_it_is_held(tmp_path: Path) -> None:
    from zoo.hf.causal_lm_tiny import tiny_causal_config

    config = tiny_causal_config("qwen2", layers=4)  # the output projection is the embedding
    source, _ = _saved(tmp_path / "qwen2", config, "8KB")
    records = _launched(source, tmp_path / "out", 4)
    held = [set(record["held"]) for record in records]
    for rank, record in enumerate(records):
        assert sorted(record["read"]) == sorted(held[rank]), f"rank {rank} read other stages' tensors or missed some"
    assert set().union(*held) >= {"layers.0.tokens.weight", "layers.6.lm_head.weight"}
    holders = [rank for rank, keys in enumerate(held) if keys & {"layers.0.tokens.weight", "layers.6.lm_head.weight"}]
    assert len(holders) == 2, "the tied embedding is read by the first stage and by the last, each for itself"
