"""The pipeline schedules, checked as pure data: no torch, no devices."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from lightning_gpipe.engine.schedule import (
    SCHEDULES,
    Action,
    Phase,
    bubble_fraction,
    clock_cycles,
    dependencies,
    stage_actions,
    validate_schedule,
)
from lightning_gpipe.plan.simulate import simulate_step

GRID = [(K, M) for K in range(1, 7) for M in range(1, 13)]


def simulate(schedule: str, K: int, M: int, forward_time: float = 1.0, backward_time: float = 2.0) -> list[list[tuple]]:
    """Per stage, ``(start, end, action)`` of the schedule on an ideal machine: equal stages, free transfers."""
    step = simulate_step(schedule, [forward_time] * K, [backward_time] * K, M)
    return [[(span.start, span.end, span.action) for span in stage] for stage in step.spans]


def names(schedule: str, K: int, M: int) -> list[str]:
    return [" ".join(str(a) for a in stage_actions(schedule, j, K, M)) for j in range(K)]


def test_action_prints_short_and_accepts_phase_strings():
    assert str(Action(Phase.FORWARD, 3)) == "F3"
    assert str(Action(Phase.BACKWARD, 0)) == "B0"
    assert Action("backward", 2) == Action(Phase.BACKWARD, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"microbatch must be an int >= 0, got -1"):
        Action(Phase.FORWARD, -1)


@pytest.mark.parametrize(
    ("K", "M", "expected"),
    [
        (1, 1, ["F0 B0"]),
        (2, 3, ["F0 F1 F2 B2 B1 B0", "F0 F1 F2 B2 B1 B0"]),
        (3, 2, ["F0 F1 B1 B0"] * 3),
    ],
)
def test_gpipe_actions(K, M, expected):
    assert names("gpipe", K, M) == expected


@pytest.mark.parametrize(
    ("K", "M", "expected"),
    [
        (1, 2, ["F0 B0 F1 B1"]),
        (2, 3, ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]),
        (
            4,
            6,
            [
                "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
                "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
                "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
                "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
            ],
        ),
        # Fewer micro-batches than stages is legal: the warm-up just takes every forward.
        (4, 2, ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]),
    ],
)
def test_1f1b_actions(K, M, expected):
    assert names("1f1b", K, M) == expected


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("K", "M"), GRID)
def test_every_stage_runs_each_pass_once_forward_first(schedule, K, M):
    for j in range(K):
        actions = stage_actions(schedule, j, K, M)
        expected = {Action(p, i) for p in Phase for i in range(M)}
        assert len(actions) == 2 * M
        assert set(actions) == expected
        position = {a: n for n, a in enumerate(actions)}
        assert all(position[Action(Phase.FORWARD, i)] < position[Action(Phase.BACKWARD, i)] for i in range(M))


def test_dependencies():
    F, B = Phase.FORWARD, Phase.BACKWARD
    assert dependencies(0, Action(F, 2), 3) == []
    assert dependencies(1, Action(F, 2), 3) == [(0, Action(F, 2))]
    assert dependencies(2, Action(B, 1), 3) == [(2, Action(F, 1))]
    assert dependencies(0, Action(B, 1), 3) == [(0, Action(F, 1)), (1, Action(B, 1))]
    assert dependencies(0, Action(B, 0), 1) == [(0, Action(F, 0))]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("K", "M"), GRID)
def test_simulate_never_deadlocks_and_respects_dependencies(schedule, K, M):
    timeline = simulate(schedule, K, M)
    end = {(j, a): e for j, spans in enumerate(timeline) for _, e, a in spans}
    for j, spans in enumerate(timeline):
        assert [a for _, _, a in spans] == stage_actions(schedule, j, K, M)
        previous_end = 0.0
        for start, stop, action in spans:
            assert start >= previous_end
            previous_end = stop
            assert all(start >= end[dep] for dep in dependencies(j, action, K))


def test_simulate_reports_a_deadlock(monkeypatch):
    from lightning_gpipe.plan import simulate as simulate_module

    # The detector itself must fire: here every stage's first backward waits on a forward that comes after it.
    def backwards_first(schedule, stage, num_stages, num_microbatches):
        return [Action(Phase.BACKWARD, 0), Action(Phase.FORWARD, 0)]

    monkeypatch.setattr(simulate_module, "stage_actions", backwards_first)
    with pytest.raises(RuntimeError, match=r"deadlocks with K=2, M=1: stuck \{0: 'B0', 1: 'B0'\}"):
        simulate("gpipe", 2, 1)


@pytest.mark.parametrize(("K", "M"), GRID)
@pytest.mark.parametrize(("forward_time", "backward_time"), [(1.0, 1.0), (1.0, 2.0)])
def test_gpipe_bubble_matches_analysis(K, M, forward_time, backward_time):
    timeline = simulate("gpipe", K, M, forward_time, backward_time)
    makespan = max(spans[-1][1] for spans in timeline)
    assert makespan == (M + K - 1) * (forward_time + backward_time)
    for spans in timeline:
        idle = makespan - sum(e - s for s, e, _ in spans)
        assert idle / makespan == pytest.approx(bubble_fraction(K, M))


@pytest.mark.parametrize(("K", "M"), GRID)
def test_1f1b_same_makespan_as_gpipe_with_less_in_flight(K, M):
    gpipe = simulate("gpipe", K, M, 1.0, 1.0)
    one_f_one_b = simulate("1f1b", K, M, 1.0, 1.0)
    assert max(s[-1][1] for s in one_f_one_b) == max(s[-1][1] for s in gpipe) == 2 * (M + K - 1)
    for j in range(K):
        in_flight = peak = 0
        for action in stage_actions("1f1b", j, K, M):
            in_flight += 1 if action.phase is Phase.FORWARD else -1
            peak = max(peak, in_flight)
        assert peak == min(K - j, M)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 1) == 0.75
    assert bubble_fraction(4, 13) == 0.1875


@pytest.mark.parametrize(
    ("m", "n", "expected"),
    [
        (1, 1, [[(0, 0)]]),
        (1, 3, [[(0, 0)], [(0, 1)], [(0, 2)]]),
        (3, 1, [[(0, 0)], [(1, 0)], [(2, 0)]]),
        (
            3,
            3,
            [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)]],
        ),
        (4, 2, [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(3, 0), (2, 1)], [(3, 1)]]),
    ],
)
def test_clock_cycles(m, n, expected):
    assert list(clock_cycles(m, n)) == expected


def test_validate_schedule():
    assert validate_schedule("1f1b") == "1f1b"
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule 'interleaved'\. HINT: use one of 'gpipe', '1f1b'"):
        validate_schedule("interleaved")
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule None"):
        validate_schedule(None)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("gpipe", 0, 0, 4), ValueError, r"num_stages must be >= 1, got 0\. HINT: a pipeline has at least one stage"),
        (("gpipe", 2, 2, 4), ValueError, r"stage must satisfy 0 <= stage < num_stages = 2, got stage=2"),
        (("gpipe", -1, 2, 4), ValueError, r"got stage=-1"),
        (("gpipe", 0, 2, 0), ValueError, r"num_microbatches must be >= 1, got 0\. HINT: .*chunks >= 1"),
        (("gpipe", 0, 2, 2.0), TypeError, r"num_microbatches must be an int >= 1, got 2\.0 of type float"),
        (("gpipe", 0, True, 2), TypeError, r"num_stages must be an int >= 1, got True of type bool"),
        (("gpipe", "0", 2, 2), TypeError, r"stage must be an int, got '0' of type str"),
        (("GPipe", 0, 2, 2), ValueError, r"Unknown pipeline schedule 'GPipe'"),
    ],
)
def test_stage_actions_validation(args, error, match):
    with pytest.raises(error, match=match):
        stage_actions(*args)


def test_other_entry_points_validate():
    with pytest.raises(ValueError, match=r"num_microbatches must be >= 1, got 0"):
        list(clock_cycles(0, 2))
    with pytest.raises(ValueError, match=r"num_stages must be >= 1, got 0"):
        bubble_fraction(0, 2)
    with pytest.raises(ValueError, match=r"stage must satisfy 0 <= stage < num_stages = 2, got stage=3"):
        dependencies(3, Action(Phase.FORWARD, 0), 2)


def test_the_schedule_imports_the_standard_library_only():
    # The schedule is pure data: no torch, so it can be read, tested and simulated without devices.
    import lightning_gpipe.engine.schedule as schedule_module

    imported = set()
    for node in ast.walk(ast.parse(Path(schedule_module.__file__).read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.partition(".")[0])
    assert imported <= sys.stdlib_module_names | {"__future__"}, imported - sys.stdlib_module_names
