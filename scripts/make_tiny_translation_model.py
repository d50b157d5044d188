"""Write a small random-initialized M2M-100 model and its tokenizer, trained on the embedded corpus, for offline use.

    python scripts/make_tiny_translation_model.py out/zoo/tiny-m2m100

It stands in for a hub id such as ``facebook/m2m100_418M`` where nothing can be downloaded: the directory is in the
real ``save_pretrained`` format, so ``zoo.load_pretrained(directory)`` and the configs read it as they read a hub model.
The embedded languages xa, xb, xc, xd are mapped onto M2M-100's de, fr, es, it (``language_codes`` in the config).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zoo.data.synthetic_text import make_synthetic_corpus
from zoo.hf.tiny import save_tiny_translation_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1000)
    args = parser.parse_args()
    texts: list[str] = []
    for pair, splits in make_synthetic_corpus(seed=0).items():
        source, target = pair.split("-")
        for row in splits["train"]["translation"]:
            texts += [row[source], row[target]]
    save_tiny_translation_model(
        args.directory,
        texts,
        "m2m_100",
        d_model=args.d_model,
        layers=args.layers,
        heads=4,
        ff_dim=4 * args.d_model,
        vocab_size=args.vocab_size,
    )
    print(f"wrote {args.directory}")


if __name__ == "__main__":
    main()
