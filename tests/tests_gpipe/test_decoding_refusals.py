"""A decoding call that cannot run fails on every rank with one message before any stage starts, and the ranks can
decode again after: one 2-rank job (``helpers.generation_job``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.jobs import run_job
from helpers.runif import RunIf


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_bad_decoding_calls_fail_alike_on_every_rank_before_any_stage_starts(tmp_path: Path) -> None:
    results = run_job("helpers.generation_job", [str(tmp_path)], 2, timeout=500)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    seen = [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False) for rank in range(2)]
    expected = {
        # GPT-2's learned positions used to raise a bare IndexError on one stage and gloo's error on the other.
        "prompt_too_long": "a prompt of 126 tokens and max_new_tokens=4 need 129 positions, but the model has 128",
        "no_new_tokens": "max_new_tokens=0 must be at least 1",
        "top_p_out_of_range": "top_p=1.5: sampling needs temperature > 0, top_k >= 0 (0: off) and 0 < top_p <= 1",
        "caches_too_large": "of key/value cache on stage 0, but its device (cpu) has",
    }
    for case, message in expected.items():
        errors = [seen[rank][case] for rank in range(2)]
        assert errors[0] is not None, f"{case} did not fail"
        assert errors[0] == errors[1], f"{case}: the ranks failed differently: {errors}"
        kind, text = errors[0]
        assert kind == "ValueError", (case, kind, text)
        assert message in text, (case, text)
    assert seen[0]["after"].shape == seen[1]["after"].shape == (4, 10)
    assert torch.equal(seen[0]["after"], seen[1]["after"])
