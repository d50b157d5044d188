"""Every Lightning flow under GPipeStrategy, checkpoint portability across K, and faults ending the job."""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.flows_job import Classifier
from helpers.jobs import run_job, run_scripts
from helpers.lightning_job import SequentialModule
from helpers.runif import RunIf
from test_strategy_equivalence import assert_same_parameters, plain, run_fits

JOB_TIMEOUT = 900  # the shared job: five scripts, one after the other, in the same two ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank launch for every flow below that should succeed: each script writes into its own folder."""
    root = tmp_path_factory.mktemp("flows")
    for folder in ("k2", "flows", "amp", "boundary", "trimmed"):
        (root / folder).mkdir()
    k2 = [
        {"pipe_size": 2, "devices": 2, "chunks": 4, "epochs": 1, "steps": -1, "save": str(root / "two-stages.ckpt")},
        {"pipe_size": 2, "devices": 2, "chunks": 4, "steps": 3, "meta": True},
    ]
    (root / "k2" / "config.json").write_text(json.dumps({"runs": k2}))
    scripts = [
        ["helpers.lightning_job", str(root / "k2" / "config.json")],
        ["helpers.flows_job", str(root / "flows")],
        ["helpers.amp_job", str(root / "amp")],
        ["helpers.boundary_job", str(root / "boundary")],
        ["helpers.user_model_job", str(root / "trimmed"), "trimmed_token_mean"],
    ]
    results = run_scripts(scripts, 2, timeout=JOB_TIMEOUT)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    return root


@pytest.fixture(scope="module")
def one_rank(two_ranks: Path) -> list[dict[str, torch.Tensor]]:
    """The 1-rank fits: resuming the two stages' checkpoint, and the meta-device model as one stage."""
    checkpoint = str(two_ranks / "two-stages.ckpt")
    runs = [
        {"pipe_size": 1, "devices": 1, "chunks": 4, "epochs": 2, "steps": -1, "resume": checkpoint},
        {"pipe_size": 1, "devices": 1, "chunks": 4, "steps": 3, "meta": True},
    ]
    return run_fits(two_ranks / "k1", 1, runs)


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
def test_fit_validate_test_predict_with_callbacks_loggers_and_metrics(two_ranks: Path) -> None:
    tmp_path = two_ranks / "flows"
    seen = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    # Every rank sees the same logged values (mirrored from the last stage), so collectives agree.
    assert seen[0]["fit"] == seen[1]["fit"]
    assert {"train_loss", "val_loss", "val_acc"} <= seen[0]["fit"].keys()
    assert 0.0 <= seen[0]["fit"]["val_acc"] <= 1.0
    assert seen[0]["validate"] == seen[1]["validate"]
    assert seen[0]["test"][0]["test_loss"] > 0
    assert seen[0]["predict"] == seen[1]["predict"]
    assert len(seen[0]["predict"]) == 32
    assert seen[0]["bf16_loss"] == seen[0]["bf16_loss"]  # finite, not NaN
    # ModelCheckpoint(monitor=...) wrote top-k and last checkpoints; they hold the whole model.
    best = Path(seen[0]["best"])
    assert best.exists()
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    state = torch.load(best, weights_only=True)["state_dict"]
    Classifier().load_state_dict(state, strict=True)
    # The CSV logger on rank 0 got the last stage's metrics, and the learning-rate monitor its value.
    metrics = next((tmp_path / "logs").rglob("metrics.csv")).read_text()
    assert "val_loss" in metrics
    assert "train_loss" in metrics
    assert "lr-Adam" in metrics


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
def test_checkpoint_from_two_stages_resumes_on_one_and_loads_into_the_plain_module(
    two_ranks: Path, one_rank: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    checkpoint = two_ranks / "two-stages.ckpt"  # the shared job's first fit; one_rank's first fit resumes it
    saved = torch.load(checkpoint, weights_only=True)
    SequentialModule().load_state_dict(saved["state_dict"], strict=True)  # the whole model, original names
    assert all(isinstance(name, str) for name in saved["optimizer_states"][0]["state"])  # keyed by name
    resumed = one_rank[0]
    uninterrupted = plain(tmp_path / "plain", epochs=2, steps=-1)
    assert_same_parameters(resumed, uninterrupted)


@RunIf(multiprocess=True)
def test_a_rank_that_raises_ends_the_whole_job(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"runs": [{"pipe_size": 2, "devices": 2, "chunks": 4, "steps": 6, "fail_rank": 1}]}))
    start = time.monotonic()
    results = run_job("helpers.lightning_job", [str(config)], 2, timeout=180)
    elapsed = time.monotonic() - start
    assert all(result.returncode not in (0, None) for result in results), [r.returncode for r in results]
    assert "deliberate failure on rank 1" in results[1].stdout
    assert "pipeline stage" in results[0].stdout  # the survivor names its stage and the failed peer
    assert elapsed < 120


@RunIf(multiprocess=True)
@pytest.mark.parametrize(
    "links_on_world",
    # The old wiring's stall is evidence for R1 (slow); the default run keeps the variant that fails if it returns.
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["link-groups", "one-world-group"],
)
def test_logging_with_sync_dist_in_training_step_under_nccl_stream_order(tmp_path: Path, links_on_world: bool) -> None:
    # R1 (examples/spiral.py's pattern): `self.log(..., sync_dist=True)` in training_step runs a barrier and an
    # all-reduce on the world group between the forwards and the backwards. Under NCCL's rule (every group's operations
    # in issue order, imposed here by helpers.stream_order), P2P on the world group deadlocks: stage 0's barrier
    # waits behind the gradient receive it posted, whose gradient the last stage sends only after that barrier.
    tmp_path.mkdir(exist_ok=True)
    run = {"pipe_size": 2, "devices": 2, "chunks": 4, "steps": 2, "sync_dist": True, "stream_order": True}
    if not links_on_world:
        assert_same_parameters(run_fits(tmp_path, 2, [run])[0], plain(tmp_path, steps=2))
        return
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"runs": [{**run, "links_on_world": True}]}))
    results = run_job("helpers.lightning_job", [str(config)], 2, timeout=400)
    assert any(result.returncode != 0 for result in results)
    assert "waits behind earlier operations of its group" in results[0].stdout + results[1].stdout


def test_gloo_with_cuda_devices_is_refused_with_the_fix() -> None:
    # R12: gloo's send and receive take CPU tensors only; the job would fail at the first boundary.
    from lightning_gpipe.config import StrategyConfig

    fix = r"process_group_backend='gloo' cannot .* on cuda:1; use 'nccl'"
    with pytest.raises(ValueError, match=fix):
        StrategyConfig(process_group_backend="gloo").backend_for(torch.device("cuda", 1))
    assert StrategyConfig(process_group_backend="nccl").backend_for(torch.device("cuda", 1)) == "nccl"
    assert StrategyConfig(process_group_backend="gloo").backend_for(torch.device("cpu")) == "gloo"
    assert StrategyConfig().backend_for(torch.device("cpu")) == "gloo"


def test_bad_configuration_fails_when_the_trainer_is_built() -> None:
    from lightning_gpipe import GPipeStrategy

    with pytest.raises(
        ValueError, match=r"world_size=2 is not divisible by pipe_size=3; use one of its divisors: 1, 2"
    ):
        L.Trainer(strategy=GPipeStrategy(pipe_size=3), accelerator="cpu", devices=2)
    with pytest.warns(UserWarning, match="chunks=1 is smaller than pipe_size=2"):
        L.Trainer(strategy=GPipeStrategy(chunks=1), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"balance=\[1, 1, 1\] has 3 stages but the pipelines have 2"):
        L.Trainer(strategy=GPipeStrategy(balance=[1, 1, 1]), accelerator="cpu", devices=2)


def test_the_chunks_warning_prints_once_per_rank() -> None:
    # Regression: Lightning's accelerator connector and setup_environment both set the world ranks, and each resolved
    # the settings again, so "chunks=1 is smaller than pipe_size=2" printed twice on every rank.
    from lightning_gpipe import GPipeStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = L.Trainer(strategy=GPipeStrategy(chunks=1), accelerator="cpu", devices=2).strategy
        strategy.set_world_ranks()  # what setup_environment does in every process
    assert [str(w.message) for w in caught if "smaller than pipe_size" in str(w.message)] == [
        "chunks=1 is smaller than pipe_size=2: at most 1 of 2 stages can work at once. Use chunks >= 8 for a small "
        "bubble."
    ]


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
def test_meta_device_model_allocates_one_stage_per_rank_and_trains_like_one_stage(
    two_ranks: Path, one_rank: list[dict[str, torch.Tensor]]
) -> None:
    # Built in configure_model: each rank allocates only its stage, and every layer is initialized from its own
    # seed, so one and two stages start (and end) with the same parameters. Both are the second fit of their job.
    two = torch.load(two_ranks / "k2" / "result-1.pt", weights_only=True)
    one = one_rank[1]
    assert_same_parameters(two, one)
    total = sum(value.numel() for value in one.values())
    local = [int((two_ranks / "k2" / f"local-parameters-1-rank{rank}.txt").read_text()) for rank in range(2)]
    assert sum(local) == total
    assert max(local) <= 0.6 * total  # balanced by parameter count: about 1/K of the model each


SCHEDULES = {"gpipe": 1, "1f1b": 1, "zero_bubble": 1, "interleaved": 2, "zbv": 2}  # schedule: virtual_stages


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
@pytest.mark.parametrize("stages", [2, 4])
def test_a_batch_smaller_than_the_number_of_stages_trains_like_plain_lightning(tmp_path: Path, stages: int) -> None:
    # Regression: a training batch of fewer samples than pipe_size was refused ("cannot fill 2 pipeline stages"),
    # though its micro-batches run through every stage as chunks < pipe_size does: one long sequence per step with
    # accumulate_grad_batches, where a pipeline is needed most. Every schedule, chunks=1 and the default (4K); at K=4
    # interleaved's 8 stages of one layer would leave a process only Tanh layers (nothing to optimize), so not there.
    runs = [
        {"pipe_size": stages, "devices": stages, "batch": 1, "steps": 2, "accumulate": 2, "chunks": chunks,
         "options": {"schedule": schedule, "virtual_stages": virtual}}
        for schedule, virtual in SCHEDULES.items()
        if stages == 2 or schedule != "interleaved"
        for chunks in (1, None)
    ]  # fmt: skip
    if stages == 4:  # two samples through four stages
        runs += [{**run, "batch": 2} for run in runs if run["options"]["schedule"] in ("gpipe", "1f1b")]
    results = run_fits(tmp_path, stages, runs, timeout=JOB_TIMEOUT - 60)
    batches = {run["batch"] for run in runs}
    references = {batch: plain(tmp_path, steps=2, batch=batch, accumulate=2) for batch in batches}
    for run, result in zip(runs, results, strict=True):
        assert_same_parameters(result, references[run["batch"]])


@RunIf(multiprocess=True)
def test_a_stage_without_trainable_parameters_is_named_with_the_fix(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"runs": [{"pipe_size": 2, "devices": 2, "balance": [4, 4], "freeze_first": 4}]}))
    results = run_job("helpers.lightning_job", [str(config)], 2, timeout=180)
    assert all(result.returncode != 0 for result in results)
    output = results[0].stdout + results[1].stdout
    assert "stage 0 (layers 0-3 of 'layers') has no trainable parameters" in output
    assert "move some to it with balance= (now [4, 4])" in output


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
def test_loss_scaling_skips_an_overflowing_step_on_every_stage(two_ranks: Path) -> None:
    from helpers.amp_job import INF_STEP

    tmp_path = two_ranks / "amp"
    traces = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    scales = [[entry["scale"] for entry in trace] for trace in traces]
    assert scales[0] == scales[1]  # one loss scale for the whole pipeline
    assert scales[0][INF_STEP] == scales[0][INF_STEP - 1] / 2  # the overflow halved it ...
    for trace in traces:  # ... and no stage stepped: the stage without the inf skipped too
        assert trace[INF_STEP]["checksum"] == trace[INF_STEP - 1]["checksum"]
        assert trace[INF_STEP + 1]["checksum"] != trace[INF_STEP]["checksum"]


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
def test_after_fit_the_whole_model_has_every_buffer_and_evaluates(two_ranks: Path) -> None:
    # Non-persistent buffers of the other stage's layers were uninitialized memory after fit (NaN rotary tables,
    # BERT's position_ids out of range); UserDict batches were refused by the splitter.
    from helpers.boundary_job import Module, samples

    tmp_path = two_ranks / "boundary"
    after = torch.load(tmp_path / "after.pt", weights_only=True)
    plain = Module()
    plain.load_state_dict(after["state"], strict=True)  # the trained weights into a model built as usual
    expected = dict(plain.layers.named_buffers())
    assert after["buffers"].keys() == expected.keys()
    for name, buffer in after["buffers"].items():
        assert torch.equal(buffer, expected[name]), name
    x = torch.stack([x for x, _ in samples()])
    assert torch.equal(after["output"], plain.layers(x).detach())
    assert torch.equal(after["whole_head"], after["state"]["layers.4.weight"])  # the kept model shares the layers


@pytest.mark.slow  # six 2-rank fits and a 20 s wait for a rank that never saves: over a minute on two cores
@pytest.mark.timeout(900)
@RunIf(multiprocess=True)
def test_a_users_own_module_behaves_as_under_plain_lightning(tmp_path: Path) -> None:
    """Issue 17 (items 4, 5, 6, 9, 10, 11, 13), all in one 2-rank job; the references are plain fits in this process.

    The unit tests of the pieces (log_mirror, microbatch, partitioned) run by default; this checks them end to end.
    """
    from helpers import user_model_job as job

    results = run_job("helpers.user_model_job", [str(tmp_path)], 2, timeout=800)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    seen = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    # 13: rank 0 prints the whole pipeline with default logging: every stage's layers and parameters.
    assert "GPipe: 1 pipeline of 2 stages" in results[0].stdout
    assert "stage 1 (rank 0): layers " in results[0].stdout
    # ... and the whole model's count, which Lightning's summary (rank 0's stage only) cannot show.
    whole = r"whole model: [\d,]+ parameters \([\d,]+ trainable\); Lightning's model summary counts only stage 1"
    assert re.search(whole, results[0].stdout), results[0].stdout[-3000:]
    # 5: a token mean over ragged padding, reported with `loss_weight`, trains as the full batch's token mean.
    assert_same_parameters(torch.load(tmp_path / "token-mean.pt", weights_only=True), job.fit_token_mean(1))
    # 6: a Metric logged on_step is the whole batch's value (macro accuracy: not a mean of micro-batch values);
    # 11: `self.layers[-1].parameters()` in a parameter group works on every stage, and trains as plain.
    reference, _ = job.fit_classifier(1)
    assert seen[0]["metric_and_groups"] == {"step_accuracy": pytest.approx(reference.step_accuracy, abs=1e-6)}
    assert seen[1]["metric_and_groups"] == seen[0]["metric_and_groups"]
    assert_same_parameters(torch.load(tmp_path / "groups.pt", weights_only=True), reference.state_dict())
    # 9: values that are not per-sample come back as the step returned them; per-sample tensors are concatenated.
    assert seen[0]["predict"] == {"batch_idx": 0, "scale": 2.0, "tag": "v1", "out": [16, 3]}
    # 11: two optimizers are refused with advice that works under GPipe (one optimizer, parameter groups).
    for rank in range(2):
        assert (
            "GPipeStrategy takes one optimizer: use one with parameter groups" in seen[rank]["two_optimizers"]["error"]
        )
    # 4: `self.trainer.should_stop = True` in training_step stops every stage after that step.
    assert seen[0]["should_stop"] == seen[1]["should_stop"] == 2
    # 10: `if trainer.is_global_zero: trainer.save_checkpoint(...)` fails at once on rank 0 saying what to do.
    assert "call it on every rank (no is_global_zero guard)" in seen[0]["save_on_rank_zero"]["error"]
    assert isinstance(seen[1]["save_on_rank_zero"], float)


@pytest.mark.timeout(JOB_TIMEOUT)
@RunIf(multiprocess=True)
def test_a_token_mean_over_sequences_trimmed_per_microbatch_trains_as_plain_lightning(two_ranks: Path) -> None:
    """Issue 15 item 2: each micro-batch cut after its own longest sequence crosses the boundary with its own length
    (refused before: "may differ only in the micro-batch dimension"), and `loss_weight` makes the micro-batches'
    token means the whole batch's."""
    from helpers import user_model_job as job

    tmp_path = two_ranks / "trimmed"
    seen = json.loads((tmp_path / "rank-0.json").read_text())
    assert "error" not in seen["trimmed_token_mean"], seen["trimmed_token_mean"]
    trained = torch.load(tmp_path / "trimmed-token-mean.pt", weights_only=True)
    assert_same_parameters(trained, job.fit_token_mean(1, trimmed=True))
    assert_same_parameters(trained, job.fit_token_mean(1))  # trimming changes nothing in plain Lightning
