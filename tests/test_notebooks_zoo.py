"""The tutorials that train the zoo's models run top to bottom, offline (see ``helpers.notebooks``).

Apart from ``test_notebooks.py`` only so that pytest-xdist runs the longest notebooks beside the others.
"""

from __future__ import annotations

import pathlib

import pytest
from helpers.notebooks import NOTEBOOK_TIMEOUT, ZOO_NOTEBOOKS, run_notebook
from helpers.runif import RunIf


def test_the_zoo_tutorials_are_found() -> None:
    assert len(ZOO_NOTEBOOKS) == 4, [path.name for path in ZOO_NOTEBOOKS]


@RunIf(multiprocess=True)
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
@pytest.mark.parametrize("path", ZOO_NOTEBOOKS, ids=[path.stem for path in ZOO_NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path) -> None:
    run_notebook(path)
