"""A pipelined sequence whose decoding calls run on K stages in threads of this process, for the zoo's decoders.

``model.layers = pipelined(model.layers, [2, 3], chunks=2)`` makes the model's decoders take the path they take inside
a step under ``GPipeStrategy`` (``layers.decode(decoding)``): every stage runs the call with its own layers and caches,
micro-batches in flight, over a ``ThreadTransport``, in seconds and without processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

from torch import nn

from lightning_gpipe.engine.decoding import decode
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.partition.sequence import PipelinedSequential


def decode_in_threads(cells: list[nn.Module], decoding: Any, chunks: int) -> Any:
    """``decoding`` run by the stages made of ``cells``, one thread each (each its own copy of the call, as each
    process has); the last stage's result."""
    transports = ThreadTransport.create(len(cells), timeout=datetime.timedelta(seconds=120))
    results: list[Any] = [None] * len(cells)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            call = dataclasses.replace(decoding)  # what another process would have built
            results[index] = decode(Stage(cells[index], transports[index]), call, chunks)
        except BaseException as error:
            errors.append(error)
            transports[index].abort(repr(error))

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(cells))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results[-1]


def pipelined(sequence: nn.Sequential, balance: list[int], chunks: int) -> PipelinedSequential:
    """A stand-in for ``sequence`` (as a step under the strategy sees it) whose decoding calls run on the stages of
    ``balance`` in threads; a plain call runs the whole sequence."""
    assert sum(balance) == len(sequence), f"balance {balance} for {len(sequence)} layers"
    cells, start = [], 0
    for size in balance:
        cells.append(sequence[start : start + size])
        start += size
    stand_in = PipelinedSequential(dict(sequence.named_children()), len(sequence), 0, 1)
    stand_in.runner = sequence
    stand_in.decoder = lambda decoding: decode_in_threads(cells, decoding, chunks)
    return stand_in
