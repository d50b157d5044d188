"""Corpus BLEU, overall and per language pair, as sacrebleu computes it.

sacrebleu's defaults are used unchanged (13a tokenization, mixed case, exponential smoothing, one reference), so the
numbers equal ``sacrebleu REF -i HYP`` on the same detokenized text. The signature sacrebleu 2.6 reports for them is
``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`` (:func:`bleu_signature`); quote it next to scores.
13a splits off punctuation and separates words at spaces, which suits the embedded synthetic languages (Latin
letters, words separated by spaces); languages without spaces need ``tokenize="zh"``/``"ja-mecab"`` or chrF.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sacrebleu.metrics import BLEU

__all__ = ["bleu_by_pair", "bleu_signature", "corpus_bleu"]


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
