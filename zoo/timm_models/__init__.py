"""timm image models in the zoo: ResNet, ConvNeXt and ViT, with timm's pretrained weights, as flat pipelines."""

from zoo.timm_models.classifier import TimmClassifier, load_timm
from zoo.timm_models.layers import TimmLayers, TokenEmbedding, TokenPool, family_of, flatten_timm_model

__all__ = [
    "TimmClassifier",
    "TimmLayers",
    "TokenEmbedding",
    "TokenPool",
    "family_of",
    "flatten_timm_model",
    "load_timm",
]
