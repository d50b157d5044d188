"""Each rank's random generators in a checkpoint: saved per global rank, restored on the same layout only.

Lightning saves no random state of its own. In a pipeline each rank draws from its own generators (a stage's dropout
masks, its re-materialization's replays), so a checkpoint keeps every rank's torch CPU generator, the generator of its
CUDA device, numpy's and Python's, by global rank. A run resumed on the same world size and pipe size gives each rank
its own generators back and continues their streams; on another layout the streams cannot be divided up again (a stage
that now spans two ranks' layers drew from two generators), so every rank keeps the generators it has.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RANDOM_STATES_KEY", "random_states", "restore_random_states"]

RANDOM_STATES_KEY = "gpipe_random_states"
"""The checkpoint entry: ``{"world_size", "pipe_size", "ranks": [one rank's states, by global rank]}``."""


def random_states(device: torch.device) -> dict[str, Any]:
    """This process's generators (``device``'s too when it is a CUDA device), as ``torch.load(weights_only=True)``
    reads them back: tensors, numbers and tuples only."""
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_random_states(saved: Any, world_size: int, pipe_size: int, rank: int, device: torch.device) -> bool:
    """Give this process the generators that global ``rank`` had when ``saved`` was written, if it was written by the
    same ``world_size`` and ``pipe_size``; returns whether it did."""
    if not isinstance(saved, dict) or (saved.get("world_size"), saved.get("pipe_size")) != (world_size, pipe_size):
        return False
    states = saved["ranks"][rank]
    torch.set_rng_state(states["torch"])
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    return True
