"""A timm image model as a zoo classifier: timm's layers (and pretrained weights) in one flat sequence, a new head.

``TimmClassifier(model_name="resnet50", pretrained=True, num_classes=10)`` builds the timm model, takes timm's
pretrained weights (from the Hugging Face Hub, or from a local file with ``pretrained="path.safetensors"``), cuts it
into pipeline layers with the family's recipe (:mod:`zoo.timm_models.layers`) and replaces the classifier with a
freshly initialized one for ``num_classes``: the GPipe paper's transfer protocol. Training follows
:class:`zoo.ImageClassifier`. A weights file whose tensors are the model's (names and shapes) is read on first use, or
per pipeline stage (:mod:`zoo.deferred`); one timm has to convert (another image size for a ViT, an original release's
format) is loaded by timm, whole.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo._registry import register_model
from zoo.backbone import LoadReport
from zoo.deferred import initialize_unread, parameters_on_meta
from zoo.tasks.classification import ImageClassifier
from zoo.timm_models.layers import family_of, flatten_timm_model
from zoo.weights import CheckpointReader, SafetensorsFiles, TensorFiles, TorchFile

__all__ = ["TimmClassifier", "load_timm"]


@register_model("timm")
class TimmClassifier(ImageClassifier):
    """A timm ResNet, ConvNeXt or ViT as a zoo image classifier: ``layers`` = backbone layers, then a new ``Linear``.

    Args:
        model_name: a timm model name of a supported family (``timm.list_models("resnet*")``, ``"convnext*"``,
            ``"vit_*"``); others are refused with the list of families.
        num_classes: classes of the task; the classifier is always new (timm's own initialization of a Linear).
        pretrained: ``True`` loads timm's pretrained weights from the Hugging Face Hub; a path loads them from a local
            file in timm's format (``.safetensors`` or ``.pth``, as ``pretrained_cfg_overlay=dict(file=...)``);
            ``None`` or ``False`` starts from timm's random initialization.
        model_kwargs: more arguments of ``timm.create_model`` (e.g. ``drop_path_rate``, or a smaller architecture).
        image_size: side of the (square) training images; sizes the sample input that balances stages by FLOPs, and
            for a ViT sets ``img_size`` (timm resamples a pretrained position embedding to it). ``None``: timm's.
        freeze_backbone: train the new classifier only (backbone parameters and BatchNorm statistics stay).

    The training arguments (``optimizer``, ``lr``, ...) are :class:`zoo.ImageClassifier`'s; the defaults here are a
    fine-tuning recipe (AdamW, a short warm-up).
    """

    def __init__(
        self,
        model_name: str = "resnet18",
        num_classes: int = 1000,
        pretrained: bool | str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        image_size: int | None = None,
        label_smoothing: float = 0.1,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        lr_decay_rate: float = 0.9,
        lr_decay_epochs: float = 1.0,
        warmup_epochs: float = 0.5,
        freeze_backbone: bool = False,
    ) -> None:
        family = family_of(model_name)
        kwargs = dict(model_kwargs or {})
        if family == "vit" and image_size is not None:
            kwargs.setdefault("img_size", image_size)
        timm_model, weights = create_timm_model(model_name, pretrained, kwargs)
        converted = flatten_timm_model(timm_model)
        head = nn.Linear(converted.head.in_features, num_classes)
        super().__init__(
            nn.Sequential(*converted.backbone, head),
            num_classes,
            (len(converted.backbone),),
            label_smoothing=label_smoothing,
            optimizer=optimizer,
            lr=lr,
            weight_decay=weight_decay,
            lr_decay_rate=lr_decay_rate,
            lr_decay_epochs=lr_decay_epochs,
            warmup_epochs=warmup_epochs,
            freeze_backbone=freeze_backbone,
        )
        self.save_hyperparameters()
        self.family = family
        self.timm_head_keys = converted.head_keys
        pretrained_cfg: dict[str, Any] = getattr(timm_model, "pretrained_cfg", {})
        size = image_size or int(pretrained_cfg.get("input_size", (3, 224, 224))[-1])
        if family == "vit":
            size = int(getattr(timm_model, "patch_embed").img_size[0])  # noqa: B009 (timm types it as Tensor | Module)
        # A sample input lets GPipeStrategy balance stages by FLOPs (early high-resolution blocks cost the most).
        self.example_input_array = torch.zeros(2, 3, size, size)
        if weights is not None:
            self.defer_weights(weights.reader(self))

    def head_prefixes(self) -> tuple[str, ...]:
        return tuple(f"layers.{index}" for index in self.head_layers)


def create_timm_model(
    model_name: str, pretrained: bool | str | None, kwargs: dict[str, Any]
) -> tuple[nn.Module, TimmWeights | None]:
    """``timm.create_model`` with ``pretrained`` as :class:`TimmClassifier` takes it, and where its weights wait.

    A weights file (a local one, or the hub's ``model.safetensors`` of the name's pretrained tag) that holds the
    model's own tensors is not read: the model is built on the meta device and the file's tensors wait in the
    returned :class:`TimmWeights`. Any other pretrained weights are loaded by timm, which refuses the meta device then;
    timm's random initialization on the meta device is refused when nothing could initialize some parameters."""
    import timm

    meta = torch.empty(()).device.type == "meta"  # under `with torch.device("meta")`
    if isinstance(pretrained, str) and not Path(pretrained).expanduser().is_file():
        raise FileNotFoundError(
            f"pretrained={pretrained!r}: no such file; pass a timm weights file (.safetensors or .pth, the state "
            "dict of timm.create_model(model_name)), or pretrained=True to download timm's weights"
        )
    file = _weights_file(model_name, pretrained) if pretrained else None
    if file is not None:
        with parameters_on_meta():
            model = timm.create_model(model_name, pretrained=False, **kwargs)
        weights = TimmWeights.matching(model, file)
        if weights is not None:
            return model, weights
    if meta and pretrained:
        raise ValueError(
            f"pretrained={pretrained!r} under the meta device: these weights are converted by timm, which cannot load "
            "them into meta tensors. Build the model on a real device to load them, or with pretrained=None to size it "
            "on meta"
        )
    options: dict[str, Any] = {}
    if isinstance(pretrained, str):
        # A local file holds timm's own state dict: never the original release format that some configs load with a
        # custom loader (ViT's JAX .npz), which timm before 1.0.31 applied to any file it was given.
        options["pretrained_cfg_overlay"] = {"file": str(Path(pretrained).expanduser()), "custom_load": False}
    model = timm.create_model(model_name, pretrained=bool(pretrained), **options, **kwargs)
    if meta:
        uninitialized = _without_initializer(model)
        if uninitialized:
            raise ValueError(
                f"the timm model {model_name!r} holds parameters that only timm's own initializer sets "
                f"({', '.join(uninitialized[:4])}{' ...' if len(uninitialized) > 4 else ''}): built on the meta "
                "device they would stay uninitialized when the pipeline materializes its stages. Build it on a real "
                "device (no `with torch.device('meta')`)"
            )
    return model, None


def _weights_file(model_name: str, pretrained: bool | str) -> Path | None:
    """The local file of ``pretrained``, or the hub's ``model.safetensors`` of the name's pretrained tag (downloaded
    as timm would); ``None`` when timm takes its weights from elsewhere (a URL, an older file name)."""
    if isinstance(pretrained, str):
        return Path(pretrained).expanduser()
    import timm
    from huggingface_hub import hf_hub_download

    config = timm.models.get_pretrained_cfg(model_name)
    if config is None or not config.hf_hub_id:
        return None
    repository, _, revision = config.hf_hub_id.partition("@")
    try:
        return Path(hf_hub_download(repository, "model.safetensors", revision=revision or None))
    except Exception:  # no safetensors file there, or not reachable: timm's own loader decides
        return None


@dataclasses.dataclass
class TimmWeights:
    """A timm weights file whose tensors are those of a timm model built on the meta device (by ``id``)."""

    files: TensorFiles
    by_tensor: dict[int, str]

    @classmethod
    def matching(cls, model: nn.Module, file: Path) -> TimmWeights | None:
        """The weights of ``file`` for ``model``, or ``None`` when timm would have to convert them (other names or
        shapes outside the classifier); the model's tensors the file lacks (BatchNorm's ``num_batches_tracked``) get
        their modules' own initialization."""
        files: TensorFiles = SafetensorsFiles(file) if file.suffix == ".safetensors" else TorchFile(file)
        head = set(_classifier_keys(model))
        state = nn.Module.state_dict(model, keep_vars=True)
        stored = {key for key in state if key in files.entries and files.entries[key].shape == tuple(state[key].shape)}
        unmatched = [key for key in files.entries if key not in stored and key not in head]
        # As torch's BatchNorm loads a state dict without its counter: from zero.
        missing = [key for key in state if key not in stored and key not in head]
        if unmatched or any(not key.endswith("num_batches_tracked") for key in missing):
            return None
        initialize_unread(model, missing, _reset)
        return cls(files, {id(state[key]): key for key in stored if key not in head})

    def reader(self, module: nn.Module) -> CheckpointReader:
        """The reader of ``module``'s state-dict keys whose tensors the file holds."""
        state = nn.Module.state_dict(module, keep_vars=True)
        return CheckpointReader(
            self.files, {key: self.by_tensor[id(t)] for key, t in state.items() if id(t) in self.by_tensor}
        )


def _classifier_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of the timm model's classifier, which the zoo replaces."""
    get_classifier = getattr(model, "get_classifier", None)
    classifier = get_classifier() if callable(get_classifier) else None
    if not isinstance(classifier, nn.Module):
        return []
    ids = {id(tensor) for tensor in [*classifier.parameters(), *classifier.buffers()]}
    return [key for key, tensor in nn.Module.state_dict(model, keep_vars=True).items() if id(tensor) in ids]


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _without_initializer(model: nn.Module) -> list[str]:
    """Names of parameters and buffers owned by modules that have no ``reset_parameters`` to re-create them."""
    owned_by_wrappers = {"cls_token", "reg_token", "pos_embed"}  # TokenEmbedding.reset_parameters sets these
    names = []
    for module_name, module in model.named_modules():
        if callable(getattr(module, "reset_parameters", None)):
            continue
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if module is model and name in owned_by_wrappers:
                continue
            names.append(f"{module_name}.{name}" if module_name else name)
    return names


def load_timm(
    model_name: str,
    num_classes: int | None = None,
    freeze_backbone: bool = False,
    *,
    weights: str | Path | None = None,
    **overrides: Any,
) -> TimmClassifier:
    """The timm model ``model_name`` with its pretrained backbone and a new classifier: ``zoo.load_pretrained``'s
    ``"timm/<name>"`` source.

    Args:
        model_name: a timm model name of a supported family.
        num_classes: classes of the new task; ``None`` keeps timm's (the classifier is new all the same).
        freeze_backbone: train the new classifier only.
        weights: a local weights file in timm's format; ``None`` downloads timm's pretrained weights.
        overrides: other :class:`TimmClassifier` arguments (``model_kwargs``, ``image_size``, ``lr``, ...).
    """
    if "pretrained" in overrides:
        raise ValueError(
            "load_pretrained('timm/...') always loads pretrained weights: give a local file as weights=PATH instead "
            "of pretrained=..."
        )
    if num_classes is None:
        import timm

        num_classes = int(timm.models.get_pretrained_cfg_value(model_name, "num_classes") or 1000)
    pretrained: bool | str = str(weights) if weights is not None else True
    model = TimmClassifier(model_name, num_classes, pretrained=pretrained, freeze_backbone=freeze_backbone, **overrides)
    state = nn.Module.state_dict(model)  # the keys: the weights are not read here
    model.load_report = LoadReport(
        loaded=tuple(key for key in state if not model.is_head(key)),
        fresh=tuple(key for key in state if model.is_head(key)),
        skipped=model.timm_head_keys,
        source=model.weights_source or "",
    )
    return model
