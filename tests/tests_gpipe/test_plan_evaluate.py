"""One configuration weighed: the step time and bubble the planner predicts from a profile, schedule by schedule."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers.plan_profiles import FREE_LINKS, MiB, meta, synthetic

from lightning_gpipe.engine.microbatch import scatter
from lightning_gpipe.plan import (
    DEFAULT_BOUNDARY_OVERHEAD,
    DEFAULT_MICROBATCH_OVERHEAD,
    DEFAULT_REMATERIALIZATION_OVERHEAD,
    evaluate,
)


def test_evaluate_predicts_the_bubble_of_balanced_stages() -> None:
    candidate = evaluate(
        synthetic(),
        pipe_size=4,
        chunks=8,
        batch_size=32,
        checkpoint="never",
        latency=0.0,
        overhead=0.0,
        boundary_overhead=0.0,
        first_send_parked=False,  # the paper's bubble: no transport holds a message back
    )
    assert candidate.balance == (2, 2, 2, 2)
    # Transfers of 4 samples x 0.125 MiB at 2 GB/s are small but not zero: the bubble is a little above (K-1)/(M+K-1).
    assert 3 / 11 <= candidate.bubble < 3 / 11 + 0.02
    stage_pass = 2 * 3 * (0.5e-3 + 4 * 1e-3)  # two layers, forward + backward of four samples
    assert candidate.step_time == pytest.approx((8 + 3) * stage_pass, rel=0.02)


def test_measured_rematerialization_and_optimizer_steps_enter_the_step_time() -> None:
    base = synthetic(4)
    never = evaluate(base, pipe_size=1, chunks=4, batch_size=16, checkpoint="never")
    # Measured: re-materializing each layer adds 5 ms per micro-batch, the wrapper 1 ms once per stage; each layer's
    # optimizer step takes 2 ms, and 3 ms once per stage.
    measured = replace(
        base,
        recompute=dict.fromkeys(base.times, (0.005,) * 4),
        recompute_call=1e-3,
        updates=(2e-3,) * 4,
        update_call=3e-3,
    )
    stepped = evaluate(measured, pipe_size=1, chunks=4, batch_size=16, checkpoint="never")
    assert stepped.step_time == pytest.approx(never.step_time + 4 * 2e-3 + 3e-3)
    always = evaluate(measured, pipe_size=1, chunks=4, batch_size=16, checkpoint="always")
    assert always.step_time == pytest.approx(stepped.step_time + 4 * (4 * 5e-3 + 1e-3))
    # Where 2 ms of each layer's 5 fall in the first forward, one stage takes as long (where it falls matters only
    # between stages: tests/tests_gpipe/test_simulate.py).
    split = replace(measured, recompute_forward=dict.fromkeys(base.times, (0.002,) * 4))
    assert split.recompute_forward_times(4) == [0.002] * 4
    forwards = evaluate(split, pipe_size=1, chunks=4, batch_size=16, checkpoint="always")
    assert forwards.step_time == pytest.approx(always.step_time)
    # Unmeasured (FLOP-rate profiles): the forward again, plus the wrapper's default cost.
    unmeasured = evaluate(base, pipe_size=1, chunks=4, batch_size=16, checkpoint="always")
    forward = sum(base.pass_times(4)[0])
    assert unmeasured.step_time == pytest.approx(
        never.step_time + 4 * (forward + DEFAULT_REMATERIALIZATION_OVERHEAD["cpu"])
    )


def test_evaluate_adds_the_engines_cost_per_micro_batch() -> None:
    # Layers are profiled alone; what the engine adds per micro-batch (Python, bookkeeping, the re-materialization
    # wrapper) grows with M, which a sum of layer times misses: the prediction underestimated large M.
    profile = synthetic()
    options: dict[str, Any] = {"pipe_size": 1, "chunks": 8, "batch_size": 32, "latency": 0.0}
    bare = evaluate(profile, checkpoint="never", overhead=0.0, **options)
    engine = evaluate(profile, checkpoint="never", overhead=2e-3, **options)
    assert engine.step_time - bare.step_time == pytest.approx(8 * 2e-3)
    replayed = evaluate(profile, checkpoint="always", overhead=2e-3, **options)
    plain_replay = evaluate(profile, checkpoint="always", overhead=0.0, **options)
    ratio = DEFAULT_REMATERIALIZATION_OVERHEAD["cpu"] / DEFAULT_MICROBATCH_OVERHEAD["cpu"]
    assert replayed.step_time - plain_replay.step_time == pytest.approx(8 * 2e-3 * (1 + ratio))
    assert evaluate(profile, checkpoint="never", **options).step_time == pytest.approx(
        bare.step_time + 8 * DEFAULT_MICROBATCH_OVERHEAD["cpu"]
    )


def test_evaluate_charges_each_stage_its_boundaries_per_micro_batch() -> None:
    # A stage's own thread sends and receives every micro-batch at each of its boundaries, which a layer profiled
    # alone, and the engine's per-micro-batch overhead (measured on one stage) never do.
    options: dict[str, Any] = {"pipe_size": 3, "chunks": 8, "batch_size": 32, "checkpoint": "never"}
    options.update(balance=[3, 2, 3], latency=0.0, overhead=0.0)
    bare = evaluate(synthetic(), boundary_overhead=0.0, **options)
    charged = evaluate(synthetic(), boundary_overhead=1e-3, **options)
    added = [after - before for after, before in zip(charged.stage_busy, bare.stage_busy, strict=True)]
    assert added == pytest.approx([8e-3, 16e-3, 8e-3])  # the middle stage has two boundaries
    assert charged.step_time > bare.step_time
    alone = {**options, "pipe_size": 1, "balance": None}
    assert evaluate(synthetic(), boundary_overhead=1e-3, **alone).step_time == pytest.approx(
        evaluate(synthetic(), boundary_overhead=0.0, **alone).step_time
    )
    # By default the CPU figure is charged.
    assert evaluate(synthetic(), **options).stage_busy[1] - bare.stage_busy[1] == pytest.approx(
        16 * DEFAULT_BOUNDARY_OVERHEAD["cpu"]
    )


def test_evaluate_holds_the_first_message_of_cpu_stages_until_the_next_forward() -> None:
    # CPU stages talk over gloo, which parks the step's first activation (see simulate_step): the default charges it.
    options = {"pipe_size": 2, "chunks": 4, "batch_size": 32, "checkpoint": "never", "latency": 0.0}
    parked, free = evaluate(synthetic(), **options), evaluate(synthetic(), **options, first_send_parked=False)
    stage_forward = 4 * (0.5e-3 + 8 * 1e-3)  # four layers' forward of eight samples
    assert parked.step_time - free.step_time == pytest.approx(stage_forward, rel=0.05)


@pytest.mark.parametrize(
    ("schedule", "v", "bubble"),
    [
        ("gpipe", 1, 3 / 11),  # (K-1)/(M+K-1)
        ("1f1b", 1, 3 / 11),
        ("interleaved", 2, 3 / 19),  # (K-1)/(v·M+K-1)
        ("interleaved", 4, 3 / 35),
        ("zero_bubble", 1, 3 / 27),  # ZB-H1, F = I = W: (K-1)/(3M+K-1)
        ("zbv", 1, 3 / 51),  # ZB-V, F = I = W, M >= 2K: (K-1)/(6M+K-1)
    ],
)
def test_evaluate_predicts_each_schedules_formula_on_balanced_stages(schedule: str, v: int, bubble: float) -> None:
    # K=4, M=8 over 16 equal layers: K·v stages of equal layers, each process's stages simulated together.
    candidate = evaluate(
        meta(), pipe_size=4, chunks=8, batch_size=32, checkpoint="never", schedule=schedule, virtual_stages=v,
        **FREE_LINKS,
    )  # fmt: skip
    per_process = {"interleaved": v, "zbv": 2}.get(schedule, 1)
    assert len(candidate.balance) == 4 * per_process
    assert len(candidate.stage_memory) == len(candidate.stage_busy) == 4
    assert candidate.bubble == pytest.approx(bubble)


def test_evaluate_takes_the_weight_gradient_from_the_layers_with_weights_only() -> None:
    # Without trainable parameters a backward has no W: ZB-H1 has nothing to move into the drain, so it predicts
    # 1F1B's step; with them (W = B/2) it predicts less.
    settings: dict[str, Any] = {"pipe_size": 4, "chunks": 8, "batch_size": 32, "checkpoint": "never", **FREE_LINKS}
    frozen = replace(meta(), layers=tuple(replace(layer, trainable_bytes=0) for layer in meta().layers))
    assert evaluate(frozen, schedule="zero_bubble", **settings).step_time == pytest.approx(
        evaluate(frozen, schedule="1f1b", **settings).step_time
    )
    assert evaluate(meta(), schedule="zero_bubble", **settings).step_time < (
        evaluate(meta(), schedule="1f1b", **settings).step_time
    )


@pytest.mark.parametrize(("schedule", "v", "remote"), [("1f1b", 1, 2), ("interleaved", 2, 6), ("zbv", 1, 4)])
def test_a_boundary_costs_its_stages_only_between_two_processes(schedule: str, v: int, remote: int) -> None:
    # K=2: 1F1B has one boundary (two stage ends); interleaved v=2 three, all between processes (v times 1F1B's
    # messages, less one); ZB-V three, but its middle one (stages 1 and 2) lies on process 1 and costs nothing.
    stages = 2 * {"interleaved": v, "zbv": 2}.get(schedule, 1)
    settings: dict[str, Any] = {"pipe_size": 2, "chunks": 4, "batch_size": 16, "checkpoint": "never"}
    settings |= {"schedule": schedule, "virtual_stages": v, "balance": [16 // stages] * stages}
    base = evaluate(meta(), boundary_overhead=0.0, **settings, **FREE_LINKS)
    charged = evaluate(meta(), boundary_overhead=1e-3, **settings, **FREE_LINKS)
    assert sum(charged.stage_busy) - sum(base.stage_busy) == pytest.approx(4 * remote * 1e-3)


def test_evaluate_takes_the_split_backward_from_the_profiles_measured_passes() -> None:
    # The planner derived I and W from the whole backward (W = B/2), but the engine's split (its graph walk,
    # an autograd call per group of parameters) costs more than B, so zero_bubble and zbv were predicted too fast.
    # Measured I = W = B here; K=2, M=1: F0, F1, I1 (8B), then stage 0's split, which has no input gradient: its
    # input pass only walks the graph (0 here) and its weight pass is the whole backward (8B).
    ratio = meta()
    times = {n: b for n, (_, b) in ratio.times.items()}
    zeros = dict.fromkeys(times, (0.0,) * 16)
    measured = replace(ratio, split_input=times, split_weight=times, split_walk=zeros)
    settings: dict[str, Any] = {"pipe_size": 2, "chunks": 1, "batch_size": 4, "checkpoint": "never", **FREE_LINKS}
    forward, backward = ratio.pass_times(4)
    F, B = 8 * forward[0], 8 * backward[0]
    assert evaluate(measured, schedule="zero_bubble", **settings).step_time == pytest.approx(2 * F + 2 * B)
    # Unmeasured (a profile from FLOPs): W is half of B on every stage, the first's I the other half.
    assert evaluate(ratio, schedule="zero_bubble", **settings).step_time == pytest.approx(2 * F + 1.5 * B)
    # The other schedules do not split: the measured passes change nothing.
    assert (
        evaluate(measured, schedule="1f1b", **settings).step_time
        == evaluate(ratio, schedule="1f1b", **settings).step_time
    )


def test_a_stages_split_pays_per_autograd_node_of_its_earlier_layers() -> None:
    # Summed layer by layer, the split of a stage read short of the engine's, whose weight
    # pass makes one autograd call per group of parameters, each walking the whole graph below it (and the input pass
    # searches below each group): a stage's later layers pay per node of its earlier ones.
    base = meta(4)
    times = {n: b for n, (_, b) in base.times.items()}
    zeros = dict.fromkeys(times, (0.0,) * 4)
    per_node = (1e-6,) * 4  # a second per million nodes below, for I and for W
    layers = tuple(replace(layer, graph_nodes=100) for layer in base.layers)
    flat = replace(base, layers=layers, split_input=times, split_weight=times, split_walk=zeros)
    deep = replace(flat, split_input_below=per_node, split_weight_below=per_node)
    settings: dict[str, Any] = {"pipe_size": 2, "chunks": 1, "batch_size": 4, "checkpoint": "never", **FREE_LINKS}
    # The last stage's second layer pays for its first's 100 nodes in I and in W, both on the path of M = 1 (its W
    # ends the step, as long as stage 0's whole backward without them); the first stage pays nothing (no groups).
    flat_step, deep_step = (evaluate(p, schedule="zero_bubble", **settings) for p in (flat, deep))
    assert deep_step.step_time - flat_step.step_time == pytest.approx(2 * 100 * 1e-6)
    assert deep_step.stage_busy[0] == pytest.approx(flat_step.stage_busy[0])
    assert deep_step.stage_busy[1] == pytest.approx(flat_step.stage_busy[1] + 2 * 100 * 1e-6)


def test_a_split_backwards_weight_pass_pays_the_engines_cost_of_a_pass() -> None:
    # ZB-H1 on one stage has no bubble to fill: its step is 1F1B's plus one more pass per micro-batch, W, which the
    # engine runs as it runs F and B (half its cost per micro-batch each).
    settings: dict[str, Any] = {"pipe_size": 1, "chunks": 4, "batch_size": 16, "checkpoint": "never", **FREE_LINKS}
    plain = evaluate(meta(), schedule="1f1b", overhead=1e-3, **settings)
    split = evaluate(meta(), schedule="zero_bubble", overhead=1e-3, **settings)
    assert split.step_time - plain.step_time == pytest.approx(4 * 1e-3 / 2)


def test_the_planner_weighs_the_micro_batches_the_engine_splits_for_every_batch_and_chunks() -> None:
    # The planner counted ceil(N / ceil(N / M)) micro-batches where the engine splits min(M, N): 12 samples with
    # chunks=8 are 8 micro-batches of 2 or 1 samples, which the planner simulated as 6 of 2.
    profile = synthetic(2)
    for total in range(1, 65):
        for chunks in range(1, 65):
            engine = scatter(torch.zeros(total, 1), chunks)
            weighed = evaluate(profile, pipe_size=1, chunks=chunks, batch_size=total, checkpoint="never")
            assert (weighed.chunks, weighed.microbatch_size) == (len(engine), engine[0].size), (total, chunks)


def test_sharded_replicas_gather_before_the_step_reduce_after_it_and_update_their_shards() -> None:
    # One stage of 8 MiB of parameters on 4 replicas, over a link of 1e9 bytes per second: whole replicas all-reduce
    # 2 x 3/4 of the gradients after the step; sharded ones gather 3/4 of the parameters before their first action,
    # reduce-scatter 3/4 of the gradients after their last, and their optimizer steps over a quarter of the parameters
    # (its cost per call whole).
    profile = replace(synthetic(8), updates=(1e-3,) * 8, update_call=2e-3)
    options: dict[str, Any] = {"pipe_size": 1, "chunks": 1, "batch_size": 16, "checkpoint": "never", "replicas": 4}
    options |= {"bandwidth": 1e9, "latency": 0.0, "overhead": 0.0, "boundary_overhead": 0.0}
    whole = evaluate(profile, data_parallel="ddp", **options)
    sharded = evaluate(profile, data_parallel="fsdp", **options)
    link = 3 / 4 * 8 * MiB / 1e9
    compute = whole.step_time - 2 * link - (8e-3 + 2e-3)
    assert sharded.step_time == pytest.approx(link + compute + link + (8e-3 / 4 + 2e-3))
    assert (whole.data_parallel, sharded.data_parallel) == ("ddp", "fsdp")
    # One replica has nothing to shard over: planned as the strategy runs it, whole.
    alone = evaluate(profile, data_parallel="fsdp", **{**options, "replicas": 1})
    assert alone.data_parallel == "ddp"
