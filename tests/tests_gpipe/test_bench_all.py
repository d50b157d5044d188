"""The benchmark orchestrator (``python -m benchmarks``) and the generated docs block that every benchmark rewrites."""

from __future__ import annotations

import pathlib

import pytest

import benchmarks.__main__ as orchestrator
from benchmarks.docs_page import replace_block


def test_headlines_are_the_trailing_key_value_lines() -> None:
    output = "table\n| a | b |\nnot=a headline line\nratio=1.02\n\nsmall_ratio=1.61*\n"
    assert orchestrator.headlines_from(output) == {"ratio": "1.02", "small_ratio": "1.61*"}


def test_no_headlines_when_the_output_ends_otherwise() -> None:
    assert orchestrator.headlines_from("ratio=1.0\nTraceback (most recent call last):\n") == {}


def test_every_goal_has_a_unique_key() -> None:
    keys = [goal.key for experiment in orchestrator.EXPERIMENTS for goal in experiment.headlines]
    assert len(keys) == len(set(keys)) == 14


def test_the_quick_run_has_every_goal() -> None:
    quick = [experiment for experiment in orchestrator.EXPERIMENTS if experiment.quick]
    assert {goal.key for experiment in quick for goal in experiment.headlines} == {
        "ratio_vs_torch_pipelining",
        "small_stage_ratio_vs_torch_pipelining",
        "efficiency_vs_bubble_bound",
        "pipeline1_layers_vs_naive1",
    }


def test_index_block_is_replaced_in_place(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = tmp_path / "index.md"
    index.write_text("# Benchmarks\n\nintro\n")
    monkeypatch.setattr(orchestrator, "INDEX", index)
    orchestrator._write_index(orchestrator._index_block({"ratio_vs_torch_pipelining": "0.90"}, "make bench", 60.0))
    first = index.read_text()
    assert "| `ratio_vs_torch_pipelining` | 0.90 | >= 1.00 | **no** |" in first
    assert "| `pipeline1_layers_vs_naive1` | missing |" in first
    orchestrator._write_index(orchestrator._index_block({"ratio_vs_torch_pipelining": "1.10"}, "make bench", 60.0))
    second = index.read_text()
    assert second.count(orchestrator.BEGIN) == 1
    assert "| `ratio_vs_torch_pipelining` | 1.10 | >= 1.00 | yes |" in second
    assert second.startswith("# Benchmarks\n\nintro\n")


def test_an_error_headline_is_met_at_or_below_its_goal() -> None:
    block = orchestrator._index_block({"plan_memory_error": "0.25", "plan_time_error": "0.12"}, "make bench", 60.0)
    assert "| `plan_memory_error` | 0.25 | <= 0.10 | **no** |" in block
    assert "| `plan_time_error` | 0.12 | <= 0.15 | yes |" in block


def test_a_results_block_is_replaced_in_place_or_appended() -> None:
    begin, end = "<!-- results -->", "<!-- end of results -->"
    text = f"# Page\n\nintro\n\n{begin}\nold numbers\n{end}\n\n## After\n"
    updated = replace_block(text, begin, end, "new numbers")
    assert updated == f"# Page\n\nintro\n\n{begin}\nnew numbers\n{end}\n\n## After\n"
    assert replace_block("# Page\n", begin, end, "numbers") == f"# Page\n\n{begin}\nnumbers\n{end}\n"
