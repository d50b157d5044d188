"""The planner: its memory model and choices on synthetic profiles, infeasible answers, and a real profile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe.plan import (
    InfeasiblePlanError,
    LayerProfile,
    ModelProfile,
    evaluate,
    parse_bytes,
    plan,
    profile_layers,
    stage_memory,
)

MiB = 2**20


def synthetic(
    layers: int = 8,
    *,
    params: int = MiB,
    saved: float = 0.5 * MiB,
    output: float = 0.125 * MiB,
    transient: float = 0.25 * MiB,
    seconds: float = 1e-3,
    overhead: float = 0.5e-3,
) -> ModelProfile:
    """``layers`` identical layers; per sample ``saved``/``output``/``transient`` bytes; a forward takes ``overhead``
    plus ``seconds`` per sample, a backward twice that."""
    layer = LayerProfile("Block", params, params, 0, saved, output, transient, 1.0)
    forward = {n: overhead + seconds * n for n in (1, 2, 4, 8, 16, 32)}
    times = {n: ((t,) * layers, (2 * t,) * layers) for n, t in forward.items()}
    return ModelProfile((layer,) * layers, output, times)


def test_parse_bytes() -> None:
    assert parse_bytes("16GB") == 16 * 2**30
    assert parse_bytes("512 MiB") == 512 * MiB
    assert parse_bytes(1000) == 1000.0
    with pytest.raises(ValueError, match="unknown memory unit 'parsecs' in '3parsecs'"):
        parse_bytes("3parsecs")
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes(0)


def test_memory_of_one_stage_without_rematerialization() -> None:
    profile = synthetic()
    n, M = 4, 4
    memory = stage_memory(
        profile,
        range(8),
        stage=0,
        num_stages=1,
        num_microbatches=M,
        microbatch_size=n,
        batch_size=16,
        checkpoint="never",
    )
    assert memory.state == 8 * MiB * (1 + 1 + 2)  # parameters, gradients, Adam's two moments
    assert memory.batch == 16 * profile.input_bytes
    # Fill-drain: all M micro-batches keep every saved activation; the first backward adds the largest layer's
    # workspace. This is the last stage: its output went to the loss, and no gradient comes back to it.
    assert memory.activations == M * n * 8 * 0.5 * MiB + n * 0.25 * MiB
    assert memory.optimizer == 8 * MiB
    assert memory.peak == memory.state + memory.batch + memory.activations


def test_rematerialization_keeps_boundaries_and_rebuilds_one_micro_batch() -> None:
    profile = synthetic()
    n, M = 4, 4
    kwargs = {"num_microbatches": M, "microbatch_size": n, "batch_size": 16, "num_stages": 2}
    always = stage_memory(profile, range(4, 8), stage=1, checkpoint="always", **kwargs)
    # Stage 1 (the last) keeps each micro-batch's received input; the first backward rebuilds one micro-batch's
    # saved activations and needs the workspace.
    boundary = n * 0.125 * MiB
    assert always.activations == M * boundary + n * 4 * 0.5 * MiB + n * 0.25 * MiB
    except_last = stage_memory(profile, range(4, 8), stage=1, checkpoint="except_last", **kwargs)
    # The last micro-batch keeps its activations instead of its boundary; its backward comes first.
    assert except_last.activations == (M - 1) * boundary + n * 4 * 0.5 * MiB + n * 0.25 * MiB


def test_a_tensor_saved_by_two_neighbouring_layers_counts_once() -> None:
    # Each layer saves its input (0.25 MiB of its 0.5) and its output (0.125): layer l's saved output is layer l+1's
    # saved input, so a 4-layer stage holds 4 x 0.5 - 3 x 0.125 MiB per sample, and its output as the forward ends.
    layer = LayerProfile("Block", 0, 0, 0, 0.5 * MiB, 0.125 * MiB, 0.0, 1.0, 0.25 * MiB, 0.125 * MiB)
    profile = ModelProfile((layer,) * 4, 0.125 * MiB, {})
    memory = stage_memory(
        profile,
        range(4),
        stage=0,
        num_stages=1,
        num_microbatches=1,
        microbatch_size=1,
        batch_size=1,
        checkpoint="never",
        optimizer_slots=0,
    )
    assert memory.activations == (4 * 0.5 - 3 * 0.125 + 0.125) * MiB


def test_1f1b_holds_fewer_micro_batches_than_fill_drain() -> None:
    profile = synthetic()
    kwargs = {"num_microbatches": 8, "microbatch_size": 2, "batch_size": 16, "num_stages": 2, "checkpoint": "never"}
    gpipe = stage_memory(profile, range(4), stage=0, schedule="gpipe", **kwargs)
    one_f_one_b = stage_memory(profile, range(4), stage=0, schedule="1f1b", **kwargs)
    per_microbatch = 2 * (4 * 0.5 + 0.125) * MiB
    workspace = 2 * (0.125 + 0.25) * MiB  # the incoming gradient and the workspace
    assert gpipe.activations == 8 * per_microbatch + workspace
    assert one_f_one_b.activations == 2 * per_microbatch + workspace  # K - j = 2 in flight on stage 0


def test_evaluate_predicts_the_bubble_of_balanced_stages() -> None:
    candidate = evaluate(synthetic(), pipe_size=4, chunks=8, batch_size=32, checkpoint="never", latency=0.0)
    assert candidate.balance == (2, 2, 2, 2)
    # Transfers of 4 samples x 0.125 MiB at 2 GB/s are small but not zero: the bubble is a little above (K-1)/(M+K-1).
    assert 3 / 11 <= candidate.bubble < 3 / 11 + 0.02
    stage_pass = 2 * 3 * (0.5e-3 + 4 * 1e-3)  # two layers, forward + backward of four samples
    assert candidate.step_time == pytest.approx((8 + 3) * stage_pass, rel=0.02)


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
    assert "per stage" in str(two)


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


def test_profile_counts_bytes_alike_on_cpu_and_meta() -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    torch.manual_seed(0)
    real = profile_layers(build(), torch.randn(4, 32), microbatch_sizes=[2, 4], repeats=1, warmup=0)
    with torch.device("meta"):
        meta_layers = build()
    meta = profile_layers(meta_layers, torch.empty(4, 32, device="meta"), microbatch_sizes=[2, 4], flops_per_second=1e9)
    for a, b in zip(real.layers, meta.layers, strict=True):
        assert (a.param_bytes, a.saved_bytes, a.output_bytes, a.flops) == (
            b.param_bytes,
            b.saved_bytes,
            b.output_bytes,
            b.flops,
        )
    assert real.layers[0].saved_bytes == 32 * 4  # the Linear saves its input: 32 floats per sample
    assert real.layers[0].flops == 2 * 32 * 64
    assert meta.pass_times(4)[0][0] == pytest.approx(4 * 2 * 32 * 64 / 1e9)
    assert all(t > 0 for t in real.pass_times(3)[1])


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
