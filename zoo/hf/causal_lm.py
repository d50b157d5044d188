"""Conversion of a Hugging Face decoder-only language model into the zoo's flat layer sequence, by its structure.

One adapter serves every model of the common structure, whatever its family (Llama, Mistral, Qwen2, Qwen3, Gemma,
Gemma 3, Phi-3, OLMo, OLMo 3, ...): a ``...ForCausalLM`` holding ``model`` and ``lm_head``, whose ``model`` holds
exactly ``embed_tokens``, ``layers`` (decoder layers taking ``position_embeddings``), ``norm`` and ``rotary_emb``. A
second, small one serves GPT-2 (``transformer`` with ``wte``, ``wpe``, ``drop``, ``h``, ``ln_f``: learned positions).
Any other structure is refused, naming the model type: its forward may do something between the modules that the
sequence would leave out (Gemma 2's logit soft-capping, ...). A rotary module with one table per layer type (its
config's ``rope_parameters`` keyed by the layer types) is reproduced for the families whose forward was checked
against the library's (:data:`ROTARY_PER_LAYER_TYPE`: each layer gets its type's table) and refused for the others.
The sequence::

    TokenEmbedding, CausalDecoderLayer x N, FinalNorm, LanguageModelHead

Weights are the library model's own tensors (tied ones stay one ``nn.Parameter``); :func:`zoo.hf.conversion.key_map`
names them for :mod:`zoo.hf.export`, which writes them back.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from zoo.hf.causal_lm_layers import CausalDecoderLayer, FinalNorm, LanguageModelHead, TokenEmbedding
from zoo.hf.checkpoint import LibraryWeights, build_on_meta, resolve_dtype

__all__ = [
    "ROTARY_PER_LAYER_TYPE",
    "SUPPORTED_STRUCTURE",
    "build_causal_lm",
    "causal_layers",
    "check_causal_config",
    "check_causal_structure",
]

_COMMON = {"embed_tokens", "layers", "norm", "rotary_emb"}
_GPT2 = {"wte", "wpe", "drop", "h", "ln_f"}
SUPPORTED_STRUCTURE = (
    "a ...ForCausalLM of 'model' and 'lm_head', its 'model' made of exactly 'embed_tokens', 'layers', 'norm' and "
    "'rotary_emb' (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3, OLMo, ...), or GPT-2"
)
"""What the adapters convert, as refusals name it."""
ROTARY_PER_LAYER_TYPE = ("gemma3_text", "olmo3")
"""The model types whose rotary module has one table per layer type and whose forward the adapter reproduces (each
layer its type's table, mask and nothing else: checked against the library's logits)."""
# Config settings by which a model of the common structure computes something its modules' calls do not show.
_UNSUPPORTED_SETTINGS = ("final_logit_softcapping", "logit_scale", "embedding_multiplier", "logits_scaling")


def _rotary_types(config: PretrainedConfig) -> tuple[str, ...]:
    """The layer types of a rotary module with one table per layer type (its config's ``rope_parameters`` holds one
    dict per type), in its order (sorted, as Gemma 3's and OLMo 3's modules keep them); empty for one table."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and parameters and all(isinstance(value, dict) for value in parameters.values()):
        return tuple(sorted(set(getattr(config, "layer_types", None) or parameters)))
    return ()


def check_causal_config(config: PretrainedConfig, source: str) -> None:
    """Refuse, naming the model type and the structure supported, a config the adapters cannot reproduce."""
    settings = [name for name in _UNSUPPORTED_SETTINGS if getattr(config, name, None) not in (None, 1.0)]
    if getattr(config, "use_bidirectional_attention", False):  # EmbeddingGemma: not a causal language model
        settings.append("use_bidirectional_attention")
    per_type = _rotary_types(config) and config.model_type not in ROTARY_PER_LAYER_TYPE
    reason = (
        "it is an encoder-decoder"
        if config.is_encoder_decoder
        else "it has no causal language model class"
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        else f"its config sets {settings}"
        if settings
        else f"its rotary embedding has a table per layer type, reproduced for {list(ROTARY_PER_LAYER_TYPE)} only"
        if per_type
        else ""
    )
    if reason:
        raise ValueError(
            f"{source!r} is a {config.model_type!r} model and {reason}; zoo.load_pretrained converts decoder-only "
            f"language models of the common structure: {SUPPORTED_STRUCTURE}"
        )


def check_causal_structure(model: nn.Module, source: str) -> None:
    """Refuse a library model whose modules are not those of the supported structure, naming what differs."""
    config: Any = getattr(model, "config", None)
    children = {name for name, _ in model.named_children()}
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    parts = {name for name, _ in base.named_children()} if base is not None else set()
    if children == {"model", "lm_head"} and parts == _COMMON:
        return
    if children == {"transformer", "lm_head"} and parts == _GPT2:
        return
    raise ValueError(
        f"{source!r} is a {getattr(config, 'model_type', type(model).__name__)!r} model made of {sorted(children)} "
        f"and {sorted(parts)}; zoo.load_pretrained converts decoder-only language models of the common structure: "
        f"{SUPPORTED_STRUCTURE}"
    )


def build_causal_lm(
    source: str, config: dict[str, Any] | None = None, *, pretrained: bool = True, dtype: str = "float32"
) -> tuple[PreTrainedModel, LibraryWeights | None]:
    """The ``transformers`` model of ``source``, built without reading a weight, and where its weights are.

    With ``pretrained``: every tensor the checkpoint holds is on the meta device, in ``dtype`` (a ``torch`` dtype's
    name, or ``"auto"``: the checkpoint's), and :class:`~zoo.hf.checkpoint.LibraryWeights` says where each is stored
    (what the files lack is initialized as ``from_pretrained`` does). Without: random weights from ``config`` (a
    ``config.to_dict()``; default the source's) in the default dtype, and no weights to read (random initialization
    also works under ``torch.device("meta")``). An unsupported model is refused from its config and its structure
    (built on the meta device), before any weight file is opened.
    """
    hf_config = AutoConfig.for_model(**config) if config is not None else AutoConfig.from_pretrained(source)
    check_causal_config(hf_config, source)
    if not pretrained:
        resolve_dtype(dtype, hf_config)  # a bad dtype is refused alike
        model = AutoModelForCausalLM.from_config(hf_config)
        assert isinstance(model, PreTrainedModel), type(model)
        check_causal_structure(model, source)
        return model, None
    model = build_on_meta(AutoModelForCausalLM, hf_config, resolve_dtype(dtype, hf_config, source))
    check_causal_structure(model, source)
    return model, LibraryWeights.of(model, source)


def _sliding(config: PretrainedConfig, index: int) -> bool:
    """Whether decoder layer ``index`` attends within a sliding window, as the library's model decides it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2, Qwen3: one type per layer
        return bool(layer_types[index] == "sliding_attention")
    return getattr(config, "sliding_window", None) is not None  # Mistral, Phi-3: every layer or none


def causal_layers(model: nn.Module) -> nn.Sequential:
    """The flat layer sequence running ``model``'s own modules (see the module docstring for its entries)."""
    library: Any = model  # transformers' classes are not typed per architecture
    config = library.config
    if hasattr(library, "transformer"):  # GPT-2
        base = library.transformer
        tokens, blocks, norm = base.wte, base.h, base.ln_f
        extra: dict[str, Any] = {"positions": base.wpe, "dropout": base.drop}
    else:
        base = library.model
        tokens, blocks, norm = base.embed_tokens, base.layers, base.norm
        extra = {"rotary": base.rotary_emb, "rotary_types": _rotary_types(config)}
    sliding = [_sliding(config, index) for index in range(len(blocks))]
    # The embedding builds the masks of the kinds the layers use, as the library's forward does.
    embedding = TokenEmbedding(tokens, config, full=not all(sliding), sliding=any(sliding), **extra)
    types = extra.get("rotary_types") or ()
    tables = [types.index(config.layer_types[index]) if types else 0 for index in range(len(blocks))]
    return nn.Sequential(
        embedding,
        *[CausalDecoderLayer(block, sliding[index], tables[index]) for index, block in enumerate(blocks)],
        FinalNorm(norm),
        LanguageModelHead(library.lm_head),
    )
