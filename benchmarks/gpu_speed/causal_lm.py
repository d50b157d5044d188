"""The GPU benchmark's causal-LM workload: a random-initialized Qwen2 as ``zoo.PretrainedCausalLM``, and its batches.

The config is written here, nothing is downloaded: at :data:`~benchmarks.gpu_speed.configs.CAUSAL_LM`'s sizes it is
Qwen2.5-0.5B's shape (its ``config.json``: rotary base 1e6, RMSNorm epsilon 1e-6, full attention in every layer, tied
embeddings), 494,032,768 parameters. Importing this module imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from benchmarks.gpu_speed.configs import Workload
from zoo.tasks.causal_lm import PretrainedCausalLM

__all__ = ["qwen2_module", "collated_batches", "qwen2_config"]

SOURCE = "random-qwen2"  # the model's name_or_path: nothing is read from it (no weights, no tokenizer)


def qwen2_config(workload: Workload) -> dict[str, Any]:
    """The Qwen2 config of ``workload``'s shape, as the dict ``PretrainedCausalLM(config=...)`` takes."""
    config = transformers.Qwen2Config(
        vocab_size=workload.vocab_size,
        hidden_size=workload.d_model,
        intermediate_size=workload.ff_dim,
        num_hidden_layers=workload.num_layers,
        num_attention_heads=workload.num_heads,
        num_key_value_heads=workload.kv_heads,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    return config.to_dict()


def qwen2_module(workload: Workload) -> PretrainedCausalLM:
    """``workload``'s model with random weights, on the current default device (``with torch.device(...)``)."""
    return PretrainedCausalLM(SOURCE, config=qwen2_config(workload), pretrained=False, lr=1e-5)


def collated_batches(workload: Workload, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches as Hugging Face's collators make them: random ``input_ids`` [B, T] (none the padding id 0),
    ``attention_mask`` all ones, ``labels`` the ids, so every token but each sequence's first is learned."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, workload.vocab_size, (workload.batch, workload.seq_len), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return batches
