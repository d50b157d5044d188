"""The shared subword vocabulary of all languages, with the special and target-language tokens at fixed ids.

Ids 0-3 are ``<pad>``, ``<s>``, ``</s>``, ``<unk>``; then one ``<2xx>`` token per language (sorted by code) that tells a
multilingual model which language to produce (Johnson et al., 2017); then the subwords.

The model is byte-pair encoding (Sennrich et al.) from Hugging Face ``tokenizers``. BPE rather than Unigram because its
training is a deterministic greedy merge sequence (every rank of a job trains the same vocabulary from the same text),
takes under a second on the embedded corpus, and meets ``vocab_size`` exactly until every word of the text is one
token (the embedded corpus saturates at about 2,430); Unigram's pruning stopped at 1,484 of 2,000 requested entries
on the same text. Words are marked with
SentencePiece's ``▁`` (Metaspace) and punctuation is split off, so decoding restores the text exactly up to whitespace
normalization (runs of whitespace become one space, leading and trailing whitespace is dropped).
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "SubwordTokenizer",
    "language_token",
]

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def language_token(code: str) -> str:
    """The target-language token of language ``code``, e.g. ``"<2de>"``."""
    return f"<2{code}>"


class SubwordTokenizer:
    """A trained ``tokenizers.Tokenizer`` plus the project's id conventions; serializes to one JSON string."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        for expected, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != expected:
                raise ValueError(
                    f"Special token {token!r} has id {tokenizer.token_to_id(token)}, the project needs {expected}; "
                    "train the tokenizer with SubwordTokenizer.train."
                )
        self._tokenizer = tokenizer
        vocabulary = tokenizer.get_vocab(with_added_tokens=True)
        codes = [token[2:-1] for token in vocabulary if token.startswith("<2") and token.endswith(">")]
        self._languages = tuple(sorted(codes, key=lambda code: vocabulary[language_token(code)]))

    @classmethod
    def train(cls, texts: Iterable[str], languages: Sequence[str] = (), vocab_size: int = 8000) -> SubwordTokenizer:
        """Learn a BPE vocabulary of at most ``vocab_size`` entries (specials included) from ``texts``.

        ``languages`` are the codes that get a ``<2xx>`` token (ids 4, 5, ... in sorted order). The printable ASCII
        characters are always in the alphabet, so unseen Latin text never maps to ``<unk>``. When ``vocab_size`` is
        smaller than the specials plus the alphabet, the vocabulary is the specials plus the alphabet.
        """
        codes = sorted(set(languages))
        for code in codes:
            if not code or any(c in code for c in "<> \t\n"):
                raise ValueError(f"Language code {code!r} must be non-empty without spaces or angle brackets.")
        specials = [*SPECIAL_TOKENS, *(language_token(code) for code in codes)]
        if vocab_size <= len(specials):
            raise ValueError(
                f"vocab_size={vocab_size} leaves no room for subwords after {len(specials)} special tokens; "
                f"use a vocab_size of a few hundred or more."
            )
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
        )
        # Metaspace first, so that "cats." becomes "▁cats" + "." and decoding glues the period back on.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    # Serialization: one JSON string, so that it can live inside a checkpoint next to the weights.

    def to_json(self) -> str:
        """The whole tokenizer (model, normalizer, pre-tokenizer, decoder) as one JSON string."""
        return self._tokenizer.to_str()

    @classmethod
    def from_json(cls, text: str) -> SubwordTokenizer:
        """Rebuild a tokenizer from :meth:`to_json`'s string."""
        return cls(Tokenizer.from_str(text))

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (a ``tokenizer.json`` that ``tokenizers.Tokenizer.from_file`` reads)."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> SubwordTokenizer:
        """Read a tokenizer written by :meth:`save`."""
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"No tokenizer file at {str(file)!r}; write one with SubwordTokenizer.save(path).")
        return cls.from_json(file.read_text(encoding="utf-8"))

    # Vocabulary.

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials and language tokens included (the embedding and softmax size)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def languages(self) -> tuple[str, ...]:
        """Codes of the languages that have a ``<2xx>`` token, in id order."""
        return self._languages

    def language_id(self, code: str) -> int:
        """Id of the ``<2xx>`` token of language ``code``."""
        token_id = self._tokenizer.token_to_id(language_token(code))
        if token_id is None:
            raise ValueError(
                f"Language {code!r} has no {language_token(code)} token; this tokenizer knows {list(self.languages)}. "
                "Retrain it with the language in `languages`."
            )
        return int(token_id)

    # Encoding and decoding.

    def encode(self, text: str) -> list[int]:
        """Subword ids of ``text``, without any special token."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many texts at once (in parallel, in Rust)."""
        return [list(e.ids) for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, skipping padding, ``<s>``, ``</s>``, ``<unk>`` and language tokens."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_batch(self, sequences: Iterable[Iterable[int]]) -> list[str]:
        """:meth:`decode` for many sequences at once."""
        return self._tokenizer.decode_batch([[int(i) for i in ids] for ids in sequences], skip_special_tokens=True)
