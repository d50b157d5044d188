"""Transparency: a pipelined step accumulates the gradients of the unpartitioned model on the whole mini-batch.

For K in {1, 2, 4} stages, M in {1, 3, 4, 8} micro-batches and every re-materialization mode, in-process (threads)
and with one process per stage over gloo. Tolerance: 1e-6 relative (norm-wise), float32.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.models import BALANCES, batch, build, cells, full_batch_grads, loss_fn, relative_error, stage_stream_grads
from helpers.runif import RunIf

from lightning_gpipe.engine.pipeline import Pipeline, run_in_threads
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES
from lightning_gpipe.engine.transport import ProcessGroupTransport
from tools.launch import run_processes

STAGES = [1, 2, 4]
CHUNKS = [1, 3, 4, 8]
TOLERANCE = 1e-6
SEEDS = [11, 22, 33, 44]


def assert_transparent(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == reference.keys()
    for name, expected in reference.items():
        error = relative_error(grads[name], expected)
        assert error <= TOLERANCE, f"{name}: relative error {error:.2e}"


def pipelined_grads(name: str, stages: int, chunks: int, mode: str, **kwargs: object) -> dict[str, torch.Tensor]:
    model = build(name)
    model.zero_grad()
    run_in_threads(cells(model, BALANCES[name][stages]), batch(), loss_fn, chunks=chunks, checkpoint=mode, **kwargs)
    return {key: p.grad.clone() for key, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["mlp", "nested"])
@pytest.mark.parametrize(("stages", "chunks", "mode"), list(itertools.product(STAGES, CHUNKS, CHECKPOINT_MODES)))
def test_in_process_pipeline_equals_full_batch(name: str, stages: int, chunks: int, mode: str) -> None:
    reference = full_batch_grads(build(name), batch())
    assert_transparent(pipelined_grads(name, stages, chunks, mode), reference)


@pytest.mark.parametrize(("stages", "chunks", "mode"), list(itertools.product(STAGES, [1, 4], CHECKPOINT_MODES)))
def test_in_process_dropout_under_rematerialization(stages: int, chunks: int, mode: str) -> None:
    seeds = SEEDS[:stages]
    reference = stage_stream_grads(build("dropout"), BALANCES["dropout"][stages], batch(), chunks, seeds)
    assert_transparent(pipelined_grads("dropout", stages, chunks, mode, seeds=seeds), reference)


def test_recomputation_replays_dropout_masks_bit_for_bit() -> None:
    always = pipelined_grads("dropout", 2, 4, "always", seeds=SEEDS[:2])
    never = pipelined_grads("dropout", 2, 4, "never", seeds=SEEDS[:2])
    for name in always:
        assert torch.equal(always[name], never[name]), name


def test_1f1b_schedule_gives_the_same_gradients() -> None:
    reference = full_batch_grads(build("mlp"), batch())
    assert_transparent(pipelined_grads("mlp", 4, 8, "except_last", schedule="1f1b"), reference)


def _stage_worker(rank: int, world_size: int) -> dict[tuple[str, int, str], dict[str, torch.Tensor]]:
    """Stage ``rank`` of a ``world_size``-stage pipeline: gradients of its cell for every configuration."""
    grads = {}
    for name, chunks, mode in itertools.product(["mlp", "nested", "dropout"], CHUNKS, CHECKPOINT_MODES):
        model = build(name)
        cell = cells(model, BALANCES[name][world_size])[rank]
        torch.manual_seed(SEEDS[rank])  # each stage's own random stream, as the reference assumes
        pipeline = Pipeline(cell, ProcessGroupTransport(range(world_size)), chunks=chunks, checkpoint=mode)
        pipeline.train_step(batch(), loss_fn)
        grads[(name, chunks, mode)] = {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}
    return grads


@RunIf(multiprocess=True)
@pytest.mark.parametrize("stages", [2, 4])
def test_process_pipeline_equals_full_batch(stages: int) -> None:
    per_rank = run_processes(_stage_worker, stages, timeout=400)
    for name, chunks, mode in itertools.product(["mlp", "nested", "dropout"], CHUNKS, CHECKPOINT_MODES):
        grads = {}
        for rank_grads in per_rank:
            grads.update({key: torch.from_numpy(g) for key, g in rank_grads[(name, chunks, mode)].items()})
        if name == "dropout":
            balance = BALANCES[name][stages]
            reference = stage_stream_grads(build(name), balance, batch(), chunks, SEEDS[:stages])
        else:
            reference = full_batch_grads(build(name), batch())
        assert_transparent(grads, reference)


@pytest.mark.parametrize("name", ["mlp", "nested"])
@pytest.mark.parametrize(("stages", "chunks", "mode"), list(itertools.product([2, 4], CHUNKS, CHECKPOINT_MODES)))
def test_zero_bubble_gives_the_same_gradients(name: str, stages: int, chunks: int, mode: str) -> None:
    # Split backwards: each input pass sends its gradient on at once, the weight pass later reuses its graph.
    reference = full_batch_grads(build(name), batch())
    assert_transparent(pipelined_grads(name, stages, chunks, mode, schedule="zero_bubble"), reference)


@pytest.mark.parametrize(("stages", "chunks", "mode"), list(itertools.product([2, 4], [1, 3, 4], CHECKPOINT_MODES)))
def test_zero_bubble_replays_dropout_masks(stages: int, chunks: int, mode: str) -> None:
    # A re-materialized micro-batch is recomputed by its input pass with the random state of its forward.
    seeds = SEEDS[:stages]
    reference = stage_stream_grads(build("dropout"), BALANCES["dropout"][stages], batch(), chunks, seeds)
    assert_transparent(pipelined_grads("dropout", stages, chunks, mode, seeds=seeds, schedule="zero_bubble"), reference)
