"""The GPipe paper's models as LightningModules: AmoebaNet-D/-B classifiers and deep Transformers.

Every model keeps its layers in one flat ``nn.Sequential`` (``model.layers``), so it trains unchanged with
``strategy="gpipe"``, and builds on the meta device, so the paper's largest configurations can be sized without
memory::

    import zoo

    zoo.list_models()
    model = zoo.create_model("amoebanet_d", num_layers=18, num_filters=208, num_classes=1000)
    model = zoo.load_pretrained("pretrain.ckpt", num_classes=10)  # backbone loaded, new random heads
    model = zoo.load_pretrained("timm/resnet50", num_classes=10)  # timm's ImageNet weights, a new classifier
    model = zoo.load_pretrained("facebook/m2m100_418M")  # Hugging Face translation model: a zoo.PretrainedTranslator
    model = zoo.load_pretrained("Qwen/Qwen2.5-0.5B")  # Hugging Face decoder-only LM: a zoo.PretrainedCausalLM
"""

from typing import Any

from zoo._registry import create_model, list_models, register_model
from zoo.backbone import LoadReport
from zoo.finetune import load_pretrained
from zoo.tasks.base import ZooModule
from zoo.tasks.classification import AmoebaNetB, AmoebaNetD, ImageClassifier
from zoo.tasks.language_model import TransformerLM
from zoo.tasks.translation import Transformer
from zoo.timm_models import TimmClassifier

__all__ = [
    "AmoebaNetB",
    "AmoebaNetD",
    "ImageClassifier",
    "LoadReport",
    "PretrainedCausalLM",
    "PretrainedTranslator",
    "Transformer",
    "TimmClassifier",
    "TransformerLM",
    "ZooModule",
    "create_model",
    "list_models",
    "load_pretrained",
    "register_model",
]


def __getattr__(name: str) -> Any:
    # The Hugging Face models import transformers (seconds of start-up): only when they are asked for.
    if name == "PretrainedTranslator":
        from zoo.tasks.pretrained_translation import PretrainedTranslator

        return PretrainedTranslator
    if name == "PretrainedCausalLM":
        from zoo.tasks.causal_lm import PretrainedCausalLM

        return PretrainedCausalLM
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
