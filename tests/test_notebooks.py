"""Every tutorial in ``notebooks/`` runs top to bottom, offline, and is committed without outputs.

The tutorials on the engine and the strategy run here, the zoo's in ``test_notebooks_zoo.py``. Each notebook runs in
a fresh Jupyter kernel from this environment with its own folder as the working directory; a cell that raises fails
the test with the cell's traceback. The time limit per notebook is the tutorials' promise to readers (under three
minutes on an idle 2-core CPU) with a margin for a loaded CI machine (a notebook measured 329 s under a load average
of 5).
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from helpers.notebooks import NOTEBOOK_TIMEOUT, NOTEBOOKS, ZOO_NOTEBOOKS, run_notebook
from helpers.runif import RunIf


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


ENGINE_NOTEBOOKS = [path for path in NOTEBOOKS if path not in ZOO_NOTEBOOKS]  # the zoo's: test_notebooks_zoo.py


@RunIf(multiprocess=True)
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
@pytest.mark.parametrize("path", ENGINE_NOTEBOOKS, ids=[path.stem for path in ENGINE_NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path) -> None:
    run_notebook(path)
