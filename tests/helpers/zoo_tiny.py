"""A tiny configuration and batch for every registered zoo model: what the zoo-wide tests train."""

from __future__ import annotations

from typing import Any

import torch

import zoo

# Dropout and drop path off and no warm-up, so a pipelined step can be compared with a plain one exactly.
TINY: dict[str, dict[str, Any]] = {
    "amoebanet_d": {"num_layers": 3, "num_filters": 8, "num_classes": 5, "image_size": 32, "dropout": 0.0,
                    "warmup_epochs": 0.0, "lr": 0.01},
    "amoebanet_b": {"num_layers": 3, "num_filters": 8, "num_classes": 5, "image_size": 32, "dropout": 0.0,
                    "warmup_epochs": 0.0, "lr": 0.01},
    "transformer": {"num_layers": 2, "ff_dim": 64, "num_heads": 2, "d_model": 32, "vocab_size": 50, "head_dim": 16,
                    "dropout": 0.0, "warmup_steps": 0, "lr": 3e-3, "logits_abs_max": 5.0},
    "transformer_lm": {"num_layers": 2, "ff_dim": 64, "num_heads": 2, "d_model": 32, "vocab_size": 50,
                       "dropout": 0.0, "warmup_steps": 0, "lr": 3e-3, "logits_abs_max": 5.0},
    "timm": {"model_name": "resnet18d", "num_classes": 5, "image_size": 32, "warmup_epochs": 0.0, "lr": 0.01,
             "model_kwargs": {"layers": [1, 1, 1, 1], "channels": [8, 16, 32, 64], "stem_width": 4}},
}  # fmt: skip

BATCH_SIZE = 8
STEPS = 2  # optimizer steps of the multi-process fits
# BatchNorm normalizes each micro-batch on its own, so the CNNs run with M = 1 to compare exactly with plain training.
CHUNKS = {"amoebanet_d": 1, "amoebanet_b": 1, "transformer": 4, "transformer_lm": 4, "timm": 1}


def tiny_model(name: str, **overrides: Any) -> zoo.ZooModule:
    model = zoo.create_model(name, **{**TINY[name], **overrides})
    assert isinstance(model, zoo.ZooModule)
    return model


def tiny_batch(name: str, batch_size: int = BATCH_SIZE, seed: int = 0) -> Any:
    """One batch in the model's own format, with a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    config = TINY[name]
    if name.startswith("amoebanet") or name == "timm":
        images = torch.randn(batch_size, 3, config["image_size"], config["image_size"], generator=generator)
        return images, torch.randint(0, config["num_classes"], (batch_size,), generator=generator)
    vocab = config["vocab_size"]
    if name == "transformer":
        # Sources of several lengths, so the padding mask crosses the stage boundary; targets without padding, so a
        # token-mean loss weighted per sample (GPipe's micro-batch weighting) equals the full batch's.
        source = torch.randint(4, vocab, (batch_size, 7), generator=generator)
        source[:, 0] = 4  # the target-language token
        lengths = torch.randint(3, 8, (batch_size,), generator=generator)
        for row, length in enumerate(lengths.tolist()):
            source[row, length - 1] = 2
            source[row, length:] = 0
        target = torch.randint(4, vocab, (batch_size, 6), generator=generator)
        target[:, 0], target[:, -1] = 1, 2
        return source, target
    tokens = torch.randint(4, vocab, (batch_size, 9), generator=generator)
    tokens[:, 0], tokens[:, -1] = 1, 2
    return tokens
