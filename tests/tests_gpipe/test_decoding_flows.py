"""Decoding inside validation and predict steps, and a training_step's extra keys, under GPipeStrategy against plain
Lightning: one 2-rank job (``helpers.eval_job``) covers them all."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers.eval_job import DECODING, fit_tagger, fit_translator, trainer
from helpers.jobs import run_job
from helpers.runif import RunIf
from helpers.zoo_tiny import tiny_batch, tiny_model


@RunIf(multiprocess=True)
def test_decoding_and_step_outputs_under_the_pipeline_equal_plain_lightning(tmp_path: Path) -> None:
    results = run_job("helpers.eval_job", [str(tmp_path)], 2, timeout=500)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    seen = [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False) for rank in range(2)]

    # Validation BLEU (greedy decoding of every validation batch through the stages) during training.
    plain = trainer(devices=1, max_epochs=2)
    fit_translator(plain)
    plain_bleu = float(plain.callback_metrics["val_bleu"])
    assert plain_bleu > 0  # the decoded tokens overlap the references: a BLEU that tokens can change
    for rank in range(2):
        assert seen[rank]["fit_val_bleu"] == plain_bleu

    # Greedy and beam predictions equal the whole model's decoding with the trained weights, token for token.
    whole = tiny_model("transformer", **DECODING)
    whole.load_state_dict(torch.load(tmp_path / "translator.pt", weights_only=True))
    source = tiny_batch("transformer", seed=1)[0]
    greedy = whole.translate(source)
    whole.hparams["beam_size"] = 3
    beam = whole.translate(source)
    assert not torch.equal(greedy, beam)  # beam search took other paths than greedy decoding
    assert ((greedy == 2).sum(dim=1) == 1).any()  # some rows stop,
    assert (greedy[:, -1] != 0).any()  # and some run to the end
    for rank in range(2):
        assert torch.equal(seen[rank]["greedy"], greedy)
        assert torch.equal(seen[rank]["beam"], beam)

    # on_train_batch_end gets the step's other keys on every stage, the batch's values as plain Lightning gives them.
    expected = fit_tagger(trainer(devices=1, use_distributed_sampler=False))
    for rank in range(2):
        assert len(seen[rank]["outputs"]) == len(expected) == 3
        for got, want in zip(seen[rank]["outputs"], expected, strict=True):
            assert got.keys() == want.keys() == {"loss", "preds", "probs", "tag"}
            assert torch.equal(got["preds"], want["preds"])
            torch.testing.assert_close(got["probs"], want["probs"])
            torch.testing.assert_close(got["loss"], want["loss"])
            assert got["tag"] == "t"
