"""timm models in the zoo: each family's flat layers compute timm's forward, and weights load as a user's would.

Offline: every timm model is built with ``pretrained=False`` and tiny arguments, its state dict saved in timm's own
file formats, and loaded back through the path a user online takes: ``pretrained=True`` with the file given as
``pretrained_cfg_overlay=dict(file=...)`` (what ``weights=PATH`` does), or timm's Hugging Face Hub download itself,
answered from a hub cache laid out as ``huggingface_hub`` writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models import save_for_hf
from torch import nn

import lightning_gpipe.partition.sequence
import zoo
from zoo.timm_models import TokenEmbedding, flatten_timm_model

# A tiny model of each family, and of the variants whose layers differ (deep stem, no class token, register tokens).
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "resnet": ("resnet18", {"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64)}),
    "resnet-deep-stem": ("resnet50d", {"layers": (1, 1, 1, 1), "channels": (4, 8, 16, 32), "stem_width": 8}),
    "convnext": ("convnext_atto", {"depths": (1, 1, 1, 1), "dims": (8, 16, 32, 64)}),
    "vit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}),
    "vit-avg-registers": (
        "vit_tiny_patch16_224",
        {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2, "class_token": False,
         "global_pool": "avg", "reg_tokens": 2, "no_embed_class": True},
    ),
}  # fmt: skip


def tiny_timm(case: str, num_classes: int = 7) -> nn.Module:
    torch.manual_seed(0)
    name, kwargs = TINY[case]
    return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs).eval()


def images(seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", TINY)
def test_the_flat_layers_compute_timms_own_forward(case: str) -> None:
    model = tiny_timm(case)
    converted = flatten_timm_model(model)
    sequence = nn.Sequential(*converted.backbone, converted.head).eval()
    x = images()
    torch.testing.assert_close(sequence(x), model(x), rtol=0, atol=1e-5)
    assert {id(p) for p in sequence.parameters()} == {id(p) for p in model.parameters()}  # every weight, none twice


@pytest.mark.parametrize(("case", "suffix"), [(case, ".safetensors") for case in TINY] + [("resnet", ".pth")])
def test_load_pretrained_from_a_timm_weights_file_keeps_the_backbone_and_makes_a_new_head(
    case: str, suffix: str, tmp_path: Path
) -> None:
    original = tiny_timm(case)
    weights = tmp_path / f"model{suffix}"
    state = {key: value.contiguous() for key, value in original.state_dict().items()}
    save_file(state, weights) if suffix == ".safetensors" else torch.save(state, weights)
    name, kwargs = TINY[case]

    model = zoo.load_pretrained(
        f"timm/{name}", num_classes=3, weights=str(weights), model_kwargs={**kwargs, "num_classes": 7}
    )

    assert isinstance(model, zoo.TimmClassifier)
    model.eval()
    x = images()
    features = original.forward_head(original.forward_features(x), pre_logits=True)
    torch.testing.assert_close(model.layers[:-1](x), features, rtol=0, atol=1e-5)
    # Before the head change the logits are timm's own: its classifier on the converted backbone's features.
    torch.testing.assert_close(original.get_classifier()(model.layers[:-1](x)), original(x), rtol=0, atol=1e-5)
    head = model.layers[-1]
    assert isinstance(head, nn.Linear)
    assert head.out_features == 3
    assert model(x).shape == (3, 3)
    report = model.load_report
    assert report.fresh == (f"layers.{len(model.layers) - 1}.weight", f"layers.{len(model.layers) - 1}.bias")
    assert set(report.skipped) <= set(original.state_dict())
    assert len(report.loaded) == len(original.state_dict()) - len(report.skipped)


def test_a_vit_weights_file_loads_where_timm_would_read_it_as_a_jax_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found on a GPU machine with timm 1.0.29: a local file given for a ViT went to ViT's custom loader for Google's
    # .npz releases, because timm kept the registry's custom_load=True; timm 1.0.31 resets it when a file is given.
    # Emptying the source keys that trigger that reset gives the older timm's behaviour.
    import timm.models._builder

    monkeypatch.setattr(timm.models._builder, "_PRETRAINED_SOURCE_KEYS", (), raising=False)  # absent before 1.0.31
    original = tiny_timm("vit")
    weights = tmp_path / "model.safetensors"
    save_file({key: value.contiguous() for key, value in original.state_dict().items()}, weights)
    name, kwargs = TINY["vit"]
    model = zoo.load_pretrained(
        f"timm/{name}", num_classes=3, weights=str(weights), model_kwargs={**kwargs, "num_classes": 7}
    )
    x = images()
    model.eval()
    torch.testing.assert_close(model.layers[:-1](x), original.forward_head(original.forward_features(x), True))


@pytest.mark.parametrize("case", ["resnet", "vit"])
def test_load_pretrained_takes_timms_hub_weights_as_a_user_online_does(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The repository timm downloads for the name (its default pretrained tag), written as timm publishes it
    # (save_for_hf: config.json + model.safetensors) into a hub cache laid out as huggingface_hub keeps it.
    name, kwargs = TINY[case]
    original = tiny_timm(case, num_classes=1000)
    repo_id = timm.models.get_pretrained_cfg(name).hf_hub_id
    assert repo_id is not None
    assert repo_id.startswith("timm/")
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save_for_hf(original, str(repo / "snapshots" / commit), safe_serialization=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a miss raises instead of downloading

    model = zoo.load_pretrained(f"timm/{name}", num_classes=3, model_kwargs=kwargs).eval()

    x = images()
    torch.testing.assert_close(original.get_classifier()(model.layers[:-1](x)), original(x), rtol=0, atol=1e-5)
    assert model(x).shape == (3, 3)
    assert len(model.load_report.loaded) == len(original.state_dict()) - 2


def test_a_timm_classifier_checkpoint_reloads_through_load_pretrained(tmp_path: Path) -> None:
    name, kwargs = TINY["vit"]
    model = zoo.create_model("timm", model_name=name, model_kwargs=kwargs, num_classes=4)
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams), "zoo_model": "timm"}
    torch.save(checkpoint, tmp_path / "vit.ckpt")

    again = zoo.load_pretrained(tmp_path / "vit.ckpt", num_classes=2, freeze_backbone=True)

    assert isinstance(again, zoo.TimmClassifier)
    assert again.load_report.fresh == ("layers.5.weight", "layers.5.bias")
    for key in again.load_report.loaded:
        assert torch.equal(again.state_dict()[key], model.state_dict()[key]), key
    assert [n for n, p in again.named_parameters() if p.requires_grad] == ["layers.5.weight", "layers.5.bias"]


def test_a_model_of_another_family_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'efficientnet_b0' \(defined in timm.models.efficientnet\) is of no "
                       r"supported family; the zoo converts these families: resnet .*, convnext .*, vit "):  # fmt: skip
        zoo.load_pretrained("timm/efficientnet_b0", num_classes=10)
    with pytest.raises(ValueError, match=r"unknown timm model 'resnet_nonexistent'"):
        zoo.create_model("timm", model_name="resnet_nonexistent")


def test_a_missing_weights_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"pretrained='.*missing.safetensors': no such file"):
        zoo.load_pretrained("timm/resnet18", num_classes=10, weights=str(tmp_path / "missing.safetensors"))


def test_on_meta_the_vit_materializes_every_parameter_including_its_tokens() -> None:
    name, kwargs = TINY["vit"]
    with torch.device("meta"):
        model = zoo.create_model("timm", model_name=name, model_kwargs=kwargs, num_classes=4)
    embedding = model.layers[0]
    assert isinstance(embedding, TokenEmbedding)
    assert embedding.pos_embed is not None
    assert embedding.pos_embed.is_meta
    # As GPipeStrategy does for its stage: allocate uninitialized memory, then reset_parameters on every module.
    lightning_gpipe.partition.sequence.materialize(list(enumerate(model.layers)), torch.device("cpu"), seed=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert 0.01 < embedding.pos_embed.std().item() < 0.03  # timm's N(0, 0.02), not whatever memory held
    assert embedding.cls_token is not None
    assert embedding.cls_token.abs().max().item() < 1e-4


def test_on_meta_models_that_timm_alone_can_initialize_or_weights_it_converts_are_refused(tmp_path: Path) -> None:
    name, kwargs = TINY["convnext"]
    uninitialized = r"holds parameters that only timm's own initializer sets \(stages.0.blocks.0"
    with pytest.raises(ValueError, match=uninitialized), torch.device("meta"):
        zoo.create_model("timm", model_name=name, model_kwargs=kwargs)
    # A ViT's weights for 32-pixel images into a 64-pixel model: timm resamples the position embedding, whole.
    name, kwargs = TINY["vit"]
    weights = tmp_path / "vit32.safetensors"
    save_file({key: value.contiguous() for key, value in tiny_timm("vit").state_dict().items()}, weights)
    converted = r"pretrained='.*vit32.safetensors' under the meta device: these weights are converted by timm"
    with pytest.raises(ValueError, match=converted), torch.device("meta"):
        zoo.create_model("timm", model_name=name, pretrained=str(weights), model_kwargs={**kwargs, "img_size": 64})
