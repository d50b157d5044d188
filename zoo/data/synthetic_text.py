"""The embedded multilingual corpus: English-like sentences and their translations into synthetic languages.

Every sentence is one clause drawn from a small grammar (subject, verb, object; adjectives, counts, definiteness and
three tenses) and rendered by each language's own rules. The languages differ where real ones differ (word order,
adjective position, affixes versus particles, plural and case marking, verb agreement) and each has its own lexicon
of pseudo-words, so a model has to learn reordering and morphology rather than word-for-word substitution. Pairs have
very different sizes, and the two low-resource languages share grammar with the richer ones ("xc" is built like "xa",
"xd" orders its clause like English), which is what multilingual training exploits.

Generation is pure Python, deterministic for a seed, and takes about a second for the default sizes.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset, DatasetDict, Features, Translation, load_from_disk

__all__ = [
    "DEFAULT_SIZES",
    "LANGUAGES",
    "Affix",
    "Clause",
    "Grammar",
    "NounPhrase",
    "lexicon",
    "load_corpus",
    "make_synthetic_corpus",
    "render",
    "render_english",
    "sample_clause",
    "save_corpus",
]

# Training pairs per language: one high-resource, one medium and two low-resource pairs, as in multilingual NMT.
DEFAULT_SIZES: dict[str, int] = {"xa": 20_000, "xb": 4_000, "xc": 500, "xd": 300}

# (singular, plural); subjects are drawn from the animate nouns only, objects from all.
_ANIMATE = {
    "dog": "dogs", "cat": "cats", "bird": "birds", "horse": "horses", "wolf": "wolves", "fox": "foxes",
    "farmer": "farmers", "teacher": "teachers", "child": "children", "woman": "women", "man": "men",
    "king": "kings", "queen": "queens", "baker": "bakers", "doctor": "doctors", "student": "students",
    "friend": "friends", "sailor": "sailors", "soldier": "soldiers", "neighbour": "neighbours",
}  # fmt: skip
_INANIMATE = {
    "apple": "apples", "book": "books", "letter": "letters", "house": "houses", "boat": "boats", "river": "rivers",
    "tree": "trees", "stone": "stones", "song": "songs", "story": "stories", "door": "doors", "window": "windows",
    "cake": "cakes", "car": "cars", "ball": "balls", "key": "keys", "flower": "flowers", "box": "boxes",
    "bottle": "bottles", "garden": "gardens",
}  # fmt: skip
_NOUNS = {**_ANIMATE, **_INANIMATE}
_ADJECTIVES = (
    "big", "small", "old", "young", "red", "green", "happy", "sad", "tall", "quiet",
    "loud", "clever", "brave", "lazy", "strange", "beautiful", "dark", "bright", "heavy", "new",
)  # fmt: skip
# (base, third person singular, past)
_VERBS = {
    "see": ("sees", "saw"), "find": ("finds", "found"), "like": ("likes", "liked"), "help": ("helps", "helped"),
    "watch": ("watches", "watched"), "follow": ("follows", "followed"), "carry": ("carries", "carried"),
    "paint": ("paints", "painted"), "push": ("pushes", "pushed"), "pull": ("pulls", "pulled"),
    "open": ("opens", "opened"), "clean": ("cleans", "cleaned"), "want": ("wants", "wanted"),
    "buy": ("buys", "bought"), "sell": ("sells", "sold"), "draw": ("draws", "drew"), "build": ("builds", "built"),
    "visit": ("visits", "visited"), "chase": ("chases", "chased"), "hold": ("holds", "held"),
    "throw": ("throws", "threw"), "catch": ("catches", "caught"), "take": ("takes", "took"),
}  # fmt: skip
_NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
TENSES = ("past", "present", "future")


@dataclass(frozen=True)
class NounPhrase:
    """A noun with an optional adjective; ``count`` > 1 is plural, and a plural indefinite phrase is counted."""

    noun: str
    adjective: str | None = None
    count: int = 1
    definite: bool = True

    @property
    def plural(self) -> bool:
        return self.count > 1

    @property
    def counted(self) -> bool:
        """Whether the phrase carries a number word ("three dogs") rather than an article."""
        return self.plural and not self.definite


@dataclass(frozen=True)
class Clause:
    """The meaning of one sentence: who does what to whom, and when."""

    subject: NounPhrase
    verb: str
    tense: str
    object: NounPhrase


@dataclass(frozen=True)
class Affix:
    """A marker glued to its word (``"prefix"``, ``"suffix"``) or a particle (``"before"``, ``"after"``)."""

    text: str
    position: str = "suffix"

    def __post_init__(self) -> None:
        assert self.position in ("prefix", "suffix", "before", "after"), self.position

    @property
    def attached(self) -> bool:
        return self.position in ("prefix", "suffix")


@dataclass(frozen=True)
class Grammar:
    """How one synthetic language renders a clause, and how its pseudo-words sound."""

    name: str
    order: str  # "SVO", "SOV" or "VSO"
    adjective_after_noun: bool
    plural: Affix
    plural_after_number: bool  # whether a counted noun ("three dog-s") is still marked plural
    tense: Mapping[str, Affix | None]
    definite: Affix | None = None  # None: definiteness is not expressed
    subject_case: Affix | None = None
    object_case: Affix | None = None
    verb_plural: Affix | None = None  # verb agreement with a plural subject
    adjective_agreement: bool = False  # adjectives take the noun's plural affix too
    consonants: str = "ptkmnsl"
    vowels: str = "aeiou"
    syllables: tuple[int, int] = (2, 3)
    codas: str = ""  # consonants that may close a syllable
    particles: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        assert self.order in ("SVO", "SOV", "VSO"), self.order
        affixes = [self.plural, self.definite, self.subject_case, self.object_case, self.verb_plural]
        affixes += list(self.tense.values())
        words = tuple(a.text for a in affixes if a is not None and not a.attached)
        object.__setattr__(self, "particles", words)


LANGUAGES: dict[str, Grammar] = {
    # Agglutinative SOV, everything a suffix, plural not marked after a number (Turkish-like).
    "xa": Grammar(
        name="Kalemi",
        order="SOV",
        adjective_after_noun=False,
        plural=Affix("ler"),
        plural_after_number=False,
        tense={"past": Affix("di"), "present": Affix("ir"), "future": Affix("ecek")},
        object_case=Affix("i"),
        verb_plural=Affix("lar"),
        consonants="kmtlsrndgb",
        vowels="aeiou",
        codas="nrl",
    ),
    # Analytic VSO, adjectives after the noun, particles for plural, article, case and tense (Polynesian-like).
    "xb": Grammar(
        name="Hawero",
        order="VSO",
        adjective_after_noun=True,
        plural=Affix("nga", "before"),
        plural_after_number=True,
        tense={"past": Affix("ua", "before"), "present": Affix("te", "before"), "future": Affix("ka", "before")},
        definite=Affix("le", "before"),
        object_case=Affix("i", "before"),
        consonants="pbtdfvlrwh",
        vowels="aeiou",
        syllables=(1, 3),
    ),
    # Same structure as "xa" (SOV, suffixes in the same slots), its own affixes and lexicon: learns from "xa".
    "xc": Grammar(
        name="Zunavi",
        order="SOV",
        adjective_after_noun=False,
        plural=Affix("nu"),
        plural_after_number=False,
        tense={"past": Affix("ta"), "present": Affix("ru"), "future": Affix("mos")},
        object_case=Affix("o"),
        verb_plural=Affix("ni"),
        consonants="zkvnlmrsh",
        vowels="aoiu",
        codas="sz",
    ),
    # SVO like the source, adjectives after the noun agreeing in number, prefixes for article and tense.
    "xd": Grammar(
        name="Pelosi",
        order="SVO",
        adjective_after_noun=True,
        plural=Affix("en"),
        plural_after_number=True,
        tense={"past": Affix("pa", "prefix"), "present": None, "future": Affix("vo", "prefix")},
        definite=Affix("il", "prefix"),
        verb_plural=Affix("n"),
        adjective_agreement=True,
        consonants="ptkmnsdrv",
        vowels="aeio",
        syllables=(2, 2),
        codas="s",
    ),
}


def lexicon(code: str) -> dict[str, str]:
    """Map every English lemma (nouns, adjectives, verbs, numbers) to the pseudo-word of language ``code``.

    The lexicon depends on the language only (seeded by its code), not on the corpus seed: a language stays the same
    language whatever sentences are sampled from it.
    """
    return dict(_lexicon(code))


@functools.cache
def _lexicon(code: str) -> dict[str, str]:
    grammar = _grammar(code)
    rng = random.Random(f"zoo-lexicon-{code}")
    taken = set(grammar.particles)
    words: dict[str, str] = {}
    for lemma in [*_NOUNS, *_ADJECTIVES, *_VERBS, *_NUMBERS.values()]:
        word = _pseudo_word(rng, grammar)
        while word in taken:
            word = _pseudo_word(rng, grammar)
        taken.add(word)
        words[lemma] = word
    return words


def _pseudo_word(rng: random.Random, grammar: Grammar) -> str:
    syllables = []
    for _ in range(rng.randint(*grammar.syllables)):
        syllable = rng.choice(grammar.consonants) + rng.choice(grammar.vowels)
        if grammar.codas and rng.random() < 0.3:
            syllable += rng.choice(grammar.codas)
        syllables.append(syllable)
    return "".join(syllables)


def _grammar(code: str) -> Grammar:
    if code not in LANGUAGES:
        raise ValueError(f"Unknown synthetic language {code!r}; the embedded corpus has {sorted(LANGUAGES)}.")
    return LANGUAGES[code]


def sample_clause(rng: random.Random) -> Clause:
    """Draw one clause from the grammar (uniform choices; about 40% of noun phrases carry an adjective)."""
    return Clause(
        subject=_sample_noun_phrase(rng, list(_ANIMATE)),
        verb=rng.choice(list(_VERBS)),
        tense=rng.choice(TENSES),
        object=_sample_noun_phrase(rng, list(_NOUNS)),
    )


def _sample_noun_phrase(rng: random.Random, nouns: list[str]) -> NounPhrase:
    adjective = rng.choice(_ADJECTIVES) if rng.random() < 0.4 else None
    kind = rng.random()
    if kind < 0.4:
        return NounPhrase(rng.choice(nouns), adjective, count=1, definite=True)
    if kind < 0.6:
        return NounPhrase(rng.choice(nouns), adjective, count=1, definite=False)
    if kind < 0.8:
        return NounPhrase(rng.choice(nouns), adjective, count=2, definite=True)
    return NounPhrase(rng.choice(nouns), adjective, count=rng.randint(2, 9), definite=False)


def render_english(clause: Clause) -> str:
    """The English sentence of a clause, e.g. ``"The big dog saw three small cats."``."""
    subject = _english_noun_phrase(clause.subject)
    third, past = _VERBS[clause.verb]
    if clause.tense == "past":
        verb = past
    elif clause.tense == "future":
        verb = f"will {clause.verb}"
    else:
        verb = clause.verb if clause.subject.plural else third
    return _sentence([subject, verb, _english_noun_phrase(clause.object)])


def _english_noun_phrase(phrase: NounPhrase) -> str:
    noun = _NOUNS[phrase.noun] if phrase.plural else phrase.noun
    words = [phrase.adjective, noun] if phrase.adjective else [noun]
    if phrase.counted:
        return " ".join([_NUMBERS[phrase.count], *words])
    if phrase.definite:
        return " ".join(["the", *words])
    return " ".join(["an" if words[0][0] in "aeiou" else "a", *words])


def render(clause: Clause, code: str) -> str:
    """The sentence of a clause in synthetic language ``code``, following that language's :class:`Grammar`."""
    grammar = _grammar(code)
    words = _lexicon(code)
    tense = grammar.tense[clause.tense]
    agreement = grammar.verb_plural if clause.subject.plural else None
    verb = _surround(_surround([_glue(_glue(words[clause.verb], tense), agreement)], tense), agreement)
    parts = {
        "S": _noun_phrase(clause.subject, grammar.subject_case, grammar, words),
        "V": verb,
        "O": _noun_phrase(clause.object, grammar.object_case, grammar, words),
    }
    return _sentence([" ".join(parts[role]) for role in grammar.order])


def _noun_phrase(phrase: NounPhrase, case: Affix | None, grammar: Grammar, words: dict[str, str]) -> list[str]:
    plural = grammar.plural if phrase.plural and (grammar.plural_after_number or not phrase.counted) else None
    definite = grammar.definite if phrase.definite else None
    tokens = _surround([_glue(_glue(words[phrase.noun], plural), definite)], plural)
    if phrase.adjective:
        agreement = plural if grammar.adjective_agreement else None
        adjective = _surround([_glue(words[phrase.adjective], agreement)], agreement)
        tokens = tokens + adjective if grammar.adjective_after_noun else adjective + tokens
    if phrase.counted:
        tokens = [words[_NUMBERS[phrase.count]], *tokens]
    tokens = _surround(tokens, definite)
    # Case belongs to the whole phrase: a case suffix goes on its last word (Turkish), a prefix on its first.
    if case is not None and case.position == "suffix":
        tokens[-1] = _glue(tokens[-1], case)
    elif case is not None and case.position == "prefix":
        tokens[0] = _glue(tokens[0], case)
    return _surround(tokens, case)


def _glue(word: str, affix: Affix | None) -> str:
    """``word`` with ``affix`` glued on when it is a prefix or suffix; unchanged for particles and ``None``."""
    if affix is None or not affix.attached:
        return word
    return word + affix.text if affix.position == "suffix" else affix.text + word


def _surround(tokens: list[str], affix: Affix | None) -> list[str]:
    """``tokens`` with ``affix`` as a separate particle before or after them; unchanged for glued affixes."""
    if affix is None or affix.attached:
        return tokens
    return [affix.text, *tokens] if affix.position == "before" else [*tokens, affix.text]


def _sentence(parts: list[str]) -> str:
    text = " ".join(parts)
    return text[0].upper() + text[1:] + "."


def make_synthetic_corpus(
    seed: int = 0, sizes: Mapping[str, int] | None = None, eval_size: int = 200
) -> dict[str, DatasetDict]:
    """Generate the embedded corpus: one ``DatasetDict`` (train/validation/test) per pair ``"en-xx"``.

    Rows follow the Hugging Face translation schema, ``{"translation": {"en": ..., "xx": ...}}``. ``sizes`` maps a
    language code to its number of training pairs (default :data:`DEFAULT_SIZES`); validation and test hold
    ``eval_size`` pairs each. English sentences are unique within a pair, so no evaluation sentence is in training.
    """
    sizes = dict(DEFAULT_SIZES if sizes is None else sizes)
    for code, size in sizes.items():
        _grammar(code)
        if size < 1:
            raise ValueError(f"sizes[{code!r}] = {size}: every language needs at least one training pair.")
    if eval_size < 1:
        raise ValueError(f"eval_size = {eval_size}: validation and test need at least one pair each.")
    return {f"en-{code}": _pair_corpus(seed, code, size, eval_size) for code, size in sizes.items()}


def _pair_corpus(seed: int, code: str, train_size: int, eval_size: int) -> DatasetDict:
    rng = random.Random(f"zoo-corpus-{seed}-{code}")
    english: dict[str, str] = {}
    wanted = train_size + 2 * eval_size
    for _ in range(20 * wanted):
        clause = sample_clause(rng)
        english.setdefault(render_english(clause), render(clause, code))
        if len(english) == wanted:
            break
    assert len(english) == wanted, "the grammar ran out of distinct sentences"
    rows = [{"en": source, code: target} for source, target in english.items()]
    bounds = {"train": (0, train_size), "validation": (train_size, train_size + eval_size)}
    bounds["test"] = (train_size + eval_size, wanted)
    features = Features({"translation": Translation(languages=["en", code])})
    return DatasetDict(
        {split: Dataset.from_dict({"translation": rows[a:b]}, features=features) for split, (a, b) in bounds.items()}
    )


def save_corpus(corpus: Mapping[str, DatasetDict], directory: str | Path) -> None:
    """Write each pair with ``save_to_disk`` under ``directory/<pair>``, the layout :func:`load_corpus` and
    ``TranslationDataModule(source=directory)`` read offline."""
    for pair, splits in corpus.items():
        splits.save_to_disk(str(Path(directory) / pair))


def load_corpus(directory: str | Path) -> dict[str, DatasetDict]:
    """Read a corpus written by :func:`save_corpus` (every sub-directory holding a saved ``DatasetDict``)."""
    root = Path(directory)
    pairs = sorted(p.name for p in root.iterdir() if (p / "dataset_dict.json").is_file())
    if not pairs:
        raise ValueError(f"{str(root)!r} holds no saved DatasetDict; write one with save_corpus(corpus, directory).")
    return {pair: _as_dataset_dict(load_from_disk(str(root / pair))) for pair in pairs}


def _as_dataset_dict(loaded: object) -> DatasetDict:
    assert isinstance(loaded, DatasetDict), type(loaded)
    return loaded
