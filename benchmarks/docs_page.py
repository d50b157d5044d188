"""The generated part of a benchmark's docs page: the text between two marker comments, rewritten by every run."""

from __future__ import annotations

import pathlib

__all__ = ["replace_block", "write_block"]


def replace_block(text: str, begin: str, end: str, block: str) -> str:
    """``text`` with what lies between the ``begin`` and ``end`` markers replaced by ``block`` (appended if absent)."""
    body = f"{begin}\n{block}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + body + rest.split(end, 1)[1]
    return f"{text.rstrip()}\n\n{body}\n"


def write_block(page: pathlib.Path, begin: str, end: str, block: str) -> None:
    """Rewrite the generated block of ``page``; the hand-written text around it is kept."""
    page.parent.mkdir(parents=True, exist_ok=True)
    text = page.read_text() if page.exists() else ""
    page.write_text(replace_block(text, begin, end, block))
