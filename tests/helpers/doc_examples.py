"""The code examples of the documentation: found in its Markdown pages and run, page by page, in one namespace.

The convention the pages follow:

- every fenced block whose language is ``python`` (or ``py``) is an example and runs; other fences (``bash``,
  ``text``, ``yaml``) do not;
- the blocks of one page run in order in one shared namespace, from a scratch working directory, so a later block
  may use what an earlier one defined and files an example writes land nowhere in the repository;
- a block that starts with ``>>>`` is a doctest: its printed results are checked too;
- a block whose only line is ``--8<-- "examples/x.py"`` (pymdownx.snippets) shows that file of the repository, and
  runs it as an example of the page: errors then point into the file;
- a block runs as a module, not as a script: code under ``if __name__ == "__main__":`` is defined but not run, since
  it is what would launch processes;
- an HTML comment ``<!-- skip-example: reason -->`` on the line before the opening fence (blank lines allowed) skips
  the block; the reason says what it needs (several processes, a GPU, the network, a file a run writes) and must
  not be empty.

Errors point into the Markdown file: each block is compiled with the page as its file name and its own line
numbers, so a traceback shows the page's line.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Example", "ExampleError", "find_examples", "read_examples", "run_examples"]

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_SKIP = re.compile(r"^\s*<!--\s*skip-example:(?P<reason>.*?)-->\s*$")
_PYTHON = {"python", "py", "python3"}
_SNIPPET = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')
_ROOT = pathlib.Path(__file__).resolve().parents[2]  # where mkdocs runs, the snippets' base path
# The name examples run under: anything but "__main__", so that a script's launch block is defined but not run.
EXAMPLE_MODULE_NAME = "__doc_example__"


class ExampleError(AssertionError):
    """A doctest example whose printed result differs from the page, with doctest's report."""


@dataclass(frozen=True)
class Example:
    """One fenced Python block of a page.

    ``line`` is the 1-based line of the block's first code line in ``page``; ``skip`` is the reason given in a
    ``skip-example`` comment, or ``None`` when the block runs.
    """

    page: pathlib.Path
    line: int
    code: str
    skip: str | None = None

    @property
    def is_doctest(self) -> bool:
        """True for a block written as an interactive session (``>>>`` prompts)."""
        return self.code.lstrip().startswith(">>>")

    @property
    def where(self) -> str:
        """``page:line``, as an editor or a traceback names it."""
        return f"{self.page}:{self.line}"


def find_examples(text: str, page: pathlib.Path) -> list[Example]:
    """Return the Python blocks of one Markdown text, in page order, each with its skip reason if it has one."""
    lines = text.splitlines()
    examples: list[Example] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, ticks, lang = opening["indent"], opening["ticks"], opening["lang"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: the fence {ticks}{lang} is never closed; close it with {ticks}")
        if lang in _PYTHON:
            # Blocks inside admonitions and list items are indented: strip the fence's own indentation.
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
            included = _SNIPPET.match(body[0]) if len(body) == 1 else None
            if included is not None:
                source = _ROOT / included["path"]
                examples.append(Example(source, 1, source.read_text(encoding="utf-8"), _skip_reason(lines, i, page)))
            else:
                examples.append(Example(page, i + 2, "\n".join(body) + "\n", _skip_reason(lines, i, page)))
        i = end + 1
    return examples


def _skip_reason(lines: list[str], fence: int, page: pathlib.Path) -> str | None:
    previous = fence - 1
    while previous >= 0 and not lines[previous].strip():
        previous -= 1
    marker = _SKIP.match(lines[previous]) if previous >= 0 else None
    if marker is None:
        return None
    reason = marker["reason"].strip()
    if not reason:
        raise ValueError(
            f"{page}:{previous + 1}: a skip-example comment needs a reason, e.g. "
            "<!-- skip-example: starts two processes with torchrun -->"
        )
    return reason


def read_examples(page: pathlib.Path) -> list[Example]:
    """Return the Python blocks of a Markdown file."""
    return find_examples(page.read_text(encoding="utf-8"), page)


def run_examples(examples: list[Example], directory: pathlib.Path) -> dict[str, Any]:
    """Run the examples that are not skipped, in order, in one namespace, from ``directory``; return the namespace.

    An example that raises lets its exception through (its traceback names the page and line); a doctest whose
    output differs raises :class:`ExampleError` with doctest's report.
    """
    namespace: dict[str, Any] = {"__name__": EXAMPLE_MODULE_NAME}
    with _working_directory(directory):
        for example in examples:
            if example.skip is not None:
                continue
            if example.is_doctest:
                _run_doctest(example, namespace)
            else:
                # Padding with blank lines makes the compiled line numbers the page's line numbers.
                source = "\n" * (example.line - 1) + example.code
                exec(compile(source, str(example.page), "exec"), namespace)
    return namespace


def _run_doctest(example: Example, namespace: dict[str, Any]) -> None:
    test = doctest.DocTestParser().get_doctest(
        example.code, namespace, name=example.where, filename=str(example.page), lineno=example.line - 1
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    runner.run(test, out=report.write, clear_globs=False)
    namespace.update(test.globs)  # doctest ran in a copy; the page's later blocks see what it defined
    if runner.failures:
        raise ExampleError(f"{example.where}: the doctest's output differs from the page\n{report.getvalue()}")


@contextlib.contextmanager
def _working_directory(directory: pathlib.Path) -> Iterator[None]:
    previous = pathlib.Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)
