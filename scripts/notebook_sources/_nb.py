"""Tiny helpers for the notebook generators: markdown and code cells, written with nbformat.

A generator lists the cells; ``save`` writes the notebook without outputs, and
``scripts/run_notebooks.py --inplace`` then fills in the outputs of a real run.
"""

from __future__ import annotations

import os
import textwrap

import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str, *tags: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(textwrap.dedent(text).strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def save(name: str, cells: list[nbformat.NotebookNode]) -> str:
    """Write notebooks/NAME.ipynb (no outputs yet) and return its path."""
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    for i, cell in enumerate(nb.cells):  # stable ids keep regenerated diffs small
        cell["id"] = f"{name[:2]}-{i:02d}"
    nbformat.validate(nb)
    path = os.path.join(REPO, "notebooks", f"{name}.ipynb")
    nbformat.write(nb, path)
    return path
