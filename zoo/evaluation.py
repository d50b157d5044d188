"""Evaluation of trained zoo Transformers: translations and BLEU per language pair, perplexity of the language model.

Shape legend: B batch, S source length, T decoded length, V vocabulary.

Everything here runs on a whole model after ``fit`` (decoding calls the model once per output token; under
``GPipeStrategy`` each rank keeps its stage after ``fit``, and ``trainer.strategy.gather_module()`` puts the whole
model back on global rank 0). From the command line, a checkpoint
written by ``Trainer.save_checkpoint`` is enough: it holds the model's registry name and arguments, the data module's
arguments and its tokenizer, so ::

    python -m zoo.evaluation --checkpoint out/zoo/transformer-embedded/pretrain/last.ckpt --split test --beam-size 4

rebuilds both and prints a BLEU table (or the perplexity, for a ``transformer_lm`` checkpoint).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from zoo._registry import model_class
from zoo.backbone import read_checkpoint
from zoo.bleu import bleu_by_pair, bleu_signature
from zoo.data.language_model import LanguageModelDataModule
from zoo.data.tokenizer import EOS_ID, PAD_ID, SubwordTokenizer
from zoo.data.translation import TranslationDataModule, pad_sequences
from zoo.tasks.base import ZooModule
from zoo.tasks.language_model import TransformerLM
from zoo.tasks.translation import Transformer
from zoo.transformer.decoding import beam_search, greedy_decode

__all__ = ["evaluate_perplexity", "evaluate_translation", "load_for_evaluation", "main", "translate", "translate_ids"]

SPLITS = ("train", "validation", "test")


def translate_ids(
    model: Transformer,
    sources: torch.Tensor,
    *,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len: int = 128,
    batch_size: int = 64,
    progress: Progress | None = None,
) -> list[list[int]]:
    """Decoded token ids (up to, without, ``</s>``) for encoded ``sources`` [N, S], in their order.

    ``beam_size`` 1 is greedy decoding (``length_penalty`` then plays no part). Sources are decoded in batches of
    similar length, so that little time goes into padding.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be at least 1 (1 is greedy decoding)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    lengths = (sources != PAD_ID).sum(dim=1)
    order = torch.argsort(lengths, stable=True).tolist()
    out: list[list[int]] = [[] for _ in order]
    task = progress.add_task("translating", total=len(order)) if progress is not None else None
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = sources[rows][:, : int(lengths[rows].max())].to(device)  # [B, S]
        if beam_size == 1:
            tokens = greedy_decode(model, batch, max_len)
        else:
            tokens = beam_search(model, batch, beam_size, max_len, length_penalty).tokens  # [B, T]
        for row, ids in zip(rows, tokens.tolist(), strict=True):
            out[row] = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
        if progress is not None and task is not None:
            progress.advance(task, len(rows))
    return out


def translate(
    model: Transformer,
    tokenizer: SubwordTokenizer,
    sentences: Sequence[str],
    target_language: str,
    *,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len: int = 128,
    batch_size: int = 64,
) -> list[str]:
    """Translate raw ``sentences`` into ``target_language`` (a code of ``tokenizer``, e.g. ``"xa"``); detokenized.

    Sources are encoded as in training, ``<2tgt> subwords... </s>``. Decoding as in :func:`translate_ids`.
    """
    if isinstance(sentences, str):
        raise TypeError("sentences must be a sequence of sentences, not one string; wrap it in a list")
    language = tokenizer.language_id(target_language)
    sources = pad_sequences([[language, *ids, EOS_ID] for ids in tokenizer.encode_batch(list(sentences))])
    ids = translate_ids(
        model, sources, beam_size=beam_size, length_penalty=length_penalty, max_len=max_len, batch_size=batch_size
    )
    return tokenizer.decode_batch(ids)


def evaluate_translation(
    model: Transformer,
    datamodule: TranslationDataModule,
    split: str = "test",
    *,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len: int | None = None,
    batch_size: int = 64,
    pairs: Sequence[str] | None = None,
    limit: int | None = None,
    show_progress: bool = False,
) -> dict[str, float]:
    """sacrebleu BLEU of every directed pair of ``datamodule`` on ``split``, plus their unweighted ``"mean"``.

    ``pairs`` restricts the evaluation to some directed pairs, ``limit`` to the first sentences of each.
    ``max_len`` defaults to the data module's ``max_length`` (the longest target it trains on). The hypotheses are
    detokenized with the data module's tokenizer and scored against the raw, untruncated references
    (:func:`zoo.bleu.bleu_by_pair`).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be at least 1 sentence per pair, or None for the whole split")
    if datamodule.tokenizer is None:
        datamodule.setup("test")
    tokenizer = datamodule.tokenizer
    assert tokenizer is not None, "TranslationDataModule.setup builds the tokenizer"
    wanted = list(datamodule.directed_pairs if pairs is None else pairs)
    hypotheses: dict[str, list[str]] = {}
    references: dict[str, list[str]] = {}
    with _progress(show_progress) as progress:
        for pair in wanted:
            sources = datamodule.encode_sources(pair, split)[:limit]
            ids = translate_ids(
                model,
                sources,
                beam_size=beam_size,
                length_penalty=length_penalty,
                max_len=datamodule.max_length if max_len is None else max_len,
                batch_size=batch_size,
                progress=progress,
            )
            hypotheses[pair] = tokenizer.decode_batch(ids)
            references[pair] = datamodule.references(pair, split)[:limit]
    scores = bleu_by_pair(hypotheses, references)
    scores["mean"] = sum(scores.values()) / len(scores)
    return scores


def evaluate_perplexity(model: TransformerLM, datamodule: LanguageModelDataModule, split: str = "test") -> float:
    """Perplexity of ``model`` on ``split``: exp of the mean negative log-likelihood per non-padding token.

    Unlike the training loss there is no label smoothing, and unlike ``val_ppl`` (a per-batch running metric) the
    mean is over every token of the split at once.
    """
    loaders = {
        "train": datamodule.train_dataloader,
        "validation": datamodule.val_dataloader,
        "test": datamodule.test_dataloader,
    }
    if split not in loaders:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if datamodule.tokenizer is None:
        datamodule.setup("test")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            for batch in loaders[split]():
                batch = batch.to(device)  # [B, T + 1]
                logits = model(batch[:, :-1]).float()  # [B, T, V]
                targets = batch[:, 1:]
                total += F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=PAD_ID, reduction="sum").item()
                count += int((targets != PAD_ID).sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError(f"the {split!r} split has no tokens to score")
    return math.exp(total / count)


def load_for_evaluation(path: str | Path) -> tuple[ZooModule, TranslationDataModule | LanguageModelDataModule]:
    """The model and the data module (with the checkpoint's tokenizer, set up) of a zoo Transformer checkpoint."""
    checkpoint = read_checkpoint(path)
    datamodule: TranslationDataModule | LanguageModelDataModule
    arguments = _init_arguments(checkpoint.get("datamodule_hyper_parameters", {}))
    for cls in (TranslationDataModule, LanguageModelDataModule):
        if cls.__qualname__ in checkpoint:
            datamodule = cls(**arguments)
            datamodule.load_state_dict(checkpoint[cls.__qualname__])  # the tokenizer, before setup could train one
            break
    else:
        raise ValueError(
            f"{str(path)!r} holds no tokenizer (no TranslationDataModule or LanguageModelDataModule state): it must be "
            "written by a fit with one of the zoo's text data modules"
        )
    model = model_class(checkpoint["zoo_model"])(**_init_arguments(checkpoint.get("hyper_parameters", {})))
    assert isinstance(model, ZooModule), type(model)
    model.load_state_dict(checkpoint["state_dict"])
    datamodule.setup("test")
    return model, datamodule


def main(args: Sequence[str] | None = None) -> dict[str, float]:
    """``python -m zoo.evaluation``: BLEU per pair (or perplexity) of a checkpoint, printed as a table."""
    parser = argparse.ArgumentParser(prog="python -m zoo.evaluation", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint written by fit (e.g. last.ckpt)")
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--beam-size", type=int, default=4, help="1 decodes greedily")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="GNMT's alpha")
    parser.add_argument("--max-len", type=int, default=None, help="default: the data module's max_length")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--pairs", nargs="+", default=None, help="directed pairs to score (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N sentences of each pair")
    options = parser.parse_args(args)
    model, datamodule = load_for_evaluation(options.checkpoint)
    console = Console()
    if isinstance(model, TransformerLM) and isinstance(datamodule, LanguageModelDataModule):
        ppl = evaluate_perplexity(model, datamodule, options.split)
        console.print(f"perplexity on {options.split}: {ppl:.3f}")
        return {"perplexity": ppl}
    if not (isinstance(model, Transformer) and isinstance(datamodule, TranslationDataModule)):
        raise ValueError(f"{options.checkpoint!r} holds a {model.zoo_name!r} model, which zoo.evaluation cannot score")
    scores = evaluate_translation(
        model,
        datamodule,
        options.split,
        beam_size=options.beam_size,
        length_penalty=options.length_penalty,
        max_len=options.max_len,
        batch_size=options.batch_size,
        pairs=options.pairs,
        limit=options.limit,
        show_progress=True,
    )
    table = Table(title=f"BLEU on {options.split}, beam {options.beam_size}", caption=bleu_signature())
    table.add_column("pair")
    table.add_column("BLEU", justify="right")
    for pair, score in scores.items():
        table.add_row(pair, f"{score:.2f}")
    console.print(table)
    return scores


def _init_arguments(saved: dict[str, Any]) -> dict[str, Any]:
    # LightningCLI adds "_class_path" and "_instantiator" to the saved hyper-parameters; they are not arguments.
    return {key: value for key, value in saved.items() if not key.startswith("_")}


@contextmanager
def _progress(enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    with Progress(transient=True) as progress:
        yield progress


if __name__ == "__main__":
    main()
