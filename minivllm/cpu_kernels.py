"""minivllm's CPU kernels (``cpu_kernels.cpp``): torch operators built on first use.

Plain torch has no paged attention for a CPU: the torch backend gathers each decode group's
keys, multiplies them with one batched matmul and sums the values with ``F.embedding_bag``
(``attend_decodes_by_rows``), several passes over memory per layer. ``paged_decode`` reads each
context token's K and V rows once, straight from their blocks, with no padding and no copy, on
torch's threads; ``paged_prefill`` does the same for a step's prefill chunks (causal among
their new tokens, over everything before them), where torch would gather each chunk's context
and call ``scaled_dot_product_attention`` on it. And a decoder layer's elementwise blocks are
many small torch ops each (an RMSNorm is seven, a rotary embedding twenty): ``rms_norm``,
``rotary_embedding`` and ``silu_and_mul`` here are one call each, with the signatures of
``model/layers.py``'s functions (the model runner swaps them in on a CPU, as it swaps in Triton
kernels on a GPU). vLLM's CPU backend likewise runs its attention and these ops in native code
of its own. ``pack_panels`` and ``few_rows_linear`` are the linear layers of a decode step's few
rows (``model/cpu_gemm.py`` says when they serve). ``race_sample`` is the sampler's exponential
race in one pass per row (``sample/sampler.py``'s ``sample_race``).

The C++ file registers them with torch's dispatcher (``TORCH_LIBRARY``) as
``torch.ops.minivllm_cpu.*``, and this module gives each a shape function for tracing
(``torch.library.register_fake``), so ``torch.compile`` sees them as ops in its graph. Their
loops run on torch's own thread pool (``at::parallel_for``): the library is compiled with
``-fopenmp`` for that but links no OpenMP runtime of its own, so its calls go to the one torch
loaded and the process has one.

The first time an engine needs them, ``build`` compiles the file with the machine's C++
compiler (``$CXX``, which may be a launcher and a compiler such as ``ccache g++``, else ``c++``)
against torch's headers and libraries (``torch.utils.cpp_extension``'s paths), ``-O3
-march=native``, no ``-ffast-math``, into minivllm's cache folder: one file per source,
compiler and its version, flags, torch and CPU, so any change among them builds anew. A file
lock makes processes that start at once (test workers, tensor-parallel ranks) build it once.
Without a compiler, or when the build fails, the torch code runs and one warning gives the
compiler's first error. ``MINIVLLM_CPU_KERNELS=torch`` turns them off. They serve float32
tensors on a CPU only, and never a call that needs autograd (the course's models with gradients
on): those take the torch code.

Their results equal the torch code's up to float rounding (other summation orders, and their
own ``exp``): ``tests/test_cpu_kernels.py`` checks each against it, and the greedy outputs
against transformers run with them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

ENV = "MINIVLLM_CPU_KERNELS"  # "c" (default) or "torch"
SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
NAMESPACE = "minivllm_cpu"  # torch.ops.minivllm_cpu.*
# -fassociative-math (with the two before it) lets the compiler vectorize the dot products'
# sums, which it may then reorder. Not -ffast-math: a shared library linked with it turns on
# flush-to-zero for the whole process when it is loaded (denormal floats become 0 in torch and
# in Python too), which tests/test_cpu_kernels.py checks does not happen.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-std=c++20", "-fPIC", "-fopenmp"]
# tried in turn when a flag is not understood (another CPU architecture, a compiler without
# OpenMP, whose kernels then run on one thread)
FALLBACKS = (("-march=native",), ("-march=native", "-fopenmp"))
COMPILE_TIMEOUT_S = 600  # torch's headers are large; a busy machine is slow

_ops = None
_tried = False


def enabled() -> bool:
    return os.environ.get(ENV, "c").lower() != "torch"


def compiler() -> list[str]:
    """The C++ compiler's command: ``$CXX`` split like a shell (``ccache g++``), else c++."""
    return shlex.split(os.environ.get("CXX") or "c++")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot run the C++ compiler {shlex.join(compiler())!r} "
                           f"(set $CXX to another): {e}") from e


_versions: dict[tuple[str, ...], str] = {}


def compiler_version(command: list[str]) -> str:
    """``command --version``'s output (asked once per process), part of the build's key."""
    key = tuple(command)
    if key not in _versions:
        done = _run([*command, "--version"])
        if done.returncode:
            raise RuntimeError(f"{shlex.join(command)} --version failed: "
                               f"{(done.stderr or done.stdout).strip()[:500]}")
        _versions[key] = done.stdout.strip()
    return _versions[key]


def _torch_flags() -> tuple[list[str], list[str]]:
    """The flags that compile against and link with this torch (its headers, c10, torch_cpu).
    No OpenMP library is linked: the kernels' parallel regions use the runtime torch loaded."""
    from torch.utils import cpp_extension

    include = [f for path in cpp_extension.include_paths() for f in ("-isystem", path)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    lib = cpp_extension.library_paths()
    link = [*(f"-L{p}" for p in lib), "-lc10", "-ltorch_cpu", *(f"-Wl,-rpath,{p}" for p in lib)]
    return [abi, *include], link


def library_path(command: list[str], flags: list[str]) -> Path:
    """Where the build of this source with this compiler and these flags is cached."""
    from minivllm.model_hub import cache_dir

    parts = [SOURCE.read_bytes(), shlex.join(command), compiler_version(command),
             " ".join(flags), torch.__version__, str(Path(torch.__file__).parent),
             platform.machine(), _cpu_signature()]
    key = hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode()
                                    for p in parts)).hexdigest()[:16]
    return Path(cache_dir()) / "kernels" / f"cpu_kernels-{key}.so"


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` for the block (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _first_error(output: str, lines: int = 12) -> str:
    """The compiler's first error and a few lines around it (a C++ error can run to pages)."""
    text = output.strip().splitlines()
    first = next((i for i, ln in enumerate(text) if "error" in ln.lower()), 0)
    return "\n".join(text[max(0, first - 2): first + lines])


def build() -> Path:
    """Compile ``cpu_kernels.cpp`` unless this exact build is cached; returns the library's path.
    Raises ``RuntimeError`` with the compiler's first error when no flag set builds."""
    command = compiler()
    cflags, ldflags = _torch_flags()
    path = library_path(command, FLAGS + cflags + ldflags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        if path.exists():  # another process built it while this one waited
            return path
        # into a temporary folder first, then renamed: a process that finds the library
        # without taking the lock never loads a half-written one
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".build-"))
        try:
            errors = []
            for drop in ((), *FALLBACKS):
                flags = [f for f in FLAGS if f not in drop]
                obj, lib = tmp / "cpu_kernels.o", tmp / "cpu_kernels.so"
                steps = ([*command, *flags, *cflags, "-c", str(SOURCE), "-o", str(obj)],
                         # linked without -fopenmp: no OpenMP runtime of its own
                         [*command, "-shared", str(obj), "-o", str(lib), *ldflags])
                for step in steps:
                    done = _run(step)
                    if done.returncode:
                        errors.append((step, done.stderr or done.stdout))
                        break
                else:
                    os.replace(lib, path)
                    return path
            step, output = errors[0]
            raise RuntimeError(
                f"the C++ compiler failed on {SOURCE.name} ({len(errors)} flag sets tried; "
                f"the first):\n$ {shlex.join(step)}\n{_first_error(output)}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _registered() -> bool:
    """Whether this process loaded the library already (a reloaded module finds it loaded)."""
    return hasattr(getattr(torch.ops, NAMESPACE), "rms_norm")


def _register_fakes() -> None:
    """Output shapes for tracing (FakeTensors): what torch.compile needs to put the ops in its
    graph without running them."""
    def fake(name):
        return torch.library.register_fake(f"{NAMESPACE}::{name}")

    fake("paged_decode")(lambda q, kv_cache, block_tables, seq_lens, scale, out, window,
                         parts: None)
    fake("rms_norm")(lambda x, weight, eps: x.new_empty(x.shape))
    fake("fused_add_rms_norm")(lambda x, residual, weight, eps: (x.new_empty(x.shape),
                                                                 x.new_empty(x.shape)))
    fake("silu_and_mul")(lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))
    fake("rotary_embedding")(lambda positions, q, k, cos_sin_cache: (q.new_empty(q.shape),
                                                                     k.new_empty(k.shape)))
    fake("pack_panels")(lambda w: w.new_empty(((w.shape[0] + 15) // 16, w.shape[1], 16)))
    fake("paged_prefill")(lambda q, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                          out, window, parts: None)
    fake("race_sample")(lambda probs, keys: keys.new_empty((probs.shape[0],)))
    fake("few_rows_linear")(lambda x, panels, bias, out_features: x.new_empty(
        (*x.shape[:-1], out_features)))

    @fake("decoder_layers")
    def _(hidden, positions, slots, block_tables, seq_lens, query_start_loc, num_decodes,
          weights, qkv_biases, kv_caches, cos_sin_cache, windows, heads, eps, scale, few_rows,
          keep=None):  # a row per kept sequence, or per token
        return hidden.new_empty((hidden.shape[0] if keep is None else keep.shape[0],
                                 hidden.shape[1]))


def library():
    """``torch.ops.minivllm_cpu`` once the library is loaded, or None: turned off, or it could
    not be built (warned once)."""
    global _ops, _tried
    if not enabled():
        return None
    if _tried:
        return _ops
    _tried = True
    if not _registered():
        try:
            torch.ops.load_library(str(build()))
        except (RuntimeError, OSError) as e:
            warnings.warn(f"minivllm: the CPU kernels are unavailable, using the slower torch "
                          f"code ({e}). Set {ENV}=torch to silence this.", stacklevel=2)
            return None
    _register_fakes()
    _ops = getattr(torch.ops, NAMESPACE)
    return _ops


def kernel():
    """The decode attention operator, or None (see ``library``)."""
    ops = library()
    return None if ops is None else ops.paged_decode.default


def _plain(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors that no autograd graph needs"""
    grad = torch.is_grad_enabled()
    return all(t.device.type == "cpu" and t.dtype == torch.float32
               and not (grad and t.requires_grad) for t in tensors)


def _heads_side_by_side(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] whose heads are one contiguous row per token (any row stride):
    what the kernels index as ``x + token * stride(0) + head * head_dim``"""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def can_run(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this decode attention may take the C++ kernel (which does not build it):
    float32 on a CPU, no autograd, a contiguous cache and each query token's heads side by
    side."""
    return (enabled() and _plain(q, kv_cache) and kv_cache.is_contiguous()
            and _heads_side_by_side(q))


def int32_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as int32 rows with a contiguous last dim (what the attention kernels index)."""
    return x if x.dtype == torch.int32 and x.stride(-1) == 1 else x.int().contiguous()


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                 sliding_window: int | None = None, num_threads: int | None = None) -> bool:
    """``out[i] = attention of q[i]`` over sequence i's context (its ``seq_lens[i]`` tokens, or
    the last ``sliding_window`` of them), for the first ``len(q)`` sequences, split into
    ``num_threads`` parts (default: torch's thread count) that torch's threads run. Returns
    False (nothing written) when the kernel is not available; raises ``ValueError`` on bad
    input (then ``out`` may be partly written)."""
    fn = kernel()
    if fn is None:
        return False
    n = q.shape[0]
    if n == 0:
        return True
    fn(q, kv_cache, int32_rows(block_tables), int32_rows(seq_lens[:n]), scale, out,
       sliding_window or 0, num_threads or 0)
    return True


def prefill_takes(head_dim: int) -> bool:
    """Whether ``paged_prefill``'s kernel takes heads of this size (its tiles are 16 floats)."""
    return head_dim % 16 == 0


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                  out: torch.Tensor, sliding_window: int | None = None,
                  num_threads: int | None = None) -> bool:
    """Causal attention of each sequence's new tokens (``q[query_start_loc[i]:
    query_start_loc[i + 1]]``, the last of its ``seq_lens[i]`` tokens, already written to the
    cache) over its context, written into the same rows of ``out``. Returns False (nothing
    written) when the kernel is not available or the head size is not a multiple of 16; raises
    ``ValueError`` on bad input (then ``out`` may be partly written)."""
    ops = library()
    if ops is None or not prefill_takes(q.shape[-1]) or not _heads_side_by_side(out):
        return False
    if seq_lens.shape[0] == 0:
        return True
    ops.paged_prefill.default(q, kv_cache, int32_rows(block_tables), int32_rows(seq_lens),
                              int32_rows(query_start_loc), scale, out, sliding_window or 0,
                              num_threads or 0)
    return True


def few_rows_fit(x: torch.Tensor) -> bool:
    """Whether ``few_rows_linear`` can take ``x`` (or ``pack_panels`` a weight): float32 rows on
    a CPU with a contiguous last dim, no autograd (the library itself is ``library()``'s)."""
    return _plain(x) and _rows(x)


def race_fits(probs: torch.Tensor) -> bool:
    """Whether ``race_sample`` can take ``probs``: [rows, vocab] float32 on a CPU, no autograd,
    a contiguous last dim."""
    return enabled() and probs.dim() == 2 and _plain(probs) and _rows(probs)


# -- elementwise ops: layers.py's signatures; the torch code where the kernels cannot serve ---

def _rows(x: torch.Tensor) -> bool:
    """[..., n] whose last dim is contiguous and whose leading dims are one row stride"""
    return x.stride(-1) == 1 and (x.dim() <= 2 or x.is_contiguous())


def cpu_elementwise_ops(native: dict) -> dict | None:
    """The operators in place of ``native``'s ops (``model/layers.py``'s ``NATIVE_OPS``, by
    ``op_name``), each falling back to its native op for a call it cannot serve; None when the
    library is not there."""
    ops = library()
    if ops is None:
        return None
    native_rms_norm, native_rotary = native["rms_norm"], native["rotary_embedding"]
    native_silu_and_mul = native["silu_and_mul"]
    c_rms_norm, c_add_rms_norm = ops.rms_norm.default, ops.fused_add_rms_norm.default
    c_silu_and_mul, c_rotary = ops.silu_and_mul.default, ops.rotary_embedding.default

    def rms_norm(x, weight, eps, residual=None):
        tensors = (x, weight) if residual is None else (x, weight, residual)
        if not (_plain(*tensors) and weight.is_contiguous() and all(map(_rows, tensors))):
            return native_rms_norm(x, weight, eps, residual)
        if residual is None:
            return c_rms_norm(x, weight, eps)
        return c_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(x):
        if not (_plain(x) and _rows(x)):
            return native_silu_and_mul(x)
        return c_silu_and_mul(x)

    def rotary_embedding(positions, q, k, cos_sin_cache):
        if not (_plain(q, k, cos_sin_cache) and positions.device.type == "cpu"
                and _heads_side_by_side(q) and _heads_side_by_side(k)
                and cos_sin_cache.is_contiguous() and cos_sin_cache.shape[-1] == q.shape[-1]):
            return native_rotary(positions, q, k, cos_sin_cache)
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else (
            positions.to(torch.int64).contiguous())
        return c_rotary(pos, q, k, cos_sin_cache)

    return {"rms_norm": rms_norm, "rotary_embedding": rotary_embedding,
            "silu_and_mul": silu_and_mul}
