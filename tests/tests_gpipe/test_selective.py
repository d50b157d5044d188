"""Selective re-materialization: what it keeps and recomputes, training equal to the other modes, its memory between
"always" and "never" as measured and as the planner predicts it, and the planner's time model of it."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpipe.engine.pipeline import Pipeline, run_in_threads
from lightning_gpipe.engine.rematerialization import CheckpointMode, checkpoint_stop, checkpointed, selective_checkpoint
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.plan import evaluate, plan
from lightning_gpipe.plan.memory import stage_memory
from lightning_gpipe.plan.search import _memory_balanced
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile, profile_layers
from lightning_gpipe.profile.tensor_bytes import LiveTensorBytes

WIDTH, HEADS, TOKENS = 32, 4, 16


class Block(nn.Module):
    """A pre-norm Transformer layer in miniature: attention by ``scaled_dot_product_attention``, an MLP, dropout."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(rows, TOKENS, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(rows, TOKENS, WIDTH)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


def transformer(layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(layers)])


def batch(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, TOKENS, WIDTH, generator=generator), torch.randn(rows, TOKENS, WIDTH, generator=generator)


def mse(output: torch.Tensor, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(output, microbatch[1])


class OpCounter(TorchDispatchMode):
    """Counts the operators run while active, by name (``aten.addmm.default`` -> ``"addmm"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_selective_spares_the_last_micro_batch_like_except_last() -> None:
    assert checkpoint_stop("selective", 4) == 3
    assert checkpoint_stop("selective", 1) == 0


def test_compiled_selective_rematerializes_every_micro_batch_and_the_planner_knows_it() -> None:
    # Compiled layers re-materialize themselves inside their graphs: the last micro-batch is no exception.
    assert checkpoint_stop("selective", 4, compiled=True) == 4
    assert [checkpoint_stop(mode, 4, compiled=True) for mode in ("always", "except_last", "never")] == [4, 3, 0]
    options: dict[str, Any] = {"pipe_size": 1, "chunks": 4, "batch_size": 16, "overhead": 0.0}
    eager = evaluate(synthetic(0.2e-3), checkpoint="selective", **options)
    compiled = evaluate(synthetic(0.2e-3), checkpoint="selective", compiled=True, **options)
    assert compiled.step_time > eager.step_time  # a fourth replay
    assert compiled.stage_memory[0].activations <= eager.stage_memory[0].activations  # the last keeps no more


@pytest.mark.parametrize(("selective", "replayed_matmuls"), [(False, 1), (True, 0)])
def test_the_replay_reads_kept_matmul_outputs_and_recomputes_the_rest(selective: bool, replayed_matmuls: int) -> None:
    # The forward's matrix multiplications run as addmm (the backward's as mm). A whole replay runs the first Linear
    # again (torch stops it before the last, whose output nothing saved); a selective replay runs none of them, but
    # still recomputes the norm and the activation that the backward needs.
    cell = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    output = checkpointed(cell, torch.randn(5, 8, requires_grad=True), selective=selective)
    counter = OpCounter()
    with counter:
        output.sum().backward()
    assert counter.counts["addmm"] == replayed_matmuls
    assert counter.counts["native_layer_norm"] == 1
    assert counter.counts["gelu"] == 1


def pipelined_grads(
    mode: CheckpointMode, stages: int = 2, chunks: int = 4, schedule: str = "gpipe"
) -> list[torch.Tensor]:
    model = transformer()
    cells = [model[:2], model[2:]] if stages == 2 else [model]
    run_in_threads(cells, batch(), mse, chunks=chunks, checkpoint=mode, schedule=schedule, seeds=[3, 4][:stages])
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_selective_trains_like_never_and_always_dropout_replayed(schedule: str, chunks: int) -> None:
    # Dropout draws its masks from each stage's stream: a replay that drew new ones would change the gradients.
    never = pipelined_grads("never", chunks=chunks, schedule=schedule)
    for mode in ("selective", "always"):
        for got, expected in zip(pipelined_grads(mode, chunks=chunks, schedule=schedule), never, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def measured_activations(layers: nn.Sequential, mode: CheckpointMode, chunks: int) -> int:
    """The peak bytes of the tensors a second training step creates (the gradients exist already after the first)."""
    pipeline = Pipeline(layers, ThreadTransport.create(1)[0], chunks=chunks, checkpoint=mode)
    data = batch()  # made outside the count: the planner counts the mini-batch apart from the activations
    pipeline.train_step(data, mse)
    counter = LiveTensorBytes()
    with counter:
        pipeline.train_step(data, mse)
    return counter.peak


def test_selective_memory_lies_between_always_and_never_and_the_planner_predicts_it() -> None:
    # Measured under the engine with the profiler's exact storage counting, and predicted from a profile of the same
    # layers: the planner's memory walk must hold within its 10% tolerance for the selective mode as for the others.
    layers, rows, chunks = transformer(), 16, 4
    profile = profile_layers(
        layers,
        batch()[0],
        microbatch_sizes=[rows // chunks],
        repeats=1,
        warmup=0,
        loss_fn=lambda output: output.square().mean(),
        rematerialized=False,
        optimizer=None,
    )
    assert all(layer.selective_bytes > 0 for layer in profile.layers)
    measured, predicted = {}, {}
    for mode in ("always", "selective", "never"):
        measured[mode] = measured_activations(layers, mode, chunks)
        predicted[mode] = stage_memory(
            profile, range(len(layers)), stage=0, num_stages=1, num_microbatches=chunks,
            microbatch_size=rows // chunks, batch_size=rows, checkpoint=mode, optimizer_slots=0,
        ).activations  # fmt: skip
    assert measured["always"] < measured["selective"] < measured["never"]
    for mode, peak in measured.items():
        assert predicted[mode] == pytest.approx(peak, rel=0.1), mode


def synthetic(selective_seconds: float | None) -> ModelProfile:
    """Eight layers, each saving 0.5 MiB per sample of which selective keeps 0.25; a forward takes 1 ms per sample, a
    backward 2, a full replay 1 and a selective one ``selective_seconds`` (``None``: not measured)."""
    layer = LayerProfile("Block", 2**20, 2**20, 0, 2**19, 2**17, 2**18, 1.0, selective_bytes=2**18)
    sizes = (1, 2, 4, 8, 16, 32)
    profile = ModelProfile(
        (layer,) * 8,
        2**17,
        {n: ((1e-3 * n,) * 8, (2e-3 * n,) * 8) for n in sizes},
        recompute={n: (1e-3 * n,) * 8 for n in sizes},
    )
    if selective_seconds is None:
        return profile
    return replace(profile, selective_recompute={n: (selective_seconds * n,) * 8 for n in sizes})


def test_the_planner_charges_a_selective_replay_what_it_measured() -> None:
    options: dict[str, Any] = {"pipe_size": 1, "chunks": 4, "batch_size": 16, "overhead": 0.0}
    except_last = evaluate(synthetic(0.2e-3), checkpoint="except_last", **options)
    selective = evaluate(synthetic(0.2e-3), checkpoint="selective", **options)
    # Three replayed micro-batches of 4 samples through 8 layers: 0.8 ms per layer less each.
    assert except_last.step_time - selective.step_time == pytest.approx(3 * 8 * 4 * 0.8e-3, rel=1e-6)
    assert except_last.peak < selective.peak
    # Not measured, a selective replay is charged as a whole one.
    unmeasured = evaluate(synthetic(None), checkpoint="selective", **options)
    assert unmeasured.step_time == pytest.approx(except_last.step_time)


def test_the_planner_chooses_selective_where_it_fits_and_is_faster() -> None:
    layers = nn.Sequential(*[nn.Identity()] * 8)
    options: dict[str, Any] = {"devices": 1, "batch_size": 32, "schedules": ["gpipe"], "chunks": [4]}
    roomy = plan(layers, None, memory_per_device="1GB", profile=synthetic(0.2e-3), **options)
    assert roomy.checkpoint == "never"
    # 32 MiB of state; never peaks at 166 MiB, selective at 118 MiB (three micro-batches keep 2 MiB per sample more
    # than except_last's 70 MiB) and replays them for a fifth of the time.
    tight = plan(layers, None, memory_per_device="130MiB", profile=synthetic(0.2e-3), **options)
    assert tight.checkpoint == "selective"
    assert any("checkpoint='never' does not fit" in reason for reason in tight.reasons)
    # A selective replay as slow as a whole one buys nothing: except_last keeps less for the same time.
    assert plan(layers, None, memory_per_device="130MiB", profile=synthetic(1e-3), **options).checkpoint == (
        "except_last"
    )


@pytest.mark.heavy
def test_compiled_layers_train_alike_under_the_selective_wrapper_and_with_the_policy_inside() -> None:
    # Around compiled layers the engine's selective wrapper replays them whole; compiled with the policy inside, the
    # layers save only the kept operators' outputs (and their inputs) for backward. Both train like plain layers.
    model = transformer(2)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # compiled dropout draws from other random streams than eager
    x = batch(4)[0]

    def grads(run: Any, saved: dict[int, int] | None = None) -> list[torch.Tensor]:
        model.zero_grad()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if saved is not None and not any(t.untyped_storage() is p.untyped_storage() for p in model.parameters()):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = run(x.clone().requires_grad_())
        output.square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    plain_saved: dict[int, int] = {}
    expected = grads(model, plain_saved)
    compiled = nn.Sequential(*[cast(nn.Module, torch.compile(block)) for block in model])
    inside = [torch.compile(selective_checkpoint(block)) for block in model]

    def policy_inside(value: torch.Tensor) -> torch.Tensor:
        for call in inside:
            value = call(value)
        return value

    kept: dict[int, int] = {}
    for got in (grads(lambda v: checkpointed(compiled, v, selective=True)), grads(policy_inside, kept)):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert 0 < sum(kept.values()) < sum(plain_saved.values())


def test_the_memory_balance_weighs_what_selective_keeps() -> None:
    # The first four layers keep 4 MiB per sample under selective re-materialization, the others nothing: balanced
    # by memory, the first stage takes fewer of them than under except_last, where the layers weigh alike.
    heavy = LayerProfile("Block", 2**20, 2**20, 0, 2**19, 2**17, 2**18, 1.0, selective_bytes=2**22)
    light = replace(heavy, selective_bytes=0.0)
    times: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {
        n: ((1e-3 * n,) * 8, (2e-3 * n,) * 8) for n in (1, 2, 4, 8)
    }
    profile = ModelProfile((heavy,) * 4 + (light,) * 4, 2**17, times)
    options: dict[str, Any] = {"pipe_size": 2, "chunks": 4, "batch_size": 16}
    expected: list[tuple[CheckpointMode, int]] = [("except_last", 4), ("selective", 2)]
    for mode, first_stage in expected:
        by_time = evaluate(profile, checkpoint=mode, **options)
        assert _memory_balanced(profile, by_time, 16, {}).balance[0] == first_stage, mode
