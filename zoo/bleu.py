"""Corpus BLEU, overall and per language pair, as sacrebleu computes it.

sacrebleu's defaults are used unchanged (13a tokenization, mixed case, exponential smoothing, one reference), so the
numbers equal ``sacrebleu REF -i HYP`` on the same detokenized text. The signature sacrebleu 2.6 reports for them is
``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`` (:func:`bleu_signature`); quote it next to scores.
13a splits off punctuation and separates words at spaces, which suits the embedded synthetic languages (Latin
letters, words separated by spaces); languages without spaces need ``tokenize="zh"``/``"ja-mecab"`` or chrF.

:class:`TokenBLEU` scores token ids instead, during training: a torchmetrics ``Metric`` whose n-gram counts add up
over batches and processes, so a ``validation_step`` can log a corpus BLEU without a tokenizer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from sacrebleu.metrics import BLEU
from torchmetrics import Metric

__all__ = ["TokenBLEU", "bleu_by_pair", "bleu_signature", "corpus_bleu"]


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]) -> float:
    """BLEU (0-100) of ``hypotheses`` against ``references``.

    ``references`` is one reference per hypothesis (a list of strings), or several reference sets (a list of lists,
    each as long as ``hypotheses``), as in ``sacrebleu.corpus_bleu``.
    """
    if isinstance(hypotheses, str):
        raise TypeError("hypotheses must be a sequence of sentences, not one string; wrap it in a list.")
    reference_sets = _reference_sets(references)
    for index, refs in enumerate(reference_sets):
        if len(refs) != len(hypotheses):
            raise ValueError(
                f"Reference set {index} has {len(refs)} sentences for {len(hypotheses)} hypotheses; "
                "pass one reference per hypothesis, in the same order."
            )
    return float(BLEU().corpus_score(list(hypotheses), reference_sets).score)


def bleu_by_pair(
    hypotheses: Mapping[str, Sequence[str]], references: Mapping[str, Sequence[str] | Sequence[Sequence[str]]]
) -> dict[str, float]:
    """BLEU of every language pair, e.g. ``{"en-de": 27.3, "en-fr": 38.1}``; pairs are scored separately.

    Both mappings must hold the same pairs (the keys of ``hypotheses``, in its order, are the keys of the result).
    """
    if set(hypotheses) != set(references):
        raise ValueError(
            f"hypotheses has pairs {sorted(hypotheses)} but references has {sorted(references)}; "
            "score the same pairs on both sides."
        )
    return {pair: corpus_bleu(hypotheses[pair], references[pair]) for pair in hypotheses}


def bleu_signature(num_references: int = 1) -> str:
    """sacrebleu's signature of the settings used here with ``num_references`` reference sets, to quote with scores."""
    metric = BLEU()
    metric.corpus_score(["x"], [["x"]] * num_references)  # sacrebleu learns the number of references from a call
    return str(metric.get_signature())


def _reference_sets(references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    if isinstance(references, str):
        raise TypeError("references must be a sequence of sentences, not one string; wrap it in a list.")
    if all(isinstance(ref, str) for ref in references):
        return [[str(ref) for ref in references]]
    return [[str(ref) for ref in refs] for refs in references]


class TokenBLEU(Metric):
    """Corpus BLEU (0-100) of decoded token ids against reference token ids, accumulated over batches.

    Each row of ``hypotheses`` [B, T] and ``references`` [B, T'] counts up to its first ``eos_id`` (excluded), with
    ``pad_id`` and ``bos_id`` dropped. The score is sacrebleu's BLEU with exponential smoothing on those id sequences,
    i.e. ``BLEU(tokenize="none", smooth_method="exp")`` on the ids joined by spaces: a subword BLEU, comparable
    between runs of one vocabulary, not with detokenized BLEU (:func:`corpus_bleu`).
    """

    full_state_update = False
    correct: torch.Tensor
    total: torch.Tensor
    hypothesis_length: torch.Tensor
    reference_length: torch.Tensor

    def __init__(self, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.dropped, self.eos_id = {pad_id, bos_id}, eos_id
        self.add_state("correct", torch.zeros(4, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(4, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("hypothesis_length", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("reference_length", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def _sentence(self, row: list[int]) -> list[int]:
        if self.eos_id in row:
            row = row[: row.index(self.eos_id)]
        return [token for token in row if token not in self.dropped]

    def update(self, hypotheses: torch.Tensor, references: torch.Tensor) -> None:
        """Add the n-gram matches of a batch of hypotheses [B, T] against their references [B, T']."""
        if hypotheses.shape[0] != references.shape[0]:
            raise ValueError(
                f"{hypotheses.shape[0]} hypotheses for {references.shape[0]} references; give one reference per row"
            )
        correct, total = [0] * 4, [0] * 4
        for hypothesis, reference in zip(hypotheses.tolist(), references.tolist(), strict=True):
            hyp, ref = self._sentence(hypothesis), self._sentence(reference)
            self.hypothesis_length += len(hyp)
            self.reference_length += len(ref)
            for n in range(1, 5):
                hyp_grams = Counter(tuple(hyp[i : i + n]) for i in range(len(hyp) - n + 1))
                ref_grams = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
                correct[n - 1] += sum((hyp_grams & ref_grams).values())
                total[n - 1] += max(len(hyp) - n + 1, 0)
        self.correct += torch.tensor(correct, dtype=torch.float64, device=self.correct.device)
        self.total += torch.tensor(total, dtype=torch.float64, device=self.total.device)

    def compute(self) -> torch.Tensor:
        """The corpus BLEU of everything updated since the last reset, as a float32 tensor."""
        score = BLEU.compute_bleu(
            [int(c) for c in self.correct.tolist()],
            [int(t) for t in self.total.tolist()],
            int(self.hypothesis_length),
            int(self.reference_length),
            smooth_method="exp",
        ).score
        return torch.tensor(score, dtype=torch.float32, device=self.correct.device)
