"""The documentation's code examples run, page by page, as ``helpers.doc_examples`` describes.

``make docs`` runs this file after building the site; ``make test`` runs it again with the rest of the suite.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from types import TracebackType

import pytest
from helpers.doc_examples import EXAMPLE_MODULE_NAME, ExampleError, find_examples, read_examples, run_examples
from helpers.runif import RunIf

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
PAGES_WITH_EXAMPLES = [page for page in PAGES if any(e.skip is None for e in read_examples(page))]
PAGE_TIMEOUT = 120  # seconds; the slowest page (the concepts' small pipelines) takes about 10 s on a loaded 2-core CPU


def _page(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent(text), encoding="utf-8")
    return page


# ---------------------------------------------------------------------------------------------------- the runner


def _frames(traceback: TracebackType | None) -> list[TracebackType]:
    frames = []
    while traceback is not None:
        frames.append(traceback)
        traceback = traceback.tb_next
    return frames


def test_only_python_fences_are_examples_and_they_keep_their_page_lines(tmp_path: pathlib.Path) -> None:
    page = _page(
        tmp_path,
        """\
        # Title

        ```bash
        make test
        ```

        ```python
        x = 1
        ```

        !!! note
            ```python
            y = x + 1
            ```
        """,
    )
    examples = read_examples(page)
    assert [(e.line, e.code) for e in examples] == [(8, "x = 1\n"), (13, "y = x + 1\n")]


def test_blocks_of_a_page_share_one_namespace_and_a_scratch_directory(tmp_path: pathlib.Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    page = _page(
        tmp_path,
        """\
        ```python
        import pathlib
        x = 20
        ```

        ```python
        pathlib.Path("out.txt").write_text(str(x + 22))
        ```
        """,
    )
    namespace = run_examples(read_examples(page), scratch)
    assert namespace["x"] == 20
    assert (scratch / "out.txt").read_text() == "42"


def test_a_failing_example_fails_with_the_page_line_in_its_traceback(tmp_path: pathlib.Path) -> None:
    page = _page(
        tmp_path,
        """\
        ```python
        ok = 1
        raise RuntimeError("broken example")
        ```
        """,
    )
    with pytest.raises(RuntimeError, match="broken example") as info:
        run_examples(read_examples(page), tmp_path)
    frames = [(tb.tb_frame.f_code.co_filename, tb.tb_lineno) for tb in _frames(info.value.__traceback__)]
    assert (str(page), 3) in frames


def test_skip_comments_skip_the_next_block_and_need_a_reason(tmp_path: pathlib.Path) -> None:
    page = _page(
        tmp_path,
        """\
        <!-- skip-example: starts two processes -->

        ```python
        raise RuntimeError("must not run")
        ```

        ```python
        ran = True
        ```
        """,
    )
    examples = read_examples(page)
    assert [e.skip for e in examples] == ["starts two processes", None]
    assert run_examples(examples, tmp_path)["ran"] is True

    without_reason = "<!-- skip-example: -->\n```python\npass\n```\n"
    with pytest.raises(ValueError, match=r"page.md:1: a skip-example comment needs a reason"):
        find_examples(without_reason, tmp_path / "page.md")


def test_a_doctest_block_checks_its_printed_results(tmp_path: pathlib.Path) -> None:
    good = _page(tmp_path, "```python\n>>> 6 * 7\n42\n>>> answer = 42\n```\n")
    assert run_examples(read_examples(good), tmp_path)["answer"] == 42

    bad = _page(tmp_path, "```python\n>>> 6 * 7\n41\n```\n")
    with pytest.raises(ExampleError, match=r"page.md:2: the doctest's output differs"):
        run_examples(read_examples(bad), tmp_path)


def test_a_script_block_defines_its_main_guard_without_running_it(tmp_path: pathlib.Path) -> None:
    page = _page(
        tmp_path,
        """\
        ```python
        def main():
            return "launched"

        if __name__ == "__main__":
            raise RuntimeError("would launch processes")
        ```
        """,
    )
    namespace = run_examples(read_examples(page), tmp_path)
    assert namespace["__name__"] == EXAMPLE_MODULE_NAME
    assert namespace["main"]() == "launched"


def test_a_snippet_block_runs_the_file_it_includes(tmp_path: pathlib.Path) -> None:
    page = _page(tmp_path, '```python\n--8<-- "examples/gpt_sequence.py"\n```\n')
    (example,) = read_examples(page)
    assert example.page == DOCS.parent / "examples" / "gpt_sequence.py"
    assert example.line == 1
    assert "def gpt(" in example.code


def test_an_unclosed_fence_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"page.md:1: the fence ```python is never closed"):
        find_examples("```python\nx = 1\n", tmp_path / "page.md")


# ---------------------------------------------------------------------------------------------------- the pages


def test_every_page_parses_and_every_skip_says_why() -> None:
    skipped = [(e.where, e.skip) for page in PAGES for e in read_examples(page) if e.skip is not None]
    assert all(reason for _, reason in skipped)
    assert len(PAGES_WITH_EXAMPLES) >= 8, [str(p.relative_to(DOCS)) for p in PAGES_WITH_EXAMPLES]


@pytest.mark.timeout(PAGE_TIMEOUT)
@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=[str(p.relative_to(DOCS)) for p in PAGES_WITH_EXAMPLES])
def test_the_examples_of_a_page_run(page: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run_examples(read_examples(page), tmp_path)


@pytest.mark.slow
@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_the_getting_started_script_trains_as_two_processes(tmp_path: pathlib.Path) -> None:
    # The page's runner defines the script's main block without running it; here it runs as the reader runs it.
    page = DOCS / "getting_started.md"
    (script,) = [e for e in read_examples(page) if e.page == page and 'if __name__ == "__main__":' in e.code]
    (tmp_path / "train.py").write_text(script.code, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(DOCS.parent)}
    for inherited in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(inherited, None)  # a launched rank's variables would make the script wait for ranks it never starts
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final loss" in done.stdout
