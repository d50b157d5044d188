"""Text data: the embedded corpus, the subword tokenizer, temperature sampling and the text data modules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset, DatasetDict, Features, Translation

from zoo.data.language_model import LanguageModelDataModule
from zoo.data.sampling import TemperatureSampler, temperature_probabilities
from zoo.data.synthetic_text import (
    DEFAULT_SIZES,
    LANGUAGES,
    Clause,
    NounPhrase,
    lexicon,
    load_corpus,
    make_synthetic_corpus,
    render,
    render_english,
    save_corpus,
)
from zoo.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SubwordTokenizer
from zoo.data.translation import TranslationDataModule

SMALL = {"xa": 400, "xb": 120, "xc": 40, "xd": 30}


def _texts(corpus: dict[str, DatasetDict], split: str = "train") -> list[str]:
    return [text for splits in corpus.values() for row in splits[split][:]["translation"] for text in row.values()]


@pytest.fixture(scope="module")
def corpus() -> dict[str, DatasetDict]:
    return make_synthetic_corpus(seed=0)


@pytest.fixture(scope="module")
def small_corpus() -> dict[str, DatasetDict]:
    return make_synthetic_corpus(seed=0, sizes=SMALL, eval_size=50)


@pytest.fixture(scope="module")
def tokenizer(small_corpus: dict[str, DatasetDict]) -> SubwordTokenizer:
    return SubwordTokenizer.train(_texts(small_corpus), ["xb", "en", "xa", "xc", "xd"], vocab_size=600)


@pytest.fixture(scope="module")
def module() -> TranslationDataModule:
    dm = TranslationDataModule(embedded_sizes=SMALL, vocab_size=600, batch_size=16, seed=0)
    dm.setup("fit")
    return dm


# The embedded corpus.


def test_corpus_sizes_are_as_configured_and_very_different(corpus: dict[str, DatasetDict]) -> None:
    assert sorted(corpus) == [f"en-{code}" for code in sorted(DEFAULT_SIZES)]
    for code, size in DEFAULT_SIZES.items():
        splits = corpus[f"en-{code}"]
        assert {name: len(split) for name, split in splits.items()} == {"train": size, "validation": 200, "test": 200}
    sizes = [len(corpus[f"en-{code}"]["train"]) for code in DEFAULT_SIZES]
    assert max(sizes) / min(sizes) > 50  # one high-resource pair, one medium, two low-resource


def test_corpus_uses_the_hugging_face_translation_schema(corpus: dict[str, DatasetDict]) -> None:
    for pair, splits in corpus.items():
        code = pair.split("-")[1]
        for split in splits.values():
            assert split.features == Features({"translation": Translation(languages=["en", code])})
        row = splits["train"][0]
        assert list(row) == ["translation"]
        assert sorted(row["translation"]) == sorted(["en", code])
        assert all(isinstance(text, str) and text for text in row["translation"].values())


def test_evaluation_sentences_are_not_in_training(corpus: dict[str, DatasetDict]) -> None:
    for splits in corpus.values():
        train = {row["en"] for row in splits["train"][:]["translation"]}
        for split in ("validation", "test"):
            assert train.isdisjoint(row["en"] for row in splits[split][:]["translation"])


def test_corpus_is_deterministic_per_seed() -> None:
    first = make_synthetic_corpus(seed=7, sizes={"xb": 60, "xd": 20}, eval_size=10)
    again = make_synthetic_corpus(seed=7, sizes={"xb": 60, "xd": 20}, eval_size=10)
    other = make_synthetic_corpus(seed=8, sizes={"xb": 60, "xd": 20}, eval_size=10)
    for pair in first:
        for split in ("train", "validation", "test"):
            assert first[pair][split][:] == again[pair][split][:]
        assert first[pair]["train"][:] != other[pair]["train"][:]


def test_save_and_load_corpus_round_trip(tmp_path: Path) -> None:
    corpus = make_synthetic_corpus(seed=1, sizes={"xa": 30, "xc": 20}, eval_size=5)
    save_corpus(corpus, tmp_path)
    loaded = load_corpus(tmp_path)
    assert sorted(loaded) == sorted(corpus)
    for pair in corpus:
        for split in ("train", "validation", "test"):
            assert loaded[pair][split][:] == corpus[pair][split][:]
            assert loaded[pair][split].features == corpus[pair][split].features


def test_lexicons_are_distinct_pseudo_words() -> None:
    words = {code: lexicon(code) for code in LANGUAGES}
    for code, table in words.items():
        assert len(set(table.values())) == len(table), code  # no two meanings share a word
        assert set(table.values()).isdisjoint(LANGUAGES[code].particles), code
        assert all(word.isalpha() and word.islower() for word in table.values()), code
    assert words["xa"]["dog"] != words["xc"]["dog"]  # same grammar, different vocabulary


def test_word_order_and_morphology_of_each_language() -> None:
    """Two hand-picked clauses, rendered by the rules each grammar declares (order, affixes, particles)."""
    plural = Clause(
        subject=NounPhrase("dog", "big", count=2, definite=True),
        verb="see",
        tense="past",
        object=NounPhrase("cat", "small", count=3, definite=False),
    )
    singular = Clause(
        subject=NounPhrase("farmer", None, count=1, definite=False),
        verb="help",
        tense="present",
        object=NounPhrase("apple", "red", count=1, definite=True),
    )
    assert render_english(plural) == "The big dogs saw three small cats."
    assert render_english(singular) == "A farmer helps the red apple."
    future = Clause(NounPhrase("child", count=2), "take", "future", NounPhrase("key", count=1, definite=False))
    assert render_english(future) == "The children will take a key."

    def expect(code: str, sentence: str) -> str:
        words = lexicon(code)
        text = sentence.format(**words)
        return text[0].upper() + text[1:] + "."

    # xa: SOV, adjective first; plural -ler except after a number; accusative -i on the object's last word;
    # past -di then plural agreement -lar on the verb.
    assert render(plural, "xa") == expect("xa", "{big} {dog}ler {three} {small} {cat}i {see}dilar")
    assert render(singular, "xa") == expect("xa", "{farmer} {red} {apple}i {help}ir")
    # xb: VSO, adjective after the noun; particles for tense (ua), article (le), plural (nga) and object (i).
    assert render(plural, "xb") == expect("xb", "ua {see} le nga {dog} {big} i {three} nga {cat} {small}")
    assert render(singular, "xb") == expect("xb", "te {help} {farmer} i le {apple} {red}")
    # xc: the structure of xa with its own suffixes (-nu, -o, -ta, -ni) and lexicon.
    assert render(plural, "xc") == expect("xc", "{big} {dog}nu {three} {small} {cat}o {see}tani")
    assert render(singular, "xc") == expect("xc", "{farmer} {red} {apple}o {help}ru")
    # xd: SVO, adjective after the noun agreeing in number (-en), article prefix il-, tense prefix pa-, verb -n.
    assert render(plural, "xd") == expect("xd", "il{dog}en {big}en pa{see}n {three} {cat}en {small}en")
    assert render(singular, "xd") == expect("xd", "{farmer} {help} il{apple} {red}")


def test_corpus_errors_are_pinned() -> None:
    with pytest.raises(ValueError, match=r"Unknown synthetic language 'zz'; the embedded corpus has \['xa'"):
        make_synthetic_corpus(sizes={"zz": 10})
    with pytest.raises(ValueError, match=r"sizes\['xa'\] = 0: every language needs at least one training pair"):
        make_synthetic_corpus(sizes={"xa": 0})
    with pytest.raises(ValueError, match="holds no saved DatasetDict"):
        load_corpus(Path(__file__).parent)


# The tokenizer.


def test_special_and_language_ids_are_fixed(tokenizer: SubwordTokenizer) -> None:
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert tokenizer.languages == ("en", "xa", "xb", "xc", "xd")  # sorted, whatever order they were given in
    assert [tokenizer.language_id(code) for code in tokenizer.languages] == [4, 5, 6, 7, 8]
    assert tokenizer.vocab_size == 600
    assert min(min(ids) for ids in tokenizer.encode_batch(["The big dog.", "Ua kuri."])) > 8  # subwords after them


def test_decode_inverts_encode_on_the_corpus(tokenizer: SubwordTokenizer, small_corpus: dict[str, DatasetDict]) -> None:
    sentences = _texts(small_corpus, "test")
    ids = tokenizer.encode_batch(sentences)
    assert all(UNK_ID not in row for row in ids)
    assert tokenizer.decode_batch(ids) == sentences
    assert [tokenizer.decode(tokenizer.encode(s)) for s in sentences[:50]] == sentences[:50]
    # Specials are skipped; whitespace is normalized (documented).
    text = sentences[0]
    assert tokenizer.decode([tokenizer.language_id("xa"), BOS_ID, *tokenizer.encode(text), EOS_ID, PAD_ID]) == text
    assert tokenizer.decode(tokenizer.encode("  The   big dog. ")) == "The big dog."


def test_saved_tokenizer_gives_identical_ids(
    tokenizer: SubwordTokenizer, small_corpus: dict[str, DatasetDict], tmp_path: Path
) -> None:
    sentences = _texts(small_corpus, "validation")
    tokenizer.save(tmp_path / "tokenizer.json")
    for restored in (
        SubwordTokenizer.load(tmp_path / "tokenizer.json"),
        SubwordTokenizer.from_json(tokenizer.to_json()),
    ):
        assert restored.encode_batch(sentences) == tokenizer.encode_batch(sentences)
        assert restored.languages == tokenizer.languages
    again = SubwordTokenizer.train(_texts(small_corpus), ["en", "xa", "xb", "xc", "xd"], vocab_size=600)
    assert again.to_json() == tokenizer.to_json()  # training is deterministic: every rank builds the same one


def test_tokenizer_errors_are_pinned(tokenizer: SubwordTokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Language 'de' has no <2de> token; this tokenizer knows \['en', 'xa'"):
        tokenizer.language_id("de")
    with pytest.raises(ValueError, match="vocab_size=6 leaves no room for subwords after 6 special tokens"):
        SubwordTokenizer.train(["a b"], ["en", "de"], vocab_size=6)
    with pytest.raises(ValueError, match="No tokenizer file at"):
        SubwordTokenizer.load(tmp_path / "missing.json")


# Temperature sampling.


def test_temperature_probabilities_follow_the_power_law() -> None:
    sizes = [20_000, 4_000, 500, 300]
    assert temperature_probabilities(sizes, 1.0) == pytest.approx([n / sum(sizes) for n in sizes])
    for temperature in (2.0, 5.0, 100.0):
        p = temperature_probabilities(sizes, temperature)
        assert sum(p) == pytest.approx(1.0)
        for i in range(1, len(sizes)):
            assert p[0] / p[i] == pytest.approx((sizes[0] / sizes[i]) ** (1 / temperature))
    nearly_uniform = temperature_probabilities(sizes, 1e6)
    assert max(nearly_uniform) - min(nearly_uniform) < 1e-5
    # Huge corpora and tiny temperatures stay finite.
    assert temperature_probabilities([10**12, 1], 0.01) == pytest.approx([1.0, 0.0])


def test_temperature_errors_are_pinned() -> None:
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="must be a finite number > 0: 1.0 samples pairs in proportion"):
            temperature_probabilities([1, 2], bad)
    with pytest.raises(TypeError, match="temperature must be a number, got str '5'"):
        temperature_probabilities([1, 2], "5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sizes=\[3, 0\]: every pair needs at least one example"):
        temperature_probabilities([3, 0], 5.0)
    with pytest.raises(ValueError, match="sizes is empty"):
        temperature_probabilities([], 5.0)
    with pytest.raises(ValueError, match="num_samples=0 must be at least 1"):
        TemperatureSampler([3], num_samples=0)


@pytest.mark.parametrize("temperature", [1.0, 5.0, 100.0])
def test_sampled_pair_frequencies_match_the_temperature_law(temperature: float) -> None:
    """200k draws: each pair's count is within 5 binomial standard errors of N·p_l, and draws within a pair are uniform.

    No scipy here for a chi-square test, so each of the 8 checks per temperature (4 counts, 4 within-pair means,
    both nearly normal at these sizes) is a 5-sigma bound: for an unseeded run the chance of a false failure is at
    most 8 · P(|Z| > 5) ≈ 4.6e-6 per temperature. With the fixed seed the outcome is reproducible.
    """
    sizes = [20_000, 4_000, 500, 300]
    draws = 200_000
    sampler = TemperatureSampler(sizes, temperature, num_samples=draws, seed=0)
    draws_of_pairs = sampler.pair_draws()  # the coming pass
    indices = torch.tensor(list(sampler))
    offsets = torch.tensor([0, 20_000, 24_000, 24_500, 24_800])
    pairs = torch.bucketize(indices, offsets[1:], right=True)
    assert torch.equal(pairs, draws_of_pairs)  # each index lies in its pair's range
    counts = torch.bincount(pairs, minlength=len(sizes)).tolist()
    for count, p in zip(counts, temperature_probabilities(sizes, temperature), strict=True):
        assert abs(count - draws * p) <= 5 * math.sqrt(draws * p * (1 - p)), (counts, temperature)
    # Within a pair, examples are uniform: the mean index is (N-1)/2 within 5 standard errors of the discrete
    # uniform distribution (variance (N²-1)/12).
    for pair, (count, size) in enumerate(zip(counts, sizes, strict=True)):
        within = (indices[pairs == pair] - offsets[pair]).double()
        assert abs(within.mean().item() - (size - 1) / 2) <= 5 * math.sqrt((size**2 - 1) / 12 / count)


def test_sampler_is_deterministic_per_seed_and_epoch() -> None:
    sampler = TemperatureSampler([50, 10, 5], 5.0, num_samples=400, seed=3)
    first = list(sampler)
    assert len(first) == len(sampler) == 400
    assert list(TemperatureSampler([50, 10, 5], 5.0, num_samples=400, seed=3)) == first
    assert list(TemperatureSampler([50, 10, 5], 5.0, num_samples=400, seed=4)) != first
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    # Without set_epoch (a DDP-wrapped sampler), every pass draws anew, reproducibly.
    third = list(sampler)
    assert third not in (first, second)
    replay = TemperatureSampler([50, 10, 5], 5.0, num_samples=400, seed=3)
    assert [list(replay), list(replay)] == [first, third]
    assert len(TemperatureSampler([50, 10, 5])) == 65  # default: one epoch is the total size


# The translation data module.


def _rows(batch: torch.Tensor) -> list[list[int]]:
    """Check right padding and a single closing </s>; return the unpadded rows."""
    assert batch.dtype == torch.int64
    assert batch.dim() == 2
    rows = []
    for row in batch.tolist():
        length = row.index(EOS_ID) + 1
        assert all(token == PAD_ID for token in row[length:]), row
        assert PAD_ID not in row[:length], row  # with the line above: exactly one </s>, then only padding
        rows.append(row[:length])
    return rows


def test_training_batches_follow_the_contract(module: TranslationDataModule) -> None:
    tokenizer = module.tokenizer
    assert tokenizer is not None
    language_ids = {tokenizer.language_id(pair.split("-")[1]): pair for pair in module.directed_pairs}
    aligned = {pair: dict(zip(module.sources(pair, "train"), module.references(pair, "train"), strict=True))
               for pair in module.directed_pairs}  # fmt: skip
    seen = set()
    for source, target in module.train_dataloader():
        assert source.shape[0] == target.shape[0] <= 16
        for src, tgt in zip(_rows(source), _rows(target), strict=True):
            pair = language_ids[src[0]]  # the target-language token comes first
            seen.add(pair)
            assert tgt[0] == BOS_ID
            assert BOS_ID not in src
            assert aligned[pair][tokenizer.decode(src)] == tokenizer.decode(tgt)
    assert seen == set(module.directed_pairs)


def test_evaluation_loaders_are_per_pair_in_order(module: TranslationDataModule) -> None:
    tokenizer = module.tokenizer
    assert tokenizer is not None
    loaders = module.val_dataloader()
    assert module.directed_pairs == ["en-xa", "en-xb", "en-xc", "en-xd"]
    assert len(loaders) == len(module.directed_pairs)
    for pair, loader in zip(module.directed_pairs, loaders, strict=True):
        sources = torch.cat([F.pad(s, (0, 40 - s.shape[1])) for s, _ in loader])
        expected = module.encode_sources(pair, "validation")
        assert torch.equal(sources, F.pad(expected, (0, 40 - expected.shape[1])))
        assert (expected[:, 0] == tokenizer.language_id(pair.split("-")[1])).all()
        assert tokenizer.decode_batch(expected.tolist()) == module.sources(pair, "validation")
        assert len(module.references(pair, "validation")) == len(expected) == 200
    assert len(module.test_dataloader()) == 4


def test_both_directions_add_the_reverse_pairs() -> None:
    dm = TranslationDataModule(pairs=["en-xd"], directions="both", embedded_sizes={"xd": 30}, vocab_size=300)
    dm.setup()
    assert dm.directed_pairs == ["en-xd", "xd-en"]
    assert dm.tokenizer is not None
    assert dm.tokenizer.languages == ("en", "xd")
    assert dm.sources("xd-en") == dm.references("en-xd")
    assert (dm.encode_sources("xd-en")[:, 0] == dm.tokenizer.language_id("en")).all()
    assert dm.split_sizes() == {"en-xd": 30, "xd-en": 30}
    assert dm.sampling_probabilities() == {"en-xd": 0.5, "xd-en": 0.5}


def test_max_length_drops_long_training_pairs_and_truncates_evaluation() -> None:
    dm = TranslationDataModule(pairs=["en-xb"], embedded_sizes={"xb": 200}, vocab_size=400, max_length=12)
    dm.setup()
    assert 0 < dm.split_sizes()["en-xb"] < 200  # some pairs were longer than 12 tokens and are left out
    for source, target in dm.train_dataloader():
        assert source.shape[1] <= 12
        assert target.shape[1] <= 12
    sources = dm.encode_sources("en-xb", "test")
    assert sources.shape == (200, 12)
    _rows(sources)  # truncated rows still end with </s>
    assert len(dm.references("en-xb", "test")) == 200  # BLEU still sees every reference


def test_state_dict_carries_the_tokenizer(module: TranslationDataModule, tmp_path: Path) -> None:
    state = module.state_dict()
    assert module.tokenizer is not None
    assert state == {"tokenizer": module.tokenizer.to_json()}
    # Restored before setup: setup keeps it instead of training a new one.
    restored = TranslationDataModule(embedded_sizes=SMALL, vocab_size=300, batch_size=16)
    assert restored.state_dict() == {}
    restored.load_state_dict(state)
    restored.setup()
    assert restored.state_dict() == state
    # Restored after setup (Lightning restores checkpoints after setup): the data is re-encoded with it.
    late = TranslationDataModule(embedded_sizes=SMALL, vocab_size=300, batch_size=16)
    late.setup()
    assert not torch.equal(late.encode_sources("en-xa"), module.encode_sources("en-xa"))
    late.load_state_dict(state)
    assert torch.equal(late.encode_sources("en-xa"), module.encode_sources("en-xa"))
    # The same through a file.
    module.save_tokenizer(tmp_path / "tokenizer.json")
    from_file = TranslationDataModule(embedded_sizes=SMALL, tokenizer_path=str(tmp_path / "tokenizer.json"))
    from_file.setup()
    assert torch.equal(from_file.encode_sources("en-xc", "validation"), module.encode_sources("en-xc", "validation"))


def test_lightning_checkpoint_holds_the_tokenizer(module: TranslationDataModule, tmp_path: Path) -> None:
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(600, 4)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.embedding(batch[0]).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Tiny(), datamodule=module)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert module.tokenizer is not None
    assert checkpoint["TranslationDataModule"] == {"tokenizer": module.tokenizer.to_json()}


def _local_rows(code: str, count: int) -> list[dict[str, dict[str, str]]]:
    """A tiny corpus in the real translation schema (German or French with English, non-ASCII letters included)."""
    foreign = {"de": "Ich habe {n} grüne Äpfel.", "fr": "J'ai {n} pommes vertes, déjà."}
    english = "I have {n} green apples."
    return [{"translation": {code: foreign[code].format(n=n), "en": english.format(n=n)}} for n in range(count)]


def test_local_corpus_in_the_translation_schema(tmp_path: Path) -> None:
    # A save_to_disk DatasetDict named the WMT way ("de-en"), and json-lines files for "fr-en".
    features = Features({"translation": Translation(languages=["de", "en"])})
    DatasetDict({
        "train": Dataset.from_list(_local_rows("de", 40), features=features),
        "validation": Dataset.from_list(_local_rows("de", 5), features=features),
        "test": Dataset.from_list(_local_rows("de", 6), features=features),
    }).save_to_disk(str(tmp_path / "de-en"))  # fmt: skip
    (tmp_path / "fr-en").mkdir()
    for split, count in (("train", 30), ("validation", 4), ("test", 3)):
        lines = [json.dumps(row, ensure_ascii=False) for row in _local_rows("fr", count)]
        (tmp_path / "fr-en" / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    dm = TranslationDataModule(pairs=["en-de", "en-fr"], source=str(tmp_path), vocab_size=200, batch_size=8)
    dm.setup()
    assert dm.split_sizes() == {"en-de": 40, "en-fr": 30}
    assert dm.split_sizes("test") == {"en-de": 6, "en-fr": 3}
    tokenizer = dm.tokenizer
    assert tokenizer is not None
    assert tokenizer.languages == ("de", "en", "fr")
    assert dm.references("en-de", "test")[2] == "Ich habe 2 grüne Äpfel."
    aligned = {
        tokenizer.language_id(code): {
            row["translation"]["en"]: row["translation"][code] for row in _local_rows(code, 40)
        }
        for code in ("de", "fr")
    }
    seen = set()
    for source, target in dm.train_dataloader():
        for src, tgt in zip(_rows(source), _rows(target), strict=True):
            seen.add(src[0])
            assert aligned[src[0]][tokenizer.decode(src)] == tokenizer.decode(tgt)
    assert seen == {tokenizer.language_id("de"), tokenizer.language_id("fr")}
    assert tokenizer.decode(dm.encode_sources("en-fr", "test")[1].tolist()) == "I have 1 green apples."
    with pytest.raises(ValueError, match=r"No data for pair 'en-es' in .* \(found \['de-en', 'fr-en'\]\)"):
        TranslationDataModule(pairs=["en-es"], source=str(tmp_path)).setup()


def test_data_module_errors_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"Unknown pairs \['en-zz'\] for source='embedded'; the embedded corpus has"):
        TranslationDataModule(pairs=["en-xa", "en-zz"]).setup()
    with pytest.raises(ValueError, match="temperature=0 must be a finite number > 0"):
        TranslationDataModule(temperature=0)
    with pytest.raises(ValueError, match=r"directions='backward' must be one of \('forward', 'both'\)"):
        TranslationDataModule(directions="backward")
    with pytest.raises(ValueError, match="Pair 'enxa' must read 'src-tgt' with two different language codes"):
        TranslationDataModule(pairs=["enxa"])
    with pytest.raises(ValueError, match=r"embedded_sizes names unknown languages \['zz'\]"):
        TranslationDataModule(embedded_sizes={"zz": 3})
    with pytest.raises(RuntimeError, match="call setup"):
        TranslationDataModule().references("en-xa")
    with pytest.raises(ValueError, match="Every training example of 'en-xd' is longer than max_length=3 tokens"):
        TranslationDataModule(pairs=["en-xd"], embedded_sizes={"xd": 5}, vocab_size=200, max_length=3).setup()
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"Could not load 'nobody/no-such-corpus' .*pass source=<dir>"):
        TranslationDataModule(pairs=["en-de"], source="nobody/no-such-corpus").setup()


def test_unknown_pair_of_a_set_up_module(module: TranslationDataModule) -> None:
    with pytest.raises(ValueError, match=r"Pair 'xa-en' is not in this data module; it has \['en-xa'"):
        module.references("xa-en")


# The language-model data module.


def test_language_model_batches_are_padded_sentences() -> None:
    dm = LanguageModelDataModule(languages=["xb", "xd"], embedded_sizes={"xb": 60, "xd": 30}, vocab_size=300,
                                 batch_size=8)  # fmt: skip
    dm.setup()
    assert dm.tokenizer is not None
    assert dm.tokenizer.languages == ("xb", "xd")
    rows = [row for batch in dm.train_dataloader() for row in _rows(batch)]
    assert len(rows) == 90
    assert all(row[0] == BOS_ID for row in rows)
    assert sorted(dm.tokenizer.decode_batch(rows)) == sorted(dm.texts("train"))
    assert len(dm.texts("validation")) == 400  # both languages' target sides
    restored = LanguageModelDataModule(languages=["xb", "xd"], embedded_sizes={"xb": 60, "xd": 30})
    restored.load_state_dict(dm.state_dict())
    restored.setup()
    assert restored.state_dict() == dm.state_dict()


def test_language_model_blocks_cut_the_stream(tmp_path: Path) -> None:
    for split, count in (("train", 50), ("validation", 10), ("test", 10)):
        lines = [f"Line {n} of the {split} text." for n in range(count)]
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    dm = LanguageModelDataModule(source=str(tmp_path), block_size=16, vocab_size=200, batch_size=4)
    dm.setup()
    tokenizer = dm.tokenizer
    assert tokenizer is not None
    assert tokenizer.languages == ()
    blocks = torch.cat(list(dm.val_dataloader()))
    stream = [t for s in dm.texts("validation") for t in [BOS_ID, *tokenizer.encode(s), EOS_ID]]
    assert blocks.dtype == torch.int64
    assert blocks.shape == (len(stream) // 17, 17)
    assert blocks.flatten().tolist() == stream[: blocks.numel()]


def test_language_model_errors_are_pinned(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a DatasetDict.save_to_disk nor train/validation/test.txt"):
        LanguageModelDataModule(source=str(tmp_path)).setup()
    with pytest.raises(ValueError, match=r"Unknown languages \['zz'\]; the embedded corpus has \['xa'"):
        LanguageModelDataModule(languages=["zz"])
    with pytest.raises(ValueError, match="block_size=0 must be at least 1"):
        LanguageModelDataModule(block_size=0)
