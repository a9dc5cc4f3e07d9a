"""Run notebooks outside Jupyter: to refresh a chapter's committed outputs, and in tests.

``execute_notebook`` runs every cell in a fresh kernel of the current Python (so the installed
minivllm is the one imported). Cells tagged ``requires-gpu`` are skipped when torch sees no
CUDA device, as the test configuration does under nbval; they keep their stored outputs.
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
        skip_cells_with_tag="skip-execution" if has_cuda() else GPU_TAG,
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
    )
    client.execute()
    return nb


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
