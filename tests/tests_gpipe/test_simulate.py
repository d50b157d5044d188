"""The event-level step simulator against schedules computed by hand."""

from __future__ import annotations

import pytest

from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.plan.simulate import in_flight, simulate_step


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
