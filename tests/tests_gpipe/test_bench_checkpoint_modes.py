"""The checkpoint modes benchmark: a tiny run measures and predicts every mode; selective keeps between the others."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.checkpoint_modes import main, measure
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES


def test_every_mode_is_measured_and_selective_keeps_between_always_and_never() -> None:
    args = argparse.Namespace(layers=2, width=32, heads=4, tokens=16, batch=8, chunks=4, rounds=1)
    results = measure(args)
    assert list(results) == list(CHECKPOINT_MODES)
    assert results["always"]["bytes"] < results["selective"]["bytes"] < results["never"]["bytes"]
    assert all(r["seconds"] > 0 and r["predicted_seconds"] > 0 for r in results.values())


def test_the_script_prints_one_row_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--tiny"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(CHECKPOINT_MODES)
