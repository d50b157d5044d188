"""Reliability: every bad input stops with a pinned message, faults end the whole job, checkpoints stay safe, runs
repeat bit for bit, and a long run neither grows in memory nor slows down.

The multi-process checks share one job (``catalogue``, K = 2 x 2 replicas = 4 processes) that runs its fits one after
the other: process start-up dominates the cost on small machines. Its last fit ends the job on purpose.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import multiprocessing
import os
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.jobs import launch, run_job
from helpers.lightning_job import fit as fit_in_process
from helpers.models import IN, OUT, batch, cells, loss_fn, mlp
from helpers.reliability_job import FaultyModule
from helpers.runif import RunIf
from test_strategy_equivalence import assert_same_parameters, plain
from torch import nn

from lightning_gpipe import GPipeStrategy, PipelineError
from lightning_gpipe.engine.fingerprint import batch_fingerprint, same_fingerprint
from lightning_gpipe.engine.pipeline import run_in_threads
from tools.launch import loopback_store

# ---------------------------------------------------------------------------------------------- the bad-input catalogue

BAD_ARGUMENTS = [
    ({"pipe_size": 0}, ValueError, r"pipe_size=0 must be a positive int, or None for all ranks"),
    ({"pipe_size": "2"}, ValueError, r"pipe_size='2' must be a positive int"),
    ({"pipe_size": True}, ValueError, r"pipe_size=True must be a positive int"),
    ({"chunks": 0}, ValueError, r"chunks=0 must be at least 1"),
    ({"chunks": 2.0}, TypeError, r"chunks=2.0 must be an int \(micro-batches per mini-batch\), e.g. chunks=8"),
    ({"balance": "speed"}, ValueError, r"balance='speed' is not a cost source; use one of 'params', .*, a list or"),
    ({"balance": 3}, TypeError, r"balance=3 must be a list of ints, a cost name or a callable, not int"),
    ({"balance": [2, 0]}, ValueError, r"balance \[2, 0\] gives stage 1 0 layers; every stage needs at least one"),
    ({"balance": [2, "1"]}, TypeError, r"balance \[2, '1'\] has '1' \(str\) for stage 1, not an int"),
    ({"balance": [1, 1, 1], "pipe_size": 2}, ValueError, r"balance=\[1, 1, 1\] has 3 stages but pipe_size=2"),
    ({"checkpoint": "sometimes"}, ValueError, r"checkpoint='sometimes' is not a re-materialization mode"),
    ({"schedule": "pipedream"}, ValueError, r"Unknown pipeline schedule 'pipedream'; use one of"),
    (
        {"schedule": "interleaved"},
        ValueError,
        r"schedule='interleaved' needs virtual_stages >= 2 .*; pass virtual_stages=2",
    ),
    ({"schedule": "1f1b", "virtual_stages": 2}, ValueError, r"virtual_stages=2 applies to schedule='interleaved' only"),
    ({"module_name": 3}, TypeError, r"module_name=3 must be a str such as 'backbone.layers', or None"),
    ({"module_name": "body..layers"}, ValueError, r"module_name='body..layers' is not an attribute path"),
    ({"deferred_batch_norm": "yes"}, TypeError, r"deferred_batch_norm='yes' must be True or False, not str"),
    ({"detect_anomalies": 1}, TypeError, r"detect_anomalies=1 must be True or False, not int"),
    ({"verify_batches": None}, TypeError, r"verify_batches=None must be True or False, not NoneType"),
    ({"timeout": 60}, TypeError, r"timeout=60 must be a datetime.timedelta, e.g. datetime.timedelta\(minutes=30\)"),
    ({"timeout": datetime.timedelta(0)}, ValueError, r"timeout=datetime.timedelta\(0\) must be positive"),
    ({"start_method": "thread"}, ValueError, r"start_method='thread' is not a way to start the processes; use one of"),
    ({"process_group_backend": 1}, TypeError, r"process_group_backend=1 must be a backend name"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD_ARGUMENTS, ids=[str(a) for a, _, _ in BAD_ARGUMENTS])
def test_every_invalid_argument_is_refused_with_its_value_and_the_fix(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        GPipeStrategy(**arguments)


def test_valid_arguments_are_accepted() -> None:
    strategy = GPipeStrategy(
        pipe_size=2, chunks=8, balance=[4, 4], checkpoint="never", module_name="body.0.layers",
        deferred_batch_norm=True, timeout=datetime.timedelta(seconds=5), start_method="fork",
        process_group_backend="gloo", detect_anomalies=True, verify_batches=False,
    )  # fmt: skip
    assert (strategy.pipe_size, strategy.chunks) == (2, 8)


class Labelled(nn.Module):
    """Returns its input with a string label: a value that cannot cross a stage boundary."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return x, "features"


class Unlabel(nn.Module):
    def forward(self, value: tuple[torch.Tensor, str]) -> torch.Tensor:
        return value[0]


def test_a_non_tensor_crossing_a_boundary_is_named_with_its_stage_and_type() -> None:
    stages = [nn.Sequential(nn.Linear(IN, IN), Labelled()), nn.Sequential(Unlabel(), nn.Linear(IN, OUT))]
    start = time.monotonic()
    with pytest.raises(
        TypeError, match=r"stage 0 produced output\[1\] of type str; only tensors \(or None\) can cross"
    ):
        run_in_threads(stages, batch(), loss_fn, chunks=4, timeout=60)
    assert time.monotonic() - start < 10  # the receiving stage was stopped, not left waiting


class NaNOnSample(nn.Module):
    """Identity, except that sample ``row`` of the whole batch becomes NaN (micro-batch ``row // size``)."""

    def __init__(self, row: int) -> None:
        super().__init__()
        self.row, self.seen = row, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, self.seen = self.seen, self.seen + x.shape[0]
        if first <= self.row < self.seen:
            x = x.clone()
            x[self.row - first] = float("nan")
        return x


class ZeroSqrt(nn.Module):
    """Finite forward (zeros), NaN gradient: d sqrt(u) / du is infinite at u = 0, times 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 0).sqrt()


def test_nan_in_an_activation_is_named_by_stage_and_micro_batch() -> None:
    stages = cells(mlp(), [4, 4])
    # 16 samples in 4 micro-batches: sample 9 is in micro-batch 2.
    stages[1] = nn.Sequential(stages[1][0], NaNOnSample(row=9), *stages[1][1:])
    with pytest.raises(
        PipelineError,
        match=r"\[pipeline stage 1\] the output of micro-batch 2 holds NaN, the first non-finite value: check",
    ):
        run_in_threads(stages, batch(), loss_fn, chunks=4, detect_anomalies=True)


def test_nan_in_the_loss_only_is_named_by_the_last_stage_and_micro_batch() -> None:
    x, y = batch()
    y[13, 0] = float("inf")  # micro-batch 3's target: the activations stay finite, the loss does not
    with pytest.raises(PipelineError, match=r"\[pipeline stage 1\] the loss of micro-batch 3 holds Inf"):
        run_in_threads(cells(mlp(), [4, 4]), (x, y), loss_fn, chunks=4, detect_anomalies=True)


def test_nan_in_a_gradient_is_named_by_the_stage_that_computed_it() -> None:
    stages = [nn.Sequential(nn.Linear(IN, IN)), nn.Sequential(ZeroSqrt(), nn.Linear(IN, OUT))]
    with pytest.raises(PipelineError, match=r"\[pipeline stage 1\] the gradient of the input of micro-batch 3 holds"):
        run_in_threads(stages, batch(), loss_fn, chunks=4, detect_anomalies=True)
    run_in_threads(stages, batch(), loss_fn, chunks=4)  # detection is opt-in: without it the step runs


def test_batch_fingerprints_tell_apart_other_samples_and_other_orders() -> None:
    x, y = batch(size=16)
    reference = batch_fingerprint((x, y))
    assert same_fingerprint(reference, batch_fingerprint((x.clone(), y.clone())))
    assert not same_fingerprint(reference, batch_fingerprint((x.flip(0), y.flip(0))))  # same samples, reordered
    assert not same_fingerprint(reference, batch_fingerprint((x + 1e-3, y)))
    assert not same_fingerprint(reference, batch_fingerprint((x[:8], y[:8])))
    images = torch.randn(4, 3, 32, 32)
    other = images.clone()
    other[2, 1, 17, 5] += 1.0  # one value of one image, between the sampled columns ...
    assert same_fingerprint(batch_fingerprint(images), batch_fingerprint(other))  # ... is the documented blind spot
    other[2] = torch.randn(3, 32, 32)  # a different image is not
    assert not same_fingerprint(batch_fingerprint(images), batch_fingerprint(other))


# ---------------------------------------------------------------------------------------------- checkpoint safety


class Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "code ran"))


@pytest.mark.parametrize("weights_only", [None, False, True])
def test_a_checkpoint_whose_unpickling_would_run_code_is_refused_and_runs_nothing(
    tmp_path: Path, weights_only: bool | None
) -> None:
    marker, path = tmp_path / "marker.txt", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Payload(marker)}, path)
    with pytest.raises(Exception, match=r"Weights only load failed"):
        GPipeStrategy().load_checkpoint(path, weights_only=weights_only)  # what Lightning calls to resume
    assert not marker.exists()


def _write_then_die(path: str) -> None:
    class DyingWrites:
        """A CheckpointIO that writes half the file, then the process dies: a crash in the middle of a write."""

        def save_checkpoint(self, checkpoint: Any, target: Any, storage_options: Any = None) -> None:
            data = b"\x00" * 4096
            with open(target, "wb") as handle:
                handle.write(data[:2048])
                handle.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    strategy = GPipeStrategy()
    strategy._checkpoint_io = DyingWrites()  # type: ignore[assignment]
    strategy.save_checkpoint({"step": 2}, path)


def test_a_crash_in_the_middle_of_a_write_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    GPipeStrategy().save_checkpoint({"step": 1, "weights": torch.arange(4.0)}, path)
    before = path.read_bytes()
    writer = multiprocessing.get_context("fork").Process(target=_write_then_die, args=(str(path),))
    writer.start()
    writer.join(timeout=60)
    assert writer.exitcode == -signal.SIGKILL
    assert path.read_bytes() == before
    assert torch.load(path, weights_only=True)["step"] == 1
    # The half-written temporary file is left beside it, under a name no checkpoint loader picks up.
    assert [p.name for p in tmp_path.iterdir() if p.name != "last.ckpt"] == [f".last.ckpt.{writer.pid}.tmp"]


# ---------------------------------------------------------------------------------------------- one process


def _trainer(**strategy: Any) -> L.Trainer:
    return L.Trainer(
        strategy=GPipeStrategy(pipe_size=1, chunks=4, **strategy), accelerator="cpu", devices=1, max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _loader() -> torch.utils.data.DataLoader:
    x, y = batch(size=64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


@pytest.mark.usefixtures("loopback_process_group")
def test_a_nan_loss_stops_training_naming_stage_and_micro_batch_when_detection_is_on() -> None:
    module = FaultyModule({"fault": {"rank": 0, "step": 1, "microbatch": 2, "how": "nan_target"}})
    with pytest.raises(PipelineError, match=r"\[pipeline stage 0\] the loss of micro-batch 2 holds NaN"):
        _trainer(detect_anomalies=True).fit(module, _loader())
    assert module.global_step == 1  # stopped in the step that produced it, before the optimizer wrote NaN


@pytest.mark.usefixtures("loopback_process_group")
def test_a_training_step_that_never_calls_the_sequence_fails_instead_of_hanging() -> None:
    with pytest.raises(RuntimeError, match=r"training_step returned without calling the pipelined sequence 'layers'"):
        _trainer().fit(FaultyModule({"skip_sequence": True}), _loader())


@pytest.mark.usefixtures("loopback_process_group")
def test_one_process_repeats_itself_bit_for_bit(tmp_path: Path) -> None:
    runs = [fit_in_process({"pipe_size": 1, "chunks": 4, "model": "dropout", "steps": 3}, tmp_path) for _ in range(2)]
    first, second = (run.state_dict() for run in runs)
    assert all(torch.equal(first[key], second[key]) for key in first)


# ---------------------------------------------------------------------------------------------- the shared job

JOB = {"pipe_size": 2, "devices": 4, "chunks": 4}
SOAK_STEPS, SOAK_EVERY = 300, 25
# Resident memory grew 0.6 MiB over 300 steps (measured); a leak of 17 KiB a step over the 250 measured steps exceeds
# this bound.
MEMORY_NOISE = 4 * 2**20
SLOWDOWN = 2.0  # medians of windows vary by less than 1.5x on a shared machine; a leak that slows steps grows on


def _bad_checkpoints(root: Path) -> dict[str, Path]:
    """A good checkpoint of the job's model, and three it must refuse, each alone in its folder."""
    good = root / "good" / "model.ckpt"
    good.parent.mkdir(parents=True)
    fit_in_process({"strategy": "auto", "steps": 1, "save": str(good)}, root / "good")
    checkpoints = {}
    for name in ("architecture", "shape", "one-stage"):
        folder = root / name
        folder.mkdir()
        checkpoints[name] = folder / "model.ckpt"
    fit_in_process({"strategy": "auto", "model": "nested", "steps": 1, "save": str(checkpoints["architecture"])}, root)
    saved = torch.load(good, weights_only=True)
    saved["state_dict"]["layers.2.weight"] = torch.zeros(13, 12)
    saved["state_dict"]["layers.2.bias"] = torch.zeros(13)
    torch.save(saved, checkpoints["shape"])
    saved = torch.load(good, weights_only=True)
    saved["state_dict"] = {k: v for k, v in saved["state_dict"].items() if int(k.split(".")[1]) >= 4}
    torch.save(saved, checkpoints["one-stage"])
    return checkpoints


def _halves(records: list[dict[str, float]]) -> tuple[float, float]:
    """Median step time of the first and of the second half of the probes: medians, since one window in ten runs 2x
    slower on a shared machine."""
    times = [r["step_seconds"] for r in records]
    middle = len(times) // 2
    return statistics.median(times[:middle]), statistics.median(times[middle:])


def _folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("catalogue")
    checkpoints = _bad_checkpoints(root)
    digests = {name: _folder_digest(path.parent) for name, path in checkpoints.items()}
    runs: list[dict[str, Any]] = [
        # 0: the soak; one epoch of SOAK_STEPS steps for each of the two replicas.
        {**JOB, "steps": SOAK_STEPS, "samples": 32 * SOAK_STEPS, "distributed_sampler": True, "probe": SOAK_EVERY},
        # 1, 2: determinism, with dropout; 3: the same K = 2 pipelines against one device.
        {**JOB, "model": "dropout", "steps": 3},
        {**JOB, "model": "dropout", "steps": 3},
        {**JOB, "steps": 4, "chunks": 5},
        # 4: a training_step that ignores the sequence; 5-7: checkpoints this model must refuse.
        {**JOB, "steps": 1, "skip_sequence": True, "expect_error": True},
        *[{**JOB, "steps": 2, "resume": str(path), "checkpoints": str(path.parent), "expect_error": True}
          for path in checkpoints.values()],
        # 8: stage 0 of the first pipeline reads other inputs, with the check off; 9: with it on, which ends the job.
        {**JOB, "steps": 2, "rank_data": {1: 99}, "options": {"verify_batches": False}},
        {**JOB, "steps": 2, "rank_data": {1: 99}},
    ]  # fmt: skip
    (root / "config.json").write_text(json.dumps({"runs": runs}))
    start = time.monotonic()
    results = run_job("helpers.reliability_job", [str(root / "config.json")], 4, timeout=400)
    return {
        "root": root,
        "results": results,
        "seconds": time.monotonic() - start,
        "checkpoints": checkpoints,
        "digests": digests,
    }


def _error(catalogue: dict[str, Any], run: int, rank: int) -> str:
    path = catalogue["root"] / f"error-{run}-rank{rank}.txt"
    assert path.exists(), f"run {run} did not fail on rank {rank}:\n{catalogue['results'][rank].stdout[-3000:]}"
    return path.read_text()


@RunIf(multiprocess=True)
def test_a_training_step_that_never_calls_the_sequence_fails_on_every_rank(catalogue: dict[str, Any]) -> None:
    for rank in range(4):
        assert re.search(r"training_step returned without calling the pipelined sequence 'layers'",
                         _error(catalogue, 4, rank))  # fmt: skip


@RunIf(multiprocess=True)
@pytest.mark.parametrize(
    ("run", "name", "message"),
    [
        (5, "architecture", r"the checkpoint does not match this model: missing \['layers\.0\.weight'.* \(another "
                            r"model's, or one stage's\)\. Nothing was loaded\."),
        (6, "shape", r"the checkpoint does not match this model: 2 tensor\(s\) have another shape \(layers\.2\.weight: "
                     r"\(13, 12\) in the checkpoint, \(12, 12\) in the model; .*\): build the model with the "
                     r"checkpoint's sizes\. Nothing was loaded\."),
        (7, "one-stage", r"the checkpoint does not match this model: missing \['layers\.0\.weight', .*, unexpected "
                         r"\[\] \(another model's, or one stage's\)"),
    ],
)  # fmt: skip
def test_an_incompatible_checkpoint_fails_on_every_rank_and_overwrites_nothing(
    catalogue: dict[str, Any], run: int, name: str, message: str
) -> None:
    for rank in range(4):
        assert re.search(message, _error(catalogue, run, rank)), _error(catalogue, run, rank)
    folder = catalogue["checkpoints"][name].parent
    assert _folder_digest(folder) == catalogue["digests"][name]  # no file written, none changed


@RunIf(multiprocess=True)
def test_stages_that_read_different_batches_are_detected(catalogue: dict[str, Any]) -> None:
    results = catalogue["results"]
    assert (catalogue["root"] / "result-8.pt").exists()  # with verify_batches=False the same run trains
    assert all(result.returncode != 0 for result in results), [r.returncode for r in results]
    assert re.search(
        r"\[pipeline stage 1\] stage 0 and this stage read different batches at this step \(\[\(16, 6\) "
        r"torch.float32 .*\] there, \[\(16, 6\) torch.float32 .*\] here\): give every stage the same batches",
        results[0].stdout,
    ), results[0].stdout[-3000:]
    for rank in (1, 2, 3):  # the other pipeline ends too, through the gradient all-reduce
        assert "PipelineError" in results[rank].stdout, results[rank].stdout[-3000:]


@RunIf(multiprocess=True)
def test_two_runs_with_one_seed_are_bitwise_identical_and_match_one_device(
    catalogue: dict[str, Any], tmp_path: Path
) -> None:
    first, second = (torch.load(catalogue["root"] / f"result-{i}.pt", weights_only=True) for i in (1, 2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    pipelined = torch.load(catalogue["root"] / "result-3.pt", weights_only=True)
    one_device = plain(tmp_path, steps=4)
    for key, value in one_device.items():  # float32 round-off: a few units in the last place
        torch.testing.assert_close(pipelined[key], value, rtol=1e-6, atol=1e-6)


@RunIf(multiprocess=True)
def test_a_soak_of_several_hundred_steps_grows_no_memory_and_does_not_slow_down(catalogue: dict[str, Any]) -> None:
    for rank in range(4):
        probe = json.loads((catalogue["root"] / f"probe-0-rank{rank}.json").read_text())
        records = probe["records"]
        assert [r["step"] for r in records] == list(range(SOAK_EVERY, SOAK_STEPS + 1, SOAK_EVERY))
        warm = records[1:]  # the first window holds the allocator's and autograd's one-time growth
        growth = warm[-1]["rss"] - min(r["rss"] for r in warm)
        assert growth <= MEMORY_NOISE, f"rank {rank} grew {growth / 2**20:.1f} MiB: {records}"
        early, late = _halves(warm)
        assert late <= SLOWDOWN * early, f"rank {rank}: {early * 1e3:.0f} ms a step early, {late * 1e3:.0f} ms late"


@RunIf(multiprocess=True)
def test_every_socket_of_the_job_listens_on_the_loopback_interface_only(catalogue: dict[str, Any]) -> None:
    for rank in range(4):
        listening = json.loads((catalogue["root"] / f"probe-0-rank{rank}.json").read_text())["listening"]
        assert listening, "the probe found no listening socket: gloo listens on one per process"
        assert all(address.startswith("127.0.0.1:") for address in listening), listening


# ---------------------------------------------------------------------------------------------- SIGKILL


@RunIf(multiprocess=True)
@pytest.mark.parametrize(
    ("victim", "phase"),
    [
        (1, "backward"),
        (1, "collective"),
        (1, "clip"),
        (1, "gather"),
        pytest.param(0, "forward", marks=pytest.mark.slow),
    ],
)
def test_a_rank_killed_mid_step_ends_the_job_and_its_last_checkpoint_resumes_exactly(
    tmp_path: Path, victim: int, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Started by Lightning's own launcher: rank 0 is the script, rank 1 its child. Killing rank 1 tests that the
    # launcher notices and exits non-zero; killing rank 0 (the launcher itself) that the orphan ends on its own.
    # Rank 1 (stage 0) dies where the backward passes begin, once the survivor has every activation: the survivor's
    # first message to it is a gradient, whose isend gloo fails at once (that error used to escape raw). Rank 0
    # (the last stage) dies in its forward of micro-batch 2, while its peer waits for gradients. In "collective" the
    # survivor's first contact is Lightning's reduce instead, in "clip" the norm of gradient_clip_val, in "gather" a
    # user's self.all_gather (both escaped raw too: neither was wrapped).
    folder = tmp_path / "ckpt"
    run = {"pipe_size": 2, "devices": 2, "chunks": 4, "epochs": 3, "steps": -1, "checkpoints": str(folder),
           "fault": {"rank": victim, "step": 5, "microbatch": 2, "how": "sigkill", "phase": phase}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"runs": [run]}))
    result, _seconds, leftovers = launch("helpers.reliability_job", [str(tmp_path / "config.json")], timeout=400)
    ended = time.time()
    output = result.stdout
    assert result.returncode != 0
    killed = re.search(rf"rank {victim} kills itself in step 5 at ([0-9.]+)", output)
    assert killed, output[-3000:]
    assert ended - float(killed.group(1)) < 30, "the survivor took too long to give up"
    assert leftovers == 0  # every process of the job ended by itself
    survivor = 1 - victim
    survivor_stage = 1 - survivor  # K = 2: rank 0 runs the last stage, rank 1 the first
    failure = (tmp_path / f"failure-rank{survivor}.txt").read_text()
    raised = failure.strip().splitlines()[-1]  # what the survivor's fit raised, its causes chained above it
    assert re.match(rf"lightning_gpipe.engine.errors.PipelineError: \[pipeline stage {survivor_stage}\] ", raised), (
        raised
    )
    assert "Another rank of the job probably failed first" in raised or "The other stage probably failed" in raised
    if phase == "collective":
        # Lightning's collectives (barrier, broadcast, the reduce of sync_dist) let gloo's raw error escape.
        assert re.search(r"\] reducing a logged value over the ranks \(self.log with sync_dist=True\) failed: ", raised)
        return
    if phase == "clip":
        assert re.search(r"\] summing the gradients' norm over the stages \(gradient_clip_val\) failed: ", raised)
        return
    if phase == "gather":
        assert re.search(r"\] gathering a tensor from every rank \(self.all_gather\) failed: ", raised), raised
        return
    assert re.search(rf"global rank {victim}\).* failed: ", raised), raised
    if phase == "backward":
        # Stage 0 posted every gradient receive before it died (small messages are posted ahead), so gloo may have
        # taken them from it already: every gradient send then completes, and the survivor's next contact fails,
        # receiving the next step's header. Either way the error names the dead rank and the message.
        sending = r"\] sending gradients of micro-batch [0-3] to stage 0 \(global rank 1\) failed: "
        receiving = r"\] receiving the step header \(micro-batch 0\) from stage 0 \(global rank 1\) failed: "
        assert re.search(sending, raised) or re.search(receiving, raised), raised
    # The last checkpoint written before the fault, at the end of epoch 0 (4 steps), is whole and loadable.
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0.ckpt", "last.ckpt"]
    saved = torch.load(folder / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4
    # Resumed by one process, it ends where an uninterrupted run ends.
    with loopback_store() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        try:
            resumed = fit_in_process({"pipe_size": 1, "devices": 1, "chunks": 4, "epochs": 3, "steps": -1,
                                      "resume": str(folder / "last.ckpt")}, tmp_path / "resume")  # fmt: skip
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert_same_parameters(resumed.state_dict(), plain(tmp_path / "plain", epochs=3, steps=-1))


# ---------------------------------------------------------------------------------------------- slow soak


@RunIf(multiprocess=True)
@pytest.mark.slow
def test_a_long_soak_grows_no_memory_and_does_not_slow_down(tmp_path: Path) -> None:
    steps, every = 2000, 100
    run = {**JOB, "steps": steps, "samples": 32 * steps, "distributed_sampler": True, "probe": every}
    (tmp_path / "config.json").write_text(json.dumps({"runs": [run]}))
    results = run_job("helpers.reliability_job", [str(tmp_path / "config.json")], 4, timeout=1200)
    for rank, result in enumerate(results):
        assert result.returncode == 0, result.stdout[-3000:]
        records = json.loads((tmp_path / f"probe-0-rank{rank}.json").read_text())["records"][1:]
        growth = records[-1]["rss"] - min(r["rss"] for r in records)
        assert growth <= MEMORY_NOISE, f"rank {rank} grew {growth / 2**20:.1f} MiB over {steps} steps"
        early, late = _halves(records)
        assert late <= SLOWDOWN * early, f"rank {rank}: {early * 1e3:.0f} ms a step early, {late * 1e3:.0f} ms late"
