"""Running a tutorial notebook as a test: a fresh Jupyter kernel from this environment, offline, no files left behind.

The tutorials are split between two test modules (``test_notebooks.py``: the engine and the strategy;
``test_notebooks_zoo.py``: the zoo's models) so that pytest-xdist, which hands out whole files, runs the two
halves on different workers.
"""

from __future__ import annotations

import pathlib

import nbformat
from nbclient import NotebookClient

__all__ = ["CELL_TIMEOUT", "NOTEBOOKS", "NOTEBOOK_TIMEOUT", "ZOO_NOTEBOOKS", "run_notebook"]

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ZOO_NOTEBOOKS = [path for path in NOTEBOOKS if path.stem.startswith(("05_", "06_", "08_", "10_"))]
"""The tutorials that train the zoo's models: the longest ones, run by their own test module."""
CELL_TIMEOUT = 300  # seconds, any one cell
NOTEBOOK_TIMEOUT = 480  # seconds, the whole notebook


def run_notebook(path: pathlib.Path) -> None:
    """Execute ``path`` top to bottom in its own folder; a cell that raises fails with the cell's traceback."""
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
