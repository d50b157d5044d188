"""The registry of zoo models: a name for every architecture, and the factory that builds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import lightning as L

__all__ = ["create_model", "list_models", "model_class", "register_model"]

ModelClass = TypeVar("ModelClass", bound=type[L.LightningModule])

_MODELS: dict[str, type[L.LightningModule]] = {}


def register_model(name: str) -> Callable[[ModelClass], ModelClass]:
    """Class decorator: make a LightningModule class available as ``zoo.create_model(name, ...)``.

    The class must call ``self.save_hyperparameters()`` so that a checkpoint can rebuild it, and name the modules that
    fine-tuning replaces in a ``head_modules`` class attribute (state-dict prefixes, e.g. ``("layers.20",)``).
    """

    def register(cls: ModelClass) -> ModelClass:
        if name in _MODELS and _MODELS[name] is not cls:
            raise ValueError(f"a zoo model named {name!r} is already registered ({_MODELS[name].__qualname__})")
        _MODELS[name] = cls
        cls.zoo_name = name  # type: ignore[attr-defined]
        return cls

    return register


def list_models() -> list[str]:
    """The names accepted by :func:`create_model`, sorted."""
    return sorted(_MODELS)


def model_class(name: str) -> type[L.LightningModule]:
    """The LightningModule class registered as ``name``; unknown names raise a ``ValueError`` listing the valid ones."""
    if name not in _MODELS:
        raise ValueError(f"unknown zoo model {name!r}; the registered models are: {', '.join(list_models())}")
    return _MODELS[name]


def create_model(name: str, **kwargs: Any) -> L.LightningModule:
    """Build the zoo model ``name`` from its constructor arguments ``kwargs``; works under the meta device."""
    return model_class(name)(**kwargs)
