"""The phase API over one step: the schedule's order is the only one accepted, and the strategy's split of a step
into Lightning's ``training_step`` and ``backward`` (with a ``zero_grad`` between) gives the whole-batch gradients.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.models import BALANCES, batch, build, cells, full_batch_grads, loss_fn, relative_error

from lightning_gpipe.engine.driver import StepDriver
from lightning_gpipe.engine.microbatch import Microbatch
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.schedule import MULTI_STAGE, SCHEDULES, Action, Phase
from lightning_gpipe.engine.step import HeldGradients
from lightning_gpipe.engine.thread_transport import ThreadTransport

TOLERANCE = 1e-6
ONE_STAGE = [s for s in SCHEDULES if s not in MULTI_STAGE]  # the schedules of one stage per process


def one_stage(schedule: str = "gpipe", chunks: int = 4) -> Pipeline:
    torch.manual_seed(0)
    (transport,) = ThreadTransport.create(1)
    return Pipeline(torch.nn.Linear(4, 2), transport, chunks=chunks, schedule=schedule)


def test_an_action_out_of_the_schedules_order_is_refused() -> None:
    pipeline = one_stage("gpipe")
    run = pipeline.begin((torch.randn(8, 4),))
    with pytest.raises(RuntimeError, match=r"stage 0 was asked for F1 but its schedule runs F0 next \(its actions: F0"):
        run.forward(1, run.microbatches[1].value[0])
    run.forward(0, run.microbatches[0].value[0])
    with pytest.raises(RuntimeError, match=r"asked for B0 but its schedule runs F1 next"):
        run.backward(0, torch.zeros((), requires_grad=True))
    run.abort("test")


def test_a_step_cannot_end_with_actions_left() -> None:
    pipeline = one_stage("1f1b", chunks=2)
    run = pipeline.begin((torch.randn(8, 4),))
    assert [str(a) for a in run.actions] == ["F0", "B0", "F1", "B1"]
    assert run.forward_span == 3
    assert run.backward_before_last_forward
    output = run.forward(0, run.microbatches[0].value[0])
    run.backward(0, output.sum())
    with pytest.raises(RuntimeError, match=r"stage 0 ended its step with actions left: F1 B1"):
        run.end()
    run.abort("test")


def test_every_step_reuses_the_schedules_actions_built_once() -> None:
    # StepRun asked the schedule for its actions, checking the schedule's name and K, M, twice per step (its own and
    # the next stage's); they are built once per (schedule, stage, K, M) and later steps, of any stage, share them.
    pipeline = one_stage("1f1b")
    actions = []
    for _ in range(2):
        run = pipeline.begin((torch.randn(8, 4),))
        actions.append(run.actions)
        outputs = {}
        for action in run.actions:
            mb = run.microbatches[action.microbatch]
            if action.phase is Phase.FORWARD:
                outputs[mb.index] = run.forward(mb.index, mb.value[0]).sum()
            else:
                run.backward(mb.index, outputs.pop(mb.index))
        run.end()
    other = one_stage("1f1b").begin((torch.randn(8, 4),))
    assert actions[0] is actions[1] is other.actions
    other.abort("test")


def test_held_gradients_survive_a_zero_grad_and_add_to_what_is_there() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 10.0)  # accumulated by an earlier batch
    held = HeldGradients([weight])
    assert weight.grad is None  # the held passes start from nothing
    (weight * 2).sum().backward()
    held.hold()
    assert torch.equal(weight.grad, torch.full((3,), 10.0))  # the earlier gradient is back
    weight.grad = None  # Lightning's zero_grad at the start of an accumulation window
    held.release()
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
    (weight * 3).sum().backward()
    assert torch.equal(weight.grad, torch.full((3,), 5.0))


def strategy_split_step(stages: int, chunks: int, schedule: str) -> dict[str, torch.Tensor]:
    """One step driven as GPipeStrategy drives it: the actions up to the last forward, ``zero_grad``, the rest."""
    model = build("mlp")
    model.zero_grad(set_to_none=True)
    stage_cells = cells(model, BALANCES["mlp"][stages])
    transports = ThreadTransport.create(stages)
    phase_one_done = threading.Barrier(stages)
    errors: list[BaseException] = []

    def work(j: int) -> None:
        pipeline = Pipeline(stage_cells[j], transports[j], chunks=chunks, schedule=schedule)
        cell = stage_cells[j]
        for p in cell.parameters():  # a gradient from an earlier step, which zero_grad must clear
            p.grad = torch.full_like(p, 100.0)
        run = pipeline.begin(batch())
        losses: dict[int, torch.Tensor] = {}

        def loss_for(i: int) -> torch.Tensor | None:
            return losses.pop(i) if pipeline.stage.is_last else None

        def backward(action: Action) -> None:  # a whole backward, or a split one's input or weight pass
            if action.phase is Phase.WEIGHT:
                run.weight(action.microbatch)
            elif action.phase is Phase.INPUT:
                run.input(action.microbatch, loss_for(action.microbatch))
            else:
                run.backward(action.microbatch, loss_for(action.microbatch))

        try:
            held = HeldGradients(cell.parameters()) if run.backward_before_last_forward else None
            for action in run.actions[: run.forward_span]:  # Lightning's training_step
                mb = run.microbatches[action.microbatch]
                if action.phase is Phase.FORWARD:
                    output = run.forward(mb.index, mb.value[0] if pipeline.stage.is_first else None)
                    if pipeline.stage.is_last:
                        losses[mb.index] = loss_fn(output, mb.value) * mb.weight
                else:
                    backward(action)
            if held is not None:
                held.hold()
            phase_one_done.wait(timeout=60)
            cell.zero_grad(set_to_none=True)  # Lightning's zero_grad, between training_step and backward
            if held is not None:  # Lightning's backward
                held.release()
            for action in run.remaining():
                backward(action)
            run.end()
        except BaseException as error:
            errors.append(error)
            run.abort(repr(error))
            phase_one_done.abort()

    run_threads: list[threading.Thread] = [threading.Thread(target=work, args=(j,)) for j in range(stages)]
    for thread in run_threads:
        thread.start()
    for thread in run_threads:
        thread.join()
    if errors:
        raise errors[0]
    return {key: p.grad.clone() for key, p in model.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize("schedule", ONE_STAGE)
@pytest.mark.parametrize(("stages", "chunks"), [(1, 4), (2, 5), (4, 8)])
def test_the_strategys_split_of_a_step_gives_the_whole_batch_gradients(stages: int, chunks: int, schedule: str) -> None:
    reference = full_batch_grads(build("mlp"), batch())
    grads = strategy_split_step(stages, chunks, schedule)
    for name, expected in reference.items():
        error = relative_error(grads[name], expected)
        assert error <= TOLERANCE, f"{name}: relative error {error:.2e}"


def weighing_driver(schedule: str, declare: object = None) -> StepDriver:
    """A driver of one stage over a batch of 8 in 2 micro-batches; row values 1 and 9 tell them apart."""
    pipeline = one_stage(schedule, chunks=2)
    rows = torch.tensor([1.0] * 4 + [9.0] * 4).unsqueeze(1).expand(8, 4)
    return StepDriver(pipeline.begin(rows), hook="training_step", returns_weights=True, declare=declare)


def loss_of(driver: StepDriver, mb: Microbatch, **extra: object) -> dict[str, object]:
    """Micro-batch ``i``'s loss is ``i + 1`` (with the cell's gradient path), plus ``extra`` keys."""
    return {"loss": driver.call(mb.value).sum() * 0 + mb.index + 1, **extra}


def test_a_loss_weight_under_1f1b_is_refused_with_the_fix_and_weighs_after_the_forwards_under_gpipe() -> None:
    # 1F1B runs micro-batch 0's backward before the last forward, when the normalizers of later micro-batches
    # (what `loss_weight` reports) are not known yet; fill-drain weighs every loss after the last forward.
    driver = weighing_driver("1f1b")
    outputs = driver.forward_phase(lambda mb: loss_of(driver, mb))
    assert driver.weigh(outputs).item() == pytest.approx(1 * 0.5 + 2 * 0.5)  # weighted by the shares of samples
    driver.backward_phase()
    driver = weighing_driver("1f1b")
    refusal = r"training_step returned 'loss_weight' under schedule='1f1b'; use schedule='gpipe', or declare batch_loss"
    with pytest.raises(ValueError, match=refusal):
        driver.forward_phase(lambda mb: loss_of(driver, mb, loss_weight=3))
    driver = weighing_driver("gpipe")
    outputs = driver.forward_phase(lambda mb: loss_of(driver, mb, loss_weight=1 + 2 * mb.index))
    assert driver.weigh(outputs).item() == pytest.approx(1 * 0.25 + 2 * 0.75)
    driver.backward_phase()


def test_a_declared_loss_weight_weighs_an_early_loss_and_a_returned_one_beside_it_is_refused() -> None:
    # A weight declared from the batch (the module's `batch_loss_weight`) is known before the schedule runs,
    # so 1F1B weighs micro-batch 0's loss by it before the last forward; a returned 'loss_weight' too says it twice.
    def declare(batch: torch.Tensor) -> torch.Tensor:
        return batch[0, 0]  # 1 and 9: weights 0.1 and 0.9

    driver = weighing_driver("1f1b", declare)
    outputs = driver.forward_phase(lambda mb: loss_of(driver, mb))
    assert driver.declared is not None
    assert driver.declared.tolist() == pytest.approx([0.1, 0.9])
    assert driver.weigh(outputs).item() == pytest.approx(1 * 0.1 + 2 * 0.9)
    driver.backward_phase()
    driver = weighing_driver("gpipe", declare)
    with pytest.raises(ValueError, match=r"returned 'loss_weight' and .* declares batch_loss_weight\(batch\) too"):
        driver.forward_phase(lambda mb: loss_of(driver, mb, loss_weight=3))
