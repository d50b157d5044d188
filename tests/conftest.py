"""Shared fixtures: every test starts from the same random state and the same environment variables."""

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import timm.optim  # noqa: F401  (see _torch_state)
import torch
import torch.distributed as dist

from tools.launch import loopback_store


def pytest_configure(config: pytest.Config) -> None:
    # Every process a test starts (a job's ranks, a command line) imports `helpers` as the test process does.
    tests = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (tests, os.environ.get("PYTHONPATH")) if path)


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed Python, NumPy and torch so that each test is reproducible on its own."""
    value = 1234
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def restore_environment() -> Iterator[None]:
    """Put back the environment variables a test changed.

    Regression: Lightning's launcher writes ``LOCAL_RANK``/``NODE_RANK`` (and ``seed_everything`` ``PL_GLOBAL_SEED``)
    into the environment of the process that fits in-process; a later test that started a job inherited them, and
    the job's launcher, taking itself for an already-launched rank, never started its other ranks: a hang.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_process_group_left() -> Iterator[None]:
    """Fail the test that leaves a process group initialized, rather than a later test of its worker.

    Regression: an in-process fit without :func:`loopback_process_group` left its world-of-one group behind; two tests
    run after it on the same pytest worker failed (a balance broadcast over the stale group, a check that no group
    exists).
    """
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group initialized: fit in-process with the loopback_process_group fixture")


_TORCH_CONFIGS = ("torch._functorch.config", "torch._dynamo.config", "torch._inductor.config")


def _torch_state() -> dict[str, object]:
    # timm.optim raises torch._dynamo's recompile limit when first imported (the zoo imports it): imported with this
    # module, before any test's settings are recorded, so that the test that happens to import it first is not blamed.
    state: dict[str, object] = {"default dtype": torch.get_default_dtype()}
    state["default device"] = torch.get_default_device()
    for name in _TORCH_CONFIGS:
        module = sys.modules.get(name)  # only those imported: a test may import one, never change it unseen
        if module is not None:
            state.update({f"{name}.{key}": value for key, value in module.get_config_copy().items()})
    return state


@pytest.fixture(autouse=True)
def no_torch_state_left() -> Iterator[None]:
    """Fail the test that changes torch's default dtype or device or its compiler settings and leaves them changed.

    Regression: a test set ``torch._functorch.config.donated_buffer`` with ``monkeypatch.setattr``, whose undo deleted
    the setting from torch's config module; a later test's compile on the same worker then failed. Use the config's
    own ``patch``, ``torch.set_default_dtype`` in a ``try``/``finally``, or ``with torch.device(...)``.
    """
    before = _torch_state()
    yield
    after = _torch_state()
    changed = sorted(key for key in before if key in after and not _same_setting(before[key], after[key]))
    changed += sorted(key for key in before if key not in after)
    if changed:
        torch.set_default_dtype(before["default dtype"])  # type: ignore[arg-type]
        torch.set_default_device(before["default device"])  # type: ignore[arg-type]
        pytest.fail(f"the test left torch's global state changed: {', '.join(changed)}")


def _same_setting(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a setting whose == is not a truth value
        return a is b


@pytest.fixture
def loopback_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-process group for a Trainer fitted in the test's process, its store on 127.0.0.1, destroyed after."""
    with loopback_store() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield
        if dist.is_initialized():
            dist.destroy_process_group()
