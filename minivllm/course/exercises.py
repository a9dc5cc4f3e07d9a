"""The exercise generator: solutions/NN_topic.ipynb -> exercises/NN_topic.ipynb.

In a solutions notebook the learner's part of a code cell sits between
``### BEGIN SOLUTION Exercise 1.1: <what to do>`` and ``### END SOLUTION``; the exercise
notebook replaces it by ``raise NotImplementedError("Exercise 1.1: <what to do>")`` (so it
fails exactly where work is missing), leaves out cells tagged ``solution-only`` and clears
outputs. Numbers "N.M" must match the chapter N and count M = 1, 2, ... in order (an exercise
may span consecutive blocks).
"""

from __future__ import annotations

import os
import re

import nbformat

BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION\b(?P<rest>.*)$")
END = re.compile(r"^[ \t]*### END SOLUTION\s*$")
LABEL = re.compile(r"^\s*Exercise (?P<n>\d+)\.(?P<m>\d+):\s*(?P<what>\S.*?)\s*$")
NOTEBOOK_NAME = re.compile(r"^(?P<n>\d\d)_[a-z0-9_]+\.ipynb$")
SOLUTION_ONLY = "solution-only"  # the cell tag of what the exercise notebook leaves out

HEADER = (
    "*Generated from `solutions/{name}` by `python -m minivllm.course make-exercises`: edit the "
    "solutions notebook, not this one.*\n\n"
    "Replace every `raise NotImplementedError(...)` with your code, run the grading cell below "
    "it, and grade the whole notebook with `pytest --nbval exercises/{name}`."
)


class ExerciseFormatError(ValueError):
    """A solutions notebook whose markers the generator cannot turn into exercises."""


def strip_solutions(source: str, where: str = "cell") -> tuple[str, list[str]]:
    """Replace each BEGIN/END SOLUTION block; return the new source and the exercise labels."""
    out, labels, inside = [], [], False
    for lineno, line in enumerate(source.split("\n"), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if inside:
                raise ExerciseFormatError(f"{where}, line {lineno}: BEGIN SOLUTION inside another")
            label = LABEL.match(begin["rest"])
            if label is None:
                raise ExerciseFormatError(
                    f"{where}, line {lineno}: write what to do after the marker, as in "
                    "'### BEGIN SOLUTION Exercise 1.2: rotate q and k by their positions'")
            text = f"Exercise {label['n']}.{label['m']}: {label['what']}"
            escaped = text.replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'{begin["indent"]}raise NotImplementedError("{escaped}")')
            labels.append(f"{label['n']}.{label['m']}")
            inside = True
        elif end:
            if not inside:
                raise ExerciseFormatError(f"{where}, line {lineno}: END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ExerciseFormatError(f"{where}: BEGIN SOLUTION is never closed by END SOLUTION")
    return "\n".join(out), labels


def _check_numbering(labels: list[str], chapter: int, where: str) -> None:
    expected_next = 1
    for label in labels:
        n, m = (int(x) for x in label.split("."))
        if n != chapter:
            raise ExerciseFormatError(
                f"{where}: Exercise {label} belongs to chapter {n}, not {chapter}")
        if m == expected_next:
            expected_next += 1
        elif m != expected_next - 1:  # the same exercise continued in a later block
            raise ExerciseFormatError(
                f"{where}: Exercise {label} is out of order (expected {chapter}.{expected_next})")
    if not labels:
        raise ExerciseFormatError(f"{where}: no '### BEGIN SOLUTION' block, so no exercise")


def make_exercise_notebook(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The learner's notebook for one solutions notebook (``name``: its file name)."""
    match = NOTEBOOK_NAME.match(name)
    if match is None:
        raise ExerciseFormatError(
            f"{name}: notebooks are named NN_topic.ipynb (e.g. 01_the_model.ipynb)")
    cells = [nbformat.v4.new_markdown_cell(HEADER.format(name=name), id="generated-header")]
    labels: list[str] = []
    for i, cell in enumerate(solution.cells):
        tags = cell.get("metadata", {}).get("tags") or []
        if SOLUTION_ONLY in tags:
            if "### BEGIN SOLUTION" in cell.source:
                raise ExerciseFormatError(
                    f"{name}, cell {i}: a solution-only cell cannot hold an exercise")
            continue
        source = cell.source
        if cell.cell_type == "code":
            source, found = strip_solutions(source, where=f"{name}, cell {i}")
            labels += found
        new = {"code": nbformat.v4.new_code_cell, "markdown": nbformat.v4.new_markdown_cell}.get(
            cell.cell_type, nbformat.v4.new_raw_cell)(source)
        if tags:
            new.metadata["tags"] = list(tags)
        new["id"] = cell.get("id") or f"cell-{i}"  # stable ids: the file is the same on every run
        cells.append(new)
    _check_numbering(labels, int(match["n"]), name)
    metadata = {k: solution.metadata[k] for k in ("kernelspec", "language_info")
                if k in solution.metadata}
    return nbformat.v4.new_notebook(cells=cells, metadata=metadata)


def generate(root: str = ".") -> dict[str, str]:
    """{exercises/NN_topic.ipynb path: text} for every solutions/NN_topic.ipynb under ``root``."""
    solutions = os.path.join(root, "solutions")
    if not os.path.isdir(solutions):
        raise ExerciseFormatError(f"no solutions/ folder in {os.path.abspath(root)!r}")
    out = {}
    for name in sorted(n for n in os.listdir(solutions) if n.endswith(".ipynb")):
        solution = nbformat.read(os.path.join(solutions, name), as_version=4)
        out[os.path.join(root, "exercises", name)] = nbformat.writes(
            make_exercise_notebook(solution, name)) + "\n"
    return out


def stale_exercises(root: str = ".") -> list[str]:
    """Exercise notebooks that differ from what ``generate`` writes now, or have no solution."""
    wanted = generate(root)
    stale = [path for path, text in wanted.items() if _read(path) != text]
    folder = os.path.join(root, "exercises")
    if os.path.isdir(folder):
        stale += [os.path.join(folder, n) for n in sorted(os.listdir(folder))
                  if n.endswith(".ipynb") and os.path.join(folder, n) not in wanted]
    return stale


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_exercises(root: str = ".") -> list[str]:
    """Write every exercise notebook (and delete ones whose solution is gone)."""
    wanted = generate(root)
    os.makedirs(os.path.join(root, "exercises"), exist_ok=True)
    for path, text in wanted.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    for path in stale_exercises(root):  # only orphans are left
        os.remove(path)
    return sorted(wanted)
