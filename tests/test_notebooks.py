"""Every tutorial notebook runs top to bottom in a real kernel on CPU ranks (gloo).

Any error fails the test, except in cells tagged ``raises-exception``. Each notebook takes
20 to 60 s on 2 cores; deselect them with ``-m "not notebooks"``. The committed outputs are
refreshed with ``scripts/notebook_sources/build.py`` (or ``scripts/run_notebooks.py
--inplace``); this test executes a copy in memory and writes nothing.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "0*.ipynb")))


def _runner():
    """scripts/run_notebooks.py's ``execute``: the tests run notebooks as that script does."""
    path = os.path.join(REPO, "scripts", "run_notebooks.py")
    spec = importlib.util.spec_from_file_location("run_notebooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.notebooks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    from nbclient.exceptions import CellExecutionError

    try:
        _runner().execute(path, timeout=300)
    except CellExecutionError as e:  # nbclient's message names the cell and the traceback
        pytest.fail(f"{os.path.basename(path)} failed:\n{e}", pytrace=False)


def test_every_notebook_is_collected():
    assert NOTEBOOKS, "no notebooks/0*.ipynb found"
