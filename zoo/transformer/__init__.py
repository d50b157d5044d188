"""The GPipe paper's Transformers: the encoder-decoder T(L, H, A) and the decoder-only Transformer-L, as flat layer
sequences, with their objective, optimization and decoding."""

from zoo.transformer.decoding import BeamSearchResult, beam_search, greedy_decode, sequence_log_prob
from zoo.transformer.network import decoder_slice, encoder_slice, transformer_layers, transformer_lm_layers

__all__ = [
    "BeamSearchResult",
    "beam_search",
    "decoder_slice",
    "encoder_slice",
    "greedy_decode",
    "sequence_log_prob",
    "transformer_layers",
    "transformer_lm_layers",
]
