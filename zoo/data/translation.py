"""The translation data module over the embedded, hub or local corpora, and what the text data modules share.

Batch contract (shared with the zoo's Transformers; ids from :mod:`zoo.data.tokenizer`)::

    translation:    (source, target), int64 [B, S] and [B, T], right-padded with 0
                    source = <2tgt> subwords... </s>      (target-language token first, Johnson et al.)
                    target = <s> subwords... </s>
    language model: int64 [B, T+1] = <s> subwords... </s>, right-padded with 0 (:mod:`zoo.data.language_model`)

``source`` selects the corpus: ``"embedded"`` (the synthetic languages of :mod:`zoo.data.synthetic_text`), a local
directory (one sub-directory or file set per pair, see :class:`TranslationDataModule`), or a Hugging Face hub dataset
id such as ``"wmt/wmt14"`` with one config per pair. The tokenizer is trained in ``setup`` unless one is given; its
training is deterministic, so every rank of a distributed job builds the same vocabulary from the same text without
exchanging anything. It travels in the data module's ``state_dict``, which Lightning stores in every checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from datasets import Dataset as HFDataset
from datasets import DatasetDict, load_dataset, load_from_disk
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from zoo.data.sampling import TemperatureSampler, temperature_probabilities
from zoo.data.synthetic_text import DEFAULT_SIZES, make_synthetic_corpus
from zoo.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, SubwordTokenizer

__all__ = ["TranslationDataModule", "pad_sequences"]

SPLITS = ("train", "validation", "test")
DIRECTIONS = ("forward", "both")


def pad_sequences(sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """Right-pad id sequences with ``PAD_ID`` (0) into one int64 tensor [N, longest]."""
    if len(sequences) == 0:
        return torch.zeros(0, 0, dtype=torch.int64)
    out = torch.full((len(sequences), max(len(s) for s in sequences)), PAD_ID, dtype=torch.int64)
    for row, ids in enumerate(sequences):
        out[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return out


class _Sequences(Dataset):
    """A list of encoded examples (one id list, or a tuple of them) as a map-style dataset."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


def _collate_translation(batch: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_sequences([s for s, _ in batch]), pad_sequences([t for _, t in batch])


def _split_pair(pair: str) -> tuple[str, str]:
    parts = pair.split("-")
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise ValueError(f"Pair {pair!r} must read 'src-tgt' with two different language codes, e.g. 'en-de'.")
    return parts[0], parts[1]


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    with file.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


class _TokenizerState:
    """What both data modules share: the tokenizer, where it comes from, and how it rides in checkpoints."""

    tokenizer: SubwordTokenizer | None
    _text: dict[str, Any]  # the loaded text, empty until setup()

    def _encode(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """``{"tokenizer": <json>}`` once a tokenizer exists; Lightning saves it in checkpoints."""
        return {} if self.tokenizer is None else {"tokenizer": self.tokenizer.to_json()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tokenizer of a checkpoint, re-encoding the data if ``setup`` already ran with another one."""
        if "tokenizer" not in state_dict:
            return
        self.tokenizer = SubwordTokenizer.from_json(state_dict["tokenizer"])
        if self._text:
            self._encode()

    def _init_tokenizer(self, tokenizer_path: str | None) -> None:
        self.tokenizer = SubwordTokenizer.load(tokenizer_path) if tokenizer_path is not None else None

    def _require_tokenizer(self) -> SubwordTokenizer:
        if self.tokenizer is None:
            raise RuntimeError("The tokenizer is not ready; call setup() (or load_state_dict) first.")
        return self.tokenizer

    def save_tokenizer(self, path: str | Path) -> None:
        """Write the tokenizer as one JSON file (pass it back as ``tokenizer_path``)."""
        self._require_tokenizer().save(path)


class TranslationDataModule(_TokenizerState, L.LightningDataModule):
    """Multilingual translation data: temperature-sampled training over pairs, per-pair evaluation.

    Arguments (plain types, so LightningCLI can set them):

    - ``pairs``: directed pairs ``"src-tgt"`` ("en-xa" translates English into xa); default: every embedded pair.
    - ``source``: ``"embedded"``; a local directory with, per pair, a sub-directory written by
      ``DatasetDict.save_to_disk`` or holding ``train.jsonl``/``validation.jsonl``/``test.jsonl`` in the translation
      schema (``{"translation": {"en": ..., "de": ...}}``, a directory named for either direction); or a hub id with
      one config per pair (``"wmt/wmt14"``: config "de-en" serves both "de-en" and "en-de").
    - ``directions``: ``"forward"`` (the pairs as given) or ``"both"`` (also each reverse direction).
    - ``temperature``: T of p_l ∝ (N_l / ΣN)^(1/T) over the directed pairs; 1.0 is proportional sampling.
    - ``vocab_size``: of the tokenizer trained in ``setup`` (ignored when ``tokenizer_path`` is given).
    - ``max_length``: tokens per sequence, language token and ``</s>`` or ``<s>``/``</s>`` included. Longer training
      examples are dropped (a truncated target would teach the model to stop mid-sentence); evaluation examples are
      truncated instead, so that BLEU is always computed over the whole reference set.
    - ``limit_per_pair``: keep only the first N training examples of each pair (for large real corpora).
    - ``num_samples``: training draws per epoch; default the sum of the training set sizes.
    - ``embedded_sizes``: training pairs per embedded language, overriding the defaults (e.g. ``{"xa": 2000}``).
    """

    def __init__(
        self,
        pairs: list[str] | None = None,
        source: str = "embedded",
        directions: str = "forward",
        temperature: float = 5.0,
        vocab_size: int = 2000,
        batch_size: int = 64,
        max_length: int = 64,
        num_workers: int = 0,
        tokenizer_path: str | None = None,
        seed: int = 0,
        limit_per_pair: int | None = None,
        num_samples: int | None = None,
        embedded_sizes: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        pairs = [f"en-{code}" for code in DEFAULT_SIZES] if pairs is None else list(pairs)
        if not pairs:
            raise ValueError("pairs is empty: name at least one pair such as 'en-xa'.")
        for pair in pairs:
            _split_pair(pair)
        if directions not in DIRECTIONS:
            raise ValueError(f"directions={directions!r} must be one of {DIRECTIONS}.")
        temperature_probabilities([1], temperature)  # validates temperature now rather than at the first epoch
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1.")
        if max_length < 3:
            raise ValueError(f"max_length={max_length} must be at least 3 (a language token, a subword and </s>).")
        if limit_per_pair is not None and limit_per_pair < 1:
            raise ValueError(f"limit_per_pair={limit_per_pair} must be at least 1, or None for all examples.")
        self.pairs = pairs
        self.source = source
        self.directions = directions
        self.temperature = temperature
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.max_length = max_length
        self.num_workers = num_workers
        self.seed = seed
        self.limit_per_pair = limit_per_pair
        self.num_samples = num_samples
        self.embedded_sizes = _check_embedded_sizes(embedded_sizes)
        self._init_tokenizer(tokenizer_path)
        self._text: dict[str, dict[str, list[tuple[str, str]]]] = {}  # directed pair -> split -> (source, target)
        self._encoded: dict[str, dict[str, list[tuple[list[int], list[int]]]]] = {}

    @property
    def directed_pairs(self) -> list[str]:
        """The directed pairs in loader order (validation/test loader ``i`` serves ``directed_pairs[i]``)."""
        if self.directions == "forward":
            return list(self.pairs)
        reverse = ["-".join(reversed(_split_pair(pair))) for pair in self.pairs]
        return list(dict.fromkeys([*self.pairs, *reverse]))

    @property
    def languages(self) -> list[str]:
        """Every language code of the directed pairs, sorted."""
        return sorted({code for pair in self.directed_pairs for code in _split_pair(pair)})

    # Lightning hooks.

    def prepare_data(self) -> None:
        # Runs once per node before setup: fetching from the hub here fills the cache that every rank then reads.
        if self.source != "embedded" and not Path(self.source).exists():
            self._load_text()

    def setup(self, stage: str | None = None) -> None:
        if self._text:
            return
        self._text = self._load_text()
        if self.tokenizer is None:
            self.tokenizer = SubwordTokenizer.train(self._training_text(), self.languages, self.vocab_size)
        self._encode()

    def train_dataloader(self) -> DataLoader:
        sets = [_Sequences(self._split(pair, "train")) for pair in self.directed_pairs]
        sampler = TemperatureSampler([len(s) for s in sets], self.temperature, self.num_samples, self.seed)
        return DataLoader(
            ConcatDataset(sets),
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=_collate_translation,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> list[DataLoader]:
        return [self._eval_loader(pair, "validation") for pair in self.directed_pairs]

    def test_dataloader(self) -> list[DataLoader]:
        return [self._eval_loader(pair, "test") for pair in self.directed_pairs]

    # What BLEU evaluation needs.

    def sources(self, pair: str, split: str = "test") -> list[str]:
        """The raw source sentences of ``pair``'s ``split``, in loader order."""
        return [s for s, _ in self._texts(pair, split)]

    def references(self, pair: str, split: str = "test") -> list[str]:
        """The raw reference translations of ``pair``'s ``split`` (untruncated), in loader order."""
        return [t for _, t in self._texts(pair, split)]

    def encode_sources(self, pair: str, split: str = "test") -> torch.Tensor:
        """The encoded sources of ``pair``'s ``split`` (``<2tgt> ... </s>``), int64 [N, S] right-padded with 0."""
        return pad_sequences([s for s, _ in self._split(pair, split)])

    def split_sizes(self, split: str = "train") -> dict[str, int]:
        """Examples per directed pair in ``split`` (after the length filter for training)."""
        return {pair: len(self._split(pair, split)) for pair in self.directed_pairs}

    def sampling_probabilities(self) -> dict[str, float]:
        """The temperature sampling probability of each directed pair."""
        sizes = self.split_sizes("train")
        return dict(zip(sizes, temperature_probabilities(list(sizes.values()), self.temperature), strict=True))

    # Internals.

    def _texts(self, pair: str, split: str) -> list[tuple[str, str]]:
        if not self._text:
            raise RuntimeError("No data yet; call setup() first.")
        if pair not in self._text:
            raise ValueError(f"Pair {pair!r} is not in this data module; it has {self.directed_pairs}.")
        if split not in SPLITS:
            raise ValueError(f"split={split!r} must be one of {SPLITS}.")
        return self._text[pair][split]

    def _split(self, pair: str, split: str) -> list[tuple[list[int], list[int]]]:
        self._texts(pair, split)  # validates
        return self._encoded[pair][split]

    def _eval_loader(self, pair: str, split: str) -> DataLoader:
        return DataLoader(
            _Sequences(self._split(pair, split)),
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=_collate_translation,
            num_workers=self.num_workers,
        )

    def _training_text(self) -> Iterable[str]:
        # Each undirected pair once: "both" adds reversed copies of the same sentences.
        seen = set()
        for pair, splits in self._text.items():
            key = frozenset(_split_pair(pair))
            if key in seen:
                continue
            seen.add(key)
            for source, target in splits["train"]:
                yield source
                yield target

    def _encode(self) -> None:
        tokenizer = self._require_tokenizer()
        encoded: dict[str, dict[str, list[tuple[list[int], list[int]]]]] = {}
        for pair in self.directed_pairs:
            language = tokenizer.language_id(_split_pair(pair)[1])
            encoded[pair] = {}
            for split in SPLITS:
                rows = self._text[pair][split]
                sources = tokenizer.encode_batch([s for s, _ in rows])
                targets = tokenizer.encode_batch([t for _, t in rows])
                pairs = zip(sources, targets, strict=True)
                examples = [([language, *s, EOS_ID], [BOS_ID, *t, EOS_ID]) for s, t in pairs]
                if split == "train":
                    examples = [(s, t) for s, t in examples if max(len(s), len(t)) <= self.max_length]
                    if not examples:
                        raise ValueError(
                            f"Every training example of {pair!r} is longer than max_length={self.max_length} tokens; "
                            "raise max_length."
                        )
                else:
                    examples = [(_truncate(s, self.max_length), _truncate(t, self.max_length)) for s, t in examples]
                encoded[pair][split] = examples
        self._encoded = encoded

    def _load_text(self) -> dict[str, dict[str, list[tuple[str, str]]]]:
        corpora = self._load_corpora()
        text: dict[str, dict[str, list[tuple[str, str]]]] = {}
        for pair in self.directed_pairs:
            src, tgt = _split_pair(pair)
            corpus = corpora[frozenset((src, tgt))]
            text[pair] = {}
            for split in SPLITS:
                if split not in corpus:
                    raise ValueError(f"The corpus of {pair!r} has no {split!r} split (it has {sorted(corpus)}).")
                rows = corpus[split]
                if split == "train" and self.limit_per_pair is not None:
                    rows = rows.select(range(min(self.limit_per_pair, len(rows))))
                # Slicing converts the whole column at once (and honours select's indices), unlike row iteration.
                text[pair][split] = [(row[src], row[tgt]) for row in rows[:]["translation"]]
        return text

    def _load_corpora(self) -> dict[frozenset[str], DatasetDict]:
        """One ``DatasetDict`` per undirected pair of the requested pairs, keyed by its two language codes."""
        wanted = {frozenset(_split_pair(pair)): pair for pair in self.pairs}
        if self.source == "embedded":
            return self._load_embedded(wanted)
        if Path(self.source).exists():
            return {key: self._load_local(pair) for key, pair in wanted.items()}
        return {key: self._load_hub(pair) for key, pair in wanted.items()}

    def _load_embedded(self, wanted: dict[frozenset[str], str]) -> dict[frozenset[str], DatasetDict]:
        available = {frozenset(("en", code)): code for code in DEFAULT_SIZES}
        unknown = [pair for key, pair in wanted.items() if key not in available]
        if unknown:
            names = [f"en-{code}" for code in DEFAULT_SIZES] + [f"{code}-en" for code in DEFAULT_SIZES]
            raise ValueError(f"Unknown pairs {unknown} for source='embedded'; the embedded corpus has {names}.")
        codes = [available[key] for key in wanted]
        sizes = {code: self.embedded_sizes.get(code, DEFAULT_SIZES[code]) for code in codes}
        corpus = make_synthetic_corpus(seed=self.seed, sizes=sizes)
        return {key: corpus[f"en-{available[key]}"] for key in wanted}

    def _load_local(self, pair: str) -> DatasetDict:
        root = Path(self.source)
        src, tgt = _split_pair(pair)
        for name in (pair, f"{tgt}-{src}"):
            directory = root / name
            if (directory / "dataset_dict.json").is_file():
                loaded = load_from_disk(str(directory))
                assert isinstance(loaded, DatasetDict), type(loaded)
                return loaded
            files = {split: directory / f"{split}.jsonl" for split in SPLITS}
            if all(file.is_file() for file in files.values()):
                rows = {split: _read_jsonl(file) for split, file in files.items()}
                return DatasetDict({split: _translation_rows(r, str(files[split])) for split, r in rows.items()})
        found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise ValueError(
            f"No data for pair {pair!r} in {str(root)!r} (found {found}). Put a DatasetDict.save_to_disk directory "
            f"or train/validation/test.jsonl files in the translation schema under {str(root / pair)!r}."
        )

    def _load_hub(self, pair: str) -> DatasetDict:
        src, tgt = _split_pair(pair)
        error: Exception | None = None
        for config in (pair, f"{tgt}-{src}"):
            try:
                loaded = load_dataset(self.source, config)
            except Exception as exc:  # offline, unknown id and unknown config all land here
                error = exc
                continue
            assert isinstance(loaded, DatasetDict), type(loaded)
            return loaded
        raise ValueError(
            f"Could not load {self.source!r} with config {pair!r} or {f'{tgt}-{src}'!r} from the Hugging Face hub "
            f"({error}). "
            "Offline, save the dataset once with DatasetDict.save_to_disk(<dir>/<pair>) (or write "
            "train/validation/test.jsonl there) and pass source=<dir>; source='embedded' needs no files."
        ) from error


def _translation_rows(rows: list[dict[str, Any]], origin: str) -> HFDataset:
    if rows and "translation" not in rows[0]:
        raise ValueError(f'{origin!r} rows need a \'translation\' field, e.g. {{"translation": {{"en": ..., ...}}}}.')
    return HFDataset.from_list(rows)


def _check_embedded_sizes(sizes: dict[str, int] | None) -> dict[str, int]:
    sizes = dict(sizes or {})
    unknown = sorted(set(sizes) - set(DEFAULT_SIZES))
    if unknown:
        raise ValueError(
            f"embedded_sizes names unknown languages {unknown}; the embedded corpus has {sorted(DEFAULT_SIZES)}."
        )
    return sizes


def _truncate(ids: list[int], length: int) -> list[int]:
    return ids if len(ids) <= length else [*ids[: length - 1], EOS_ID]
