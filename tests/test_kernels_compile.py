"""Every Triton kernel compiles for an H200 (sm_90), the attention kernels also for a T4 (sm_75)
and an A10 (sm_86) within each one's shared memory, checked on any Linux machine (no GPU)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_kernels_compile_for_sm75_sm86_sm90(tmp_path):
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, don't reuse a cached cubin
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "aot_compile.py")],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    # the script found every @triton.jit function the sources define (counted here another way)
    # and compiled each one, or a kernel that calls it
    found = re.search(r"found (\d+) @triton.jit functions in minivllm.kernels: (\d+) kernels "
                      r"compiled, (\d+) helpers", done.stdout)
    assert found, done.stdout[-2000:]
    n, kernels, helpers = map(int, found.groups())
    assert n == _jit_decorators() and kernels + helpers == n and kernels > 0
    variants = re.search(r"compiled (\d+) kernel variants for sm_75, sm_86, sm_90, each within its "
                         r"shared memory", done.stdout)
    assert variants and int(variants.group(1)) > kernels, done.stdout[-2000:]  # several dtypes


def _jit_decorators() -> int:
    """How many functions the kernels' sources decorate with @triton.jit."""
    folder = os.path.join(ROOT, "kernels")
    return sum(len(re.findall(r"^@triton\.jit\b", open(os.path.join(folder, f)).read(), re.M))
               for f in os.listdir(folder) if f.endswith(".py"))


def _aot_module():
    spec = importlib.util.spec_from_file_location("aot_compile", os.path.join(ROOT, "tests",
                                                                              "aot_compile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Fn:
    """Stands in for a JIT function: a name and a source (hashable, as the script needs)."""

    def __init__(self, name: str, src: str) -> None:
        self.__name__, self.src = name, src


def test_a_kernel_left_out_of_the_compile_script_is_named():
    """The script's own bookkeeping, on stand-ins: a function a compiled kernel calls is a helper,
    one nobody compiles or calls is reported (the script then fails)."""
    aot = _aot_module()
    kernel = _Fn("_k_kernel", "def _k_kernel(x):\n    y = tile(x)\n")
    tile, new = _Fn("tile", "def tile(x): ..."), _Fn("_new_kernel", "def _new_kernel(x): ...")
    found = {"m._k_kernel": kernel, "m.tile": tile, "m._new_kernel": new}
    assert aot.uncompiled(found, {kernel}) == ({"m.tile"}, ["m._new_kernel"])
    assert aot.uncompiled(found, {kernel, new}) == ({"m.tile"}, [])
