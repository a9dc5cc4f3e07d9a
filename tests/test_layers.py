"""The package's import directions: each layer imports only from the layers below it.

    utils, progress, outputs, sampling_params, config, core.sched_output, engine.messages
      <  kernels, cpu_kernels, distributed  <  attention
      <  model  <  sample  <  worker  <  executor  <  core  <  engine  <  entrypoints
      <  testing, sim
      <  benchmarks  <  course

``config`` (the engine's arguments and resolved configuration), ``core.sched_output`` (the
messages from the scheduler to the runner) and ``engine.messages`` (those between the front end
and the engine core) are shared vocabulary at the bottom: plain dataclasses that the layers
above fill in and read.

Checked on module-level imports (what runs at ``import``); imports inside functions and under
``if TYPE_CHECKING:`` are how an upper layer is reached on purpose, late. ``import minivllm``
loads nothing heavy, and the scheduler and the simulator import without torch.
"""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = [
    {"utils", "progress", "outputs", "sampling_params", "config", "core.sched_output",
     "engine.messages"},
    {"kernels", "distributed", "cpu_kernels"},
    {"attention"},
    {"model", "model_hub"},
    {"sample"},
    {"worker"},
    {"executor"},
    {"core"},
    {"engine"},
    {"entrypoints"},
    {"testing", "sim"},
    {"benchmarks"},
    {"course"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
    for path in sorted((ROOT / "minivllm").rglob("*.py")):
        parts = path.relative_to(ROOT / "minivllm").with_suffix("").parts
        yield "minivllm." + ".".join(parts), parts, path
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        parts = ("kernels", *path.relative_to(ROOT / "kernels").with_suffix("").parts)
        yield "minivllm." + ".".join(parts), parts, path


def _top_level_imports(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Try):
            nodes = node.body
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            nodes = [node]
        else:
            continue
        for n in nodes:
            if isinstance(n, ast.Import):
                yield from (a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                yield n.module


def _layer(parts: tuple[str, ...]) -> str:
    """The most specific name in LEVEL for a module: ``core.sched_output``, else ``core``."""
    if parts == ("__init__",):
        return "__init__"
    dotted = ".".join(parts)
    return dotted if dotted in LEVEL else parts[0]


def test_imports_follow_the_layers():
    wrong = []
    for module, parts, path in _modules():
        here = _layer(parts)
        if here == "__init__":
            continue
        assert here in LEVEL, f"{module}: put its package in a layer of this test"
        for target in _top_level_imports(ast.parse(path.read_text())):
            if not target.startswith("minivllm."):
                continue
            there = _layer(tuple(target.split(".")[1:]))
            if there != here and LEVEL[there] > LEVEL[here]:
                wrong.append(f"{module} ({here}) imports {target} ({there}), a layer above")
    assert not wrong, "\n".join(wrong)


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_minivllm_is_light_and_the_scheduler_needs_no_torch():
    assert "torch" not in _loaded_after("import minivllm")
    for statement in ("import minivllm.core.scheduler", "import minivllm.sim",
                      "from minivllm import SamplingParams"):
        loaded = _loaded_after(statement)
        assert "torch" not in loaded, statement
        assert "minivllm.worker.model_runner" not in loaded, statement
    assert "minivllm.engine.llm_engine" in _loaded_after("from minivllm import LLM")
