"""``make gpu-check`` (``python -m benchmarks.gpu_check``) without a GPU, and its reporting of a failing check."""

from __future__ import annotations

import pytest
import torch

import benchmarks.gpu_check as gpu_check


def test_without_cuda_every_check_says_skipped_and_the_command_succeeds(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{name}: no CUDA device: skipped" for name in gpu_check.CHECKS]
    assert len(lines) == 12


def test_only_runs_the_named_checks(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--only", "meta init on CUDA"]) == 0
    assert capsys.readouterr().out == "meta init on CUDA: no CUDA device: skipped\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check passes where CUDA exists")
def test_a_failing_check_prints_its_reason_on_one_line(capsys) -> None:
    # A check run in its process: without CUDA the threaded-engine check fails, and the line must say why.
    assert gpu_check._run_one("threaded engine vs single device") == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("RESULT FAILED (")
    assert "\n" not in line


def test_unknown_checks_are_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "no such check"])


def test_the_threaded_engine_check_passes_on_the_cpu(monkeypatch) -> None:
    # The check's own logic, run where it can: a wrong comparison would fail here before it ever reaches a GPU.
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    assert gpu_check.check_threaded_engine().startswith("max abs gradient difference")


def test_a_test_module_that_cannot_be_imported_is_named_with_its_error(tmp_path) -> None:
    # A GPU machine without one of the suite's packages fails collection; "1 error" alone would not say why.
    (tmp_path / "test_needs_a_package.py").write_text(
        "import pytest\nimport package_this_machine_lacks\n\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n"
    )
    with pytest.raises(AssertionError, match="No module named 'package_this_machine_lacks'"):
        gpu_check.check_gpu_tests((str(tmp_path),))
