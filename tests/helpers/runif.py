"""One gate for tests that need hardware or several processes (Lightning's ``RunIf`` habit).

Multi-process tests run by default; set ``GPIPE_SKIP_MULTIPROCESS=1`` to leave them out on a machine where spawning
gloo ranks is not possible. GPU tests run only where CUDA is available.
"""

from __future__ import annotations

import os

import pytest
import torch


def RunIf(*, gpu: bool = False, multiprocess: bool = False, min_gpus: int = 1) -> pytest.MarkDecorator:  # noqa: N802
    """A skip marker that names every unmet condition, combined with the matching selection markers."""
    reasons = []
    marks = []
    if gpu:
        marks.append(pytest.mark.gpu)
        if torch.cuda.device_count() < min_gpus:
            reasons.append(f"needs {min_gpus} CUDA device(s), found {torch.cuda.device_count()}")
    if multiprocess:
        marks.append(pytest.mark.multiprocess)
        if os.environ.get("GPIPE_SKIP_MULTIPROCESS") == "1":
            reasons.append("GPIPE_SKIP_MULTIPROCESS=1")
    skip = pytest.mark.skipif(bool(reasons), reason="; ".join(reasons))

    def decorate(test):  # type: ignore[no-untyped-def]
        for mark in [*marks, skip]:
            test = mark(test)
        return test

    return decorate  # type: ignore[return-value]
