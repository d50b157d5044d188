"""The FSDP benchmark's results block: what the ranks hold, the step times, the planner's prediction, on a page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import benchmarks.fsdp_memory.run as bench

MiB = 2**20


def _rank(held: float, growth: float, step: float) -> dict[str, Any]:
    parts = {"parameters": held / 4, "gradients": held / 4, "optimizer": held / 2}
    return {"held": parts, "rss_growth": growth, "step": step, "cpu": step / 2}


def test_the_block_reports_the_ratio_held_the_rounds_and_the_planners_prediction() -> None:
    memory = {
        "ddp": [_rank(64 * MiB, 100 * MiB, 0.4)] * 4,
        "fsdp": [_rank(32 * MiB, 90 * MiB, 0.5)] * 4,
    }
    rounds = [{"ddp": [_rank(0, 0, 0.4)] * 4, "fsdp": [_rank(0, 0, 0.5)] * 4}] * 3
    plans = {
        "ddp": {"state": [64 * MiB, 64 * MiB], "peak": [80 * MiB, 81 * MiB], "step": 0.1},
        "fsdp": {"state": [32 * MiB, 32 * MiB], "peak": [70 * MiB, 71 * MiB], "step": 0.125},
    }
    block = bench.markdown(rounds, memory, plans, steps=10, batch=256, command="python -m benchmarks.fsdp_memory.run")
    assert bench.held_ratio(memory) == 0.5
    assert "fsdp / ddp = **0.500**" in block
    assert "**fsdp_speed_vs_ddp = 0.80**" in block
    assert sum(line.startswith("| ") and ("ddp |" in line or "fsdp |" in line) for line in block.splitlines()) == 8
    assert "state ddp 64.0 and 64.0 MiB, fsdp 32.0 and 32.0 MiB" in block
    assert "step ddp 100.0 ms, fsdp 125.0 ms: ddp / fsdp 0.80" in block


def test_the_page_holds_a_generated_block_and_is_in_the_site() -> None:
    repo = Path(__file__).resolve().parents[2]
    text = bench.PAGE.read_text()
    assert text.count(bench.BEGIN) == text.count(bench.END) == 1
    assert "benchmarks/fsdp.md" in (repo / "mkdocs.yml").read_text()
    assert "(fsdp.md)" in (repo / "docs" / "benchmarks" / "index.md").read_text()
    assert not (repo / "benchmarks" / "fsdp_memory" / "RESULTS.md").exists()
