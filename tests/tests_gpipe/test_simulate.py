"""The event-level step simulator against schedules computed by hand."""

from __future__ import annotations

import pytest

from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.plan.simulate import SimulatedStep, in_flight, simulate_step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("K", "M"), [(1, 1), (2, 1), (2, 4), (3, 5), (4, 16), (8, 32)])
def test_equal_stages_give_the_papers_bubble(schedule: str, K: int, M: int) -> None:
    f, b = 1.0, 2.0
    step = simulate_step(schedule, [f] * K, [b] * K, M)
    assert step.makespan == pytest.approx((M + K - 1) * (f + b))
    assert step.bubble == pytest.approx(bubble_fraction(K, M))
    assert step.busy == pytest.approx([M * (f + b)] * K)


def test_transfers_delay_each_crossing() -> None:
    # K=2, M=2, f=1, b=2, 0.5 s per crossing. Stage 0: F0 0-1, F1 1-2. Stage 1: F0 1.5-2.5, F1 2.5-3.5, B1 3.5-5.5,
    # B0 5.5-7.5. Stage 0: B1 6-8 (gradient arrives at 6), B0 8-10 (arrives at 8).
    step = simulate_step("gpipe", [1, 1], [2, 2], 2, transfer=0.5)
    assert step.makespan == 10.0
    assert [(s.start, s.end) for s in step.spans[0]] == [(0, 1), (1, 2), (6, 8), (8, 10)]


def test_the_slowest_stage_sets_the_pace() -> None:
    # Stage 1 takes 3 + 6 per micro-batch: stage 0's first forward, then M of stage 1's passes, then stage 0's last
    # backward: 1 + 4 * 9 + 2.
    step = simulate_step("gpipe", [1, 3], [2, 6], 4)
    assert step.makespan == 39.0


def test_recomputation_lengthens_the_checkpointed_backwards_only() -> None:
    # One stage, f=1, b=2: "always" re-runs both forwards (2 + 2 * 3); "except_last" (stop = M - 1) one of them.
    assert simulate_step("gpipe", [1], [2], 2, checkpoint_stop=2).makespan == 8.0
    assert simulate_step("gpipe", [1], [2], 2, checkpoint_stop=1).makespan == 7.0
    assert simulate_step("gpipe", [1], [2], 2, recompute=[0.5], checkpoint_stop=2).makespan == 7.0


def test_the_checkpoint_wrappers_forward_share_delays_the_next_stage() -> None:
    # The wrapper's hooks run in the first forward too. K=2, M=2, f=1, b=2, recompute 1: as a backward cost, stage 1
    # starts at 1 and the step ends at 1 + 2 * (1 + 3) + 3 = 12. Half of it in the forward: stage 0's forwards take
    # 1.5, stage 1's too (start 1.5, then 2 * (1.5 + 2.5)), and stage 0's last backward 2.5: 1.5 + 8 + 2.5 = 12 as
    # well, where only the re-materialized micro-batches pay it ("except_last": stop = 1).
    base = {"recompute": [1.0, 1.0], "checkpoint_stop": 2}
    assert simulate_step("gpipe", [1, 1], [2, 2], 2, **base).makespan == 12.0
    split = simulate_step(
        "gpipe", [1, 1], [2, 2], 2, recompute=[0.5, 0.5], checkpoint_stop=2, checkpoint_forward=[0.5, 0.5]
    )
    assert split.makespan == 12.0
    assert [span.end - span.start for span in split.spans[0][:2]] == [1.5, 1.5]
    one = simulate_step(
        "gpipe", [1, 1], [2, 2], 2, recompute=[0.5, 0.5], checkpoint_stop=1, checkpoint_forward=[0.5, 0.5]
    )
    assert [span.end - span.start for span in one.spans[0][:2]] == [1.5, 1.0]
    # Stage 1's backwards are the long ones (4): stage 0's extra 2 hides behind them in its backwards (the step ends at
    # 21 + 3 = 24), but in its forwards it delays every forward of stage 1 (stage 1 starts its backwards at 13: 30).
    wrapped = {"checkpoint_stop": 4, "checkpoint_forward": [2, 0], "recompute": [0, 0]}
    assert simulate_step("gpipe", [1, 1], [1, 4], 4, recompute=[2, 0], checkpoint_stop=4).makespan == 24.0
    assert simulate_step("gpipe", [1, 1], [1, 4], 4, **wrapped).makespan == 30.0
    with pytest.raises(ValueError, match="checkpoint_forward has 1 entries"):
        simulate_step("gpipe", [1, 1], [2, 2], 2, checkpoint_forward=[0.5])


def test_each_stage_steps_its_optimizer_after_its_last_backward() -> None:
    # K=2, M=2, f=1, b=2, free links: stage 1's last backward ends at 7, stage 0's at 9 (fill-drain ends on stage 0).
    assert simulate_step("gpipe", [1, 1], [2, 2], 2).makespan == 9.0
    # Stage 0's step lengthens the step; stage 1's hides behind stage 0's last backward until it is longer than it.
    assert simulate_step("gpipe", [1, 1], [2, 2], 2, update=[0.5, 1.0]).makespan == 9.5
    assert simulate_step("gpipe", [1, 1], [2, 2], 2, update=[0.0, 3.0]).makespan == 10.0
    assert simulate_step("gpipe", [1, 1], [2, 2], 2, update=[0.5, 1.0]).busy == (6.5, 7.0)
    with pytest.raises(ValueError, match="update has 1 entries"):
        simulate_step("gpipe", [1, 1], [2, 2], 2, update=[0.5])


@pytest.mark.parametrize(("K", "M"), [(1, 1), (2, 4), (4, 2), (4, 8), (8, 8)])
def test_in_flight_micro_batches(K: int, M: int) -> None:
    assert [in_flight("gpipe", j, K, M) for j in range(K)] == [M] * K
    assert [in_flight("1f1b", j, K, M) for j in range(K)] == [min(K - j, M) for j in range(K)]


def test_bad_times_are_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"backward has 1 entries; give one per stage boundary or stage \(2\)"):
        simulate_step("gpipe", [1, 1], [2], 4)
    with pytest.raises(ValueError, match=r"transfer holds -1.*finite number of seconds >= 0"):
        simulate_step("gpipe", [1, 1], [2, 2], 4, transfer=-1)
    with pytest.raises(ValueError, match="forward is empty"):
        simulate_step("gpipe", [], [], 4)
    with pytest.raises(ValueError, match="Unknown pipeline schedule 'zb'"):
        simulate_step("zb", [1], [1], 4)


def test_a_parked_first_send_leaves_when_its_stage_finishes_the_next_forward() -> None:
    # Over gloo the step's first activation waits for the receiver's late receive and moves when the sender next
    # calls the transport: stage 1 starts micro-batch 0 once stage 0 has finished micro-batch 1, not a link later.
    forward, backward = [3.0, 1.0], [1.0, 1.0]
    plain = simulate_step("gpipe", forward, backward, 2, transfer=0.5)
    parked = simulate_step("gpipe", forward, backward, 2, transfer=0.5, first_send_parked=True)
    assert plain.spans[1][0].start == 3.5
    assert parked.spans[1][0].start == 6.0
    assert parked.spans[1][1].start == 7.0  # micro-batch 1 goes as usual: its receive was posted ahead
    # With one micro-batch the sender's next call is the wait for its gradient: nothing is held back.
    assert simulate_step("gpipe", forward, backward, 1, transfer=0.5, first_send_parked=True).spans[1][0].start == 3.5
    for schedule in ("gpipe", "1f1b"):  # every schedule still completes
        step = simulate_step(schedule, [1.0] * 3, [2.0] * 3, 4, transfer=0.1, first_send_parked=True)
        assert step.makespan > simulate_step(schedule, [1.0] * 3, [2.0] * 3, 4, transfer=0.1).makespan


def split(schedule: str, K: int, M: int, f: float, i: float, w: float, v: int = 1) -> SimulatedStep:
    """The schedule on equal processes: per process f, i and w seconds, shared evenly by its stages."""
    per = {"interleaved": v, "zbv": 2}.get(schedule, 1)
    n = K * per
    return simulate_step(schedule, [f / per] * n, [(i + w) / per] * n, M, weight=[w / per] * n, virtual_stages=v)


# K, M with M a multiple of K, where the formulas are stated (Narayanan et al., 2021; Qi et al., 2024).
FORMULA_GRID = [(K, M) for K in (1, 2, 3, 4, 8) for M in (K, 2 * K, 4 * K)]


@pytest.mark.parametrize(("K", "M"), FORMULA_GRID)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_divides_the_bubble_by_v(K: int, M: int, v: int) -> None:
    # Megatron-LM: bubble time (K-1)·(f+b)/v against M·(f+b) of work, (K-1)/(v·M) of the ideal step, which is
    # (K-1)/(v·M + K-1) of the step itself.
    step = split("interleaved", K, M, 1.0, 2.0, 0.0, v)
    assert step.makespan == pytest.approx(M * 3.0 + (K - 1) * 3.0 / v)
    assert step.bubble == pytest.approx((K - 1) / (v * M + K - 1))
    assert step.busy == pytest.approx([M * 3.0] * K)


@pytest.mark.parametrize(("K", "M"), FORMULA_GRID)
def test_zero_bubble_h1_has_a_third_of_1f1bs_bubble(K: int, M: int) -> None:
    # Qi et al.: with F = I = W the bubble of ZB-H1 is (K-1)·(F + I - W) = (K-1)·F, 1F1B's is (K-1)·(F + I + W).
    zb = split("zero_bubble", K, M, 1.0, 1.0, 1.0)
    one_f_one_b = simulate_step("1f1b", [1.0] * K, [2.0] * K, M)
    assert zb.makespan - 3 * M == pytest.approx((K - 1) * 1.0)
    assert one_f_one_b.makespan - 3 * M == pytest.approx((K - 1) * 3.0)
    assert zb.bubble == pytest.approx((K - 1) / (3 * M + K - 1))


@pytest.mark.parametrize(("K", "M"), [(K, M) for K in (1, 2, 3, 4, 8) for M in (2 * K, 3 * K, 4 * K)])
def test_zbv_leaves_only_the_first_forwards_trip(K: int, M: int) -> None:
    # ZB-V with F = I = W (per process 1 each, 1/2 per stage) and M >= 2K: no bubble in the steady state; what is
    # left is process r waiting for the first micro-batch to come down, (K-1) stage forwards in all:
    # (K-1)/2 of 3M seconds, (K-1)/(6M + K-1) of the step.
    step = split("zbv", K, M, 1.0, 1.0, 1.0)
    assert step.makespan == pytest.approx(3 * M + (K - 1) / 2)
    assert step.bubble == pytest.approx((K - 1) / (6 * M + K - 1))


@pytest.mark.parametrize("schedule", ["interleaved", "zero_bubble", "zbv"])
@pytest.mark.parametrize(("K", "M"), [(1, 1), (2, 1), (2, 3), (3, 2), (4, 4), (4, 6), (5, 7)])
def test_the_new_schedules_never_beat_the_work_and_never_deadlock(schedule: str, K: int, M: int) -> None:
    # Unequal F, I, W and transfers: the step still ends, and never before a process's own work is done.
    if schedule == "interleaved" and M % max(1, M // K):
        pytest.skip("chunks that interleaved rounds cannot split")
    per = {"interleaved": 2, "zbv": 2}.get(schedule, 1)
    n = K * per
    forward = [1.0 + 0.1 * s for s in range(n)]
    step = simulate_step(schedule, forward, [2.0] * n, M, weight=[0.7] * n, transfer=0.05, virtual_stages=per)
    assert step.num_stages == K
    assert all(busy <= step.makespan + 1e-9 for busy in step.busy)
    assert sum(step.busy) == pytest.approx(M * (sum(forward) + 2.0 * n))


def test_a_split_backward_pays_recomputation_in_its_input_gradient() -> None:
    # One stage, f=1, I=2, W=1, recompute 1 for both micro-batches: the forward is rebuilt once, before I.
    step = simulate_step("zero_bubble", [1.0], [3.0], 2, weight=[1.0], checkpoint_stop=2)
    assert [(str(s.action), s.end - s.start) for s in step.spans[0]] == [
        ("F0@0", 1.0),
        ("I0@0", 3.0),
        ("W0@0", 1.0),
        ("F1@0", 1.0),
        ("I1@0", 3.0),
        ("W1@0", 1.0),
    ]


def test_stages_on_one_process_pass_values_for_free_and_step_together() -> None:
    # ZB-V, K=1: both stages on one process; a transfer time changes nothing, and the two updates add up.
    alone = simulate_step("zbv", [1.0, 1.0], [2.0, 2.0], 2)
    linked = simulate_step("zbv", [1.0, 1.0], [2.0, 2.0], 2, transfer=5.0, update=[0.5, 0.25])
    assert alone.makespan == 12.0
    assert linked.makespan == 12.75
    assert linked.updates == (0.75,)


def test_split_times_are_checked() -> None:
    with pytest.raises(ValueError, match=r"weight holds \[3\.0\], more than backward \[2\.0\]"):
        simulate_step("zero_bubble", [1.0], [2.0], 2, weight=[3.0])
    with pytest.raises(ValueError, match=r"forward has 3 entries, but schedule='zbv' needs a multiple of 2"):
        simulate_step("zbv", [1.0] * 3, [2.0] * 3, 2)


@pytest.mark.parametrize(("K", "M"), [(2, 4), (4, 8), (4, 2)])
def test_in_flight_of_the_new_schedules(K: int, M: int) -> None:
    # A split backward keeps its micro-batch until W: ZB-H1 holds min(K, M) on every process (1F1B's first stage).
    assert [in_flight("zero_bubble", r, K, M) for r in range(K)] == [min(K, M)] * K
    # Interleaved: (v-1) rounds more on each process, plus 1F1B's warm-up, in stage units.
    if M % K == 0:
        assert [in_flight("interleaved", r, K, M, 2) for r in range(K)] == [K + 2 * (K - 1 - r) + 1 for r in range(K)]


@pytest.mark.parametrize(("schedule", "M"), [("interleaved", 1), ("interleaved", 2), ("zbv", 1), ("zbv", 3)])
def test_a_parked_first_send_waits_only_for_a_forward_of_its_own_stage(schedule: str, M: int) -> None:
    # Regression: the parked first send was released by the sender's next action whatever its stage. An interleaved
    # process's next forward can be on its later stage, which waits for the very value parked: the planner's
    # simulation of CPU stages deadlocked ("schedule 'interleaved' deadlocks with K=2, M=1").
    step = simulate_step(schedule, [1.0] * 4, [2.0] * 4, M, transfer=0.1, first_send_parked=True, virtual_stages=2)
    assert step.makespan >= simulate_step(schedule, [1.0] * 4, [2.0] * 4, M, transfer=0.1, virtual_stages=2).makespan


def test_a_process_starts_once_its_parameters_are_gathered() -> None:
    # K=2, M=2, f=1, b=2: fill-drain ends at 9 (see above). Stage 0 gathering its parameters until 0.5 delays the whole
    # step; stage 1's gather hides behind stage 0's first forward until it ends after that forward's arrival (at 1).
    assert simulate_step("gpipe", [1, 1], [2, 2], 2, ready=[0.5, 0.0]).makespan == 9.5
    assert simulate_step("gpipe", [1, 1], [2, 2], 2, ready=[0.0, 1.0]).makespan == 9.0
    assert simulate_step("gpipe", [1, 1], [2, 2], 2, ready=[0.0, 2.5]).makespan == 10.5
    with pytest.raises(ValueError, match="ready has 1 entries"):
        simulate_step("gpipe", [1, 1], [2, 2], 2, ready=[0.5])
