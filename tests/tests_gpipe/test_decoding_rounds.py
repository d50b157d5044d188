"""Decoding rounds: a decoding call run by every stage with per-stage caches, micro-batches in flight, no Trainer.

Each stage is a thread over a ThreadTransport. The model is a toy language model whose causal layer keeps a cache (the
running sum of its inputs); its cached decoding must give the tokens of the whole model re-reading every prefix.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.decoding import decode
from lightning_gpipe.engine.driver import StepDriver
from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.microbatch import scatter
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.relay import CallRelay
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.step import StepRun
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.timeline import Timeline

V, D, EOS = 13, 8, 2


class Embed(nn.Module):
    """tokens [b, t] -> x [b, t, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(V, D)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


class Mix(nn.Module):
    """x [b, t, D] -> tanh(W x + the mean of x over the positions so far); ``cache`` keeps the running sum."""

    cache: dict[str, Any] | None = None

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.delay = delay  # seconds of sleep per call, for the overlap test (it releases the interpreter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        total = x.cumsum(dim=1)
        count = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)
        cache = self.cache
        if cache is not None:
            if "sum" in cache:
                total, count = total + cache["sum"][:, None], count + cache["count"]
            cache["sum"], cache["count"] = total[:, -1], count[-1]
        return torch.tanh(self.linear(x) + total / count[None, :, None])


def toy_model(layers: int = 4, delay: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(Embed(), *[Mix(delay) for _ in range(layers)], nn.Linear(D, V)).double().eval()
    with torch.no_grad():
        model[-1].weight.mul_(4.0)
        model[-1].bias[EOS] += 2.0  # some rows end early, at different rounds
    return model


def prompts(rows: int, length: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (rows, length), generator=torch.Generator().manual_seed(seed))


def whole_greedy(model: nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """The whole model re-reading every prefix: [rows, new], rows that ended padded with 0 after EOS."""
    tokens, done = prompt, torch.zeros(prompt.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(new):
            token = model(tokens)[:, -1].argmax(-1).masked_fill(done, 0)
            tokens = torch.cat([tokens, token[:, None]], dim=1)
            done |= token == EOS
            if bool(done.all()):
                break
    return nn.functional.pad(tokens[:, prompt.shape[1] :], (0, new + prompt.shape[1] - tokens.shape[1]))


@dataclass
class ToyPart:
    """One micro-batch of a toy greedy decoding on one stage."""

    prompt: torch.Tensor
    new: int
    grow: bool = False  # send a value that grows each round (refused from round 2 on)
    caches: dict[int, dict[str, Any]] = field(default_factory=dict)
    chosen: list[torch.Tensor] = field(default_factory=list)
    done: torch.Tensor | None = None

    def first(self) -> torch.Tensor:
        return self.prompt

    def next(self) -> torch.Tensor:
        return self.chosen[-1][:, None]

    def run(self, cell: nn.Module, value: Any) -> Any:
        value = value[0] if isinstance(value, tuple) else value  # what grow added
        for layer in cell:
            if isinstance(layer, Mix):
                layer.cache = self.caches.setdefault(id(layer), {})
        try:
            output = cell(value)
        finally:
            for layer in cell:
                if isinstance(layer, Mix):
                    layer.cache = None
        if self.grow and output.dtype == torch.float64 and output.shape[-1] == D:
            return (output, torch.zeros(output.shape[0], len(self.chosen)))
        return output

    def choose(self, output: torch.Tensor) -> tuple[torch.Tensor, bool]:
        token = output[:, -1].argmax(-1)
        done = torch.zeros_like(token, dtype=torch.bool) if self.done is None else self.done
        token = token.masked_fill(done, 0)
        finished = bool((done | (token == EOS)).all()) or len(self.chosen) + 1 == self.new
        return token, finished

    def follow(self, control: torch.Tensor) -> None:
        self.chosen.append(control.clone())
        done = torch.zeros_like(control, dtype=torch.bool) if self.done is None else self.done
        self.done = done | (control == EOS)

    def result(self) -> torch.Tensor:
        tokens = torch.stack(self.chosen, dim=1)
        return nn.functional.pad(tokens, (0, self.new - tokens.shape[1]))


@dataclass
class ToyDecoding:
    prompt: torch.Tensor
    new: int
    cache_budget: int | None = None  # pretend the caches need this many bytes
    grow: bool = False

    @property
    def rows(self) -> int:
        return self.prompt.shape[0]

    def part(self, rows: slice) -> ToyPart:
        return ToyPart(self.prompt[rows], self.new, self.grow)

    def join(self, results: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(results)

    def cache_bytes(self, cell: nn.Module, rows: int) -> int:
        if self.cache_budget is not None:
            return self.cache_budget
        return sum(isinstance(layer, Mix) for layer in cell) * rows * (D * 8 + 8)


def cells_of(model: nn.Sequential, balance: list[int]) -> list[nn.Module]:
    cells, start = [], 0
    for size in balance:
        cells.append(model[start : start + size])
        start += size
    return cells


class ReceivingWhenNeeded(ThreadTransport):
    """A transport that does not post receives ahead, as on device streams (NCCL)."""

    @property
    def posts_ahead(self) -> bool:
        return False


def in_threads(
    cells: list[nn.Module], work: Callable[[Stage], Any], timeline: Timeline | None = None, ahead: bool = True
) -> list[Any]:
    """``work(stage)`` on every stage of the pipeline of ``cells``, one thread each; each stage's result."""
    transports = ThreadTransport.create(len(cells), timeout=datetime.timedelta(seconds=60))
    if not ahead:
        for transport in transports:
            transport.__class__ = ReceivingWhenNeeded
    results: list[Any] = [None] * len(cells)
    errors: list[tuple[int, BaseException]] = []

    def run(index: int) -> None:
        try:
            results[index] = work(Stage(cells[index], transports[index], timeline=timeline))
        except BaseException as error:
            errors.append((index, error))
            transports[index].abort(repr(error))

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(cells))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise sorted(errors, key=lambda e: isinstance(e[1], PipelineError))[0][1]
    return results


PIPELINES = [([6], 1), ([6], 3), ([2, 4], 1), ([3, 3], 2), ([1, 3, 2], 3), ([1, 1, 2, 2], 4), ([2, 2, 2], 7)]


@pytest.mark.parametrize(("balance", "chunks"), PIPELINES)
def test_cached_decoding_under_the_pipeline_gives_the_whole_models_tokens(balance: list[int], chunks: int) -> None:
    model = toy_model()
    prompt = prompts(7)
    expected = whole_greedy(model, prompt, new=9)
    ends = [row.index(EOS) if EOS in row else 9 for row in expected.tolist()]
    assert len(set(ends)) > 2, "rows should stop at different rounds"
    results = in_threads(cells_of(model, balance), lambda stage: decode(stage, ToyDecoding(prompt, 9), chunks))
    assert torch.equal(results[-1], expected)
    assert all(result is None for result in results[:-1])


def test_a_transport_that_receives_when_needed_decodes_alike() -> None:
    model = toy_model()
    prompt = prompts(6, seed=4)
    expected = whole_greedy(model, prompt, new=8)
    cells = cells_of(model, [2, 2, 2])
    results = in_threads(cells, lambda stage: decode(stage, ToyDecoding(prompt, 8), 2), ahead=False)
    assert torch.equal(results[-1], expected)


def test_each_round_is_one_message_per_link_after_the_first_two() -> None:
    model = toy_model()
    prompt = prompts(4, seed=1)
    sent: list[tuple[int, int, int]] = []  # (from, to, bytes)
    transports = ThreadTransport.create(2, timeout=datetime.timedelta(seconds=60))
    for transport in transports:
        original = transport.send

        def counted(tensor: torch.Tensor, peer: int, what: str, original: Any = original, me: int = transport.stage):
            sent.append((me, peer, tensor.numel()))
            original(tensor, peer, what)

        transport.send = counted  # type: ignore[method-assign]
    cells = cells_of(model, [3, 3])
    results: list[Any] = [None, None]

    def run(index: int) -> None:
        results[index] = decode(Stage(cells[index], transports[index]), ToyDecoding(prompt, 6), 2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens = results[1]
    rounds = [min(row.index(EOS) + 1 if EOS in row else 6, 6) for row in tokens.tolist()]
    per_batch = [max(rounds[:2]), max(rounds[2:])]  # a micro-batch runs until its last row ends
    down = [size for src, dst, size in sent if (src, dst) == (0, 1)]
    up = [size for src, dst, size in sent if (src, dst) == (1, 0)]
    verdicts = 1  # the memory verdict, each way
    # Down: each micro-batch's round 0 and 1 come with a header; then one frame per round.
    assert len(down) == verdicts + sum(rounds + 2 for rounds in per_batch)
    # Up: a control per round, its first with a header.
    assert len(up) == verdicts + sum(rounds + 1 for rounds in per_batch)
    assert max(up[verdicts:]) < 1100  # token ids and a flag, never logits


def test_a_stage_works_on_one_micro_batch_while_the_next_stage_works_on_another() -> None:
    model = toy_model(layers=2, delay=0.02)
    timeline = Timeline()
    prompt = prompts(4, seed=2)
    in_threads(cells_of(model, [2, 2]), lambda stage: decode(stage, ToyDecoding(prompt, 4), 2), timeline)
    spans = {(span.stage, span.microbatch): [] for span in timeline.spans}
    for span in timeline.spans:
        spans[(span.stage, span.microbatch)].append((span.start, span.end))
    overlapping = 0
    for start, end in spans[(0, 1)]:
        overlapping += any(start < other_end and other_start < end for other_start, other_end in spans[(1, 0)])
    assert overlapping >= 2, "stage 0's rounds of micro-batch 1 should run while stage 1 runs micro-batch 0"


def test_a_call_whose_caches_would_not_fit_is_refused_on_every_stage() -> None:
    model = toy_model()
    errors: list[str] = []

    def work(stage: Stage) -> None:
        budget = 2**60 if stage.index == 1 else 0
        try:
            decode(stage, ToyDecoding(prompts(2), 4, cache_budget=budget), 1)
        except ValueError as error:
            errors.append(str(error))

    in_threads(cells_of(model, [2, 2, 2]), work)
    assert len(errors) == 3
    assert len(set(errors)) == 1
    assert "needs 1.07e+09 GiB of key/value cache on stage 1" in errors[0]
    assert "decode fewer sequences at a time" in errors[0]


def test_a_value_that_changes_its_layout_after_the_second_round_is_refused() -> None:
    model = toy_model()
    with pytest.raises(PipelineError, match=r"round 2 of micro-batch 0 sends its decoding output in another layout"):
        in_threads(cells_of(model, [3, 3]), lambda stage: decode(stage, ToyDecoding(prompts(2), 5, grow=True), 1))


def test_the_engine_pipeline_decodes() -> None:
    model = toy_model()
    prompt = prompts(5, seed=3)
    expected = whole_greedy(model, prompt, new=7)
    transports = ThreadTransport.create(2, timeout=datetime.timedelta(seconds=60))
    cells = cells_of(model, [3, 3])
    pipelines = [Pipeline(cells[i], transports[i], chunks=2) for i in range(2)]
    results: list[Any] = [None, None]
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, pipelines[i].decode(ToyDecoding(prompt, 7))))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0] is None
    assert torch.equal(results[1], expected)


def steps_in_threads(cells: list[nn.Module], batch: torch.Tensor, step: Callable[..., Any], chunks: int) -> list[Any]:
    """An evaluation step of the pipeline of ``cells`` on ``batch`` through the step driver, as the strategy runs it;
    per stage, the step function's outputs and the micro-batch sizes the step ended with."""

    def work(stage: Stage) -> Any:
        pipeline = Pipeline(stage.cell, stage.transport, chunks=chunks)
        with torch.no_grad():
            run = pipeline.begin(batch, training=False)
            driver = StepDriver(run, relay=CallRelay(pipeline.stage))
            outputs = driver.forward_phase(lambda mb: step(driver, mb))
            driver.finish()
        return outputs, [mb.size for mb in run.microbatches]

    return in_threads(cells, work)


def test_a_step_that_decodes_at_its_first_call_decodes_the_whole_batch_in_micro_batches() -> None:
    model = toy_model()
    prompt = prompts(6, seed=5)
    expected = whole_greedy(model, prompt, new=6)
    calls: list[int] = []

    def step(driver: StepDriver, mb: Any) -> Any:
        calls.append(mb.value.shape[0])
        return driver.decode(ToyDecoding(mb.value, 6))

    results = steps_in_threads(cells_of(model, [3, 3]), prompt, step, chunks=3)
    (outputs, sizes), (last_outputs, last_sizes) = results
    assert sizes == last_sizes == [6]  # the step's three micro-batches became one: the whole batch
    assert outputs == [None]
    assert torch.equal(last_outputs[0], expected)
    # Each stage ran the step for micro-batch 0 up to its decoding call, then once on the whole batch.
    assert sorted(calls) == [2, 2, 6, 6]


def test_a_decoding_call_after_a_first_call_is_relayed_to_the_other_stages() -> None:
    model = toy_model()
    prompt = prompts(6, seed=6)

    def step(driver: StepDriver, mb: Any) -> Any:
        logits = driver.call(mb.value if driver.stage.is_first else None)
        if not driver.stage.is_last:
            return None  # the strategy ends a stage's step at its first call
        return logits[:, -1].argmax(-1), driver.decode(ToyDecoding(mb.value, 5))

    (outputs, _), (last_outputs, sizes) = steps_in_threads(cells_of(model, [2, 4]), prompt, step, chunks=2)
    assert sizes == [3, 3]
    assert outputs == [None, None]
    with torch.no_grad():
        first = model(prompt)[:, -1].argmax(-1)
    assert torch.equal(torch.cat([tokens for tokens, _ in last_outputs]), first)
    assert torch.equal(torch.cat([decoded for _, decoded in last_outputs]), whole_greedy(model, prompt, new=5))


def test_whole_batch_decoding_is_refused_in_training_and_after_a_forward() -> None:
    stage = Stage(toy_model()[:2], ThreadTransport.create(1)[0])
    batch = prompts(4)
    run = StepRun(stage, "gpipe", scatter(batch, 2), training=True, batch=batch)
    with pytest.raises(RuntimeError, match="only an evaluation step whose first forward has not run"):
        run.decode_whole()
    run = StepRun(stage, "gpipe", scatter(batch, 2), training=False, batch=batch)
    with torch.no_grad():
        run.forward(0, batch[:2])
    with pytest.raises(RuntimeError, match="only an evaluation step whose first forward has not run"):
        run.decode_whole()
