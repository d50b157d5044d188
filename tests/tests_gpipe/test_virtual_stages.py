"""Several stages per process: ``schedule="interleaved"`` and ``"zbv"`` give plain autograd's gradients and loss.

Each process (a thread here, a gloo process in the last tests) holds the stages ``stages_of(schedule, r, K, v)`` and
runs ``process_actions`` in order; adjacent stages on one process exchange copies in the process.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.models import WithTable, batch, build, cells, full_batch_grads, loss_fn, relative_error
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine.config import PipelineConfig
from lightning_gpipe.engine.driver import StepDriver
from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.layout import new_link_groups
from lightning_gpipe.engine.microbatch import scatter
from lightning_gpipe.engine.pipeline import Pipeline, run_in_threads
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.schedule import process_actions, stages_of
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import LinkGroups, ProcessGroupTransport, _Loopback
from lightning_gpipe.engine.unbatched import Unbatched
from tools.launch import run_processes

TOLERANCE = 1e-6
MODES: list[CheckpointMode] = ["always", "except_last", "selective", "never"]
# (schedule, v, K, M): M a multiple of K, M < K, and M not a multiple of K where interleaved's rounds allow it.
CASES = [
    ("interleaved", 2, 2, 4),
    ("interleaved", 2, 2, 3),
    ("interleaved", 2, 2, 1),
    ("interleaved", 2, 4, 8),
    ("interleaved", 2, 4, 6),
    ("interleaved", 2, 4, 2),
    ("interleaved", 3, 2, 4),
    ("zbv", 2, 2, 4),
    ("zbv", 2, 2, 3),
    ("zbv", 2, 2, 1),
    ("zbv", 2, 4, 5),
    ("zbv", 2, 4, 2),
    ("zbv", 2, 1, 3),  # one process holding both stages: stage 0 is fed, the loss is the same process's
]
ONE_LAYER_PER_STAGE = {4: [2, 2, 2, 2], 6: [2, 1, 1, 2, 1, 1], 2: [4, 4], 8: [1] * 8}


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=60)


def pipelines(stage_cells: list[nn.Module], schedule: str, v: int, chunks: int, **settings: Any) -> list[Pipeline]:
    """One Pipeline per process of ``stage_cells`` (every stage's cell), linked by thread transports."""
    K = len(stage_cells) // len(stages_of(schedule, 0, 1, v))
    transports = ThreadTransport.create(len(stage_cells), timeout=timeout())
    held = [stages_of(schedule, r, K, v) for r in range(K)]
    return [
        Pipeline(
            {s: stage_cells[s] for s in stages},
            {s: transports[s] for s in stages},
            chunks=chunks,
            schedule=schedule,
            virtual_stages=v,
            **settings,
        )
        for stages in held
    ]


def in_threads(work: Callable[[int], Any], num_processes: int) -> list[Any]:
    """``work(r)`` for every process ``r``, one thread each; the first error re-raised."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            results[r] = work(r)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(num_processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        original = [error for error in errors if "the pipeline was aborted" not in str(error)]
        raise (original or errors)[0]
    return [results[r] for r in range(num_processes)]


def assert_grads(model: nn.Module, expected: dict[str, torch.Tensor], tolerance: float = TOLERANCE) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        error = relative_error(p.grad, expected[name])
        assert error <= tolerance, f"{name}: relative error {error:.2e}"


# ------------------------------------------------------------------------------------------------ transparency


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("schedule", "v", "K", "M"), CASES)
def test_gradients_and_loss_equal_plain_autograd(schedule: str, v: int, K: int, M: int, mode: CheckpointMode) -> None:
    model = build("mlp")
    data = batch()
    expected = full_batch_grads(model, data)
    expected_loss = float(loss_fn(model(data[0]), data).detach())
    model.zero_grad()
    loss = run_in_threads(
        cells(model, ONE_LAYER_PER_STAGE[K * v]),
        data,
        loss_fn,
        chunks=M,
        checkpoint=mode,
        schedule=schedule,
        virtual_stages=v,
    )
    assert abs(float(loss) - expected_loss) <= TOLERANCE * expected_loss
    assert_grads(model, expected)


@pytest.mark.parametrize("mode", MODES)
def test_zbv_weight_passes_recompute_nothing_the_input_pass_recomputed(mode: CheckpointMode) -> None:
    model = build("mlp")
    stage_cells = cells(model, [2, 2, 2, 2])
    calls: list[int] = []
    for cell in stage_cells:
        cell[0].register_forward_hook(lambda module, args, out: calls.append(1))
    reference = full_batch_grads(build("mlp"), batch())
    run_in_threads(stage_cells, batch(), loss_fn, chunks=4, checkpoint=mode, schedule="zbv")
    replayed = {"always": 4, "except_last": 3, "selective": 3, "never": 0}[mode]
    assert len(calls) == 4 * (4 + replayed)  # four stages: each forward, plus one replay per re-materialized one
    assert_grads(model, reference)


@pytest.mark.parametrize(("schedule", "v"), [("interleaved", 2), ("zbv", 2)])
def test_nested_boundary_values_cross_processes_and_the_in_process_link(schedule: str, v: int) -> None:
    # Tuples with a bool mask and a None leaf between every pair of stages, zbv's middle link within one process.
    model = build("nested")
    data = batch(10)  # micro-batches of 3, 3, 2, 2: every link resizes its predicted layout
    expected = full_batch_grads(model, data)
    model.zero_grad()
    run_in_threads(cells(model, [2, 1, 1, 1]), data, loss_fn, chunks=4, schedule=schedule, virtual_stages=v)
    assert_grads(model, expected)


@pytest.mark.parametrize("mode", ["always", "except_last", "selective"])
@pytest.mark.parametrize(("schedule", "K"), [("interleaved", 2), ("zbv", 2), ("zbv", 4)])
def test_dropout_is_replayed_exactly_under_rematerialization(schedule: str, K: int, mode: CheckpointMode) -> None:
    # Each process draws from its own seeded stream: re-materializing must replay its masks, so every mode gives the
    # gradients of checkpoint="never" with the same seeds, bit for bit.
    def grads(checkpoint: CheckpointMode) -> dict[str, torch.Tensor]:
        model = build("dropout")
        run_in_threads(
            cells(model, ONE_LAYER_PER_STAGE[2 * K]),
            batch(),
            loss_fn,
            chunks=4,
            checkpoint=checkpoint,
            schedule=schedule,
            virtual_stages=2,
            seeds=list(range(3, 3 + K)),
        )
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    reference, replayed = grads("never"), grads(mode)
    for name, expected in reference.items():
        assert torch.equal(replayed[name], expected), name


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8),
        nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3),
    )  # fmt: skip


@pytest.mark.parametrize(("schedule", "mode"), [("interleaved", "always"), ("zbv", "except_last"), ("zbv", "never")])
def test_deferred_batch_norm_commits_once_per_stage_at_the_step_end(schedule: str, mode: CheckpointMode) -> None:
    # Micro-batch statistics change the gradients and the later layers' statistics, so the reference is the same
    # deferred model as one stage; the first BatchNorm, whose input is the batch's, matches the full batch's too.
    data = batch()
    plain = bn_model()
    plain(data[0])
    reference = DeferredBatchNorm.convert(bn_model())
    run_in_threads([reference], data, loss_fn, chunks=4, checkpoint=mode)
    model = DeferredBatchNorm.convert(bn_model())
    run_in_threads(
        cells(model, [2, 2, 2, 2]), data, loss_fn, chunks=4, checkpoint=mode, schedule=schedule, virtual_stages=2
    )
    norms = [(ours, one) for ours, one in zip(model.modules(), reference.modules(), strict=True)]
    norms = [(ours, one) for ours, one in norms if isinstance(ours, DeferredBatchNorm)]
    assert len(norms) == 2
    for ours, one in norms:
        torch.testing.assert_close(ours.running_mean, one.running_mean)
        torch.testing.assert_close(ours.running_var, one.running_var)
        assert ours.num_batches_tracked.item() == 1  # type: ignore[operator]
    torch.testing.assert_close(norms[0][0].running_mean, plain[1].running_mean)
    assert_grads(model, {name: p.grad for name, p in reference.named_parameters()})  # type: ignore[misc]


class PassTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, value: tuple[torch.Tensor, Unbatched]) -> tuple[torch.Tensor, Unbatched]:
        h, table = value
        assert isinstance(table, Unbatched)
        assert table.value.shape == (4, 8)
        return torch.tanh(self.linear(h) + table.value[0]), table


class UseTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, value: tuple[torch.Tensor, Unbatched]) -> torch.Tensor:
        h, table = value
        return self.linear(h + table.value.mean(0))


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_unbatched_values_cross_every_link(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(WithTable(), PassTable(), PassTable(), UseTable())
    data = batch(8)  # micro-batches of 2 and 4 tables: only the table's mark keeps it whole
    expected = full_batch_grads(model, data)
    model.zero_grad()
    run_in_threads(list(model), data, loss_fn, chunks=4, schedule=schedule, virtual_stages=2)
    assert_grads(model, expected)


class MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def sequence_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), MeanOverTime(), nn.Linear(8, 3)
    )


def trimmed(microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Each micro-batch's sequences cut to its own length (one more than its samples): shapes change mid-step."""
    x = microbatch[0]
    return x[:, : x.shape[0] + 1]


@pytest.mark.parametrize(
    ("schedule", "mode"),
    [("gpipe", "except_last"), ("interleaved", "except_last"), ("zbv", "always"), ("zbv", "never")],
)
def test_sequence_lengths_vary_per_microbatch_and_between_steps(schedule: str, mode: CheckpointMode) -> None:
    # Regression (gpipe too): a shape change at a micro-batch of another size than the step's first (micro-batch 2 of
    # sizes 3, 3, 2, 2) sends a new header there; the receiver posted that micro-batch's buffers with the header's
    # layout resized to the first micro-batch's size, (3, T, 8) for (2, T, 8), and failed on the shape.
    model = sequence_model()
    generator = torch.Generator().manual_seed(2)
    for size, length in [(10, 7), (8, 5), (10, 9)]:  # micro-batches of 3, 3, 2, 2 (or 2 each) samples
        data = (torch.randn(size, length, 6, generator=generator), torch.randn(size, 3, generator=generator))
        model.zero_grad()
        total = sum(mb.weight * loss_fn(model(trimmed(mb.value)), mb.value) for mb in scatter(data, 4))
        total.backward()
        expected = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
        model.zero_grad()
        run_in_threads(
            cells(model, [2, 2, 1, 2]),
            data,
            loss_fn,
            chunks=4,
            input_fn=trimmed,
            checkpoint=mode,
            schedule=schedule,
            virtual_stages=1 if schedule == "gpipe" else 2,
        )
        assert_grads(model, expected)


def test_a_process_s_cell_without_parameters_computes_on_its_other_cells_device() -> None:
    # Found on an H100: interleaved and zbv at K=2 refused a CUDA model whose stage held only an activation (such a
    # cell defaulted to the CPU). The meta device stands in for a GPU here.
    from lightning_gpipe.engine.pipeline import _process_devices

    meta, cpu = torch.device("meta"), torch.device("cpu")
    cells = [nn.Linear(2, 2, device=meta), nn.ReLU(), nn.Linear(2, 2, device=meta), nn.ReLU()]
    assert _process_devices(cells, [(0, 2), (1, 3)]) == [meta, cpu, meta, cpu]
    assert _process_devices(cells, [(0, 3), (1, 2)]) == [meta, meta, meta, meta]
    cells[2] = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"stages \[0, 2\] of one process sit on devices \['meta', 'cpu'\]"):
        _process_devices(cells, [(0, 2), (1, 3)])


@RunIf(gpu=True)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("schedule", "K"), [("interleaved", 2), ("zbv", 2), ("zbv", 1)])
def test_cuda_processes_equal_plain_autograd_and_replay_dropout(schedule: str, K: int, mode: CheckpointMode) -> None:
    model = build("mlp").cuda()
    x, y = batch()
    expected = full_batch_grads(model, (x.cuda(), y.cuda()))
    model.zero_grad()
    run_in_threads(
        cells(model, ONE_LAYER_PER_STAGE[2 * K]), batch(), loss_fn, chunks=4, checkpoint=mode, schedule=schedule,
        virtual_stages=2,
    )  # fmt: skip
    assert_grads(model, expected, tolerance=1e-5)
    grads = []
    for checkpoint in (mode, "never"):
        model = build("dropout").cuda()
        run_in_threads(
            cells(model, ONE_LAYER_PER_STAGE[2 * K]), batch(), loss_fn, chunks=4, checkpoint=checkpoint,
            schedule=schedule, virtual_stages=2, seeds=list(range(K)),
        )  # fmt: skip
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    for name, grad in grads[1].items():
        assert torch.equal(grads[0][name], grad), name


# ------------------------------------------------------------------------------------------- Pipeline per process


@pytest.mark.parametrize(("schedule", "K"), [("interleaved", 2), ("zbv", 2), ("zbv", 1)])
def test_eval_step_gathers_the_plain_output_where_the_last_stage_is(schedule: str, K: int) -> None:
    model = build("mlp")
    data = batch(10)
    processes = pipelines(cells(model, ONE_LAYER_PER_STAGE[2 * K]), schedule, 2, chunks=4)
    outputs = in_threads(lambda r: processes[r].eval_step(data), K)
    holder = next(r for r in range(K) if 2 * K - 1 in stages_of(schedule, r, K, 2))
    torch.testing.assert_close(outputs[holder], model(data[0]))
    assert all(output is None for r, output in enumerate(outputs) if r != holder)


def test_the_timeline_records_every_action_with_its_stage() -> None:
    model = build("mlp")
    timeline = Timeline()
    run_in_threads(cells(model, [2, 2, 2, 2]), batch(), loss_fn, chunks=4, schedule="zbv", timeline=timeline)
    recorded = {(span.stage, span.phase, span.microbatch) for span in timeline.spans}
    names = {"F": "forward", "I": "input", "W": "weight"}
    for r in range(2):
        for action in process_actions("zbv", r, 2, 4):
            assert (action.stage, names[str(action)[0]], action.microbatch) in recorded, action


def test_train_step_returns_the_loss_on_the_process_of_the_last_stage_and_trains_again() -> None:
    model = build("mlp")
    data = batch()
    expected = full_batch_grads(model, data)
    model.zero_grad()
    processes = pipelines(cells(model, [2, 2, 2, 2]), "interleaved", 2, chunks=4)
    for step in range(2):  # a second step reuses the links: its headers and posted receives start afresh
        model.zero_grad()
        losses = in_threads(lambda r: processes[r].train_step(data, loss_fn), 2)
        assert losses[0] is None
        torch.testing.assert_close(losses[1], loss_fn(model(data[0]), data).detach())
        assert_grads(model, expected)
        assert [s.index for s in processes[1].stages] == [1, 3], step


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_an_anomaly_is_named_by_its_stage(schedule: str) -> None:
    model = build("mlp")
    with torch.no_grad():
        model[4].weight.fill_(float("nan"))  # stage 2's first layer
    with pytest.raises(PipelineError, match=r"\[pipeline stage 2\].*micro-batch 0"):
        run_in_threads(
            cells(model, [2, 2, 2, 2]),
            batch(),
            loss_fn,
            chunks=4,
            schedule=schedule,
            virtual_stages=2,
            detect_anomalies=True,
            timeout=20,
        )


# ------------------------------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (
            {"schedule": "interleaved"},
            r"schedule='interleaved' needs virtual_stages >= 2.*got 1; pass virtual_stages=2",
        ),
        ({"schedule": "zbv", "virtual_stages": 3}, r"virtual_stages=3 applies to schedule='interleaved' only; sch"),
        ({"schedule": "1f1b", "virtual_stages": 2}, r"virtual_stages=2 applies to schedule='interleaved' only; l"),
    ],
)
def test_virtual_stages_the_schedule_does_not_take_are_refused(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineConfig(chunks=4, **settings)


def test_zbv_always_holds_two_stages_and_interleaved_v() -> None:
    assert PipelineConfig(schedule="zbv").stages_per_process == 2
    assert PipelineConfig(schedule="zbv", virtual_stages=2).stages_per_process == 2
    assert PipelineConfig(schedule="interleaved", virtual_stages=3).stages_per_process == 3
    assert PipelineConfig().stages_per_process == 1


def test_chunks_that_interleaved_rounds_cannot_split_are_refused_when_the_pipeline_is_built() -> None:
    with pytest.raises(
        ValueError, match=r"cannot split chunks=5 into rounds of about pipe_size=2; use chunks <= 2 or a multiple of 2"
    ):
        pipelines(cells(build("mlp"), [2, 2, 2, 2]), "interleaved", 2, chunks=5)


def test_cells_of_stages_the_process_does_not_hold_are_refused() -> None:
    transports = ThreadTransport.create(4)
    stage_cells = cells(build("mlp"), [2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"cells for stages \[0, 1\] of 4.*such as \[0, 2\]"):
        Pipeline(
            {0: stage_cells[0], 1: stage_cells[1]},
            {0: transports[0], 1: transports[1]},
            chunks=4,
            schedule="interleaved",
            virtual_stages=2,
        )
    with pytest.raises(ValueError, match=r"cells for stages \[0, 2\] and transports for \[0, 1\]"):
        Pipeline(
            {0: stage_cells[0], 2: stage_cells[2]},
            {0: transports[0], 1: transports[1]},
            chunks=4,
            schedule="interleaved",
            virtual_stages=2,
        )
    with pytest.raises(ValueError, match=r"transport\[s\]\.stage must be s, got \{2: 1\}"):
        Pipeline(
            {0: stage_cells[0], 2: stage_cells[2]},
            {0: transports[0], 2: transports[1]},
            chunks=4,
            schedule="interleaved",
            virtual_stages=2,
        )
    with pytest.raises(ValueError, match=r"schedule='zbv' places 2 stages on each process, but Pipeline got one cell"):
        Pipeline(stage_cells[0], transports[0], chunks=4, schedule="zbv")


def test_a_process_of_several_stages_has_no_one_stage() -> None:
    (process,) = pipelines(cells(build("mlp"), [4, 4]), "zbv", 2, chunks=2)
    assert [stage.index for stage in process.stages] == [0, 1]
    with pytest.raises(AttributeError, match=r"holds stages \[0, 1\], not one; use Pipeline.stages"):
        _ = process.stage


def test_a_driver_that_must_feed_stage_0_without_feed_is_refused() -> None:
    # ZB-V's first process holds stages 0 and 2K-1 and calls its step at the last one: stage 0's input must come
    # from elsewhere.
    (process,) = pipelines(cells(build("mlp"), [4, 4]), "zbv", 2, chunks=2)
    with pytest.raises(
        TypeError,
        match=r"steps at stage 1 of its stages \[0, 1\], so stage 0 needs its input: pass StepDriver\(\.\.\., feed",
    ):
        StepDriver(process.begin(batch()))


@torch.no_grad()
def test_a_second_call_of_the_sequence_is_refused_with_several_stages_per_process() -> None:
    (process,) = pipelines(cells(build("mlp"), [4, 4]), "zbv", 2, chunks=2)
    driver = StepDriver(process.begin(batch(4), training=False), feed=lambda mb: mb.value[0])

    def decode(mb: Any) -> Any:
        return driver.call(driver.call(None))

    with pytest.raises(RuntimeError, match=r"twice for one batch under schedule='zbv'.*evaluate with schedule='gpipe'"):
        driver.forward_phase(decode)


def test_the_in_process_link_keeps_order_and_refuses_a_wait_before_the_send() -> None:
    loopback = _Loopback()
    buffers = [torch.empty(2) for _ in range(3)]
    waits = [loopback.post_recv(1, 0, buffer, f"message {k}") for k, buffer in enumerate(buffers)]
    sent = [torch.full((2,), float(k)) for k in range(2)]
    for tensor in sent:
        loopback.send(1, tensor)
    sent[0].add_(5)  # a copy was queued, as across processes
    waits[1]()  # fills the earlier receive first
    waits[0]()
    assert [b.tolist() for b in buffers[:2]] == [[0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(PipelineError, match=r"\[pipeline stage 1\] waited for message 2 from stage 0, which this pro"):
        waits[2]()


# ------------------------------------------------------------------------------------------ over gloo processes


def _links(ranks: list[int]) -> list[LinkGroups | None]:
    """A 2-rank group per link between two processes and direction, created by every rank in the same order."""
    return new_link_groups(ranks, timeout())


def _gloo_worker(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for schedule in ("interleaved", "zbv"):
        held = {r: stages_of(schedule, r, world_size, 2) for r in range(world_size)}
        ranks = [next(r for r in held if s in held[r]) for s in range(2 * world_size)]
        links = _links(ranks)
        model = build("nested")
        stage_cells = cells(model, [2, 1, 1, 1])
        transports = ProcessGroupTransport.for_stages(ranks, held[rank], links=links, timeout=timeout())
        pipeline = Pipeline(
            {s: stage_cells[s] for s in held[rank]}, transports, chunks=4, schedule=schedule, virtual_stages=2
        )
        for size in (10, 8):  # two steps, micro-batches of 3, 3, 2, 2, then of 2
            model.zero_grad()
            loss = pipeline.train_step(batch(size), loss_fn)
            results[f"{schedule} {size}"] = {
                "loss": loss,
                "grads": {
                    name: p.grad.clone()
                    for s in held[rank]
                    for name, p in model.named_parameters()
                    if name.split(".")[0] in {str(k) for k in _layers(s)} and p.grad is not None
                },
            }
        results[f"{schedule} eval"] = pipeline.eval_step(batch(10))
        try:
            ProcessGroupTransport.for_stages(ranks, held[rank])
        except ValueError as error:
            results[f"{schedule} without links"] = str(error)
        results[f"{schedule} refused"] = [
            _refusal(ProcessGroupTransport.for_stages, ranks, held[1 - rank], links=links),
            _refusal(ProcessGroupTransport, ranks, links=links),
        ]

        # A step that fails on the last stage's process: the other stops at its deadline, and neither goes on.
        impatient = ProcessGroupTransport.for_stages(
            ranks, held[rank], links=_links(ranks), timeout=datetime.timedelta(seconds=3)
        )
        failing = Pipeline(
            {s: stage_cells[s] for s in held[rank]}, impatient, chunks=4, schedule=schedule, virtual_stages=2
        )
        errors = []
        for _ in range(2):
            try:
                failing.train_step(batch(10), _failing_loss)
            except (PipelineError, RuntimeError) as error:
                errors.append(str(error))
        results[f"{schedule} errors"] = errors
    return results


def _refusal(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{fn} accepted {args}")


def _failing_loss(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
    raise RuntimeError("the loss failed")


def _layers(stage: int) -> range:
    bounds = [0, 2, 3, 4, 5]
    return range(bounds[stage], bounds[stage + 1])


@pytest.fixture(scope="module")
def gloo_runs() -> list[dict[str, Any]]:
    return run_processes(_gloo_worker, 2, timeout=240)


@RunIf(multiprocess=True)
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("size", [10, 8])
def test_two_gloo_processes_of_two_stages_each_equal_plain_autograd(
    gloo_runs: list[dict[str, Any]], schedule: str, size: int
) -> None:
    model = build("nested")
    data = batch(size)
    expected = full_batch_grads(model, data)
    grads = {name: torch.as_tensor(g) for run in gloo_runs for name, g in run[f"{schedule} {size}"]["grads"].items()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected[name]) <= TOLERANCE, name
    holder = 0 if schedule == "zbv" else 1  # the last stage's process
    assert gloo_runs[1 - holder][f"{schedule} {size}"]["loss"] is None
    loss = float(torch.as_tensor(gloo_runs[holder][f"{schedule} {size}"]["loss"]))
    assert loss == pytest.approx(float(loss_fn(model(data[0]), data).detach()), rel=TOLERANCE)


@RunIf(multiprocess=True)
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_eval_over_gloo_gathers_the_plain_output_on_the_last_stages_process(
    gloo_runs: list[dict[str, Any]], schedule: str
) -> None:
    holder = 0 if schedule == "zbv" else 1
    assert gloo_runs[1 - holder][f"{schedule} eval"] is None
    with torch.no_grad():
        expected = build("nested")(batch(10)[0])
    torch.testing.assert_close(torch.as_tensor(gloo_runs[holder][f"{schedule} eval"]), expected)


@RunIf(multiprocess=True)
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_a_failed_step_over_gloo_stops_both_processes_and_the_next_step(
    gloo_runs: list[dict[str, Any]], schedule: str
) -> None:
    holder = 0 if schedule == "zbv" else 1
    first, second = gloo_runs[holder][f"{schedule} errors"]
    assert first == "the loss failed"
    other_first, other_second = gloo_runs[1 - holder][f"{schedule} errors"]
    assert other_first.startswith("[pipeline stage"), other_first
    assert "a new step began after a failed one" in other_second, other_second
    assert "a new step began after a failed one" in second, second


@RunIf(multiprocess=True)
def test_transports_for_stages_another_rank_holds_are_refused(gloo_runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(gloo_runs):
        others, one_stage = run["interleaved refused"]
        held = f"but this process (global rank {rank}) holds stages [{rank}, {rank + 2}] of ranks [0, 1, 0, 1]"
        assert held in others
        assert f"this process (global rank {rank}) holds several stages of the pipeline's ranks" in one_stage
        assert "ProcessGroupTransport.for_stages" in one_stage


@RunIf(multiprocess=True)
def test_links_on_the_default_group_are_refused_where_two_join_the_same_processes(
    gloo_runs: list[dict[str, Any]],
) -> None:
    for run in gloo_runs:
        assert "the links after stages [0, 1, 2] join the same two processes" in run["interleaved without links"]
        assert "the links after stages [0, 2] join the same two processes" in run["zbv without links"]
