"""Peak activation memory per process under every schedule, walked through its actions on a synthetic profile."""

from __future__ import annotations

import pytest

from lightning_gpipe.plan.memory import process_memory, stage_memory
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile

MiB = 2**20
LAYERS, SAVED, OUTPUT, TRANSIENT = 16, 0.5 * MiB, 0.125 * MiB, 0.25 * MiB
K, M, N = 4, 8, 2  # processes, micro-batches, samples per micro-batch


def profile() -> ModelProfile:
    """``LAYERS`` identical layers: per sample each saves ``SAVED``, outputs ``OUTPUT`` and needs ``TRANSIENT``."""
    layer = LayerProfile("Block", MiB, MiB, 0, SAVED, OUTPUT, TRANSIENT, 1.0)
    return ModelProfile((layer,) * LAYERS, OUTPUT, {})


def cells(stages: int) -> list[range]:
    width = LAYERS // stages
    return [range(s * width, (s + 1) * width) for s in range(stages)]


def activations(schedule: str, stages: int, checkpoint: str = "never", v: int = 1) -> list[float]:
    return [
        process_memory(
            profile(), cells(stages), rank=r, num_processes=K, num_microbatches=M, microbatch_size=N,
            batch_size=M * N, checkpoint=checkpoint, schedule=schedule, virtual_stages=v,
        ).activations
        for r in range(K)
    ]  # fmt: skip


def kept(stages: int) -> float:
    """What one micro-batch keeps on a stage that is not the last: its saved activations and the output it sent."""
    return N * (LAYERS // stages * SAVED + OUTPUT)


# A backward's incoming gradient, the largest layer's workspace, and that layer's weight gradient (1 MiB), computed
# before it is added to the one held.
WORKSPACE = N * (OUTPUT + TRANSIENT) + MiB


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_process_memory_of_one_stage_schedules_is_stage_memory(schedule: str) -> None:
    kwargs = {"num_microbatches": M, "microbatch_size": N, "batch_size": M * N, "checkpoint": "except_last"}
    for r, cell in enumerate(cells(K)):
        alone = stage_memory(profile(), cell, stage=r, num_stages=K, schedule=schedule, **kwargs)
        assert process_memory(profile(), cells(K), rank=r, num_processes=K, schedule=schedule, **kwargs) == alone


def test_1f1b_keeps_k_minus_r_micro_batches() -> None:
    assert activations("1f1b", K)[:-1] == [(K - r) * kept(K) + WORKSPACE for r in range(K - 1)]


def test_zero_bubble_keeps_1f1bs_first_stage_on_every_process() -> None:
    # ZB-H1 holds K micro-batches until their W on every process: no more than 1F1B's first stage, which sizes the
    # pipeline's memory, though more than 1F1B on the later stages.
    # The first stage's W runs its whole backward, with each layer's workspace and weight gradient; the incoming
    # gradient is counted in its I.
    one_f_one_b, zb = activations("1f1b", K), activations("zero_bubble", K)
    assert one_f_one_b[0] == K * kept(K) + WORKSPACE
    assert zb[0] == K * kept(K) + WORKSPACE - N * OUTPUT
    assert max(zb) <= max(one_f_one_b)
    assert all(z >= o for z, o in zip(zb[1:], one_f_one_b[1:], strict=True))


def test_zbv_keeps_1f1bs_activations_plus_a_boundary_per_half_stage() -> None:
    # Two half stages per process, 2K half micro-batches in flight: 1F1B's K whole ones, and each half stage also
    # keeps the output it sent. The peak is at a W, which holds no incoming gradient (as on ZB-H1's first stage).
    zbv, one_f_one_b = activations("zbv", 2 * K), activations("1f1b", K)
    assert max(zbv) == 2 * K * kept(2 * K) + WORKSPACE - N * OUTPUT
    assert max(zbv) - max(one_f_one_b) == (K - 1) * N * OUTPUT


@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_keeps_more_than_1f1b(v: int) -> None:
    # Process r's warm-up: (v-1) rounds of K micro-batches on its earlier stages and 1F1B's 2(K-1-r) more, of 1/v
    # of its layers each; the last stage, on process K-1, keeps no output.
    interleaved = activations("interleaved", K * v, v=v)
    assert interleaved[0] == ((v - 1) * K + 2 * (K - 1) + 1) * kept(K * v) + WORKSPACE
    assert interleaved[0] > activations("1f1b", K)[0]


def test_split_backwards_keep_rebuilt_micro_batches_until_w() -> None:
    # Re-materialized: I rebuilds the forward and W reads what I rebuilt instead of recomputing it, so stage r keeps
    # the r micro-batches whose W it deferred rebuilt: more memory on later stages than 1F1B's boundaries only.
    one_f_one_b, zb = activations("1f1b", K, "always"), activations("zero_bubble", K, "always")
    assert zb[0] == one_f_one_b[0] - N * OUTPUT  # the first stage's W holds no incoming gradient
    assert zb == sorted(zb)
    assert zb[-1] > one_f_one_b[-1]


def test_memory_refuses_a_mismatched_layout() -> None:
    kwargs = {"num_microbatches": M, "microbatch_size": N, "batch_size": M * N, "checkpoint": "never"}
    with pytest.raises(
        ValueError, match=r"stage_memory predicts one stage per process; schedule='zbv' has several: use process_memory"
    ):
        stage_memory(profile(), range(4), stage=0, num_stages=K, schedule="zbv", **kwargs)
    with pytest.raises(ValueError, match=r"cells has 4 ranges; schedule='zbv' with 4 processes has 8 stages"):
        process_memory(profile(), cells(K), rank=0, num_processes=K, schedule="zbv", **kwargs)
