"""timm image models as one flat layer sequence: a small recipe per model family, and the wrappers the ViT needs.

A recipe takes a built timm model and returns its layers in forward order (``backbone``: stem, every block of every
stage, final norm, global pooling) and its classifier (``head``), reusing timm's own modules and parameters, so the
sequence computes exactly what ``model(x)`` computes and a pretrained state dict needs no renaming. Families:

- ``resnet`` (``timm.models.resnet.ResNet``): stem (conv1, bn1, act1, maxpool), each block of layer1..layer4,
  global pool, ``fc``.
- ``convnext`` (``timm.models.convnext.ConvNeXt``): stem, each stage's downsample and blocks, pool + norm of the
  head, ``head.fc``.
- ``vit`` (``timm.models.vision_transformer.VisionTransformer``): :class:`TokenEmbedding` (patch embedding, class
  and register tokens, position embedding), each block, norm, :class:`TokenPool`, ``head``.

Legend: B batch, N patch tokens, P prefix tokens (class + register), D embedding width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from timm.layers import NormMlpClassifierHead
from timm.models.convnext import ConvNeXt
from timm.models.resnet import ResNet
from timm.models.vision_transformer import VisionTransformer, global_pool_nlc
from torch import nn

__all__ = ["FAMILIES", "TimmLayers", "TokenEmbedding", "TokenPool", "family_of", "flatten_timm_model"]


@dataclasses.dataclass(frozen=True)
class TimmLayers:
    """A timm model cut into pipeline layers: ``backbone`` ends with pooled features [B, F]; ``head`` maps them."""

    family: str
    backbone: list[nn.Module]
    head: nn.Linear
    head_keys: tuple[str, ...]  # the classifier's keys in timm's own state dict (left out when fine-tuning)


class TokenEmbedding(nn.Module):
    """The ViT's input: patch embedding, then the class/register tokens and the position embedding (timm's
    ``_pos_embed``), position dropout, patch dropout and the pre-norm. Owns ``cls_token``, ``reg_token`` and
    ``pos_embed``, and initializes them in :meth:`reset_parameters` as timm does, so a model built on the meta
    device and materialized layer by layer starts fully initialized.
    """

    def __init__(self, model: VisionTransformer) -> None:
        super().__init__()
        if model.dynamic_img_size:
            raise ValueError(
                "dynamic_img_size=True: the zoo's ViT layers take one fixed image size (a pipeline needs fixed "
                "activation shapes); build the timm model without dynamic_img_size"
            )
        self.patch_embed = model.patch_embed
        self.cls_token = model.cls_token
        self.reg_token = model.reg_token
        self.pos_embed = model.pos_embed
        self.no_embed_class = model.no_embed_class
        self.pos_drop = model.pos_drop
        self.patch_drop = model.patch_drop
        self.norm_pre = model.norm_pre

    def reset_parameters(self) -> None:
        """timm's ViT initialization of the tokens: position embedding ~ N(0, 0.02) truncated, tokens ~ N(0, 1e-6)."""
        with torch.no_grad():
            if self.pos_embed is not None:
                nn.init.trunc_normal_(self.pos_embed, std=0.02)
            for token in (self.cls_token, self.reg_token):
                if token is not None:
                    nn.init.normal_(token, std=1e-6)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] -> tokens [B, P + N, D]."""
        x = self.patch_embed(images)  # [B, N, D]
        batch = x.shape[0]
        prefix = [token.expand(batch, -1, -1) for token in (self.cls_token, self.reg_token) if token is not None]
        if self.pos_embed is None:
            x = torch.cat([*prefix, x], dim=1)
        elif self.no_embed_class:  # deit-3 style: the position embedding covers the patches only
            x = torch.cat([*prefix, x + self.pos_embed], dim=1)
        else:  # original ViT: the position embedding covers the prefix tokens too
            x = torch.cat([*prefix, x], dim=1) + self.pos_embed
        x = self.pos_drop(x)
        x = self.patch_drop(x)
        return self.norm_pre(x)


class TokenPool(nn.Module):
    """The ViT's pooling before its classifier: class token or mean over tokens (timm's ``pool``), then ``fc_norm``
    and the head dropout. Tokens [B, P + N, D] -> features [B, D]."""

    def __init__(self, model: VisionTransformer) -> None:
        super().__init__()
        if model.attn_pool is not None:
            raise ValueError(
                "global_pool='map' (attention pooling) is not supported by the zoo's ViT layers; build the timm model "
                "with global_pool='token' or 'avg'"
            )
        self.pool_type: str = model.global_pool
        self.num_prefix_tokens: int = model.num_prefix_tokens
        self.include_prefix: bool = model.pool_include_prefix
        self.fc_norm: nn.Module = model.fc_norm
        self.head_drop: nn.Module = model.head_drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = global_pool_nlc(
            tokens,
            pool_type=self.pool_type,
            num_prefix_tokens=self.num_prefix_tokens,
            reduce_include_prefix=self.include_prefix,
        )
        return self.head_drop(self.fc_norm(x))


def _resnet(model: nn.Module) -> TimmLayers:
    assert isinstance(model, ResNet)
    stem = nn.Sequential(model.conv1, model.bn1, model.act1, model.maxpool)
    stages: list[nn.Sequential] = [model.layer1, model.layer2, model.layer3, model.layer4]  # type: ignore[list-item]
    blocks = [block for stage in stages for block in stage]
    pool: nn.Module = model.global_pool
    if model.drop_rate:  # timm applies this dropout between pooling and fc
        pool = nn.Sequential(pool, nn.Dropout(float(model.drop_rate)))
    return TimmLayers("resnet", [stem, *blocks, pool], _linear(model.fc, "fc"), ("fc.weight", "fc.bias"))


def _convnext(model: nn.Module) -> TimmLayers:
    assert isinstance(model, ConvNeXt)
    head = model.head
    if not isinstance(head, NormMlpClassifierHead) or not isinstance(head.pre_logits, nn.Identity):
        raise ValueError(
            f"ConvNeXt with a {type(head).__name__} head (head_norm_first=True or head_hidden_size set) is not "
            "supported; the zoo's ConvNeXt recipe takes the default head (pool, norm, fc)"
        )
    layers: list[nn.Module] = [model.stem]
    for stage in model.stages:
        downsample, blocks = stage.downsample, stage.blocks
        assert isinstance(downsample, nn.Module)
        assert isinstance(blocks, nn.Sequential)
        if not isinstance(downsample, nn.Identity):
            layers.append(downsample)
        layers.extend(blocks)
    if not isinstance(model.norm_pre, nn.Identity):
        layers.append(model.norm_pre)
    layers.append(nn.Sequential(head.global_pool, head.norm, head.flatten, head.drop))
    return TimmLayers("convnext", layers, _linear(head.fc, "head.fc"), ("head.fc.weight", "head.fc.bias"))


def _vit(model: nn.Module) -> TimmLayers:
    assert isinstance(model, VisionTransformer)
    layers = [TokenEmbedding(model), *model.blocks, model.norm, TokenPool(model)]
    return TimmLayers("vit", layers, _linear(model.head, "head"), ("head.weight", "head.bias"))


def _linear(module: nn.Module, name: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"the timm model's classifier {name!r} is a {type(module).__name__}, not a Linear layer: build it with "
            "num_classes >= 1"
        )
    return module


# The timm module that defines a model name's architecture -> (family, model class, recipe).
FAMILIES: dict[str, tuple[str, type[nn.Module], Callable[[nn.Module], TimmLayers]]] = {
    "timm.models.resnet": ("resnet", ResNet, _resnet),
    "timm.models.convnext": ("convnext", ConvNeXt, _convnext),
    "timm.models.vision_transformer": ("vit", VisionTransformer, _vit),
}


def family_of(model_name: str) -> str:
    """The zoo family (``"resnet"``, ``"convnext"``, ``"vit"``) of the timm model ``model_name``; other models raise
    a ``ValueError`` listing the supported families. Decided from the name alone, before anything is downloaded."""
    import timm

    if not timm.is_model(model_name):
        raise ValueError(f"unknown timm model {model_name!r}: see timm.list_models() for the names timm knows")
    module = timm.models.model_entrypoint(model_name).__module__
    if module not in FAMILIES:
        supported = ", ".join(f"{family} ({path})" for path, (family, _, _) in FAMILIES.items())
        raise ValueError(
            f"the timm model {model_name!r} (defined in {module}) is of no supported family; the zoo converts these "
            f"families: {supported}. Pick a model of one of them, e.g. 'resnet50', 'convnext_tiny' or "
            "'vit_small_patch16_224'"
        )
    return FAMILIES[module][0]


def flatten_timm_model(model: nn.Module) -> TimmLayers:
    """Cut a built timm model (resnet, convnext or vit family) into its pipeline layers and its classifier.

    The layers share their modules and parameters with ``model``: ``nn.Sequential(*layers.backbone, layers.head)``
    computes ``model(x)`` (in eval mode, exactly). Raises ``ValueError`` for a model of another family.
    """
    for _, cls, recipe in FAMILIES.values():
        if type(model) is cls:
            return recipe(model)
    supported = ", ".join(f"{family} ({cls.__name__})" for family, cls, _ in FAMILIES.values())
    raise ValueError(
        f"cannot convert a {type(model).__name__}: the zoo converts timm models of these families: {supported}"
    )
