"""The planner's search: the configuration it chooses among all it weighs, its reasons, and what fits otherwise."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers.plan_profiles import FREE_LINKS, MiB, meta, synthetic
from torch import nn

from lightning_gpipe.plan import InfeasiblePlanError, evaluate, plan


def test_plan_prefers_one_device_per_replica_when_the_model_fits() -> None:
    result = plan(
        nn.Sequential(*[nn.Identity()] * 8),
        None,
        devices=2,
        memory_per_device="1GB",
        batch_size=32,
        profile=synthetic(),
    )
    assert (result.pipe_size, result.chunks, result.checkpoint) == (1, 1, "never")
    assert result.best.replicas == 2


def test_plan_rematerializes_or_pipelines_when_memory_is_short() -> None:
    profile = synthetic()
    layers = nn.Sequential(*[nn.Identity()] * 8)
    roomy = plan(layers, None, devices=1, memory_per_device="1GB", batch_size=32, profile=profile)
    assert roomy.checkpoint == "never"
    # 32 MiB of state; keeping all activations needs 32 x 4.125 MiB more: only re-materialization fits in 64 MiB.
    # (Fill-drain only: 1F1B on one stage is plain gradient accumulation, which holds one micro-batch.)
    tight = plan(
        layers, None, devices=1, memory_per_device="64MiB", batch_size=32, profile=profile, schedules=["gpipe"]
    )
    assert tight.checkpoint in ("always", "except_last")
    assert max(tight.stage_peaks) <= 64 * MiB
    assert any("checkpoint='never' does not fit" in reason for reason in tight.reasons)
    # With two devices, K = 2 halves the state: the plan says why K = 1 was not taken.
    two = plan(layers, None, devices=2, memory_per_device="40MiB", batch_size=32, profile=profile)
    assert two.pipe_size == 2
    assert any(reason.startswith("K=1 does not fit") for reason in two.reasons)
    assert sum(two.balance) == 8
    assert "why:" in str(two)
    # One row per process; a process holding several stages (interleaved, ZB-V) lists each one's layers.
    assert ("per process" if len(two.balance) > two.pipe_size else "per stage") in str(two)


def test_infeasible_request_names_the_smallest_device_count_and_memory() -> None:
    # State only (no activations to speak of): each layer holds 4 MiB and its optimizer step 1 MiB more, so 11 MiB
    # devices take two layers each: 4 devices, where 2 devices need 4 x 4 + 4 MiB each.
    profile = synthetic(saved=0, output=16, transient=0)
    layers = nn.Sequential(*[nn.Identity()] * 8)
    with pytest.raises(InfeasiblePlanError, match=r"nothing fits 2 device\(s\) with 11.0 MiB each") as caught:
        plan(layers, None, devices=2, memory_per_device="11MiB", batch_size=4, profile=profile)
    assert caught.value.min_devices == 4
    assert "HINT: 4 devices of 11.0 MiB fit" in str(caught.value)
    assert caught.value.min_memory == pytest.approx(4 * 4 * MiB + 4 * MiB, rel=0.01)


def test_plan_refuses_bad_arguments() -> None:
    layers = nn.Sequential(nn.Identity())
    with pytest.raises(ValueError, match=r"devices=0 must be an int >= 1"):
        plan(layers, None, devices=0, memory_per_device="1GB", batch_size=4, profile=synthetic(1))
    with pytest.raises(ValueError, match="checkpoint='sometimes' is not a re-materialization mode"):
        plan(layers, None, devices=1, memory_per_device="1GB", batch_size=4, checkpoints=["sometimes"])


def test_plan_of_a_real_model_trains_with_its_settings() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])
    sample = torch.randn(2, 64)
    result = plan(
        layers,
        sample,
        devices=2,
        memory_per_device="8MiB",
        batch_size=16,
        loss_fn=lambda out: out.square().mean(),
        chunks=[1, 4],
    )
    kwargs = result.strategy_kwargs()
    assert set(kwargs) == {"pipe_size", "chunks", "balance", "checkpoint", "schedule"}
    assert sum(kwargs["balance"]) == len(layers)
    assert len(kwargs["balance"]) == kwargs["pipe_size"]
    assert result.profile is not None
    assert result.profile.loss_saved_bytes > 0


def test_a_fixed_pipeline_batch_ranks_configurations_by_time_per_sample() -> None:
    # Under GPipeStrategy each pipeline reads a DataLoader's batch: K = 1 on 2 devices trains 2 x 16 samples per step
    # in one pipeline's time, which a fixed 16-sample step would rank as slower than it is.
    layers = nn.Sequential(*[nn.Identity()] * 8)
    result = plan(
        layers, None, devices=2, memory_per_device="1GB", batch_size=16, profile=synthetic(), per_pipeline_batch=True
    )
    by_k = {c.pipe_size: c for c in result.candidates}
    assert by_k[1].samples == 32
    assert result.pipe_size == 1
    assert "batch 16 per pipeline" in str(result)
    two = plan(
        layers,
        None,
        devices=2,
        memory_per_device="1GB",
        batch_size=16,
        profile=synthetic(),
        per_pipeline_batch=True,
        pipe_sizes=[2],
    )
    assert two.pipe_size == 2
    assert two.best.samples == 16
    with pytest.raises(ValueError, match=r"pipe_sizes=\[3\]: each K must divide devices=2 .* choose among \[1, 2\]"):
        plan(layers, None, devices=2, memory_per_device="1GB", batch_size=16, profile=synthetic(), pipe_sizes=[3])


def test_a_rejected_pipe_size_is_compared_with_the_chosen_one_per_sample() -> None:
    # With a batch per pipeline, K = 1 on 2 devices trains 2 x 16 samples per step, K = 2
    # 16; "K=2 fits but is slower: 334.1 ms per step of 16 samples" beside a chosen "445.0 ms per step" (of 32) read
    # as a contradiction. Both now lead with the time per sample, the measure they are ranked by.
    result = plan(
        nn.Sequential(*[nn.Identity()] * 8), None, devices=2, memory_per_device="1GB", batch_size=16,
        profile=synthetic(), per_pipeline_batch=True,
    )  # fmt: skip
    assert result.pipe_size == 1
    rejected = next(reason for reason in result.reasons if reason.startswith("K=2"))
    chosen = result.reasons[-1]
    slower = re.match(
        r"K=2 fits but is slower: ([\d.]+) ms per sample \(([\d.]+) ms per step of 16 samples\)", rejected
    )
    best = re.search(r", ([\d.]+) ms per sample \(([\d.]+) ms per step of 32 samples, 2 pipelines of 16\)", chosen)
    assert slower is not None, rejected
    assert best is not None, chosen
    assert float(slower.group(1)) > float(best.group(1))
    assert float(slower.group(2)) < float(best.group(2))  # faster per step, on half the samples
    assert "for 32 samples" in str(result)


def _batch_norm_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def test_a_batch_norm_model_with_micro_batches_of_one_sample_gets_the_planners_message() -> None:
    # plan(..., batch_size=2, devices=2) gave K = 1's two replicas one sample each, and
    # profiling that micro-batch of one raised torch's "Expected more than 1 value per channel" from BatchNorm.
    torch.manual_seed(0)
    result = plan(_batch_norm_mlp(), torch.randn(2, 8), devices=2, memory_per_device="1GB", batch_size=2)
    assert result.pipe_size == 2
    assert result.best.microbatch_size >= 2
    assert any(
        "K=1 is not weighed: its micro-batches would hold 1 sample(s) (2 pipeline(s) of 1), and BatchNorm needs at "
        "least 2 per micro-batch in training (batch_size=4 would do)" in reason
        for reason in result.reasons
    ), result.reasons
    with pytest.raises(ValueError, match=r"batch_size=2 on devices=2 gives micro-batches of 1 sample\(s\); "
                       r"BatchNorm needs 2 per micro-batch: use batch_size >= 4"):  # fmt: skip
        plan(_batch_norm_mlp(), torch.randn(2, 8), devices=2, memory_per_device="1GB", batch_size=2, pipe_sizes=[1])


def test_plan_predicts_zero_bubble_among_the_schedules_of_one_stage_per_process() -> None:
    # ZB-H1 runs in the strategy, so plan="auto" weighs it with the others: its time from the split backward's
    # simulation (a shorter drain than 1F1B's), its memory until each micro-batch's weight pass.
    profile = synthetic()
    layers = nn.Sequential(*[nn.Identity()] * 8)
    result = plan(
        layers, None, devices=4, memory_per_device="1GB", batch_size=32, profile=profile, pipe_sizes=[4],
        schedules=["gpipe", "1f1b", "zero_bubble"],
    )  # fmt: skip
    by_schedule = {
        c.schedule: c for c in result.candidates if (c.chunks, c.checkpoint) == (8, "never") and c.balance == (2,) * 4
    }
    zero_bubble, fill_drain = by_schedule["zero_bubble"], by_schedule["gpipe"]  # 1F1B: fill-drain's bubble
    assert zero_bubble.step_time < fill_drain.step_time
    assert zero_bubble.bubble < fill_drain.bubble
    assert all(m.peak > 0 for m in zero_bubble.stage_memory)
    assert result.schedule == "zero_bubble"


def test_plan_interleaves_when_the_bubble_dominates_and_memory_allows() -> None:
    # M = K: 1F1B idles 3/7 of the step. Interleaving 16 layers on K=4 divides the bubble by v (4 is the most the
    # layers allow); it keeps more micro-batches in flight, so a budget of 1F1B's peak leaves it out, and the plan
    # falls back to a schedule of one stage per process (at M = K fill-drain keeps as much as 1F1B).
    layers = nn.Sequential(*[nn.Identity()] * 16)
    asked: dict[str, Any] = {"devices": 4, "batch_size": 16, "profile": meta(), "pipe_sizes": [4], "chunks": [4]}
    asked |= {"checkpoints": ["never"], "schedules": ["gpipe", "1f1b", "interleaved"], **FREE_LINKS}
    roomy = plan(layers, None, memory_per_device="1GB", **asked)
    assert (roomy.schedule, roomy.virtual_stages, len(roomy.balance)) == ("interleaved", 4, 16)
    assert roomy.bubble == pytest.approx(3 / 19)
    assert "schedule='1f1b' is slower" in "\n".join(roomy.reasons)
    one_f_one_b = evaluate(meta(), pipe_size=4, chunks=4, batch_size=16, checkpoint="never", schedule="1f1b")
    assert one_f_one_b.peak < roomy.best.peak
    tight = plan(layers, None, memory_per_device=one_f_one_b.peak, **asked)
    assert tight.schedule in ("gpipe", "1f1b")
    assert "schedule='interleaved', virtual_stages=4 does not fit" in "\n".join(tight.reasons)


def test_plan_chooses_zbv_among_all_five_when_f_i_and_w_are_equal() -> None:
    layers = nn.Sequential(*[nn.Identity()] * 16)
    asked: dict[str, Any] = {"devices": 4, "batch_size": 32, "profile": meta(), "pipe_sizes": [4], "chunks": [8]}
    result = plan(layers, None, memory_per_device="1GB", checkpoints=["never"], **asked, **FREE_LINKS)
    assert (result.schedule, len(result.balance)) == ("zbv", 8)
    assert result.bubble == pytest.approx(3 / 51)
    why = "\n".join(result.reasons)
    for other in ("'gpipe'", "'1f1b'", "'zero_bubble'", "'interleaved', virtual_stages=2"):
        assert f"schedule={other} is slower" in why
    # The plan is the strategy's arguments: ZB-V's two stages per process take no virtual_stages.
    assert result.strategy_code() == (
        "GPipeStrategy(pipe_size=4, chunks=8, balance=[2, 2, 2, 2, 2, 2, 2, 2], checkpoint='never', schedule='zbv')"
    )


def test_plan_says_why_it_did_not_weigh_a_schedule_of_several_stages_per_process() -> None:
    # At K=1 stages sharing one process only add the engine's cost; at K=4, 6 layers cannot make ZB-V's 8 stages.
    one = plan(
        nn.Sequential(*[nn.Identity()] * 6), None, devices=1, memory_per_device="1GB", batch_size=16,
        profile=meta(6), chunks=[4],
    )  # fmt: skip
    assert any(r.startswith("schedule='zbv' is not weighed at K=1") for r in one.reasons)
    four = plan(
        nn.Sequential(*[nn.Identity()] * 6), None, devices=4, memory_per_device="1GB", batch_size=16,
        profile=meta(6), chunks=[4], pipe_sizes=[4],
    )  # fmt: skip
    assert any(r.startswith("schedule='zbv' is not weighed at K=4: its 8 stages need") for r in four.reasons)
    assert any(r.startswith("schedule='interleaved' is not weighed at K=4") for r in four.reasons)
    with pytest.raises(ValueError, match=r"virtual_stages=\[1\] must be a list of ints >= 2"):
        plan(nn.Sequential(nn.Identity()), None, devices=1, memory_per_device="1GB", batch_size=4, profile=meta(1),
             virtual_stages=[1])  # fmt: skip


def test_plan_shards_the_replicas_only_when_no_configuration_fits_whole() -> None:
    # 8 layers of 4 MiB, Adam, 4 devices restricted to K = 1 or 2: whole replicas need 82 MiB per device at best (K =
    # 2); sharded over two replicas a stage holds half its state between steps, and its parameters gathered and its
    # gradients whole during a step: 75.5 MiB.
    profile, layers = synthetic(8, params=4 * MiB), nn.Sequential(*[nn.Identity()] * 8)
    options: dict[str, Any] = {"devices": 4, "batch_size": 32, "profile": profile, "pipe_sizes": [1, 2]}
    sharded = plan(layers, None, memory_per_device="80MiB", **options)
    assert (sharded.data_parallel, sharded.pipe_size, sharded.best.replicas) == ("fsdp", 2, 2)
    assert sharded.strategy_code().endswith(", data_parallel='fsdp')")
    assert sharded.strategy_kwargs()["data_parallel"] == "fsdp"
    assert sharded.reasons[0].startswith(
        "data_parallel='fsdp': nothing fits with whole replicas ('ddp': at best 82.0 MiB per device > 80.0 MiB"
    )
    assert "gathered" in str(sharded)  # the table's column of the parameters a step gathers
    # With room for whole replicas they stay whole, and the plan says when it would shard them.
    whole = plan(layers, None, memory_per_device="100MiB", **options)
    assert whole.data_parallel == "ddp"
    assert "data_parallel" not in whole.strategy_kwargs()
    assert any("'fsdp' is weighed only when nothing fits whole" in reason for reason in whole.reasons)
    # Asked for sharded replicas, it plans them even where whole ones fit.
    asked = plan(layers, None, memory_per_device="100MiB", data_parallel="fsdp", **options)
    assert asked.data_parallel == "fsdp"
    assert any(reason.startswith("data_parallel='fsdp', as asked") for reason in asked.reasons)


def test_a_plan_of_whole_replicas_that_nothing_fits_says_what_sharding_would_hold() -> None:
    profile, layers = synthetic(8, params=4 * MiB), nn.Sequential(*[nn.Identity()] * 8)
    options: dict[str, Any] = {"devices": 4, "batch_size": 32, "profile": profile, "pipe_sizes": [1, 2]}
    whole = r"with whole replicas \(data_parallel='ddp'\) at best 82.0 MiB, "
    fits = r"sharded over them \(data_parallel='fsdp'\) at best 7\d\.\d MiB, which fits: plan with data_parallel='fsdp'"
    with pytest.raises(InfeasiblePlanError, match=whole + fits):
        plan(layers, None, memory_per_device="80MiB", data_parallel="ddp", **options)
    # "auto" weighed both: the message gives both, the thriftiest sharded.
    both = r"data_parallel='fsdp'\) peaks at .*; with whole replicas \(data_parallel='ddp'\) at best 82.0 MiB"
    with pytest.raises(InfeasiblePlanError, match=both):
        plan(layers, None, memory_per_device="40MiB", **options)
    # One pipeline of every device has no replicas to shard over.
    with pytest.raises(InfeasiblePlanError, match=r"no K weighed leaves a stage several replicas to shard it over"):
        plan(layers, None, memory_per_device="10MiB", devices=2, batch_size=32, profile=profile, pipe_sizes=[2])


def test_fsdp_over_a_single_replica_is_planned_as_ddp_and_bad_requests_are_refused() -> None:
    profile, layers = synthetic(8), nn.Sequential(*[nn.Identity()] * 8)
    alone = plan(layers, None, devices=2, memory_per_device="1GB", batch_size=32, profile=profile, pipe_sizes=[2],
                 data_parallel="fsdp")  # fmt: skip
    assert alone.data_parallel == "ddp"  # as the strategy runs it: nothing to shard over
    assert any("each stage has a single replica, nothing to shard over" in reason for reason in alone.reasons)
    with pytest.raises(ValueError, match=r"data_parallel='zero3' is not a way to plan the replicas; use 'ddp'"):
        plan(layers, None, devices=2, memory_per_device="1GB", batch_size=32, profile=profile, data_parallel="zero3")  # type: ignore[arg-type]
    # The strategy does not shard compiled stages: "fsdp" is refused, "auto" keeps the replicas whole.
    with pytest.raises(ValueError, match=r"data_parallel='fsdp' cannot be planned for compiled layers"):
        plan(layers, None, devices=2, memory_per_device="1GB", batch_size=32, profile=profile, compiled=True,
             data_parallel="fsdp")  # fmt: skip
    tight = {"devices": 4, "batch_size": 32, "profile": synthetic(8, params=4 * MiB), "pipe_sizes": [1, 2]}
    with pytest.raises(InfeasiblePlanError):
        plan(layers, None, memory_per_device="80MiB", compiled=True, **tight)
