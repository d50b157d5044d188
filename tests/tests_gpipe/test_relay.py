"""Further calls of the sequence in one evaluation step (decoding), driven by the last stage, without a Trainer.

Each stage is a thread over a ThreadTransport and runs what the strategy runs in an evaluation step: the user's step
per micro-batch, its first call through the Stage (the stages before the last stop there), its further calls through
the CallRelay; then the last stage finishes and the others serve.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.framing import MESSAGE_BYTES
from lightning_gpipe.engine.microbatch import gather, scatter
from lightning_gpipe.engine.relay import CallRelay
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.thread_transport import ThreadTransport

V, D, EOS = 11, 16, 2


class CumulativeMean(nn.Module):
    """Mixes the positions of a prefix, so the next token depends on all of it: [N, t, D] -> [N, t, D]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None]
        return x.cumsum(dim=1) / steps


class Embed(nn.Module):
    """(source [N, S], prefix [N, t]) -> [N, t, D]: the prefix's embeddings plus the source's mean embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, D)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        source, prefix = value
        return self.embedding(prefix) + self.embedding(source).mean(dim=1, keepdim=True)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(), CumulativeMean(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V)).eval()


def greedy(sequence: Any, source: torch.Tensor, max_len: int = 12) -> torch.Tensor:
    """A user's decoding loop: one call of ``sequence`` per token, stopping when every row has ended."""
    tokens = torch.ones(source.shape[0], 1, dtype=torch.long)
    finished = torch.zeros(source.shape[0], dtype=torch.bool)
    for _ in range(max_len):
        word = sequence((source, tokens))[:, -1].argmax(dim=-1).masked_fill(finished, 0)
        tokens = torch.cat([tokens, word[:, None]], dim=1)
        finished |= word == EOS
        if finished.all():
            break
    return nn.functional.pad(tokens, (0, max_len + 1 - tokens.shape[1]))  # one width, so that batches gather


class _Stop(BaseException):
    """Ends the user's step on a stage before the last once its first call is sent (as the strategy does)."""


def pipelined_steps(cells: list[nn.Module], batches: list[torch.Tensor], chunks: int, step: Any) -> list[Any]:
    """Evaluation steps of the pipeline made of ``cells``: the last stage's gathered outputs and the calls served."""
    transports = ThreadTransport.create(
        len(cells), [torch.device("cpu")] * len(cells), timeout=datetime.timedelta(seconds=30)
    )
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        stage = Stage(cells[index], transports[index])
        relay = CallRelay(stage)
        outputs, served = [], []
        try:
            with torch.no_grad():
                for batch in batches:
                    microbatches = scatter(batch, chunks)
                    stage.begin_step([mb.size for mb in microbatches])
                    step_outputs = []
                    for mb in microbatches:
                        calls = 0

                        def sequence(value: Any, mb: Any = mb) -> Any:
                            nonlocal calls
                            calls += 1
                            if calls > 1:
                                return relay.call(mb.index, value)
                            output = stage.forward(mb.index, value if stage.is_first else None)
                            if not stage.is_last:
                                raise _Stop
                            return output

                        with contextlib.suppress(_Stop):
                            step_outputs.append(step(sequence, mb.value))
                    if stage.is_last:
                        relay.finish()
                        outputs.append(gather(step_outputs))
                    else:
                        served.append(relay.serve())
                    stage.end_step()
            results[index] = (outputs, served)
        except BaseException as error:
            errors.append(error)
            stage.abort(repr(error))
            relay.abort(repr(error))

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(cells))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[index] for index in range(len(cells))]


def sources(samples: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (samples, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("balance", [[2, 3], [1, 2, 2]])
def test_greedy_decoding_through_the_stages_equals_the_whole_model(balance: list[int]) -> None:
    whole = model()
    # A source of 200 tokens makes each call's control message longer than MESSAGE_BYTES (a second message).
    batches = [sources(6, 3, seed=1), sources(5, 200, seed=2)]
    assert len(batches[1].numpy().tobytes()) > MESSAGE_BYTES
    cells, start = [], 0
    for size in balance:
        cells.append(whole[start : start + size])
        start += size
    further: list[int] = []  # further calls per micro-batch, as the last stage's steps made them

    def step(sequence: Any, source: torch.Tensor) -> torch.Tensor:
        calls = 0

        def counted(value: Any) -> Any:
            nonlocal calls
            calls += 1
            return sequence(value)

        tokens = greedy(counted, source)
        further.append(calls - 1)  # on the last stage only: the others stop at the first call
        return tokens

    results = pipelined_steps(cells, batches, chunks=3, step=step)
    outputs, _ = results[-1]
    for batch, decoded in zip(batches, outputs, strict=True):
        assert torch.equal(decoded, greedy(whole, batch))
    calls = [sum(further[:3]), sum(further[3:])]
    assert len(set(further)) > 1  # micro-batches stopped after different numbers of calls
    for _outputs, served in results[:-1]:  # every stage before the last served each further call once
        assert served == calls


def test_a_step_without_further_calls_costs_one_done_message() -> None:
    whole = model()
    results = pipelined_steps(
        [whole[:2], whole[2:]], [sources(4, 3, seed=3)], chunks=2, step=lambda sequence, s: sequence((s, s))
    )
    assert results[0][1] == [0]
    assert torch.allclose(results[1][0][0], whole((sources(4, 3, seed=3),) * 2))


def test_a_further_call_with_gradients_is_refused() -> None:
    cells = [model()[:2], model()[2:]]

    def step(sequence: Any, source: torch.Tensor) -> Any:
        sequence((source, source))
        with torch.enable_grad():
            return sequence((source, source))

    with pytest.raises(RuntimeError, match=r"a second time with gradients enabled.*only in evaluation"):
        pipelined_steps(cells, [sources(2, 3, seed=4)], chunks=1, step=step)
