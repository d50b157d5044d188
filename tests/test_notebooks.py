"""Every tutorial in ``notebooks/`` runs top to bottom, offline, and is committed without outputs.

Each notebook runs in a fresh Jupyter kernel from this environment with its own folder as the working directory; a
cell that raises fails the test with the cell's traceback. The time limit per notebook is the tutorials' promise to
readers (under three minutes on an idle 2-core CPU) with a margin for a loaded CI machine (a notebook measured 329 s
under a load average of 5).
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from helpers.runif import RunIf
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 300  # seconds, any one cell
NOTEBOOK_TIMEOUT = 480  # seconds, the whole notebook


def test_there_are_tutorials() -> None:
    assert len(NOTEBOOKS) >= 6, [path.name for path in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_committed_without_outputs(path: pathlib.Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    stale = [
        index
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not stale, f"{path.name}: cells {stale} carry outputs; clear them before committing"


@RunIf(multiprocess=True)
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    before = _files(path.parent)
    client.execute()  # raises CellExecutionError, with the failing cell and its traceback
    assert _files(path.parent) == before, "the notebook left files in notebooks/: write to a temporary directory"


def _files(folder: pathlib.Path) -> set[pathlib.Path]:
    return {item for item in folder.rglob("*") if ".ipynb_checkpoints" not in item.parts}
