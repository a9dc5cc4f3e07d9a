"""Run notebooks outside Jupyter: to refresh a chapter's committed outputs, and in tests.

``execute_notebook`` runs every cell in a fresh kernel of the current Python, top to bottom, as
Run All does. Cells tagged ``requires-gpu`` check for CUDA themselves (``course.gpu_results``);
the tag marks the cells a GPU run refreshes (``gpu_cells``).
"""

from __future__ import annotations

import os

import nbformat

GPU_TAG = "requires-gpu"


def execute_notebook(path: str, allow_errors: bool = False, timeout: int = 600,
                     nb: nbformat.NotebookNode | None = None) -> nbformat.NotebookNode:
    """Execute the notebook at ``path`` (or ``nb``, run as if it lived there); return it run."""
    from nbclient import NotebookClient

    nb = nb if nb is not None else nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                   record_timing=False,  # no timestamps in committed notebooks
                   resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
                   ).execute()
    return nb


def gpu_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indexes (among all cells) of the cells tagged ``requires-gpu``."""
    return [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and GPU_TAG in c.metadata.get("tags", [])]


def cell_errors(nb: nbformat.NotebookNode) -> list[tuple[int, str, str]]:
    """(code cell index, exception name, message) of every cell whose output is an error."""
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    return [(i, out["ename"], out["evalue"]) for i, cell in enumerate(code_cells)
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def run_in_place(path: str, timeout: int = 600) -> None:
    """Execute a notebook and save it with its fresh outputs (what chapters are committed with)."""
    nbformat.write(execute_notebook(path, timeout=timeout), path)
