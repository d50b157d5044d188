"""Hugging Face translation models (M2M-100, NLLB, Marian) as zoo models: conversion, data, decoding, tiny models.

``zoo.load_pretrained("facebook/m2m100_418M")`` (or a ``save_pretrained`` directory) returns a
:class:`~zoo.tasks.pretrained_translation.PretrainedTranslator` whose layers are one flat ``nn.Sequential`` wrapping
the library's own modules, so it trains with ``strategy="gpipe"`` and its forward is the library's. Decoder-only
language models (Llama, Qwen, GPT-2, ...) take the same route to a :class:`~zoo.tasks.causal_lm.PretrainedCausalLM`
through the ``causal_lm*`` modules (conversion, layers, generation, tiny models), with text from
:class:`~zoo.hf.data.PretrainedCausalLMDataModule`.
"""

from zoo.hf.conversion import is_hf_source
from zoo.hf.data import PretrainedCausalLMDataModule, PretrainedTranslationDataModule
from zoo.hf.generation import beam_generate, evaluate_pretrained_translation, greedy_generate
from zoo.hf.tiny import save_tiny_translation_model

__all__ = [
    "PretrainedCausalLMDataModule",
    "PretrainedTranslationDataModule",
    "beam_generate",
    "evaluate_pretrained_translation",
    "greedy_generate",
    "is_hf_source",
    "save_tiny_translation_model",
]
