"""Shared fixtures: every test starts from the same random state."""

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed Python, NumPy and torch so that each test is reproducible on its own."""
    value = 1234
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return value
