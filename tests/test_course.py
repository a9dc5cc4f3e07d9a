"""The course's machinery: the exercise generator, the committed notebooks, nbval's settings.

* exercises/ is exactly what the generator writes from solutions/ now;
* a fresh exercise notebook fails, and only at its exercise and grading cells, with
  NotImplementedError("Exercise N.M: ...") (the solutions notebooks passing is checked by the
  test command itself: nbval runs every chapter and solution notebook);
* the test command collects every chapter and solution notebook, and no exercise notebook;
* the conftest hook skips GPU cells without CUDA and ignores what may vary (stderr, addresses)
  while still comparing the rest;
* no compared output prints a float rounding residual, which is another number on another CPU.
"""

import glob
import re
import os
import subprocess
import sys

import nbformat
import pytest

from minivllm.course.exercises import (
    ExerciseFormatError, make_exercise_notebook, stale_exercises, strip_solutions,
)
from minivllm.course.notebooks import cell_errors, execute_notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTERS = sorted(glob.glob(os.path.join(ROOT, "chapters", "*.ipynb")))
SOLUTIONS = sorted(glob.glob(os.path.join(ROOT, "solutions", "*.ipynb")))
EXERCISES = sorted(glob.glob(os.path.join(ROOT, "exercises", "*.ipynb")))


def _nb(*cells):
    kernel = {"name": "python3", "display_name": "Python 3"}
    return nbformat.v4.new_notebook(cells=list(cells), metadata={"kernelspec": kernel})


# -- the generator ---------------------------------------------------------------------------

SOLVED = '''import math

def area(r):
    """Area of a circle."""
    ### BEGIN SOLUTION Exercise 4.1: return the area of a circle of radius r
    return math.pi * r * r
    ### END SOLUTION

print(area(2))'''


def test_solution_block_becomes_not_implemented_at_its_indentation():
    source, labels = strip_solutions(SOLVED)
    assert labels == ["4.1"]
    expected = '    raise NotImplementedError("Exercise 4.1: return the area of a circle of radius r")'
    assert expected in source
    assert "math.pi" not in source and "SOLUTION" not in source
    assert source.startswith("import math") and source.endswith("print(area(2))")


def test_generated_notebook_clears_outputs_keeps_tags_and_says_how_to_grade():
    code = nbformat.v4.new_code_cell(SOLVED, execution_count=3,
                                     outputs=[nbformat.v4.new_output("stream", text="12.56\n")])
    grade = nbformat.v4.new_code_cell("check(area)", metadata={"tags": ["grade"]})
    nb = make_exercise_notebook(_nb(nbformat.v4.new_markdown_cell("# Ex"), code, grade),
                                "04_circles.ipynb")
    assert "pytest --nbval exercises/04_circles.ipynb" in nb.cells[0].source
    codes = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in codes)
    assert codes[1].metadata["tags"] == ["grade"]
    assert nb.cells[1].source == "# Ex"
    nbformat.validate(nb)


def test_solution_only_cells_stay_out_of_the_exercise_notebook():
    remark = nbformat.v4.new_markdown_cell("This solution draws with multinomial.",
                                           metadata={"tags": ["solution-only"]})
    shown = nbformat.v4.new_code_cell("print(area(1))", metadata={"tags": ["solution-only"]})
    nb = make_exercise_notebook(_nb(nbformat.v4.new_code_cell(SOLVED), remark, shown),
                                "04_circles.ipynb")
    assert len(nb.cells) == 2  # the header and the exercise
    assert "multinomial" not in nbformat.writes(nb) and "area(1)" not in nbformat.writes(nb)
    hidden = nbformat.v4.new_code_cell(SOLVED, metadata={"tags": ["solution-only"]})
    with pytest.raises(ExerciseFormatError, match="solution-only cell cannot hold an exercise"):
        make_exercise_notebook(_nb(hidden), "04_circles.ipynb")


def test_quotes_in_the_message_are_escaped():
    source, _ = strip_solutions('### BEGIN SOLUTION Exercise 1.1: say "hi"\nx = 1\n### END SOLUTION')
    assert compile(source, "cell", "exec") and 'say \\"hi\\"' in source


def test_one_exercise_may_span_several_blocks():
    cell = nbformat.v4.new_code_cell(
        "### BEGIN SOLUTION Exercise 2.1: a\n1\n### END SOLUTION\n"
        "### BEGIN SOLUTION Exercise 2.1: b\n2\n### END SOLUTION\n"
        "### BEGIN SOLUTION Exercise 2.2: c\n3\n### END SOLUTION")
    nb = make_exercise_notebook(_nb(cell), "02_x.ipynb")
    assert nb.cells[1].source.count("NotImplementedError") == 3


@pytest.mark.parametrize("source, name, message", [
    ("### BEGIN SOLUTION\nx\n### END SOLUTION", "01_x.ipynb", "write what to do"),
    ("### BEGIN SOLUTION Exercise 1.1: a\nx", "01_x.ipynb", "never closed"),
    ("x\n### END SOLUTION", "01_x.ipynb", "without BEGIN"),
    ("### BEGIN SOLUTION Exercise 1.1: a\n### BEGIN SOLUTION Exercise 1.2: b", "01_x.ipynb",
     "inside another"),
    ("### BEGIN SOLUTION Exercise 2.1: a\nx\n### END SOLUTION", "01_x.ipynb", "belongs to chapter 2"),
    ("### BEGIN SOLUTION Exercise 1.2: a\nx\n### END SOLUTION", "01_x.ipynb", "out of order"),
    ("x = 1", "01_x.ipynb", "no '### BEGIN SOLUTION' block"),
    ("### BEGIN SOLUTION Exercise 1.1: a\nx\n### END SOLUTION", "model.ipynb", "NN_topic"),
])
def test_malformed_solutions_are_rejected(source, name, message):
    with pytest.raises(ExerciseFormatError, match=message):
        make_exercise_notebook(_nb(nbformat.v4.new_code_cell(source)), name)


def test_exercises_folder_is_what_the_generator_writes_now():
    assert SOLUTIONS, "no solutions notebooks"
    assert [os.path.basename(p) for p in EXERCISES] == [os.path.basename(p) for p in SOLUTIONS]
    stale = stale_exercises(ROOT)
    assert not stale, f"stale: {stale}; run: python -m minivllm.course make-exercises"


def test_stale_exercise_is_detected(tmp_path):
    for folder in ("solutions", "exercises"):
        os.makedirs(tmp_path / folder)
    cell = nbformat.v4.new_code_cell("### BEGIN SOLUTION Exercise 1.1: a\nx = 1\n### END SOLUTION")
    nbformat.write(_nb(cell), str(tmp_path / "solutions" / "01_x.ipynb"))
    assert stale_exercises(str(tmp_path)) == [str(tmp_path / "exercises" / "01_x.ipynb")]
    from minivllm.course.exercises import write_exercises

    write_exercises(str(tmp_path))
    assert stale_exercises(str(tmp_path)) == []
    (tmp_path / "exercises" / "09_orphan.ipynb").write_text("{}")
    assert stale_exercises(str(tmp_path)) == [str(tmp_path / "exercises" / "09_orphan.ipynb")]


def test_make_exercises_check_command_passes_on_the_repository():
    out = subprocess.run([sys.executable, "-m", "minivllm.course", "make-exercises", "--check",
                          "--root", ROOT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# -- the notebooks as committed --------------------------------------------------------------

def _code_cells(path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=os.path.basename)
def test_notebook_is_committed_run_without_errors(path):
    cells = _code_cells(path)
    for i, cell in enumerate(cells):  # GPU cells too: without CUDA they show a stored result
        assert cell.execution_count is not None, f"code cell {i} was not run before committing"
        assert not [o for o in cell.outputs if o.output_type == "error"], f"code cell {i} failed"


# a number as small as a float32 rounding residual, printed the way a residual is (a short
# mantissa, "{:.1e}"): 9.5e-07; not a value printed whole (a config's 9.999999747378752e-06)
RESIDUAL = re.compile(r"\b\d(?:\.\d{1,2})?e-(?:0[5-9]|[1-9]\d)\b")


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=os.path.basename)
def test_compared_outputs_print_no_rounding_residual(path):
    """nbval compares a cell's output as text, and a float32 residual (``max |a - b|`` of two
    ways to sum) is another number on another CPU (torch's matmul sums in an order that depends
    on the instruction set): such a cell prints the comparison with a tolerance instead, or
    carries ``nbval-ignore-output``."""
    for i, cell in enumerate(_code_cells(path)):
        if "nbval-ignore-output" in cell.metadata.get("tags", []):
            continue
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        found = RESIDUAL.search(text)
        assert found is None, (f"code cell {i} prints {found.group()}: a residual that differs "
                               "from CPU to CPU; print whether it is under a tolerance")


def test_the_residual_pattern_finds_residuals_only():
    assert RESIDUAL.search("max |kernel - torch x @ y|: 9.5e-07")
    assert RESIDUAL.search("off by 2.4e-10 in all")
    assert not RESIDUAL.search("under 1e-5: True")  # a tolerance, not a measured residual
    assert not RESIDUAL.search("0.0e+00 and 3.1e+04 FLOPs, 1.5e-3 s")
    assert not RESIDUAL.search("rms_norm_eps           9.999999747378752e-06")


@pytest.mark.parametrize("path", CHAPTERS, ids=os.path.basename)
def test_chapter_has_plots_and_points_to_vllm_and_exercises(path):
    nb = nbformat.read(path, as_version=4)
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert images >= 1, "a chapter shows its findings as plots"
    if not os.path.basename(path).startswith("00_"):
        assert "## In vLLM" in text and "vllm/" in text
        exercise = os.path.join("exercises", os.path.basename(path))
        assert f"`{exercise}`" in text and os.path.exists(os.path.join(ROOT, exercise))


@pytest.mark.parametrize("path", SOLUTIONS, ids=os.path.basename)
def test_every_exercise_is_followed_by_a_grading_cell(path):
    cells = _code_cells(path)
    pending = None
    for cell in cells:
        if "### BEGIN SOLUTION" in cell.source:
            pending = cell.source
        if "grade" in cell.metadata.get("tags", []):
            assert "checks.check_" in cell.source, "a grading cell calls a checker"
            pending = None
    assert pending is None, "the last exercise has no grading cell after it"


@pytest.mark.slow
@pytest.mark.parametrize("path", EXERCISES, ids=os.path.basename)
def test_fresh_exercise_notebook_fails_only_at_its_exercise_and_grading_cells(path):
    nb = execute_notebook(path, allow_errors=True)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    stub = 'raise NotImplementedError("Exercise'
    exercise_cells = {i for i, c in enumerate(cells) if stub in c.source}
    grading_cells = {i for i, c in enumerate(cells) if "grade" in c.metadata.get("tags", [])}
    labels = {line.split("Exercise ")[1].split(":")[0] for c in cells for line in c.source.split("\n")
              if 'raise NotImplementedError("Exercise' in line}
    errors = cell_errors(nb)
    failed = {i for i, _, _ in errors}
    assert failed <= exercise_cells | grading_cells, f"unexpected failures: {errors}"
    assert grading_cells <= failed, "every grading cell fails while its exercise is unsolved"
    for i, name, message in errors:
        assert name == "NotImplementedError" and message.startswith("Exercise "), (i, name, message)
    assert {m.split(":")[0].removeprefix("Exercise ") for _, _, m in errors} == labels


# -- the test command and its nbval settings -------------------------------------------------

@pytest.mark.slow
def test_test_command_collects_every_chapter_and_solution_notebook_and_no_exercise():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        testpaths = re.search(r"(?m)^testpaths = \[(.*)\]$", f.read())
    assert testpaths and '"tests"' in testpaths.group(1)
    # the notebooks the test command collects (tests/ left out: importing it all is slow)
    # only nbval among the installed plugins (the others add seconds of imports, no notebook)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "nbval", "--collect-only", "-qq",
                          "-p", "no:cacheprovider", "--ignore=tests"],  # addopts: -v
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for path in CHAPTERS + SOLUTIONS:
        rel = os.path.relpath(path, ROOT)
        assert f"{rel}::Cell 0" in out.stdout, f"{rel} is not collected"
    assert "exercises/" not in out.stdout


NOTEBOOK_CELLS = {
    "address": ("class A: pass\nprint(A())", "<__main__.A object at 0x7f00deadbeef>\n", None),
    "stderr": ("import sys\nprint('kept', file=sys.stderr)", None, "something else\n"),
    "gpu": ("raise RuntimeError('only on a GPU')", "it ran on a GPU\n", None),
    "checked": ("print('two')", "one\n", None),
}


def _cell(key):
    source, stdout, stderr = NOTEBOOK_CELLS[key]
    outputs = []
    if stdout:
        outputs.append(nbformat.v4.new_output("stream", name="stdout", text=stdout))
    if stderr:
        outputs.append(nbformat.v4.new_output("stream", name="stderr", text=stderr))
    cell = nbformat.v4.new_code_cell(source, execution_count=1, outputs=outputs)
    if key == "gpu":
        cell.metadata["tags"] = ["requires-gpu"]
    return cell


@pytest.mark.slow
def test_conftest_runs_gpu_cells_and_ignores_what_varies_but_compares_the_rest(tmp_path):
    with open(os.path.join(ROOT, "conftest.py")) as f:
        (tmp_path / "conftest.py").write_text(f.read())
    nbformat.write(_nb(_cell("address"), _cell("stderr"), _cell("gpu"), _cell("checked")),
                   str(tmp_path / "probe.ipynb"))
    command = [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-p", "nbval",
               "--nbval", "--nbval-current-env", "probe.ipynb"]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # nbval is the plugin under test
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    report = out.stdout
    assert "2 failed, 2 passed" in report, report  # the changed stdout, and the GPU cell that raised
    assert "FAILED probe.ipynb::Cell 3" in report, report
    assert "FAILED probe.ipynb::Cell 2" in report, report  # requires-gpu cells run on any machine


def test_readme_course_table_links_every_chapter():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    missing = [os.path.basename(p) for p in CHAPTERS
               if f"](chapters/{os.path.basename(p)})" not in readme]
    assert not missing, f"README's course table has no row for {missing}"


# -- no chapter gives away an exercise -------------------------------------------------------

# per chapter's exercises: the package's own answer (its source), and what writing the answer
# out in a chapter's code looks like (regexes over one code cell)
ANSWERS = {
    1: (["minivllm.model.layers:rms_norm", "minivllm.model.layers:rotary_embedding",
         "minivllm.model.layers:_rotate"],
        [r"\.pow\(2\)\.mean\(", r"rsqrt\(", r"(?s)repeat_interleave\(.*\.softmax\("]),
    2: (["minivllm.sample.sampler:Sampler.forward", "minivllm.sample.sampler:apply_top_k_top_p",
         "minivllm.sample.sampler:apply_top_k", "minivllm.model.standalone:greedy_generate"],
        [r"multinomial\(", r"(?s)single_sequence_metadata\(.*\.argmax\("]),
    3: (["minivllm.worker.block_table:compute_slot_mapping",
         "minivllm.core.kv_cache_manager:KVCacheManager.allocate_slots",
         "minivllm.attention.torch_backend:paged_decode_attention",
         "minivllm.attention.torch_backend:gather_context"],
        [r"cdiv\(.*block_size\)\s*-\s*len\("]),
    4: (["minivllm.core.scheduler_v0:PhaseSeparatedScheduler.schedule",
         "minivllm.core.scheduler:Scheduler._try_admit",
         "minivllm.core.scheduler:Scheduler._allocate_or_preempt"], []),
    5: (["minivllm.core.scheduler:Scheduler.schedule", "minivllm.core.scheduler:Scheduler._preempt",
         "minivllm.core.scheduler:Scheduler._try_admit",
         "minivllm.core.scheduler:Scheduler._allocate_or_preempt"], []),
    6: (["minivllm.core.kv_cache_utils:hash_block_tokens", "minivllm.core.kv_cache_utils:encode_block",
         "minivllm.core.kv_cache_utils:update_block_hashes",
         "minivllm.core.block_pool:BlockPool.get_new_blocks", "minivllm.core.block_pool:BlockPool.touch",
         "minivllm.core.block_pool:BlockPool.free_blocks",
         "minivllm.core.block_pool:BlockPool.cache_full_blocks"], []),
    12: (["minivllm.model.parallel_layers:RowParallelLinear.forward",
          "minivllm.model.parallel_layers:RowParallelLinear.weight_loader",
          "minivllm.model.parallel_layers:kv_head_partition",
          "minivllm.model.parallel_layers:QKVParallelLinear.weight_loader"],
         # an all-reduce written out (the row-parallel forward); a KV head chosen for a rank
         [r"all_reduce\(", r"tp_rank\s*//\s*\(?\s*tp_size\s*//", r"tp_size\s*//\s*num_kv_heads"]),
}


def _normalised_lines(text):
    lines = []
    for line in text.split("\n"):
        line = " ".join(line.split("#")[0].split())
        if len(line) >= 16 and not line.startswith(('"""', "def ", "@")):
            lines.append(line)
    return lines


def _body_lines(dotted):
    import importlib
    import inspect

    module, _, name = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    source = inspect.getsource(obj)
    return name, _normalised_lines(source.split(":\n", 1)[1] if ":\n" in source else source)


def _solution_lines(chapter):
    lines = []
    for path in SOLUTIONS:
        if os.path.basename(path).startswith(f"{chapter:02d}_"):
            for cell in _code_cells(path):
                inside = False
                for line in cell.source.split("\n"):
                    if "### BEGIN SOLUTION" in line:
                        inside = True
                    elif "### END SOLUTION" in line:
                        inside = False
                    elif inside:
                        lines += _normalised_lines(line)
    return [line for line in lines if len(line) >= 24]


def _shows(haystack, lines, run=3):
    """Does ``haystack`` contain ``run`` consecutive lines of ``lines`` (or all, if fewer)?"""
    run = min(run, len(lines))
    if run == 0:
        return False
    return any(all(line in haystack for line in lines[i:i + run]) for i in range(len(lines) - run + 1))


def _chapter_text(path):
    code, outputs = [], []
    for cell in _code_cells(path):
        code.append(cell.source)
        for o in cell.outputs:
            outputs.append(o.get("text", "") + o.get("data", {}).get("text/plain", ""))
    return code, " ".join(" ".join(t.split()) for t in outputs)


def test_answer_detector_finds_a_printed_source_and_a_written_out_answer():
    import inspect

    from minivllm.core.scheduler import Scheduler

    printed = " ".join(inspect.getsource(Scheduler.schedule).split())
    name, lines = _body_lines("minivllm.core.scheduler:Scheduler.schedule")
    # the whole source shows it; its first two lines alone do not (three in a row are needed)
    assert _shows(printed, lines) and not _shows(" ".join(lines[:2]), lines)
    assert any(re.search(p, "k = k.repeat_interleave(3, 1)\nw = s.softmax(-1)") for p in ANSWERS[1][1])


@pytest.mark.parametrize("path", CHAPTERS, ids=os.path.basename)
def test_no_chapter_shows_the_answer_to_an_exercise_before_it(path):
    """A chapter neither prints the package's source of what an exercise (of this chapter or a
    later one) asks the learner to write, nor writes that answer out in its own code."""
    chapter = int(os.path.basename(path)[:2])
    code, outputs = _chapter_text(path)
    for exercise_chapter, (sources, patterns) in ANSWERS.items():
        if exercise_chapter < chapter:
            continue  # that exercise came before this chapter: its answer may be shown
        for dotted in sources:
            name, lines = _body_lines(dotted)
            assert not _shows(outputs, lines), (
                f"an output shows the source of {name}, the answer to an exercise of chapter "
                f"{exercise_chapter}: explain it in prose, pseudo-code or a diagram instead")
            assert not any(f"getsource({name}" in c for c in code), name
        solution = _solution_lines(exercise_chapter)
        for i, cell in enumerate(code):
            for pattern in patterns:
                assert not re.search(pattern, cell), (
                    f"code cell {i} writes out the answer to an exercise of chapter "
                    f"{exercise_chapter} ({pattern!r}): explain it in prose instead")
            assert not _shows(cell, solution, run=2), (
                f"code cell {i} repeats the solution of an exercise of chapter {exercise_chapter}")
