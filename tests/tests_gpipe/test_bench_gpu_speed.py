"""``make bench-gpu`` (``benchmarks.gpu_speed``): its configurations, MFU and ratios, and a dry run on the CPU."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest
import torch
from helpers.runif import RunIf

import benchmarks.gpu_speed.run as bench
from benchmarks.gpu_speed.configs import (
    CAUSAL_LM,
    CAUSAL_LM_KEYS,
    CAUSAL_LM_TINY,
    FULL,
    QUICK_KEYS,
    TINY,
    Config,
    configurations,
)
from benchmarks.gpu_speed.report import COLUMNS, model_flops, peak_tflops, read_table, rows, table
from tools.launch import run_module

REPO = pathlib.Path(__file__).resolve().parents[2]
PARAMETERS = 735_404_800  # the zoo's Transformer-L at L=12, D=2048, FF=8192, 16 heads, V=32000
QWEN2_05B_PARAMETERS = 494_032_768  # Qwen2.5-0.5B's count, its tied embedding once


def _measured(ms: float) -> dict[str, Any]:
    return {"step_seconds": [ms / 1e3] * 3, "peak_bytes": 2**30, "parameters": PARAMETERS, "device_name": "x"}


def test_mfu_reads_as_issue_33_measured_it() -> None:
    # The measured table: strategy="auto" at 194 ms a step on an H100 SXM is MFU 0.40 (989 TFLOP/s).
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("CPU") is None
    assert model_flops(FULL, PARAMETERS) / 0.194 / 989e12 == pytest.approx(0.40, abs=0.005)


def test_ratios_divide_the_same_runs_auto_by_each_configuration() -> None:
    configs = [c for c in configurations(False, False) if c.key in ("auto", "gpipe-m4-except_last", "hand-m8-never")]
    results = {
        "auto": _measured(200.0),
        "gpipe-m4-except_last": _measured(250.0),
        "hand-m8-never": {"note": "skipped (budget)"},
    }
    lines = rows(configs, results, FULL, 989.0)
    assert [line.vs_auto for line in lines] == [1.0, 0.8, None]
    assert lines[2].note == "skipped (budget)"
    parsed = read_table(table(lines, 989.0))
    assert list(parsed['`strategy="auto"`']) == ["configuration", "ms", "tokens/s", "MFU", "peak GiB", "vs auto"]
    assert parsed["gpipe K=1, M=4, except_last"]["vs auto"] == "0.80"
    assert parsed["gpipe K=1, M=4, except_last"]["tokens/s"] == "65,536"
    assert parsed["hand loop, M=8, no re-materialization"]["ms"] == "skipped (budget)"
    # Without auto in the run there is nothing to divide by: no ratio rather than one from another run.
    assert rows(configs[1:2], {"gpipe-m4-except_last": _measured(250.0)}, FULL, 989.0)[0].vs_auto is None


def test_the_strategys_new_options_join_when_it_accepts_them() -> None:
    plain = {c.key for c in configurations(False, False)}
    both = {c.key for c in configurations(True, True)}
    assert len(plain) == len(configurations(False, False))  # keys are unique: --only names one each
    assert set(QUICK_KEYS) <= plain
    assert both - plain == {
        "gpipe-m1-selective",
        "gpipe-m4-selective",
        "gpipe-m8-selective",
        "gpipe-m4-except_last-compile_arg",
        "gpipe-m4-selective-compile_arg",
    }


def test_the_budget_guesses_a_configuration_from_the_longest_of_its_kind() -> None:
    budget = bench.Budget(100.0, time.monotonic())
    eager, compiled = Config("gpipe", 4, "always"), Config("auto", user_compile=True)
    assert (budget.guess(eager), budget.guess(compiled)) == (60.0, 150.0)  # before any ran: a first compile is long
    for seconds in (12.0, 30.0, 9.0):
        budget.record(eager, seconds)
    budget.record(compiled, 70.0)
    assert (budget.guess(eager), budget.guess(compiled)) == (30.0, 70.0)
    assert 99.0 < budget.remaining() <= 100.0


def test_without_cuda_it_says_it_needs_a_gpu_and_succeeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_the_cpu_runs_only_the_tiny_model() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu"])


@RunIf(multiprocess=True)
@pytest.mark.slow  # ~25 s: a forkserver imports torch, Lightning and the zoo once, then each configuration trains
@pytest.mark.timeout(300)
def test_dry_run_on_the_cpu_prints_the_table_with_ratios_from_the_same_run() -> None:
    # The command's whole path (fresh processes, Lightning and GPipeStrategy, report) on the tiny model.
    code, out, err = run_module(
        "benchmarks.gpu_speed.run", ["--device", "cpu", "--tiny", "--quick"], timeout=270, cwd=REPO
    )
    assert code == 0, err[-3000:]
    parsed = read_table(out)
    assert list(parsed) == ['`strategy="auto"`', "gpipe K=1, M=4, except_last"]
    auto, gpipe = parsed.values()
    assert list(gpipe) == ["configuration", *COLUMNS[1:3], "MFU", *COLUMNS[4:]]
    assert auto["vs auto"] == "1.00"
    assert float(gpipe["vs auto"]) == pytest.approx(float(auto["ms"]) / float(gpipe["ms"]), abs=0.01)
    assert float(gpipe["tokens/s"].replace(",", "")) == pytest.approx(TINY.tokens / float(gpipe["ms"]) * 1e3, rel=0.01)
    assert "- device: CPU" in out


def test_an_unknown_configuration_is_refused_with_the_known_ones(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        bench.main(["--only", "auto", "gpipe-m3-never"])
    assert "gpipe-m3-never: no such configuration; choose from ['auto'" in capsys.readouterr().err


def test_the_causal_lm_workload_is_qwen2_0_5b_random_initialized() -> None:
    from benchmarks.gpu_speed.causal_lm import collated_batches, qwen2_config, qwen2_module

    config = qwen2_config(CAUSAL_LM)
    assert config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"]
    assert set(config["layer_types"]) == {"full_attention"}  # Qwen2.5-0.5B slides no window
    with torch.device("meta"):  # the shape only: nothing allocated, nothing read
        model = qwen2_module(CAUSAL_LM)
    assert sum(p.numel() for p in model.parameters()) == QWEN2_05B_PARAMETERS
    embedding, head = model.layers[0], model.layers[-1]
    assert next(embedding.parameters()) is next(head.parameters())  # tied: one nn.Parameter
    (batch, _) = collated_batches(CAUSAL_LM_TINY, 2)
    assert {name: tuple(t.shape) for name, t in batch.items()} == dict.fromkeys(batch, (8, 16))
    assert list(batch) == ["input_ids", "attention_mask", "labels"]
    assert bool((batch["input_ids"] > 0).all())
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert "Qwen2" in CAUSAL_LM.describe()
    assert "AdamW" in CAUSAL_LM.describe()


def test_the_causal_lm_table_has_issue_32s_rows_with_ratios_to_auto() -> None:
    every = {config.key: config for config in configurations(True, True)}
    configs = [every[key] for key in CAUSAL_LM_KEYS]
    measured = {
        key: {**_measured(ms), "parameters": QWEN2_05B_PARAMETERS}
        for key, ms in zip(CAUSAL_LM_KEYS, (100.0, 110.0, 125.0), strict=True)
    }
    parsed = read_table(table(rows(configs, measured, CAUSAL_LM, 989.0), 989.0))
    assert list(parsed) == ['`strategy="auto"`', "gpipe K=1, M=1, never", "gpipe K=1, M=4, except_last"]
    assert [row["vs auto"] for row in parsed.values()] == ["1.00", "0.91", "0.80"]
    assert parsed['`strategy="auto"`']["tokens/s"] == "81,920"  # 8 x 1,024 tokens in 100 ms
    # 6 N tokens + 12 L D T tokens: 26.5 TFLOP a step, 0.27 of an H100 SXM's 989 TFLOP/s in 100 ms.
    assert parsed['`strategy="auto"`']["MFU"] == "0.27"


def test_the_causal_lm_workload_refuses_the_quick_form_and_the_hand_loops(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        bench.main(["--workload", "causal_lm", "--quick"])
    assert "--quick is Transformer-L's short form" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--workload", "causal_lm", "--only", "hand-m4-never"])
    assert "hand-m4-never: no such configuration" in capsys.readouterr().err


def test_the_causal_lm_table_goes_to_its_own_block_of_the_page(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    # Without a GPU here, the measurements are stand-ins; the page is a copy of the real one, markers and all.
    page = tmp_path / "gpu.md"
    original = bench.PAGE.read_text()
    page.write_text(original)
    begin, end = bench.MARKERS["causal_lm"]
    assert "Stand-in GPU" not in original.split(begin)[1].split(end)[0]
    results = {
        key: {**_measured(100.0), "device_name": "Stand-in GPU", "software": "torch x"} for key in CAUSAL_LM_KEYS
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "PAGE", page)
    monkeypatch.setattr(bench, "measure_all", lambda configs, workload, *_: {c.key: results[c.key] for c in configs})
    assert bench.main(["--workload", "causal_lm"]) == 0
    written = page.read_text()
    block = written.split(begin)[1].split(end)[0]
    assert list(read_table(block)) == ['`strategy="auto"`', "gpipe K=1, M=1, never", "gpipe K=1, M=4, except_last"]
    assert "- device: Stand-in GPU" in block
    assert "--workload causal_lm" in block
    other = bench.MARKERS["transformer_lm"]
    assert written.split(other[0])[1].split(other[1])[0] == original.split(other[0])[1].split(other[1])[0]
    link = "../benchmarks/gpu.md#a-05b-hugging-face-language-model-against-auto"
    assert link in (REPO / "docs" / "zoo" / "causal_lm.md").read_text()
    assert "## A 0.5B Hugging Face language model against `auto`" in original


@RunIf(multiprocess=True)
@pytest.mark.slow  # ~20 s: a forkserver imports torch, Lightning, transformers and the zoo once, then three trainings
@pytest.mark.timeout(300)
def test_dry_run_of_the_causal_lm_workload_on_the_cpu() -> None:
    # The causal-LM command's whole path (a tiny Qwen2 as PretrainedCausalLM, collator batches, GPipeStrategy at
    # M = 1 and 4, auto, the report) in fresh processes.
    code, out, err = run_module(
        "benchmarks.gpu_speed.run", ["--workload", "causal_lm", "--device", "cpu", "--tiny"], timeout=270, cwd=REPO
    )
    assert code == 0, err[-3000:]
    parsed = read_table(out)
    assert list(parsed) == ['`strategy="auto"`', "gpipe K=1, M=1, never", "gpipe K=1, M=4, except_last"]
    auto = parsed['`strategy="auto"`']
    assert auto["vs auto"] == "1.00"
    for row in parsed.values():
        assert float(row["vs auto"]) == pytest.approx(float(auto["ms"]) / float(row["ms"]), abs=0.01)
        tokens_per_second = CAUSAL_LM_TINY.tokens / float(row["ms"]) * 1e3
        assert float(row["tokens/s"].replace(",", "")) == pytest.approx(tokens_per_second, rel=0.01)
    assert "- device: CPU" in out
    assert "a random-initialized Qwen2" in out
