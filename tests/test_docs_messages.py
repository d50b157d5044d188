"""The error and warning messages the docs quote are the code's.

Each message quoted in the troubleshooting pages (``ErrorClass: text``, in a table's code span or a ``text`` block)
must match a message the package raises or warns, read from its source: the quote's placeholders (``{name}``) and
ellipses, and the code's formatted values, stand for any text. A message that lists the valid choices of a setting
(the schedules, the re-materialization modes, ...) is built from a tuple the placeholder-matching cannot see, so those
are rendered by the code and compared whole. Messages of other libraries that the pages quote are listed in
:data:`QUOTED_FROM_OTHERS`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "docs" / "troubleshooting.md", REPO / "docs" / "guide" / "strategy.md"]
SOURCES = [REPO / "lightning_gpipe", REPO / "zoo"]
KIND = r"[A-Z]\w*(?:Error|Warning|Exception)"
QUOTED_FROM_OTHERS = {  # the start of each message, and whose it is
    "MisconfigurationException: `Trainer(strategy='gpipe')` is not compatible": "Lightning's launcher",
    "ValueError: You selected an invalid strategy name": "Lightning's strategy registry",
    "RuntimeError: Tensor on device meta is not on the expected device": "torch",
    "NotImplementedError: Cannot copy out of meta tensor": "torch",
    "ValueError: Expected more than 1 value per channel when training": "torch's BatchNorm",
    "DistNetworkError: ... EADDRINUSE": "torch.distributed's store",
    "RuntimeError: operator torchvision::nms does not exist": "torchvision",
    "ModuleNotFoundError: No module named": "Python",
}
WILD = None  # a pattern item that stands for any text: a placeholder, an ellipsis, a formatted value
Pattern = tuple[str | None, ...]


def quoted_messages(page: Path) -> Iterator[tuple[str, str]]:
    """Each ``(kind, text)`` the page quotes: code spans ``Kind: text``, and the lines of ``text`` blocks that start
    with ``Kind:`` (a message continues on the following lines of its block)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    in_block, current = False, None
    for line in lines:
        if line.startswith("```"):
            if current is not None:
                yield current
            in_block, current = line == "```text", None
            continue
        if in_block:
            start = re.match(rf"({KIND}): (.*)", line)
            if start:
                if current is not None:
                    yield current
                current = (start[1], start[2])
            elif current is not None:
                current = (current[0], f"{current[1]} {line}")
            continue
        for span in re.finditer(rf"`({KIND}): ([^`]+)`", line):
            yield span[1], span[2]


def _normalized(parts: list[str | None]) -> Pattern:
    """Characters with runs of whitespace as one space (the pages wrap lines) and no backticks (a code span cannot
    hold one), and runs of wildcards as one."""
    text: list[str | None] = []
    for part in parts:
        if part is WILD:
            if not text or text[-1] is not WILD:
                text.append(WILD)
            continue
        for char in re.sub(r"\s+", " ", part.replace("`", "")):
            if not (char == " " and text and text[-1] == " "):
                text.append(char)
    return tuple(text)


def doc_pattern(text: str) -> Pattern:
    text = re.sub(r"^\[pipeline stage [^\]]*\] ", "", text)  # PipelineError's own prefix, not its message
    pieces = re.split(r"(\{[^{}]*\}|…|\.\.\.)", text.strip())
    return _normalized([WILD if index % 2 else piece for index, piece in enumerate(pieces)])


def _string_parts(node: ast.expr) -> list[str | None] | None:
    """A string expression's text with its formatted values as wildcards (``+`` joins and ``%`` values too)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts: list[str | None] = []
        for value in node.values:
            parts.extend(_string_parts(value) or [WILD] if isinstance(value, ast.Constant) else [WILD])
        return parts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_parts(node.left), _string_parts(node.right)
        if left is not None or right is not None:
            return [*(left or [WILD]), *(right or [WILD])]
    return None


def source_messages() -> list[tuple[str | None, Pattern]]:
    """Every string of the package's source, with the kind of the exception or warning it is given to, if any."""
    found: list[tuple[str | None, Pattern]] = []
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            given: dict[int, str] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    kind = "UserWarning" if name in ("warn", "rank_zero_warn") else name
                    if re.fullmatch(KIND, kind):
                        given.update({id(argument): kind for argument in node.args})
            for node in ast.walk(tree):
                if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                    parts = _string_parts(node)
                    if parts is not None and sum(len(part) for part in parts if part) >= 12:
                        found.append((given.get(id(node)), _normalized(parts)))
    return found


def compatible(quoted: Pattern, code: Pattern) -> bool:
    """Whether some text matches both patterns: each wildcard stands for any text, the empty one included, but a
    formatted value of the code never for a sentence break of the quote (so it cannot swallow a misquoted sentence)."""
    n, m = len(quoted), len(code)
    text = "".join(char if char is not WILD else "\x00" for char in quoted)
    breaks = [bool(re.match(r"\. [A-Z]", text[i : i + 3])) for i in range(n)]
    # match[i][j]: quoted[i:] and code[j:] have a common instance; filled from the ends.
    match = [[False] * (m + 1) for _ in range(n + 1)]
    match[n][m] = True
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n and j == m:
                continue
            if i < n and quoted[i] is WILD:
                match[i][j] = match[i + 1][j] or (j < m and match[i][j + 1])
            elif j < m and code[j] is WILD:
                match[i][j] = match[i][j + 1] or (i < n and not breaks[i] and match[i + 1][j])
            else:
                match[i][j] = i < n and j < m and quoted[i] == code[j] and match[i + 1][j + 1]
    return match[0][0]


def _anchors(pattern: Pattern) -> set[tuple[str, ...]]:
    """The runs of three words of a pattern's literal text: a quote shares one with the message it quotes."""
    runs = "".join(char if char is not WILD else "\x00" for char in pattern).split("\x00")
    words = [run.split() for run in runs]
    return {tuple(ws[k : k + 3]) for ws in words for k in range(len(ws) - 2)}


@pytest.fixture(scope="module")
def sources() -> list[tuple[str | None, Pattern, set[tuple[str, ...]]]]:
    return [(kind, pattern, _anchors(pattern)) for kind, pattern in source_messages()]


QUOTES = [(page, kind, text) for page in PAGES for kind, text in quoted_messages(page)]


def test_the_pages_quote_messages() -> None:
    assert len(QUOTES) > 60  # the extraction found the tables and the blocks


@pytest.mark.parametrize(
    ("page", "kind", "text"), QUOTES, ids=[f"{page.stem}:{text[:40]}" for page, kind, text in QUOTES]
)
def test_a_quoted_message_is_one_the_code_raises(
    page: Path, kind: str, text: str, sources: list[tuple[str | None, Pattern, set[tuple[str, ...]]]]
) -> None:
    if any(f"{kind}: {text}".startswith(start) for start in QUOTED_FROM_OTHERS):
        return
    quoted = doc_pattern(text)
    anchors = _anchors(quoted)
    assert anchors, f"quote at least three words of the message in a row: {kind}: {text}"
    candidates = [source for source in sources if source[2] & anchors]
    matched = [source_kind for source_kind, pattern, _ in candidates if compatible(quoted, pattern)]
    assert matched, f"{page.relative_to(REPO)} quotes a message no code raises: {kind}: {text}"
    assert kind in matched or None in matched, f"the code raises it as {matched[0]}, not {kind}: {text}"


def _choices() -> list[tuple[str, Callable[[str], object]]]:
    from lightning_gpipe.engine.rematerialization import validate_mode
    from lightning_gpipe.engine.schedule import validate_schedule

    return [("{s}", validate_schedule), ("{m}", validate_mode)]  # the bad value as the pages write it, its check


@pytest.mark.parametrize(("placeholder", "check"), _choices())
def test_a_quoted_list_of_choices_is_the_code_s(placeholder: str, check: Callable[[str], object]) -> None:
    # Regression: the strategy guide quoted the unknown-schedule error with three schedules after there were five,
    # and the re-materialization modes without "selective"; the lists are built from tuples, which the placeholder
    # matching above cannot read.
    with pytest.raises(ValueError, match="(?i)use one of") as refused:
        check(placeholder)
    rendered = re.sub(r"\s+", " ", f"ValueError: {refused.value}".replace(repr(placeholder), placeholder))
    start = rendered[: rendered.index(placeholder) + len(placeholder)]
    quotes = [f"{kind}: {text}" for _, kind, text in QUOTES if f"{kind}: {text}".startswith(start)]
    assert quotes, f"the pages quote no message starting {start!r}"
    for quote in quotes:
        before_ellipsis = re.split(r"…|\.\.\.", re.sub(r"\s+", " ", quote))[0].rstrip()
        assert rendered.startswith(before_ellipsis), f"the pages quote {quote!r}; the code says {rendered!r}"
