"""The timed calls of the generate benchmark, each run in fresh processes of one thread (``tools/launch.py``)."""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["PROMPT", "ROWS", "one_process", "predict"]

ROWS, PROMPT = 8, 32  # prompts, and tokens per prompt


def _prompts(vocab: int) -> Any:
    import torch

    ids = torch.randint(3, vocab, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def one_process(
    rank: int, world_size: int, source: str, new: int, batches: int
) -> dict[str, list[tuple[float, float]]]:
    """Wall and CPU seconds of each of ``batches`` calls of the library's ``generate`` and of the zoo model's, after a
    warm-up of each, the two taking turns in this one process (neighbours in time, the same caches and load)."""
    import torch
    import transformers

    import zoo

    ids, mask = _prompts(transformers.AutoConfig.from_pretrained(source).vocab_size)
    library = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    ours = zoo.load_pretrained(source).eval()
    calls = {
        "transformers": lambda: library.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        ),
        "zoo": lambda: ours.generate(ids, mask, max_new_tokens=new, eos_token_id=()),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    with torch.no_grad():
        for batch in range(batches + 1):
            for name in sorted(calls, reverse=bool(batch % 2)):  # each goes first in every other batch
                wall, cpu = time.perf_counter(), time.process_time()
                tokens = calls[name]()
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
                assert tokens.shape == (ROWS, PROMPT + new), tokens.shape
    return {name: measured[1:] for name, measured in times.items()}


def predict(rank: int, world_size: int, source: str, chunks: int, new: int, batches: int) -> list[tuple[float, float]]:
    """Wall and CPU seconds of each predict batch after the first on this rank (``chunks`` 0: plain Lightning, one
    device)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_gpipe
    import zoo
    from benchmarks.trainer import quiet_trainer

    os.environ["LOCAL_RANK"] = str(rank)  # Lightning's sign that the ranks were started from outside
    model = zoo.load_pretrained(source)
    model.hparams["generation"] = {"max_new_tokens": new, "eos_token_id": []}
    ids, mask = _prompts(model.hparams["config"]["vocab_size"])
    batch = {"input_ids": ids, "attention_mask": mask}

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.times: list[tuple[float, float]] = []

        def on_predict_batch_start(self, *args: Any) -> None:
            self.start = (time.perf_counter(), time.process_time())

        def on_predict_batch_end(self, *args: Any) -> None:
            self.times.append((time.perf_counter() - self.start[0], time.process_time() - self.start[1]))

    clock = Clock()
    strategy: Any = "auto" if chunks == 0 else lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=chunks)
    trainer = quiet_trainer(accelerator="cpu", devices=world_size, strategy=strategy, callbacks=[clock])
    loader: DataLoader[Any] = DataLoader([batch] * (batches + 1), batch_size=None)  # type: ignore[arg-type]
    (tokens, *_) = trainer.predict(model, loader)
    assert isinstance(tokens, torch.Tensor)
    assert tokens.shape == (ROWS, PROMPT + new), tokens.shape
    return clock.times[1:]
