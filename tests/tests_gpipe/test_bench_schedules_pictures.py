"""The schedules page's pictures: every schedule drawn from its simulated step, with the bubble of its formula."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.schedules_pictures import SCHEDULES, main, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# K = 4, M = 8, F = 1, B = 2 (I = W = 1) per process: the page's table.
EXPECTED = {"gpipe": 3 / 11, "1f1b": 3 / 11, "interleaved": 3 / 19, "zero_bubble": 3 / 27, "zbv": 3 / 51}


@pytest.mark.parametrize(("schedule", "v", "title"), SCHEDULES)
def test_the_pictured_steps_have_the_pages_bubbles(schedule: str, v: int, title: str) -> None:
    assert simulate(schedule, v, 4, 8).bubble == pytest.approx(EXPECTED[schedule])


def test_the_script_draws_one_png_per_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--out", str(tmp_path), "--processes", "2", "--chunks", "4"])
    for schedule, _, _ in SCHEDULES:
        assert (tmp_path / f"schedules_{schedule}.png").read_bytes().startswith(PNG_MAGIC)
    assert len(capsys.readouterr().out.splitlines()) == len(SCHEDULES)
