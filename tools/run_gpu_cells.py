"""Run notebooks' code cells in order, in this process, and write the outputs back.

The GPU machine has no jupyter, ipykernel, nbclient or nbval, so the chapters' GPU cells
(tagged ``requires-gpu``) get their outputs from this small runner instead::

    python tools/run_gpu_cells.py chapters/11_serving_on_a_gpu.ipynb --json summary.json
    python tools/run_gpu_cells.py --gpu-chapters         # every chapter with a requires-gpu cell
    python tools/run_gpu_cells.py --gpu-chapters --out-dir results/   # originals left alone

Each notebook runs top to bottom in a fresh namespace, with its own folder as the working
directory (as Jupyter does), so a GPU cell sees what the cells before it built. What a cell
prints becomes ``stream`` outputs, the value of its last expression an ``execute_result``, and
every matplotlib figure it leaves open (or passes to ``plt.show()``) a PNG ``display_data``.
The first cell that raises gets an ``error`` output and ends that notebook's run (the cells
after it keep their old outputs). The notebook is written back after every cell (``nbformat``
when installed, else the same JSON by hand), so a timeout keeps the cells that ran. The cells
store their own dated results with ``minivllm.course.gpu_results``.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import glob
import io
import json
import os
import signal
import sys
import time
import traceback

GPU_TAG = "requires-gpu"


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def save(nb: dict, path: str) -> None:
    try:
        import nbformat

        node = nbformat.from_dict(nb)
        tmp = path + ".tmp"
        nbformat.write(node, tmp)
    except ImportError:  # the same layout Jupyter writes: one-space indent, a final newline
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(nb, f, indent=1, ensure_ascii=False, sort_keys=True)
            f.write("\n")
    os.replace(tmp, path)


def gpu_cell_indices(nb: dict) -> list[int]:
    return [i for i, c in enumerate(nb["cells"])
            if c.get("cell_type") == "code" and GPU_TAG in c.get("metadata", {}).get("tags", [])]


class _Stream(io.TextIOBase):
    """Collects what a cell writes to stdout or stderr, as notebook stream outputs."""

    def __init__(self, name: str, outputs: list) -> None:
        self.name, self.outputs = name, outputs

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.outputs and self.outputs[-1].get("output_type") == "stream" \
                and self.outputs[-1]["name"] == self.name:
            self.outputs[-1]["text"] += text
        else:
            self.outputs.append({"output_type": "stream", "name": self.name, "text": text})
        return len(text)


class _CellTimeout(Exception):
    pass


def _figures_to_outputs(outputs: list) -> None:
    """Every open matplotlib figure becomes a PNG display_data; then they are closed."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(buf.getvalue()).decode(),
                                 "text/plain": repr(fig)}})
    plt.close("all")


def run_cell(code: str, namespace: dict, count: int, timeout_s: float | None) -> tuple[list, bool]:
    """Execute one cell; its outputs and whether it raised."""
    outputs: list = []
    namespace["display"] = lambda *objs: [outputs.append(
        {"output_type": "display_data", "metadata": {}, "data": {"text/plain": repr(o)}})
        for o in objs]
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.show = lambda *a, **k: _figures_to_outputs(outputs)
    tree = ast.parse(code, mode="exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    old = None
    if timeout_s:
        def on_alarm(signum, frame):
            raise _CellTimeout(f"cell ran past {timeout_s:.0f} s")
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(max(1, int(timeout_s)))
    failed = False
    try:
        with contextlib.redirect_stdout(_Stream("stdout", outputs)), \
                contextlib.redirect_stderr(_Stream("stderr", outputs)):
            exec(compile(tree, f"<cell {count}>", "exec"), namespace)
            value = eval(compile(last, f"<cell {count}>", "eval"), namespace) if last else None
            plt = sys.modules.get("matplotlib.pyplot")
            if plt is not None and getattr(plt.show, "__module__", "") != __name__:
                plt.show = lambda *a, **k: _figures_to_outputs(outputs)  # imported in this cell
        if value is not None:
            outputs.append({"output_type": "execute_result", "execution_count": count,
                            "metadata": {}, "data": {"text/plain": repr(value)}})
    except BaseException as e:  # noqa: BLE001 - a cell's failure is recorded, then we stop
        if isinstance(e, KeyboardInterrupt):
            raise
        failed = True
        outputs.append({"output_type": "error", "ename": type(e).__name__, "evalue": str(e),
                        "traceback": traceback.format_exception(type(e), e, e.__traceback__)})
    finally:
        if timeout_s:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    _figures_to_outputs(outputs)
    return outputs, failed


def run_notebook(path: str, cell_timeout_s: float | None = None, out_path: str | None = None,
                 stop_after_last_gpu_cell: bool = False) -> dict:
    """Run ``path``'s code cells in order; outputs written into ``out_path`` (default: ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    path = os.path.abspath(path)
    out_path = os.path.abspath(out_path or path)
    nb = load(path)
    gpu_cells = gpu_cell_indices(nb)
    last_needed = gpu_cells[-1] if (stop_after_last_gpu_cell and gpu_cells) else len(nb["cells"]) - 1
    namespace = {"__name__": "__main__"}
    summary = {"notebook": os.path.relpath(path), "gpu_cells": gpu_cells, "cells_run": 0,
               "error": None, "seconds": 0.0, "gpu_cell_outputs": {}}
    start = time.perf_counter()
    cwd = os.getcwd()
    sys.path.insert(0, os.path.dirname(path))
    os.chdir(os.path.dirname(path))
    count = 0
    try:
        for i, cell in enumerate(nb["cells"][: last_needed + 1]):
            if cell.get("cell_type") != "code":
                continue
            count += 1
            t = time.perf_counter()
            outputs, failed = run_cell(_source(cell), namespace, count, cell_timeout_s)
            cell["outputs"], cell["execution_count"] = outputs, count
            summary["cells_run"] += 1
            if i in gpu_cells:
                summary["gpu_cell_outputs"][i] = {
                    "seconds": time.perf_counter() - t,
                    "text": "".join(o.get("text", "") for o in outputs
                                    if o["output_type"] == "stream")[-2000:],
                    "figures": sum(1 for o in outputs if "image/png" in o.get("data", {}))}
            save(nb, out_path)
            if failed:
                err = outputs[-1] if outputs[-1]["output_type"] == "error" else {}
                summary["error"] = {"cell": i, "ename": err.get("ename"),
                                    "evalue": str(err.get("evalue"))[:500]}
                break
    finally:
        os.chdir(cwd)
        sys.path.remove(os.path.dirname(path))
        summary["seconds"] = time.perf_counter() - start
    return summary


def gpu_chapters(root: str) -> list[str]:
    return [p for p in sorted(glob.glob(os.path.join(root, "chapters", "[0-9][0-9]_*.ipynb")))
            if gpu_cell_indices(load(p))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*")
    p.add_argument("--gpu-chapters", action="store_true",
                   help="every chapter that has a requires-gpu cell")
    p.add_argument("--cell-timeout", type=float, default=None, help="seconds per cell")
    p.add_argument("--stop-after-last-gpu-cell", action="store_true",
                   help="skip the cells after a notebook's last GPU cell")
    p.add_argument("--out-dir", default=None,
                   help="write the executed notebooks here (default: over the originals)")
    p.add_argument("--json", default=None, help="write a summary here")
    args = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = list(args.notebooks) + (gpu_chapters(root) if args.gpu_chapters else [])
    if not paths:
        p.error("no notebook given")
    results = []
    for path in paths:
        out = os.path.join(args.out_dir, os.path.basename(path)) if args.out_dir else None
        r = run_notebook(path, args.cell_timeout, out_path=out,
                         stop_after_last_gpu_cell=args.stop_after_last_gpu_cell)
        results.append(r)
        print(f"{r['notebook']}: {r['cells_run']} cells in {r['seconds']:.1f} s"
              + (f", error in cell {r['error']['cell']}: {r['error']['ename']}" if r["error"] else ""),
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
