"""Hugging Face translation models as zoo models: the library's own forward, generate and loader are the oracles.

Nothing downloads: each family's tiny random model and tokenizer are written in the real on-disk format
(``zoo.hf.tiny``) and loaded through ``zoo.load_pretrained(directory)``, the code path of a hub id.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zoo

transformers = pytest.importorskip("transformers")

TEXTS = [
    "the cat sat on the mat.",
    "a dog runs in the park.",
    "hello world, this is a small test.",
    "der Hund läuft im Park.",
    "die Katze sitzt auf der Matte.",
]
FAMILIES = ("m2m_100", "marian")


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from zoo.hf.tiny import save_tiny_translation_model

    # Weights larger than the library's 0.02 default give the random model varied (not constant) greedy outputs.
    directory = save_tiny_translation_model(tmp_path_factory.mktemp(request.param), TEXTS, request.param)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad and parameter.dim() > 1:
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    return directory


def batch(directory: Path, library: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Two padded sources, their attention mask, decoder inputs (start token + labels) and the target prefix."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prefix: list[int] = []
    if hasattr(tokenizer, "get_lang_id"):
        tokenizer.src_lang, tokenizer.tgt_lang = "en", "de"
        prefix = [tokenizer.get_lang_id("de")]
    encoded = tokenizer(
        ["the cat sat.", "a dog runs in the park, hello."],
        text_target=["der Hund.", "die Katze sitzt."],
        padding=True,
        return_tensors="pt",
    )
    start = torch.full((2, 1), library.config.decoder_start_token_id)
    return encoded["input_ids"], encoded["attention_mask"], torch.cat([start, encoded["labels"]], dim=1), prefix


def test_layers_form_one_flat_sequence_with_the_embedding_tied(saved: Path) -> None:
    model = zoo.load_pretrained(saved)
    assert isinstance(model, zoo.PretrainedTranslator)
    names = [type(layer).__name__ for layer in model.layers]
    assert names[0] == "SourceEmbedding"
    assert names[-1] == "OutputProjection"
    assert names.count("EncoderLayer") == 2
    assert names.count("DecoderLayer") == 2
    assert all(len(list(layer.children())) == 0 or type(layer).__module__ == "zoo.hf.layers" for layer in model.layers)
    shared = model.layers[0].tokens.weight
    assert model.layers[-1].lm_head.weight is shared  # the same nn.Parameter, not a copy
    assert model.layers[names.index("DecoderEmbedding")].tokens.weight is shared
    wrapped = type(model.layers[1].layer).__name__
    assert wrapped in ("M2M100EncoderLayer", "MarianEncoderLayer")  # the library's module itself


def test_logits_equal_the_library_forward(saved: Path) -> None:
    library = transformers.AutoModelForSeq2SeqLM.from_pretrained(saved).eval()
    model = zoo.load_pretrained(saved).eval()
    source, attention, target_in, _ = batch(saved, library)
    expected = library(input_ids=source, attention_mask=attention, decoder_input_ids=target_in).logits
    torch.testing.assert_close(model(source, target_in), expected, atol=1e-4, rtol=0)


def test_greedy_generation_equals_library_generate(saved: Path) -> None:
    from zoo.hf.generation import greedy_generate

    library = transformers.AutoModelForSeq2SeqLM.from_pretrained(saved).eval()
    model = zoo.load_pretrained(saved)
    source, attention, _, prefix = batch(saved, library)
    ours = greedy_generate(model, source, prefix, max_new_tokens=6)
    theirs = library.generate(
        input_ids=source,
        attention_mask=attention,
        num_beams=1,
        do_sample=False,
        max_new_tokens=6 + len(prefix),
        bad_words_ids=[[library.config.pad_token_id]],
        **({"forced_bos_token_id": prefix[0]} if prefix else {}),
    )
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[:, 1 + len(prefix) :].flatten().tolist())) > 1, "a degenerate model would prove little"


def test_meta_device_build_and_checkpoint_round_trip(saved: Path, tmp_path: Path) -> None:
    model = zoo.load_pretrained(saved, lr=3e-4)
    with torch.device("meta"):
        meta = zoo.PretrainedTranslator(str(saved), config=model.hparams["config"], pretrained=False)
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert sum(p.numel() for p in meta.parameters()) == sum(p.numel() for p in model.parameters())
    # A zoo checkpoint rebuilds the architecture from the saved config and loads every weight, source unread.
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    again = zoo.load_pretrained(tmp_path / "model.ckpt")
    assert isinstance(again, zoo.PretrainedTranslator)
    assert again.hparams["lr"] == 3e-4
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_export_pretrained_loads_in_transformers_with_equal_logits(saved: Path, tmp_path: Path) -> None:
    model = zoo.load_pretrained(saved).eval()
    with torch.no_grad():  # change the weights, so that the export cannot pass by re-reading the source
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.01 * torch.randn_like(parameter))
    exported = model.export_pretrained(tmp_path / "export")
    library = transformers.AutoModelForSeq2SeqLM.from_pretrained(exported).eval()
    source, attention, target_in, _ = batch(exported, library)
    expected = library(input_ids=source, attention_mask=attention, decoder_input_ids=target_in).logits
    torch.testing.assert_close(model(source, target_in), expected, atol=1e-4, rtol=0)


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    config = transformers.T5Config(d_model=8, d_ff=16, num_layers=1, num_heads=2, vocab_size=32, d_kv=4)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"is a 't5' model; zoo.load_pretrained converts .*'m2m_100', 'marian'"):
        zoo.load_pretrained(tmp_path)


def test_bad_objective_arguments_are_refused_before_the_model_is_read() -> None:
    # Seq2SeqTask checks them first, as for zoo.Transformer: the source is never opened.
    from zoo.tasks.pretrained_translation import PretrainedTranslator

    with pytest.raises(ValueError, match=r"optimizer='sgd' is not supported; use one of 'adam', 'adafactor'"):
        PretrainedTranslator("never/read", optimizer="sgd")
    with pytest.raises(ValueError, match=r"label_smoothing=1.0 must be in \[0, 1\)"):
        PretrainedTranslator("never/read", label_smoothing=1.0)


def test_classification_arguments_are_refused(saved: Path) -> None:
    with pytest.raises(ValueError, match=r"num_classes=10 does not apply to the Hugging Face translation model"):
        zoo.load_pretrained(saved, num_classes=10)


def test_two_stage_gpipe_step_equals_the_plain_step(saved: Path) -> None:
    # The shared embedding lives on both stages (source embedding on stage 0; decoder embedding and output projection
    # on stage 1): GPipe with K = 2 and 2 micro-batches must give the plain model's gradients and step.
    from lightning_gpipe import run_in_threads
    from lightning_gpipe.partition.balance import split

    model = zoo.load_pretrained(saved).load_weights()  # run_in_threads puts each stage where its first weight is
    plain = zoo.load_pretrained(saved)
    library = transformers.AutoModelForSeq2SeqLM.from_pretrained(saved)
    source, _, target, _ = batch(saved, library)
    data = ((source, target[:, :-1]), target[:, 1:])

    def loss(logits: torch.Tensor, microbatch: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return plain._loss(logits, microbatch[1])

    plain.zero_grad()
    # GPipe's loss is the mean of the micro-batches' losses (each a mean over its own tokens).
    for half in (slice(0, 1), slice(1, 2)):
        part = ((source[half], target[half, :-1]), target[half, 1:])
        (loss(plain.layers(part[0]), part) / 2).backward()
    cells = split(
        model.layers, [plain.num_encoder_entries, len(model.layers) - plain.num_encoder_entries], allow_shared=True
    )
    run_in_threads(cells, data, loss, chunks=2)
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters(), strict=True):
        if not ours.requires_grad:  # Marian's fixed sinusoidal table
            assert (ours.grad, theirs.grad) == (None, None), name
            continue
        assert ours.grad is not None, name
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)
    optimizations = [module.configure_optimizers() for module in (model, plain)]  # the model's Adam and warmup
    for optimization in optimizations:
        optimization["optimizer"].step()
    for (name, ours), theirs in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5, msg=name)
    assert model.layers[-1].lm_head.weight is model.layers[0].tokens.weight
    pretrained = zoo.load_pretrained(saved).load_weights()
    assert not torch.equal(model.layers[0].tokens.weight, pretrained.layers[0].tokens.weight)


def test_a_loaded_model_starts_in_training_mode(saved: Path) -> None:
    # from_pretrained returns eval-mode modules, and Lightning keeps modes: fine-tuning would run without dropout.
    model = zoo.load_pretrained(saved)
    assert all(module.training for module in model.modules())


@pytest.mark.parametrize(("stages", "chunks"), [(2, 2), (3, 1)])
def test_generation_on_the_stages_with_caches_equals_library_generate(saved: Path, stages: int, chunks: int) -> None:
    # Every stage keeps the library's EncoderDecoderCache of its own decoder layers: the encoder runs once, then one
    # token per row and round crosses the stages; beams are reordered on every stage.
    from helpers.decoding import pipelined

    from zoo.hf.generation import beam_generate, greedy_generate

    library = transformers.AutoModelForSeq2SeqLM.from_pretrained(saved).eval()
    model = zoo.load_pretrained(saved)
    source, attention, _, prefix = batch(saved, library)
    theirs = library.generate(
        input_ids=source, attention_mask=attention, num_beams=1, do_sample=False, max_new_tokens=6 + len(prefix),
        bad_words_ids=[[library.config.pad_token_id]], **({"forced_bos_token_id": prefix[0]} if prefix else {}),
    )  # fmt: skip
    beams = beam_generate(model, source, prefix, beam_size=3, max_new_tokens=6)
    assert beams.tokens.shape[1] > 1 + len(prefix)
    entries = len(model.layers)
    balance = [entries // 2, entries - entries // 2] if stages == 2 else [2, entries - 4, 2]
    model.layers = pipelined(model.layers, balance, chunks)  # type: ignore[assignment]
    assert greedy_generate(model, source, prefix, max_new_tokens=6).tolist() == theirs.tolist()
    pipelined_beams = beam_generate(model, source, prefix, beam_size=3, max_new_tokens=6)
    assert pipelined_beams.tokens.tolist() == beams.tokens.tolist()
    torch.testing.assert_close(pipelined_beams.scores, beams.scores)
