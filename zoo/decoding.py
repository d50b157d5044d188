"""A decoding call run in rounds with key/value caches: on the whole model here, or by every stage of a pipeline.

The zoo's decoders (:mod:`zoo.hf.causal_lm_generation`, :mod:`zoo.transformer.search`) describe one call (a
``generate``, a beam search) as an object of the shape a pipeline strategy reads (``lightning_gpipe``'s
``engine.decoding.Decoding``, by duck typing: the zoo imports no library internals):

- the call: ``rows`` (its sequences), ``part(rows)`` (a slice of them on one stage), ``join(results)`` (the parts'
  results in order), ``cache_bytes(cell, rows)`` (what the caches of a stage's layers hold at most);
- a part: ``first()`` (the prompt's input), ``run(cell, value)`` (a stage's layers with the part's caches),
  ``choose(output)`` (the tokens chosen from the logits, and whether the part is finished), ``follow(control)``
  (what every stage does with the chosen tokens: extend its masks, reorder a beam search's cache), ``next()`` (the
  next round's input), ``result()``.

:func:`run_decoding` runs it: on the whole model, as one part in rounds on this process; where ``model.layers`` is a
pipeline's stand-in, through its ``decode``, which runs the same parts on every stage with micro-batches in flight. The
stages run the code that runs here, so the tokens are the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["attached", "holds_all_layers", "run_decoding"]


def holds_all_layers(layers: nn.Module) -> bool:
    """Whether ``layers`` holds every layer of the model's sequence, so that the model may call its parts one by one.

    A stand-in that holds some of them and runs each call of the whole sequence elsewhere (the sequence a pipeline
    strategy gives each stage) says ``holds_all_layers = False``; the model then calls the whole sequence instead.
    """
    return bool(getattr(layers, "holds_all_layers", True))


def run_decoding(layers: nn.Module, decoding: Any) -> Any:
    """The result of ``decoding`` (see the module) on the model whose layer sequence is ``layers``.

    Raises:
        TypeError: ``layers`` holds part of the model and offers no ``decode`` to run the call on every stage.
    """
    if not holds_all_layers(layers):
        decode = getattr(layers, "decode", None)
        if decode is None:
            raise TypeError(
                f"model.layers is a {type(layers).__name__} that holds part of the model and has no "
                "decode(decoding); decode on the whole model, or inside a step under GPipeStrategy"
            )
        return decode(decoding)
    part = decoding.part(slice(0, decoding.rows))
    value = part.first()
    while True:
        control, finished = part.choose(part.run(layers, value))
        part.follow(control)
        if finished:
            return decoding.join([part.result()])
        value = part.next()


@contextmanager
def attached(layers: Iterable[nn.Module], **attributes: Any) -> Iterator[None]:
    """Each of ``attributes`` set on the layers of ``layers`` that have it (a cache, a position offset) for the
    duration, then reset to its class default."""
    touched = [(layer, name) for layer in layers for name in attributes if hasattr(layer, name)]
    for layer, name in touched:
        setattr(layer, name, attributes[name])
    try:
        yield
    finally:
        for layer, name in touched:
            delattr(layer, name)  # back to the class attribute
