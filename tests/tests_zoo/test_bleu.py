"""BLEU per language pair equals sacrebleu's command line on the same text."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.bleu import bleu_by_pair, bleu_signature, corpus_bleu
from zoo.data.synthetic_text import make_synthetic_corpus


def _degrade(sentence: str, rng: random.Random) -> str:
    """A plausible system output: some words dropped or swapped, so BLEU lands between 0 and 100."""
    words = sentence.split()
    if len(words) > 2 and rng.random() < 0.5:
        del words[rng.randrange(len(words))]
    if len(words) > 1 and rng.random() < 0.5:
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[list[str], list[str]]]:
    """(hypotheses, references) of two pairs of the embedded corpus."""
    corpus = make_synthetic_corpus(seed=3, sizes={"xa": 1, "xd": 1}, eval_size=120)
    rng = random.Random(0)
    result = {}
    for pair, splits in corpus.items():
        code = pair.split("-")[1]
        references = [row[code] for row in splits["test"][:]["translation"]]
        result[pair] = ([_degrade(r, rng) for r in references], references)
    return result


def _cli_score(tmp_path: Path, hypotheses: list[str], *reference_sets: list[str]) -> float:
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    refs = []
    for index, references in enumerate(reference_sets):
        ref = tmp_path / f"ref{index}.txt"
        ref.write_text("\n".join(references) + "\n", encoding="utf-8")
        refs.append(str(ref))
    command = [sys.executable, "-m", "sacrebleu", *refs, "-i", str(hyp), "-b", "-w", "4"]
    return float(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip())


def test_corpus_bleu_equals_sacrebleu_cli(tmp_path: Path, outputs: dict[str, tuple[list[str], list[str]]]) -> None:
    hypotheses, references = outputs["en-xa"]
    score = corpus_bleu(hypotheses, references)
    assert 10.0 < score < 95.0  # a degraded output, so the comparison is not the trivial 0 or 100
    assert round(score, 4) == _cli_score(tmp_path, hypotheses, references)


def test_corpus_bleu_with_two_reference_sets_equals_cli(
    tmp_path: Path, outputs: dict[str, tuple[list[str], list[str]]]
) -> None:
    hypotheses, references = outputs["en-xa"]
    second = [_degrade(r, random.Random(i)) for i, r in enumerate(references)]
    score = corpus_bleu(hypotheses, [references, second])
    assert round(score, 4) == _cli_score(tmp_path, hypotheses, references, second)
    assert score != corpus_bleu(hypotheses, references)


def test_signature_is_the_cli_signature(tmp_path: Path, outputs: dict[str, tuple[list[str], list[str]]]) -> None:
    hypotheses, references = outputs["en-xd"]
    (tmp_path / "hyp.txt").write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\n".join(references) + "\n", encoding="utf-8")
    command = [sys.executable, "-m", "sacrebleu", str(tmp_path / "ref.txt"), "-i", str(tmp_path / "hyp.txt")]
    report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    assert bleu_signature() == report["signature"]
    assert "tok:13a" in bleu_signature()


def test_bleu_by_pair_scores_each_pair_on_its_own(outputs: dict[str, tuple[list[str], list[str]]]) -> None:
    hypotheses = {pair: hyps for pair, (hyps, _) in outputs.items()}
    references = {pair: refs for pair, (_, refs) in outputs.items()}
    scores = bleu_by_pair(hypotheses, references)
    assert list(scores) == list(hypotheses)
    for pair in outputs:
        assert scores[pair] == corpus_bleu(hypotheses[pair], references[pair])
    pooled = corpus_bleu(sum(hypotheses.values(), []), sum(references.values(), []))
    assert all(score != pooled for score in scores.values())


def test_perfect_and_empty_outputs() -> None:
    references = ["The big dog saw three small cats.", "A farmer helps the red apple."]
    assert corpus_bleu(references, references) == pytest.approx(100.0)
    assert corpus_bleu(["", ""], references) == 0.0


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"Reference set 0 has 1 sentences for 2 hypotheses"):
        corpus_bleu(["a b", "c d"], ["a b"])
    with pytest.raises(TypeError, match="references must be a sequence of sentences, not one string"):
        corpus_bleu(["a b"], "a b")
    with pytest.raises(TypeError, match="hypotheses must be a sequence of sentences, not one string"):
        corpus_bleu("a b", ["a b"])
    with pytest.raises(ValueError, match=r"hypotheses has pairs \['en-xa'\] but references has \['en-xb'\]"):
        bleu_by_pair({"en-xa": ["a"]}, {"en-xb": ["a"]})


def test_token_bleu_equals_sacrebleu_on_the_ids_and_adds_up_over_batches() -> None:
    import torch
    from sacrebleu.metrics import BLEU

    from zoo.bleu import TokenBLEU

    hypotheses = torch.tensor([[5, 6, 7, 8, 9, 2, 0], [5, 5, 6, 2, 0, 0, 0], [7, 7, 7, 7, 7, 7, 7]])
    references = torch.tensor([[1, 5, 6, 7, 3, 9, 2], [1, 5, 6, 6, 2, 0, 0], [1, 7, 8, 2, 0, 0, 0]])
    metric = TokenBLEU()
    metric.update(hypotheses[:1], references[:1])
    metric.update(hypotheses[1:], references[1:])
    expected = BLEU(tokenize="none", smooth_method="exp").corpus_score(
        ["5 6 7 8 9", "5 5 6", "7 7 7 7 7 7 7"], [["5 6 7 3 9", "5 6 6", "7 8"]]
    )
    assert float(metric.compute()) == pytest.approx(expected.score, abs=1e-4)
    with pytest.raises(ValueError, match=r"2 hypotheses for 3 references"):
        metric.update(hypotheses[:2], references)
