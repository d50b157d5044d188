"""The state benchmark: its table and headlines from per-rank records, and a smoke run of the whole module."""

from __future__ import annotations

import pytest
from helpers.runif import RunIf

from benchmarks.state_memory.run import headlines, table
from tools.launch import run_module

MIB = 2**20


def _record(kind: str, K: int, rank: int, load: float, save: float) -> dict[str, object]:
    # A 100M-parameter model (400 MiB in float32) split evenly: each rank's own state is 3 x 400 / K MiB.
    rises = {"load_setup": load * 400 * MIB, "first_step": 0, "save": save * 400 * MIB, "resume": 0}
    return {"kind": kind, "K": K, "rank": rank, "whole_parameters": 100 * MIB, "stage_parameters": 100 * MIB // K,
            "rises": rises, "seconds": {"save": 1.5, "resume": 2.25}}  # fmt: skip


def test_the_table_gives_each_phase_of_the_whole_model_and_of_the_ranks_own_state() -> None:
    lines = table([_record("full", 4, 1, load=0.5, save=0.75)])
    assert lines[0].startswith("| format | K | rank | own state MiB | load_setup (whole / own) |")
    assert lines[2] == "| full | 4 | 1 | 300 | 0.50 / 0.67 | 0.00 / 0.00 | 0.75 / 1.00 | 0.00 / 0.00 | 1.5 | 2.2 |"


def test_headlines_take_the_worst_rank_at_the_largest_k() -> None:
    records = [
        _record("full", 2, 0, load=2.0, save=9.0),  # at K = 2: not the headline
        _record("full", 4, 0, load=0.25, save=0.03),
        _record("full", 4, 1, load=0.5, save=0.06),
        _record("sharded", 4, 0, load=0.3, save=0.3),
    ]
    assert headlines(records) == [
        "state_load_growth_vs_whole_k4=0.50",
        "state_full_save_growth_vs_state_k4=0.02",
        "state_sharded_save_growth_vs_state_k4=0.10",
    ]


@pytest.mark.slow
@RunIf(multiprocess=True)
def test_smoke_run_prints_the_table_and_the_headlines_last() -> None:
    """The whole run with a tiny Llama, K = 1 and 2, both formats: six fresh ranks in four jobs (~90 s)."""
    code, out, err = run_module("benchmarks.state_memory.run", ["--tiny", "--ks", "1", "2"], timeout=900)
    assert code == 0, err[-4000:]
    lines = out.strip().splitlines()
    assert lines[-3].startswith("state_load_growth_vs_whole_k2=")
    assert lines[-1].startswith("state_sharded_save_growth_vs_state_k2=")
    assert sum(line.startswith("| sharded | 2 |") for line in lines) == 2
