"""Data encoded with a pretrained model's own Hugging Face tokenizer: translation pairs, and text for a decoder-only
language model (:class:`PretrainedCausalLMDataModule`).

The translation corpora, splits, pairs and temperature sampling are
:class:`~zoo.data.translation.TranslationDataModule`'s
(the embedded synthetic languages, a local directory in the translation schema, or a hub id such as ``"wmt/wmt14"``);
only the encoding differs. Batch contract, with the model's ids::

    (source, target), int64 [B, S] and [B, T], right-padded with the tokenizer's pad id
    source = tokenizer(text)["input_ids"]                      M2M-100: __en__ ... </s>     Marian: ... </s>
    target = [decoder_start_token_id, *tokenizer(text_target=text)["input_ids"]]
                                                               M2M-100: </s> __de__ ... </s>  Marian: <pad> ... </s>

A pretrained model knows its own language codes, not the corpus's: ``language_codes`` maps one to the other (the
embedded languages ``xa``..``xd`` can stand in for, say, ``de``, ``fr``, ``es``, ``it`` of M2M-100). Marian models
with several target languages get the ``>>code<<`` token in front of the source text, as their tokenizer expects.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import ConcatDataset, DataLoader
from transformers import (
    AutoTokenizer,
    DataCollatorWithFlattening,
    DataCollatorWithPadding,
    PreTrainedTokenizerBase,
)

from zoo.data.language_model import load_text_splits
from zoo.data.sampling import TemperatureSampler
from zoo.data.synthetic_text import make_synthetic_corpus
from zoo.data.translation import SPLITS, TranslationDataModule, _Sequences, _split_pair

__all__ = ["PretrainedCausalLMDataModule", "PretrainedTranslationDataModule"]

IGNORE_INDEX = -100  # a label left out of the loss, as Hugging Face's collators write it


class PretrainedTranslationDataModule(TranslationDataModule):
    """:class:`~zoo.data.translation.TranslationDataModule` encoded with a Hugging Face tokenizer.

    Arguments as the parent's (``pairs``, ``source``, ``directions``, ``temperature``, ``batch_size``,
    ``max_length``, ``limit_per_pair``, ``num_samples``, ``embedded_sizes``, ``seed``), plus:

    - ``tokenizer``: a hub id or ``save_pretrained`` directory; default the tokenizer of the model being fitted
      (``trainer.lightning_module.tokenizer``, a :class:`~zoo.tasks.pretrained_translation.PretrainedTranslator`).
    - ``language_codes``: corpus language -> the tokenizer's code, e.g. ``{"xa": "de"}``; unmapped languages keep
      their own code.
    """

    def __init__(
        self,
        tokenizer: str | None = None,
        language_codes: dict[str, str] | None = None,
        pairs: list[str] | None = None,
        source: str = "embedded",
        directions: str = "forward",
        temperature: float = 5.0,
        batch_size: int = 32,
        max_length: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        limit_per_pair: int | None = None,
        num_samples: int | None = None,
        embedded_sizes: dict[str, int] | None = None,
    ) -> None:
        super().__init__(
            pairs=pairs,
            source=source,
            directions=directions,
            temperature=temperature,
            batch_size=batch_size,
            max_length=max_length,
            num_workers=num_workers,
            seed=seed,
            limit_per_pair=limit_per_pair,
            num_samples=num_samples,
            embedded_sizes=embedded_sizes,
        )
        self.save_hyperparameters()
        self.tokenizer_source = tokenizer
        self.language_codes = dict(language_codes or {})
        self.library_tokenizer: PreTrainedTokenizerBase | None = None

    # Lightning hooks.

    def setup(self, stage: str | None = None) -> None:
        if self._text:
            return
        self.library_tokenizer = self._find_tokenizer()
        self._text = self._load_text()
        self._encode()

    def state_dict(self) -> dict[str, Any]:
        return {}  # the tokenizer is the model's, read from its source: nothing to keep in checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        sets = [_Sequences(self._split(pair, "train")) for pair in self.directed_pairs]
        sampler = TemperatureSampler([len(s) for s in sets], self.temperature, self.num_samples, self.seed)
        return DataLoader(
            ConcatDataset(sets),
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self._collate,
            num_workers=self.num_workers,
        )

    # What evaluation needs.

    def encode_sources(self, pair: str, split: str = "test") -> torch.Tensor:
        """The encoded sources of ``pair``'s ``split``, int64 [N, S] right-padded with the pad id."""
        return self._pad([s for s, _ in self._split(pair, split)])

    def target_prefix(self, pair: str) -> list[int]:
        """The tokens the target side starts with after the decoder start (M2M-100: the language token; Marian:
        none): what decoding must force before it predicts freely."""
        tokenizer = self._require_library_tokenizer()
        self._select_languages(pair)
        labels = list(tokenizer(text_target="")["input_ids"])
        return labels[:-1] if labels and labels[-1] == tokenizer.eos_token_id else labels

    # Internals.

    def _find_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer_source is not None:
            return AutoTokenizer.from_pretrained(self.tokenizer_source)
        found = getattr(self._fitted_model(), "tokenizer", None)
        if not isinstance(found, PreTrainedTokenizerBase):
            raise ValueError(
                "PretrainedTranslationDataModule has no tokenizer: pass tokenizer=<hub id or directory>, or fit it "
                "with a zoo.tasks.pretrained_translation.PretrainedTranslator, whose tokenizer it then uses"
            )
        return found

    def _fitted_model(self) -> object:
        """The model of the trainer this data module is attached to, or None outside ``fit``."""
        trainer = self.trainer
        return None if trainer is None else trainer.lightning_module

    def _require_library_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.library_tokenizer is None:
            raise RuntimeError("The tokenizer is not ready; call setup() first.")
        return self.library_tokenizer

    def _code(self, language: str) -> str:
        return self.language_codes.get(language, language)

    def _select_languages(self, pair: str) -> str:
        """Set the tokenizer's languages for ``pair``; returns the text to put before each source sentence."""
        tokenizer = self._require_library_tokenizer()
        src, tgt = (self._code(code) for code in _split_pair(pair))
        if hasattr(tokenizer, "lang_code_to_id") or hasattr(tokenizer, "src_lang"):  # M2M-100, NLLB
            known = getattr(tokenizer, "lang_code_to_id", None)
            for code in (src, tgt):
                if known is not None and code not in known:
                    raise ValueError(
                        f"language {code!r} of pair {pair!r} is not one of the tokenizer's codes (e.g. "
                        f"{sorted(known)[:6]}); map the corpus's languages with language_codes={{'xa': 'de', ...}}"
                    )
            tokenizer.src_lang = src
            tokenizer.tgt_lang = tgt
            return ""
        # Marian: a multi-target model reads the target language from a >>code<< token at the start of the source.
        return f">>{tgt}<< " if getattr(tokenizer, "supported_language_codes", None) else ""

    def _encode(self) -> None:
        tokenizer = self._require_library_tokenizer()
        start = self._decoder_start_id()
        encoded: dict[str, dict[str, list[tuple[list[int], list[int]]]]] = {}
        for pair in self.directed_pairs:
            marker = self._select_languages(pair)
            encoded[pair] = {}
            for split in SPLITS:
                rows = self._text[pair][split]
                if not rows:
                    encoded[pair][split] = []
                    continue
                batch = tokenizer(
                    [marker + s for s, _ in rows], text_target=[t for _, t in rows], add_special_tokens=True
                )
                examples = [(list(s), [start, *t]) for s, t in zip(batch["input_ids"], batch["labels"], strict=True)]
                if split == "train":
                    examples = [(s, t) for s, t in examples if max(len(s), len(t)) <= self.max_length]
                    if not examples:
                        raise ValueError(
                            f"Every training example of {pair!r} is longer than max_length={self.max_length} tokens; "
                            "raise max_length."
                        )
                else:
                    examples = [(self._truncate(s), self._truncate(t)) for s, t in examples]
                encoded[pair][split] = examples
        self._encoded = encoded

    def _decoder_start_id(self) -> int:
        # The decoder start id: the fitted model's, else the tokenizer's convention (M2M-100 </s>, Marian pad).
        start = getattr(self._fitted_model(), "decoder_start_id", None)
        if start is not None:
            return int(start)
        tokenizer = self._require_library_tokenizer()
        own = tokenizer.pad_token_id if type(tokenizer).__name__.startswith("Marian") else tokenizer.eos_token_id
        return int(own)

    def _truncate(self, ids: list[int]) -> list[int]:
        eos = self._require_library_tokenizer().eos_token_id
        return ids if len(ids) <= self.max_length else [*ids[: self.max_length - 1], int(eos)]

    def _pad(self, sequences: list[list[int]]) -> torch.Tensor:
        pad = int(self._require_library_tokenizer().pad_token_id)
        if not sequences:
            return torch.zeros(0, 0, dtype=torch.int64)
        out = torch.full((len(sequences), max(len(s) for s in sequences)), pad, dtype=torch.int64)
        for row, ids in enumerate(sequences):
            out[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        return out

    def _collate(self, batch: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pad([s for s, _ in batch]), self._pad([t for _, t in batch])

    def _eval_loader(self, pair: str, split: str) -> DataLoader:
        return DataLoader(
            _Sequences(self._split(pair, split)),
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self._collate,
            num_workers=self.num_workers,
        )


class PretrainedCausalLMDataModule(L.LightningDataModule):
    """Text for a decoder-only language model (:class:`~zoo.tasks.causal_lm.PretrainedCausalLM`), encoded with the
    model's own tokenizer and batched as Hugging Face's collators batch it::

        input_ids [B, T] int64, right-padded; attention_mask [B, T], 1 at real tokens; labels [B, T], -100 at padding
        packed=True: one row [1, N] of the batch's texts end to end (DataCollatorWithFlattening): input_ids, labels
        (-100 at each text's first token), position_ids restarting at 0 with each text; no attention_mask

    Each text is its tokens, at most ``max_length`` (truncated), and the end-of-sequence token when it fits, so that the
    model learns where a text ends.

    Args:
        source: ``"embedded"`` (the English sentences of the embedded corpus, :func:`~zoo.data.make_synthetic_corpus`:
            offline, for trying things), a text file (one text per line, training only), a local directory (a
            ``DatasetDict.save_to_disk``, or ``train.txt``/``validation.txt``/``test.txt``), or a hub dataset id
            (e.g. ``"wikitext"`` with ``hub_config="wikitext-2-raw-v1"``; ``text_column`` its texts).
        tokenizer: a hub id or ``save_pretrained`` directory; default the fitted model's own (its ``name_or_path``).
        limit: at most this many training texts (the embedded corpus is generated with this many, default 2,000).
    """

    def __init__(
        self,
        source: str = "embedded",
        tokenizer: str | None = None,
        text_column: str = "text",
        hub_config: str | None = None,
        max_length: int = 512,
        batch_size: int = 8,
        packed: bool = False,
        num_workers: int = 0,
        seed: int = 0,
        limit: int | None = None,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max_length={max_length} must be at least 2 tokens (a token and the next one to learn)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.save_hyperparameters()
        self.source, self.tokenizer_source = source, tokenizer
        self.text_column, self.hub_config = text_column, hub_config
        self.max_length, self.batch_size, self.packed = max_length, batch_size, packed
        self.num_workers, self.seed, self.limit = num_workers, seed, limit
        self.library_tokenizer: PreTrainedTokenizerBase | None = None
        self._rows: dict[str, list[list[int]]] = {}

    def setup(self, stage: str | None = None) -> None:
        if self._rows:
            return
        self.library_tokenizer = tokenizer = self._find_tokenizer()
        texts = self._load_text()
        self._rows = {split: [self._encode(tokenizer, text) for text in rows] for split, rows in texts.items()}
        if not self._rows["train"]:
            raise ValueError(f"source={self.source!r} has no training text (no non-empty line or row)")

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader("train", shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._loader("validation") if self._split("validation") else []

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._loader("test") if self._split("test") else []

    def collate(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """A batch of encoded texts, padded (or packed) as the module's docstring says."""
        if self.packed:
            return DataCollatorWithFlattening()([{"input_ids": row} for row in rows])
        tokenizer = self._require_tokenizer()
        batch = DataCollatorWithPadding(tokenizer, return_tensors="pt")([{"input_ids": row} for row in rows])
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return dict(batch)

    # Internals.

    def _find_tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer: PreTrainedTokenizerBase
        if self.tokenizer_source is not None:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_source)
        else:
            model = None if self.trainer is None else self.trainer.lightning_module
            found = getattr(model, "tokenizer", None)
            if not isinstance(found, PreTrainedTokenizerBase):
                raise ValueError(
                    "PretrainedCausalLMDataModule has no tokenizer: pass tokenizer=<hub id or directory>, or fit it "
                    "with a zoo.PretrainedCausalLM whose source has one"
                )
            tokenizer = copy.deepcopy(found)  # the model's own keeps its padding side, for generation
        tokenizer.padding_side = "right"  # for training; generation pads on the left
        if tokenizer.pad_token is None:  # Llama, GPT-2: padding is masked out of attention and loss anyway
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _require_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.library_tokenizer is None:
            raise RuntimeError("The tokenizer is not ready; call setup() first.")
        return self.library_tokenizer

    def _load_text(self) -> dict[str, list[str]]:
        path = Path(self.source)
        if self.source == "embedded":
            corpus = make_synthetic_corpus(seed=self.seed, sizes={"xa": self.limit or 2000})["en-xa"]
            texts = {split: [row["en"] for row in corpus[split]["translation"]] for split in SPLITS}
        elif path.is_file():
            lines = path.read_text("utf-8").splitlines()
            texts = {"train": [line for line in lines if line.strip()], "validation": [], "test": []}
        else:
            texts = load_text_splits(self.source, self.text_column, self.hub_config)
        if self.limit is not None:
            texts["train"] = texts["train"][: self.limit]
        return texts

    def _encode(self, tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        ids = list(tokenizer(text, truncation=True, max_length=self.max_length)["input_ids"])
        eos = tokenizer.eos_token_id
        if eos is not None and len(ids) < self.max_length and (not ids or ids[-1] != eos):
            ids.append(int(eos))
        return ids

    def _split(self, split: str) -> list[list[int]]:
        if not self._rows:
            raise RuntimeError("No data yet; call setup() first.")
        return self._rows[split]

    def _loader(self, split: str, shuffle: bool = False, generator: torch.Generator | None = None) -> DataLoader:
        return DataLoader(
            _Sequences(self._split(split)),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            collate_fn=self.collate,
            num_workers=self.num_workers,
        )
