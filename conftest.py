"""pytest hooks for the notebooks (chapters/, solutions/, and exercises/ when a learner grades).

nbval runs each notebook's cells in order, every one of them, in a plain kernel of the current
Python, and compares their outputs with the committed ones: what Jupyter's Run All runs, checked.
Here we decide what "the same output" means for a course that runs on any machine:

* no cell is skipped: cells tagged ``requires-gpu`` check for CUDA themselves
  (``minivllm.course.gpu_results``) and, without it, show the stored GPU result; their output
  differs on a GPU, so they also carry ``nbval-ignore-output``;
* stderr is not compared (warnings, progress bars, the one-time model conversion message);
* memory addresses and progress bars are blanked;
* cells whose output depends on timing carry nbval's own ``nbval-ignore-output`` tag;
* a cell that runs longer than ``CELL_TIMEOUT_S`` fails (nbval's default is over half an hour;
  a course cell takes seconds on a 2-core CPU), unless ``--nbval-cell-timeout`` is given.

Every notebook cell also gets the ``notebook`` marker: ``pytest -m "not notebook"`` skips them.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernels inherit it: no network in the course
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (``-n N``), each worker and what it starts (notebook kernels, engine
    core processes) gets cores // N torch threads, unless OMP_NUM_THREADS says otherwise: N
    workers each running torch on every core would oversubscribe the machine, and torch's
    threads then spend their time waiting for one another."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every process started from here
    import sys

    if "torch" in sys.modules:  # a plugin imported it already: the variable came too late
        sys.modules["torch"].set_num_threads(threads)


_share_the_cores_between_workers()

import pytest  # noqa: E402

GPU_TAG = "requires-gpu"
CELL_TIMEOUT_S = 300
NBVAL_DEFAULT_CELL_TIMEOUT = 2000
SANITIZE = {
    r"0x[0-9a-fA-F]{6,}": "0x<address>",
    r"[^\n]*\d+%\|[^\n]*": "<progress bar>",  # a tqdm bar that slipped into stdout
}


def pytest_configure(config):
    config.addinivalue_line("markers", "notebook: a notebook cell run by nbval")
    timeout = getattr(config.option, "nbval_cell_timeout", None)
    if timeout is not None and float(timeout) == NBVAL_DEFAULT_CELL_TIMEOUT:
        config.option.nbval_cell_timeout = CELL_TIMEOUT_S


def pytest_collection_modifyitems(config, items):
    for item in items:
        cell = getattr(item, "cell", None)
        notebook = item.parent
        if cell is None or not hasattr(notebook, "sanitize_patterns"):
            continue  # not an nbval notebook cell
        item.add_marker(pytest.mark.notebook)
        notebook.sanitize_patterns.update(SANITIZE)
        if "stderr" not in notebook.skip_compare:
            notebook.skip_compare = (*notebook.skip_compare, "stderr")
