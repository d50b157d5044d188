"""The language-model data module: monolingual text for the Transformer-L, from the embedded, hub or local corpora.

Batches are int64 [B, T+1] = <s> subwords... </s>, right-padded with 0 (ids from :mod:`zoo.data.tokenizer`). The
tokenizer is trained in ``setup`` unless one is given and travels in the data module's ``state_dict``, as
:mod:`zoo.data.translation` describes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from datasets import load_dataset, load_from_disk
from torch.utils.data import DataLoader

from zoo.data.synthetic_text import DEFAULT_SIZES, make_synthetic_corpus
from zoo.data.tokenizer import BOS_ID, EOS_ID, SubwordTokenizer
from zoo.data.translation import SPLITS, _check_embedded_sizes, _Sequences, _TokenizerState, _truncate, pad_sequences

__all__ = ["LanguageModelDataModule", "load_text_splits"]


class LanguageModelDataModule(_TokenizerState, L.LightningDataModule):
    """Monolingual text for the decoder-only Transformer-L: batches int64 [B, T+1] of ``<s> ... </s>``.

    ``source``: ``"embedded"`` (the target-side sentences of the embedded corpus, languages ``languages`` or all),
    a hub dataset id (``hub_config`` selects its config, ``text_column`` its text), or a local directory holding a
    ``DatasetDict.save_to_disk`` or ``train.txt``/``validation.txt``/``test.txt`` (one text per line).

    With ``block_size`` None each sentence is one padded row of at most ``max_length`` tokens (longer training
    sentences are dropped, evaluation ones truncated). With ``block_size`` set, all sentences of a split are joined
    into one stream ``<s> a </s> <s> b </s> ...`` cut into rows of exactly ``block_size + 1`` tokens (the remainder
    is dropped), the usual setup for long-context language modelling; rows then start anywhere in the stream.
    ``embedded_sizes`` overrides the number of training sentences per embedded language.
    """

    def __init__(
        self,
        source: str = "embedded",
        languages: list[str] | None = None,
        text_column: str = "text",
        hub_config: str | None = None,
        vocab_size: int = 2000,
        batch_size: int = 32,
        max_length: int = 64,
        block_size: int | None = None,
        num_workers: int = 0,
        tokenizer_path: str | None = None,
        seed: int = 0,
        limit: int | None = None,
        embedded_sizes: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1.")
        if max_length < 3:
            raise ValueError(f"max_length={max_length} must be at least 3 (<s>, a subword and </s>).")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1, or None for one sentence per row.")
        if source == "embedded":
            unknown = sorted(set(languages or ()) - set(DEFAULT_SIZES))
            if unknown:
                raise ValueError(f"Unknown languages {unknown}; the embedded corpus has {sorted(DEFAULT_SIZES)}.")
        self.source = source
        self.languages = sorted(languages) if languages else (sorted(DEFAULT_SIZES) if source == "embedded" else [])
        self.text_column = text_column
        self.hub_config = hub_config
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.max_length = max_length
        self.block_size = block_size
        self.num_workers = num_workers
        self.seed = seed
        self.limit = limit
        self.embedded_sizes = _check_embedded_sizes(embedded_sizes)
        self._init_tokenizer(tokenizer_path)
        self._text: dict[str, list[str]] = {}
        self._rows: dict[str, list[list[int]]] = {}

    def setup(self, stage: str | None = None) -> None:
        if self._text:
            return
        self._text = self._load_text()
        if self.tokenizer is None:
            self.tokenizer = SubwordTokenizer.train(self._text["train"], self.languages, self.vocab_size)
        self._encode()

    def texts(self, split: str = "test") -> list[str]:
        """The raw sentences of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} must be one of {SPLITS}.")
        if not self._text:
            raise RuntimeError("No data yet; call setup() first.")
        return self._text[split]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader("train", shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def _loader(self, split: str, shuffle: bool = False, generator: torch.Generator | None = None) -> DataLoader:
        self.texts(split)  # validates
        return DataLoader(
            _Sequences(self._rows[split]),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            collate_fn=pad_sequences,
            num_workers=self.num_workers,
        )

    def _encode(self) -> None:
        tokenizer = self._require_tokenizer()
        rows: dict[str, list[list[int]]] = {}
        for split, sentences in self._text.items():
            sequences = [[BOS_ID, *ids, EOS_ID] for ids in tokenizer.encode_batch(sentences)]
            if self.block_size is not None:
                stream = [token for sequence in sequences for token in sequence]
                width = self.block_size + 1
                rows[split] = [stream[i : i + width] for i in range(0, len(stream) - width + 1, width)]
            elif split == "train":
                rows[split] = [s for s in sequences if len(s) <= self.max_length]
            else:
                rows[split] = [_truncate(s, self.max_length) for s in sequences]
            if not rows[split]:
                raise ValueError(
                    f"The {split!r} split yields no rows with max_length={self.max_length}, "
                    f"block_size={self.block_size}; raise max_length or lower block_size."
                )
        self._rows = rows

    def _load_text(self) -> dict[str, list[str]]:
        if self.source == "embedded":
            sizes = {code: self.embedded_sizes.get(code, DEFAULT_SIZES[code]) for code in self.languages}
            corpus = make_synthetic_corpus(seed=self.seed, sizes=sizes)
            text = {
                split: [row[code] for code in self.languages for row in corpus[f"en-{code}"][split][:]["translation"]]
                for split in SPLITS
            }
        else:
            text = self._load_external()
        if self.limit is not None:
            text["train"] = text["train"][: self.limit]
        return text

    def _load_external(self) -> dict[str, list[str]]:
        return load_text_splits(self.source, self.text_column, self.hub_config)


def load_text_splits(source: str, text_column: str = "text", hub_config: str | None = None) -> dict[str, list[str]]:
    """The non-empty texts of each split of :data:`SPLITS`, from a local directory (a ``DatasetDict.save_to_disk`` or
    ``train.txt``/``validation.txt``/``test.txt``, one text per line) or a Hugging Face hub dataset (``hub_config``
    its config, ``text_column`` the column of a dataset's texts)."""
    root = Path(source)
    if root.exists():
        if (root / "dataset_dict.json").is_file():
            loaded: Any = load_from_disk(str(root))
        elif all((root / f"{split}.txt").is_file() for split in SPLITS):
            return {
                split: [line for line in (root / f"{split}.txt").read_text("utf-8").splitlines() if line.strip()]
                for split in SPLITS
            }
        else:
            raise ValueError(
                f"{str(root)!r} holds neither a DatasetDict.save_to_disk nor train/validation/test.txt files."
            )
    else:
        try:
            loaded = load_dataset(source, hub_config)
        except Exception as exc:  # offline, unknown id and unknown config all land here
            raise ValueError(
                f"Could not load {source!r} (config {hub_config!r}) from the Hugging Face hub ({exc}). "
                "Offline, save it once with DatasetDict.save_to_disk(<dir>) and pass source=<dir>."
            ) from exc
    missing = [split for split in SPLITS if split not in loaded]
    if missing or text_column not in loaded["train"].column_names:
        raise ValueError(
            f"{source!r} needs splits {SPLITS} with a {text_column!r} column; it has splits "
            f"{sorted(loaded)} and columns {loaded[next(iter(loaded))].column_names}. Set text_column."
        )
    return {split: [t for t in loaded[split][text_column] if t and t.strip()] for split in SPLITS}
