"""The generate benchmark's quick size, a smoke test: every configuration runs and the headlines come last."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.runif import RunIf

from tools.launch import run_module

REPO = Path(__file__).resolve().parents[2]


@RunIf(multiprocess=True)
@pytest.mark.timeout(400)
def test_the_quick_size_prints_every_table_and_the_headlines_last() -> None:
    """A tiny Llama decoding 8 and 32 tokens, one process and K = 2 with M = 1, 2; ~1 minute on an idle machine."""
    code, out, err = run_module("benchmarks.generate.run", ["--quick", "--no-docs"], timeout=380, cwd=REPO)
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    keys = [line.partition("=")[0] for line in lines[-3:]]
    assert keys == ["predict_k2_m2_vs_one_device", "zoo_vs_transformers", "pipeline_cost_growth"]
    assert all(float(line.partition("=")[2]) > 0 for line in lines[-3:])
    for row in ("| predict, one device |", "| predict, K=2, M=1 |", "| predict, K=2, M=2 |", "| 32 |"):
        assert any(line.startswith(row) for line in lines), row
