"""Run notebooks outside Jupyter: to refresh a chapter's committed outputs, and in tests.

``execute_notebook`` runs every cell in a fresh kernel of the current Python (so the installed
minivllm is the one imported), top to bottom, as Jupyter's Run All does: no cell is skipped.
Cells tagged ``requires-gpu`` check for CUDA themselves (``minivllm.course.gpu_results``): on a
GPU they measure and store the result, elsewhere they show the stored one. The tag marks the
cells a GPU run refreshes (``gpu_cells``).
"""

from __future__ import annotations

import os

import nbformat

GPU_TAG = "requires-gpu"


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def execute_notebook(
    path: str,
    allow_errors: bool = False,
    timeout: int = 600,
    nb: nbformat.NotebookNode | None = None,
) -> nbformat.NotebookNode:
    """Execute the notebook at ``path`` (or ``nb``, run as if it lived there); return it run."""
    from nbclient import NotebookClient

    if nb is None:
        nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=allow_errors,
        record_timing=False,  # no timestamps in committed notebooks
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
    )
    client.execute()
    return nb


def gpu_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indexes (among all cells) of the cells tagged ``requires-gpu``."""
    return [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and GPU_TAG in c.metadata.get("tags", [])]


def cell_errors(nb: nbformat.NotebookNode) -> list[tuple[int, str, str]]:
    """(code cell index, exception name, message) of every cell whose output is an error."""
    errors = []
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code_cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append((i, out["ename"], out["evalue"]))
    return errors


def run_in_place(path: str, timeout: int = 600) -> None:
    """Execute a notebook and save it with its fresh outputs (what chapters are committed with)."""
    nb = execute_notebook(path, timeout=timeout)
    nbformat.write(nb, path)
