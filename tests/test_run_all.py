"""Run All works anywhere: every chapter runs top to bottom, on a CPU, with no cell skipped.

How the chapters are executed, and why this file does not execute them a second time:
the test command (pyproject's ``testpaths`` include ``chapters/``, ``addopts`` has ``--nbval
--nbval-current-env``) already runs every chapter under nbval, once: nbval starts a plain
Jupyter kernel of the current Python in the notebook's folder, runs every code cell in order,
fails on any error, and compares each cell's output with the committed one (``conftest.py``
says how: stderr not compared, addresses blanked, ``nbval-ignore-output`` cells not compared).
``conftest.py`` no longer skips any cell (``requires-gpu`` cells check for CUDA themselves and
show a stored result without it) and gives every cell a timeout of ``CELL_TIMEOUT_S`` seconds.
So nbval's run is exactly a learner's Run All plus the output comparison. Executing the
chapters a second time with nbclient would add their whole running time to the suite again and
catch nothing more. This file checks what that argument rests on, cheaply:

* nothing lets a chapter cell be skipped or fail quietly (no skipping or raising tags; the
  conftest hooks mark no cell skipped: tests/test_course.py's probe; the notebook runner skips
  none either: the probe below);
* the per-cell timeout is set;
* every GPU cell follows the one pattern (``gpu_results.has_cuda()`` / ``save`` / ``show``), is
  tagged ``requires-gpu`` and ``nbval-ignore-output``, and sits in the "On a GPU" section that
  ends its chapter;
* ``gpu_results`` stores and shows results, and never raises while showing;
* what the prose says of timing outputs holds for the committed ones (``PROSE_CLAIMS``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import types

import nbformat
import pytest

from minivllm.course import gpu_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTERS = sorted(glob.glob(os.path.join(ROOT, "chapters", "[0-9][0-9]_*.ipynb")))
GPU_TAG = "requires-gpu"
IGNORE_TAG = "nbval-ignore-output"
# tags with which nbval or nbclient would not run a cell, or would let it raise
SKIPPING_TAGS = {"nbval-skip", "skip-execution", "raises-exception", "nbval-raises-exception"}


def _nb(path):
    return nbformat.read(path, as_version=4)


def _stdout(cell):
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


@pytest.mark.parametrize("path", CHAPTERS, ids=os.path.basename)
def test_no_chapter_cell_is_skipped_or_allowed_to_raise(path):
    for i, cell in enumerate(_nb(path).cells):
        tags = set(cell.metadata.get("tags", []))
        assert not tags & SKIPPING_TAGS, f"cell {i} is tagged {tags & SKIPPING_TAGS}"


@pytest.mark.parametrize("path", CHAPTERS, ids=os.path.basename)
def test_gpu_cells_follow_the_pattern_in_the_last_section(path):
    nb = _nb(path)
    chapter = os.path.basename(path)[:2]
    gpu = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
           and GPU_TAG in c.metadata.get("tags", [])]
    if not gpu:
        return
    sections = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
                and re.search(r"(?m)^## ", c.source)]
    on_a_gpu = [i for i in sections if re.search(r"(?m)^## On a GPU", nb.cells[i].source)]
    assert len(on_a_gpu) == 1, "one '## On a GPU' section gathers the GPU cells"
    assert on_a_gpu[0] == sections[-1], "the '## On a GPU' section ends the chapter"
    assert min(gpu) > on_a_gpu[0], "every GPU cell is in the '## On a GPU' section"
    after = [i for i in range(on_a_gpu[0], len(nb.cells)) if nb.cells[i].cell_type == "code"]
    assert after == gpu, "the section holds GPU cells only"
    for i in gpu:
        cell = nb.cells[i]
        assert IGNORE_TAG in cell.metadata["tags"], f"cell {i}: its output differs on a GPU"
        src = cell.source
        assert src.startswith("if gpu_results.has_cuda():"), f"cell {i} checks for CUDA first"
        assert re.search(r"(?m)^else:\n    gpu_results\.show\(", src), f"cell {i}: else shows"
        saved = re.findall(r'gpu_results\.save\("([^"]+)", "([^"]+)"', src)
        shown = re.findall(r'gpu_results\.show\("([^"]+)", "([^"]+)"', src)
        assert saved and sorted(saved) == sorted(shown), f"cell {i} shows what it saves"
        assert all(c == chapter for c, _ in saved), f"cell {i} saves under chapter {chapter}"


def test_stored_gpu_results_are_dated_and_belong_to_a_chapter_cell():
    sources = "\n".join(c.source for p in CHAPTERS for c in _nb(p).cells if c.cell_type == "code")
    folder = os.path.join(ROOT, "chapters", "gpu_results")
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        for key in ("date", "device", "torch", "data"):
            assert key in record, f"{os.path.basename(path)} has no {key}"
        chapter, name = os.path.basename(path)[:-5].split("_", 1)
        assert f'gpu_results.save("{chapter}", "{name}"' in sources, path
    for path in glob.glob(os.path.join(folder, "*.png")):
        assert os.path.exists(path[:-4] + ".json"), f"{path}: a figure without its data"


def test_conftest_sets_a_cell_timeout_unless_one_is_given():
    import importlib.util

    spec = importlib.util.spec_from_file_location("root_conftest", os.path.join(ROOT, "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    config = types.SimpleNamespace(option=types.SimpleNamespace(
        nbval_cell_timeout=conftest.NBVAL_DEFAULT_CELL_TIMEOUT), addinivalue_line=lambda *a: None)
    conftest.pytest_configure(config)
    assert config.option.nbval_cell_timeout == conftest.CELL_TIMEOUT_S <= 300
    config.option.nbval_cell_timeout = "30"  # given on the command line
    conftest.pytest_configure(config)
    assert config.option.nbval_cell_timeout == "30"


@pytest.mark.slow
def test_the_notebook_runner_runs_gpu_cells_and_they_show_stored_results_on_a_cpu(tmp_path):
    """A probe chapter run by ``minivllm.course.notebooks`` (nbclient, a plain kernel, what
    ``python -m minivllm.course run`` uses): its GPU cell runs (no skip) and, without CUDA,
    shows the stored result found beside it; a plain requires-gpu cell runs too. (That nbval
    runs requires-gpu cells under this conftest, tests/test_course.py's conftest probe checks.)"""
    if gpu_results.has_cuda():
        pytest.skip("on a GPU the cell would measure and store")
    from minivllm.course.notebooks import execute_notebook

    chapters = tmp_path / "chapters"
    (chapters / "gpu_results").mkdir(parents=True)
    (chapters / "gpu_results" / "99_probe.json").write_text(json.dumps(
        {"date": "2026-12-01 10:00 UTC", "device": "NVIDIA H200", "torch": "2.11", "data": {"x": 3}}))
    gpu_cell = nbformat.v4.new_code_cell(
        'from minivllm.course import gpu_results\n'
        'if gpu_results.has_cuda():\n    raise RuntimeError("not on this machine")\n'
        'else:\n    gpu_results.show("99", "probe", "a probe")')
    gpu_cell.metadata["tags"] = [GPU_TAG, IGNORE_TAG]
    plain = nbformat.v4.new_code_cell("print('ran')")
    plain.metadata["tags"] = [GPU_TAG]
    nb = nbformat.v4.new_notebook(cells=[gpu_cell, plain])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(chapters / "99_probe.ipynb"))
    env_before = os.environ.pop(gpu_results.ENV_DIR, None)
    try:
        ran = execute_notebook(str(chapters / "99_probe.ipynb"))
    finally:
        if env_before is not None:
            os.environ[gpu_results.ENV_DIR] = env_before
    shown = _stdout(ran.cells[0])
    assert shown.startswith("No GPU here: this cell would measure a probe."), shown
    assert "2026-12-01 10:00 UTC, NVIDIA H200" in shown and "x: 3" in shown, shown
    assert _stdout(ran.cells[1]) == "ran\n"


# -- gpu_results -------------------------------------------------------------------------------

def test_show_says_what_it_would_measure_and_that_nothing_is_stored(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(gpu_results.ENV_DIR, str(tmp_path))
    gpu_results.show("02", "nothing", "the forward pass")
    assert capsys.readouterr().out == ("No GPU here: this cell would measure the forward pass.\n"
                                       "No GPU result stored yet.\n")


def test_show_prints_a_stored_result_with_its_date_and_device(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(gpu_results.ENV_DIR, str(tmp_path))
    record = {"date": "2026-12-02 09:00 UTC", "device": "NVIDIA H200", "torch": "2.11.0",
              "data": {"tokens": [1, 4, 16], "ms": 0.25, "long": list(range(100))}}
    (tmp_path / "02_forward.json").write_text(json.dumps(record))
    gpu_results.show("02", "forward", "the forward pass")
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "Stored GPU result (2026-12-02 09:00 UTC, NVIDIA H200, torch 2.11.0):"
    assert out[2:4] == ["  tokens: [1, 4, 16]", "  ms: 0.25"]
    assert out[4].startswith("  long: [0, 1, 2") and len(out[4]) <= 110 and out[4].endswith("…")


@pytest.mark.parametrize("content", ["{not json", '"a string"', "[]"])
def test_show_never_raises(tmp_path, monkeypatch, capsys, content):
    monkeypatch.setenv(gpu_results.ENV_DIR, str(tmp_path))
    (tmp_path / "02_broken.json").write_text(content)
    gpu_results.show("02", "broken", "something")
    gpu_results.show("../02", "broken", "a bad name")
    out = capsys.readouterr().out
    assert out.count("No GPU here: this cell would measure") == 2


def test_save_without_a_gpu_stores_nothing(tmp_path, monkeypatch, capsys):
    if gpu_results.has_cuda():
        pytest.skip("a GPU is here")
    monkeypatch.setenv(gpu_results.ENV_DIR, str(tmp_path))
    gpu_results.save("02", "forward", {"ms": 1.0})
    assert os.listdir(tmp_path) == [] and "not stored" in capsys.readouterr().out


def test_save_on_a_gpu_writes_the_record_and_the_figure(tmp_path, monkeypatch):
    """save's GPU branch, with the device faked: what a GPU run commits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch

    monkeypatch.setenv(gpu_results.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(gpu_results, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    gpu_results.save("10", "step", {"ms": np.float32(1.5), "rows": np.arange(3),
                                    "nested": {"t": torch.tensor([2.0])}}, fig=fig)
    plt.close(fig)
    record = gpu_results.load("10", "step")
    assert record["device"] == "Fake GPU" and record["torch"] == torch.__version__
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC$", record["date"])
    assert record["data"] == {"ms": 1.5, "rows": [0, 1, 2], "nested": {"t": [2.0]}}
    assert (tmp_path / "10_step.png").read_bytes()[:4] == b"\x89PNG"
    gpu_results.save("10", "step", {"ms": 2.0})  # no figure this time: the old one goes
    assert not (tmp_path / "10_step.png").exists()


def test_results_folder_is_found_from_any_course_folder_and_from_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv(gpu_results.ENV_DIR, raising=False)
    chapters = os.path.join(ROOT, "chapters")
    for folder in ("chapters", "solutions", "exercises", "."):
        assert gpu_results.chapters_dir(os.path.join(ROOT, folder)) == chapters
    monkeypatch.chdir(tmp_path)  # outside the repository: the package's own checkout
    assert gpu_results.results_dir() == os.path.join(chapters, "gpu_results")


# -- numbers the prose gives as ranges ---------------------------------------------------------

# (chapter, a substring of the cell's source, a regex over its stdout, what the prose beside the
# cell says of every match (its groups as floats), that claim in words): the committed output
# must bear the prose out
PROSE_CLAIMS = [
    ("02_generation.ipynb", "decode_s[n] = min(decode_s[n]",
     r"a step of 64 decodes costs ([\d.]+)x a step of one", lambda x: 1 < x < 64,
     "a step of 64 decodes costs more than one, far less than 64"),
    ("07_engine_core_process.ipynb", "inproc = paced_server_run(",
     r"engine steps over ([\d.]+) s of the clients' ([\d.]+) s", lambda span, run: span < run,
     "the engine's steps span part of the clients' run"),
    ("07_engine_core_process.ipynb", 'ownproc = paced_server_run(',
     r"engine steps over ([\d.]+) s of the clients' ([\d.]+) s", lambda span, run: span < run,
     "the engine's steps span part of the clients' run"),
    ("07_engine_core_process.ipynb", 'ownproc = paced_server_run(',
     r"clients received ([\d,]+) tokens/s", lambda tps: tps < 14_600 / 2,
     "clients receive several times fewer tokens/s than 128 decodes every 8.79 ms"),
]


@pytest.mark.parametrize("chapter, cell_text, pattern, holds, claim", PROSE_CLAIMS,
                         ids=[f"{c[:2]}-{w[:40]}" for c, _, _, _, w in PROSE_CLAIMS])
def test_prose_claims_hold_for_the_committed_outputs(chapter, cell_text, pattern, holds, claim):
    cells = [c for c in _nb(os.path.join(ROOT, "chapters", chapter)).cells
             if c.cell_type == "code" and cell_text in c.source]
    assert len(cells) == 1, f"{chapter}: {len(cells)} cells contain {cell_text!r}"
    found = re.findall(pattern, _stdout(cells[0]))
    assert found, f"{chapter}: no {pattern!r} in the cell's output"
    for match in found:
        values = [float(v.replace(",", "")) for v in (match if isinstance(match, tuple) else (match,))]
        assert holds(*values), f"{chapter}: {values} do not bear out '{claim}'"
