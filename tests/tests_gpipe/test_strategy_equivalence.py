"""GPipeStrategy trains exactly like plain Lightning, with real processes over gloo.

Each job runs several fits in one set of processes (one per rank, launched like torchrun); rank 0 saves the whole
model after each fit, and the test compares it with the same fit under ``strategy="auto"`` (or ``"ddp"``). The tests
share one job per world size (:data:`FITS`), launched when the first of them asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.jobs import run_job
from helpers.lightning_job import fit
from helpers.runif import RunIf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TOLERANCE = 1e-5


def run_fits(tmp_path: Path, world_size: int, runs: list[dict[str, Any]], timeout: float = 400) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"runs": runs}))
    results = run_job("helpers.lightning_job", [str(config)], world_size, timeout=timeout)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    return [torch.load(tmp_path / f"result-{index}.pt", weights_only=True) for index in range(len(runs))]


def plain(tmp_path: Path, **run: Any) -> dict[str, torch.Tensor]:
    module = fit({**run, "strategy": "auto", "devices": 1}, tmp_path)
    return module.state_dict()


def assert_same_parameters(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        difference = (actual[key].double() - value.double()).abs().max().item()
        assert difference <= TOLERANCE, f"{key}: max abs difference {difference:.2e}"


CHUNKS = [1, 4, 5, 8]
_ACCUMULATE = {"pipe_size": 2, "devices": 2, "chunks": 4, "steps": 3, "accumulate": 2}
# With Lightning's default logger, TensorBoardLogger: it must work from the lock (issue 29 C6). The only run of its
# job with a logger, so its events are in lightning_logs/version_0.
_CLIP = {"pipe_size": 2, "devices": 2, "chunks": 5, "steps": 4, "clip": 0.05, "logger": True, "log_every_n_steps": 1}
_BN = {"pipe_size": 2, "devices": 2, "chunks": 5, "steps": 1, "batch_norm": True, "deferred_batch_norm": True}
_REPLICAS = {"steps": 3, "chunks": 4, "distributed_sampler": True, "shuffle": True}
# ZB-H1 with every flow at once: accumulation, clipping, validation every 2 steps, re-materialization (the input pass
# recomputes, the weight pass reuses its graph), uneven micro-batches (5 of a batch of 16).
_ZERO_BUBBLE = {"schedule": "zero_bubble", "chunks": 5, "steps": 4, "accumulate": 2, "clip": 0.05}
_VALIDATION = {"limit_val_batches": 2, "val_check_interval": 2}
FITS: dict[int, dict[str, dict[str, Any]]] = {  # world size -> name -> run: one job per world size
    1: {f"stages1-m{m}": {"pipe_size": 1, "devices": 1, "chunks": m, "steps": 4} for m in CHUNKS},
    2: {
        **{f"stages2-m{m}": {"pipe_size": 2, "devices": 2, "chunks": m, "steps": 4} for m in CHUNKS},
        "accumulate": _ACCUMULATE,
        "clip": _CLIP,
        # Deferred BatchNorm, on the first stage and then on the second (layer 3 is the BatchNorm).
        "bn-first": {**_BN, "balance": [4, 2]},
        "bn-second": {**_BN, "balance": [3, 3]},
        "ddp": {**_REPLICAS, "strategy": "ddp", "devices": 2},
        "selective": {"pipe_size": 2, "devices": 2, "chunks": 4, "steps": 4, "checkpoint": "selective"},
        "zero-bubble": {"pipe_size": 2, "devices": 2, **_ZERO_BUBBLE, **_VALIDATION, "checkpoint": "always"},
        "zero-bubble-selective": {"pipe_size": 2, "devices": 2, **_ZERO_BUBBLE, "checkpoint": "selective"},
        "zero-bubble-bn": {**_BN, "balance": [3, 3], "schedule": "zero_bubble"},
    },
    4: {
        **{f"stages4-m{m}": {"pipe_size": 4, "devices": 4, "chunks": m, "steps": 4} for m in CHUNKS},
        "gpipe-replicas": {**_REPLICAS, "pipe_size": 2, "devices": 4},
        "zero-bubble-replicas": {**_REPLICAS, "pipe_size": 2, "devices": 4, "schedule": "zero_bubble"},
        "zero-bubble-k4": {"pipe_size": 4, "devices": 4, **_ZERO_BUBBLE},
    },
}


class SharedFits:
    """The job of each world size in :data:`FITS`, launched on first use; ``fits(world_size)[name]``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def __call__(self, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
        if world_size not in self._done:
            runs = FITS[world_size]
            results = run_fits(self.folder(world_size), world_size, list(runs.values()), timeout=600)
            self._done[world_size] = dict(zip(runs, results, strict=True))
        return self._done[world_size]

    def folder(self, world_size: int) -> Path:
        return self.root / f"world{world_size}"


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> SharedFits:
    return SharedFits(tmp_path_factory.mktemp("equivalence"))


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_stages_and_chunks_train_like_plain_lightning(fits: SharedFits, tmp_path: Path, stages: int) -> None:
    runs = [{"pipe_size": stages, "devices": stages, "chunks": m, "steps": 4} for m in CHUNKS]
    results = [fits(stages)[f"stages{stages}-m{m}"] for m in CHUNKS]
    reference = plain(tmp_path, steps=4)
    for run, result in zip(runs, results, strict=True):
        assert_same_parameters(result, reference), run


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_accumulation_clipping_and_deferred_batch_norm(fits: SharedFits, tmp_path: Path) -> None:
    # Deferred BatchNorm: after one step the running statistics equal plain BatchNorm's on the whole batch. The
    # weights differ by design, since GPipe normalizes each micro-batch with its own statistics.
    shared = fits(2)
    results = [shared[name] for name in ("accumulate", "clip", "bn-first", "bn-second")]
    assert_same_parameters(results[0], plain(tmp_path, steps=3, accumulate=2))
    assert_same_parameters(results[1], plain(tmp_path, steps=4, clip=0.05))
    (events,) = (fits.folder(2) / "lightning_logs" / "version_0").glob("events.out.tfevents.*")
    logged = EventAccumulator(str(events)).Reload()
    assert [event.step for event in logged.Scalars("train_loss")] == [0, 1, 2, 3]
    reference = plain(tmp_path, steps=1, batch_norm=True)
    stats = ["layers.3.running_mean", "layers.3.running_var", "layers.3.num_batches_tracked"]
    for result in results[2:]:
        assert result.keys() == reference.keys()
        assert_same_parameters({k: result[k] for k in stats}, {k: reference[k] for k in stats})


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_selective_rematerialization_trains_like_plain_lightning(fits: SharedFits, tmp_path: Path) -> None:
    # Two stages over gloo, three of four micro-batches replayed keeping their matrix multiplications' outputs.
    assert_same_parameters(fits(2)["selective"], plain(tmp_path, steps=4))


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_zero_bubble_trains_like_plain_lightning(fits: SharedFits, tmp_path: Path) -> None:
    # Split backwards under Lightning: input passes among the forwards in training_step, weight passes held past
    # zero_grad like 1F1B's backwards, the rest in backward; replayed once per micro-batch; BatchNorm counted once.
    shared = fits(2)
    reference = plain(tmp_path, steps=4, accumulate=2, clip=0.05)
    assert_same_parameters(shared["zero-bubble"], reference)
    assert_same_parameters(shared["zero-bubble-selective"], reference)
    assert_same_parameters(fits(4)["zero-bubble-k4"], reference)
    stats = ["layers.3.running_mean", "layers.3.running_var", "layers.3.num_batches_tracked"]
    batch_norm = plain(tmp_path, steps=1, batch_norm=True)
    assert_same_parameters({k: shared["zero-bubble-bn"][k] for k in stats}, {k: batch_norm[k] for k in stats})
    assert_same_parameters(shared["zero-bubble-bn"], shared["bn-second"])  # the same step as under fill-drain
    assert_same_parameters(fits(4)["zero-bubble-replicas"], shared["ddp"])  # replicas average after the last W


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_two_stages_times_two_replicas_equals_ddp(fits: SharedFits) -> None:
    pipelined = fits(4)["gpipe-replicas"]
    ddp = fits(2)["ddp"]
    assert_same_parameters(pipelined, ddp)


STREAM_ORDER_SCHEDULES = {"gpipe": {}, "1f1b": {}, "zero_bubble": {}, "interleaved": {"virtual_stages": 2}, "zbv": {}}


@RunIf(multiprocess=True)
@pytest.mark.timeout(400)
def test_under_nccl_stream_order_every_schedule_trains_like_plain_lightning(tmp_path: Path) -> None:
    # Every process group runs its operations in issue order, and a send completes only once its receive is posted
    # (helpers.stream_order: NCCL's rule, as for large messages). On one group per link for both directions every
    # schedule but gpipe deadlocked: under 1F1B stage 0's send of activation 1 waited for the last stage's receive of
    # it, queued behind that stage's send of gradient 0, which waited for stage 0's gradient receive, queued behind
    # the send of activation 1. Each link now has a group per direction (transport.LinkGroups). Both posting policies:
    # receives posted ahead (CPU's) and when needed (NCCL's issue order).
    base = {"pipe_size": 2, "devices": 2, "chunks": 4, "steps": 2, "sync_dist": True, "stream_order": True}
    runs = [
        {**base, "schedule": schedule, **extra, "post_when_needed": when_needed}
        for when_needed in (False, True)
        for schedule, extra in STREAM_ORDER_SCHEDULES.items()
    ]
    results = run_fits(tmp_path, 2, runs, timeout=300)  # one job: a deadlock fails it within STALL_SECONDS
    reference = plain(tmp_path, steps=2)
    for run, result in zip(runs, results, strict=True):
        try:
            assert_same_parameters(result, reference)
        except AssertionError as error:
            raise AssertionError(f"{run}: {error}") from error


@RunIf(multiprocess=True)
@pytest.mark.slow
@pytest.mark.parametrize("stages", [3, 4])
def test_under_nccl_stream_order_stages_train_like_plain_lightning(tmp_path: Path, stages: int) -> None:
    # Every process group runs its operations in issue order, as NCCL's streams do (helpers.stream_order), and the
    # loss is logged with sync_dist=True between the forwards and the backwards: no operation may wait behind one that
    # needs the other ranks to get further first.
    run = {"pipe_size": stages, "devices": stages, "chunks": 5, "steps": 2, "sync_dist": True, "stream_order": True}
    result = run_fits(tmp_path, stages, [run])[0]
    assert_same_parameters(result, plain(tmp_path, steps=2))
