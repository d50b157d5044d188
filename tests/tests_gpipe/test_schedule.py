"""The pipeline schedules, checked as pure data: no torch, no devices."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from lightning_gpipe.engine.schedule import (
    MULTI_STAGE,
    SCHEDULES,
    Action,
    Phase,
    bubble_fraction,
    clock_cycles,
    dependencies,
    process_actions,
    stage_actions,
    stages_of,
    validate_schedule,
)
from lightning_gpipe.plan.simulate import simulate_step

GRID = [(K, M) for K in range(1, 7) for M in range(1, 13)]
F, B, I, W = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT, Phase.WEIGHT  # noqa: E741 (the papers' letters)
# Every schedule with the stages per process it is tried with: (schedule, virtual_stages).
ALL = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zero_bubble", 1), ("zbv", 1)]
ONE_STAGE = [s for s in SCHEDULES if s not in MULTI_STAGE]  # one stage per process: stage_actions


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


@pytest.mark.parametrize("schedule", ONE_STAGE)
@pytest.mark.parametrize(("K", "M"), GRID)
def test_every_stage_runs_each_pass_once_forward_first(schedule, K, M):
    passes = (F, Phase.INPUT, Phase.WEIGHT) if schedule == "zero_bubble" else (F, B)  # zero bubble splits B
    for j in range(K):
        actions = stage_actions(schedule, j, K, M)
        expected = {Action(p, i) for p in passes for i in range(M)}
        assert len(actions) == len(passes) * M
        assert set(actions) == expected
        position = {a: n for n, a in enumerate(actions)}
        for i in range(M):
            assert [position[Action(p, i)] for p in passes] == sorted(position[Action(p, i)] for p in passes)


def test_dependencies():
    F, B = Phase.FORWARD, Phase.BACKWARD
    assert dependencies(0, Action(F, 2), 3) == []
    assert dependencies(1, Action(F, 2), 3) == [(0, Action(F, 2))]
    assert dependencies(2, Action(B, 1), 3) == [(2, Action(F, 1))]
    assert dependencies(0, Action(B, 1), 3) == [(0, Action(F, 1)), (1, Action(B, 1))]
    assert dependencies(0, Action(B, 0), 1) == [(0, Action(F, 0))]


@pytest.mark.parametrize("schedule", ONE_STAGE)
@pytest.mark.parametrize(("K", "M"), GRID)
def test_simulate_never_deadlocks_and_respects_dependencies(schedule, K, M):
    timeline = simulate(schedule, K, M)
    end = {a: e for spans in timeline for _, e, a in spans}
    for j, spans in enumerate(timeline):
        assert [a for _, _, a in spans] == process_actions(schedule, j, K, M)
        previous_end = 0.0
        for start, stop, action in spans:
            assert start >= previous_end
            previous_end = stop
            assert all(start >= end[dep] for _, dep in dependencies(j, action, K))


def test_simulate_reports_a_deadlock(monkeypatch):
    from lightning_gpipe.plan import simulate as simulate_module

    # The detector itself must fire: here every stage's first backward waits on a forward that comes after it.
    def backwards_first(schedule, rank, num_processes, num_microbatches, virtual_stages):
        return [Action(Phase.BACKWARD, 0, rank), Action(Phase.FORWARD, 0, rank)]

    monkeypatch.setattr(simulate_module, "cached_process_actions", backwards_first)
    with pytest.raises(RuntimeError, match=r"deadlocks with K=2, M=1: stuck \{0: 'B0@0', 1: 'B0@1'\}"):
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
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule 'zb'; use one of 'gpipe', '1f1b'"):
        validate_schedule("zb")
    with pytest.raises(ValueError, match=r"Unknown pipeline schedule None"):
        validate_schedule(None)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("gpipe", 0, 0, 4), ValueError, r"num_stages must be >= 1, got 0; a pipeline has at least one stage"),
        (("gpipe", 2, 2, 4), ValueError, r"stage must satisfy 0 <= stage < num_stages = 2, got stage=2"),
        (("gpipe", -1, 2, 4), ValueError, r"got stage=-1"),
        (("gpipe", 0, 2, 0), ValueError, r"num_microbatches must be >= 1, got 0; .*chunks >= 1"),
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


# --- Schedules whose processes hold several stages or split the backward pass (generated, not yet run) ---------


def names_of(schedule: str, K: int, M: int, v: int = 1) -> list[str]:
    return [" ".join(str(a) for a in process_actions(schedule, r, K, M, v)) for r in range(K)]


def replay(schedule: str, K: int, M: int, v: int = 1) -> list[Action]:
    """Run every process's list in order, each action once its dependencies have run; the order they ran in."""
    orders = [process_actions(schedule, r, K, M, v) for r in range(K)]
    num_stages = K * len(stages_of(schedule, 0, K, v))
    done: list[Action] = []
    seen: set[Action] = set()
    position = [0] * K
    moved = True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                action = order[position[r]]
                if any(dep not in seen for _, dep in dependencies(action.stage, action, num_stages)):
                    break
                done.append(action)
                seen.add(action)
                position[r] += 1
                moved = True
    stuck = {r: str(order[position[r]]) for r, order in enumerate(orders) if position[r] < len(order)}
    assert not stuck, f"{schedule} deadlocks with K={K}, M={M}, v={v}: stuck {stuck}"
    return done


def allowed(schedule: str, K: int, M: int) -> bool:
    # Interleaved rounds must split M evenly (see test_interleaved_refuses_chunks_its_rounds_cannot_split).
    return schedule != "interleaved" or M % max(1, M // K) == 0


PROCESS_GRID = [(K, M) for K in range(1, 9) for M in (1, 2, 3, 4, 5, 7, 8, 12, 16, 24)]


def test_actions_name_their_stage_and_phase_letter():
    assert str(Action(Phase.INPUT, 2, 5)) == "I2@5"
    assert str(Action(Phase.WEIGHT, 0, 0)) == "W0@0"
    assert str(Action(Phase.BACKWARD, 1)) == "B1"
    assert Action(Phase.FORWARD, 1) != Action(Phase.FORWARD, 1, 0)
    with pytest.raises(ValueError, match=r"Action.stage must be an int >= 0 or None, got -1"):
        Action(Phase.FORWARD, 0, -1)


def test_the_schedules_of_several_stages_per_process_have_actions_per_process_only():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "zero_bubble", "interleaved", "zbv"}
    assert {"interleaved", "zbv"} == MULTI_STAGE
    for name in MULTI_STAGE:
        assert validate_schedule(name) == name
        with pytest.raises(ValueError, match=rf"schedule='{name}' places several stages on each process.*process_act"):
            stage_actions(name, 0, 2, 4)


def test_stages_of():
    assert stages_of("1f1b", 2, 4) == (2,)
    assert stages_of("zero_bubble", 3, 4) == (3,)
    assert stages_of("interleaved", 1, 4, 2) == (1, 5)
    assert stages_of("interleaved", 0, 2, 3) == (0, 2, 4)
    assert stages_of("zbv", 1, 4) == (1, 6)
    assert stages_of("zbv", 0, 1, 2) == (0, 1)
    # Every stage sits on exactly one process.
    for schedule, v in ALL:
        for K in range(1, 6):
            held = [s for r in range(K) for s in stages_of(schedule, r, K, v)]
            assert sorted(held) == list(range(K * len(stages_of(schedule, 0, K, v))))


@pytest.mark.parametrize("schedule", ONE_STAGE)
@pytest.mark.parametrize(("K", "M"), [(1, 1), (2, 3), (4, 6), (4, 2)])
def test_process_actions_of_one_stage_schedules_are_stage_actions_with_the_stage(schedule, K, M):
    for r in range(K):
        assert process_actions(schedule, r, K, M) == [
            Action(a.phase, a.microbatch, r) for a in stage_actions(schedule, r, K, M)
        ]


def test_zero_bubble_h1_actions():
    # K=2, M=3: stage 0 runs 1F1B with B split and W right after I; stage 1 (the last) defers its W by one
    # micro-batch, so its I, which stage 0 waits for, goes first.
    assert names_of("zero_bubble", 2, 3) == [
        "F0@0 F1@0 I0@0 W0@0 F2@0 I1@0 W1@0 I2@0 W2@0",
        "F0@1 I0@1 F1@1 I1@1 W0@1 F2@1 I2@1 W1@1 W2@1",
    ]


def test_interleaved_actions():
    # K=2, v=2, M=4: process 0 holds stages 0 and 2, process 1 stages 1 and 3; rounds of 2 micro-batches; warm-up
    # (v-1)·2 + 2·(K-1-r) forwards, then one forward and one backward, backwards from the last stage first.
    assert names_of("interleaved", 2, 4, 2) == [
        "F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0",
        "F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 F3@3 B3@3 B2@1 B3@1",
    ]


def test_zbv_actions():
    # K=2, M=4: process 0 holds stages 0 and 3 (the V's two ends), process 1 stages 1 and 2 (its bottom).
    assert names_of("zbv", 2, 4) == [
        "F0@0 F1@0 F2@0 F0@3 I0@3 W0@3 F1@3 I1@3 W1@3 F3@0 I0@0 W0@0 F2@3 I2@3 W2@3 I1@0 W1@0 F3@3 I3@3 W3@3 "
        "I2@0 W2@0 I3@0 W3@0",
        "F0@1 F0@2 F1@1 F1@2 I0@2 W0@2 F2@1 I0@1 W0@1 F2@2 I1@2 W1@2 F3@1 I1@1 W1@1 F3@2 I2@2 W2@2 I2@1 I3@2 "
        "I3@1 W2@1 W3@2 W3@1",
    ]


@pytest.mark.parametrize(("schedule", "v"), ALL)
@pytest.mark.parametrize(("K", "M"), PROCESS_GRID)
def test_every_pass_runs_once_on_the_process_holding_its_stage_and_never_deadlocks(schedule, v, K, M):
    if not allowed(schedule, K, M):
        pytest.skip("chunks that interleaved rounds cannot split")
    split = schedule in ("zero_bubble", "zbv")
    phases = (F, I, W) if split else (F, B)
    for r in range(K):
        actions = process_actions(schedule, r, K, M, v)
        expected = [Action(p, i, s) for s in stages_of(schedule, r, K, v) for p in phases for i in range(M)]
        assert sorted(actions, key=str) == sorted(expected, key=str)  # each exactly once, nothing else
        position = {a: n for n, a in enumerate(actions)}
        for s in stages_of(schedule, r, K, v):
            for i in range(M):
                chain = [position[Action(p, i, s)] for p in phases]
                assert chain == sorted(chain), f"{schedule}: the passes of micro-batch {i} on stage {s} out of order"
    ran = replay(schedule, K, M, v)
    assert len(ran) == K * len(stages_of(schedule, 0, K, v)) * M * len(phases)


def held(actions: list[Action], frees: tuple[Phase, ...]) -> int:
    """The most (micro-batch, stage) pairs at once whose forward has run and whose freeing pass has not."""
    count = most = 0
    for action in actions:
        count += 1 if action.phase is F else -1 if action.phase in frees else 0
        most = max(most, count)
    return most


@pytest.mark.parametrize(("K", "M"), PROCESS_GRID)
def test_zero_bubble_keeps_1f1bs_activations(K, M):
    # ZB-H1's promise: no process keeps more micro-batches than 1F1B's first stage (min(K, M)) until their W, and
    # what the input gradient needs (everything the forward saved) stays within 1F1B's bound of its own stage.
    for r in range(K):
        actions = process_actions("zero_bubble", r, K, M)
        assert held(actions, (W,)) <= min(K, M)
        assert held(actions, (I,)) == held(stage_actions("1f1b", r, K, M), (B,)) == min(K - r, M)


@pytest.mark.parametrize(("K", "M"), PROCESS_GRID)
def test_zbv_keeps_1f1bs_activations(K, M):
    # Each of the two stages holds half of a process's layers: 2·min(K, M) half-stage micro-batches are the
    # activations of min(K, M) whole ones, 1F1B's first stage.
    for r in range(K):
        assert held(process_actions("zbv", r, K, M), (W,)) <= 2 * min(K, M)


def test_interleaved_refuses_chunks_its_rounds_cannot_split():
    # Rounds of M // max(1, M // K) micro-batches: K=4 takes M <= 4, multiples of 4, and M=10 (rounds of 5).
    for M in (1, 3, 4, 6, 8, 10, 12):
        process_actions("interleaved", 0, 4, M, 2)
    with pytest.raises(
        ValueError,
        match=r"cannot split chunks=9 into rounds of about pipe_size=4; use chunks <= 4 or a multiple of 4, such as "
        r"8 or 12",
    ):
        process_actions("interleaved", 0, 4, 9, 2)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            ("interleaved", 0, 2, 4, 1),
            ValueError,
            r"schedule='interleaved' needs virtual_stages >= 2.*got 1; pass virtual_stages=2",
        ),
        (("1f1b", 0, 2, 4, 2), ValueError, r"virtual_stages=2 applies to schedule='interleaved' only; leave it at 1"),
        (("zbv", 0, 2, 4, 3), ValueError, r"virtual_stages=3 applies to schedule='interleaved' only; schedule='zbv'"),
        (("interleaved", 0, 2, 4, 2.0), TypeError, r"virtual_stages must be an int, got 2\.0 of type float"),
        (
            ("zb", 0, 2, 4, 1),
            ValueError,
            r"Unknown pipeline schedule 'zb'; use one of 'gpipe', '1f1b', 'zero_bubble', 'interl",
        ),
        (
            ("zbv", 2, 2, 4, 1),
            ValueError,
            r"rank must satisfy 0 <= rank < num_processes = 2, got rank=2$",
        ),
        (("zbv", 0, 0, 4, 1), ValueError, r"num_processes must be >= 1, got 0; .*pipe_size >= 1"),
        (("zbv", "0", 2, 4, 1), TypeError, r"rank must be an int, got '0' of type str"),
        (("zbv", 0, 2, 0, 1), ValueError, r"num_microbatches must be >= 1, got 0"),
    ],
)
def test_process_actions_validation(args, error, match):
    with pytest.raises(error, match=match):
        process_actions(*args)


def test_dependencies_across_stages_and_of_split_backwards():
    assert dependencies(3, Action(F, 2, 3), 6) == [(2, Action(F, 2, 2))]
    assert dependencies(3, Action(I, 2, 3), 6) == [(3, Action(F, 2, 3)), (4, Action(I, 2, 4))]
    assert dependencies(5, Action(I, 2, 5), 6) == [(5, Action(F, 2, 5))]
    assert dependencies(3, Action(W, 2, 3), 6) == [(3, Action(I, 2, 3))]
    assert dependencies(0, Action(B, 1, 0), 2) == [(0, Action(F, 1, 0)), (1, Action(B, 1, 1))]
    with pytest.raises(ValueError, match=r"F2@3 runs on stage 3, not on stage=2; pass stage=action\.stage"):
        dependencies(2, Action(F, 2, 3), 6)
