"""Decode attention on a CPU through a small C kernel, compiled on first use.

Plain torch has no paged attention for a CPU: the torch backend gathers each decode group's
keys, multiplies them with one batched matmul and sums the values with ``F.embedding_bag``
(``attend_decodes_by_rows``), several passes over memory per layer. ``cpu_decode.c`` reads
each context token's K and V rows once, straight from their blocks, with no padding and no
copy, on all of torch's threads. vLLM's CPU backend likewise runs its decode attention in
native code of its own.

The first time an engine needs it, the C file is compiled with the machine's C compiler
(``$CC``, else ``cc``; ``-O3 -march=native``) into minivllm's cache folder (a file named by a
hash of the source, the flags and the CPU, so a changed source or another CPU builds anew) and
loaded with ``ctypes``. Without a compiler, or when the build fails, the torch path runs and one
warning says why. ``MINIVLLM_CPU_ATTENTION=torch`` turns it off; it only serves float32 caches
on a CPU, and never a call that needs autograd (the course's models with gradients on).

Its results equal the torch reference up to float rounding (another summation order, and its
own ``exp``): ``tests/test_cpu_decode.py`` checks it against attention written out densely.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

ENV = "MINIVLLM_CPU_ATTENTION"  # "c" (default) or "torch"
SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-shared",
         "-pthread", "-fopenmp"]
# -ffast-math lets the compiler vectorize the dot products' sums (it reorders them);
# -fno-finite-math-only keeps -inf meaning -inf
ERRORS = {1: "a sequence of length < 1",
          2: "a block id outside the KV cache, or a context longer than its block table",
          3: "out of memory", 4: "a bad shape (heads not a multiple of KV heads?)"}

_kernel = None
_tried = False


def enabled() -> bool:
    return os.environ.get(ENV, "c").lower() != "torch"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def library_path(compiler: str, flags: list[str]) -> Path:
    from minivllm.model_hub import cache_dir

    key = hashlib.sha256(b"\0".join(
        [SOURCE.read_bytes(), compiler.encode(), " ".join(flags).encode(),
         platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
    return Path(cache_dir()) / "kernels" / f"cpu_decode-{key}.so"


def build(compiler: str | None = None) -> Path:
    """Compile ``cpu_decode.c`` unless this exact build is cached; returns the library's path.
    Raises ``RuntimeError`` with the compiler's message when it fails."""
    compiler = compiler or os.environ.get("CC") or "cc"
    flags = list(FLAGS)
    path = library_path(compiler, flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # into a temporary file first, then renamed: processes building at once (tensor-parallel
    # workers, test workers) never load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        portable = [f for f in flags if f != "-march=native"]
        # without OpenMP (e.g. Apple's compiler) the kernel starts threads of its own
        attempts = (flags, [f for f in flags if f != "-fopenmp"], portable,
                    [f for f in portable if f != "-fopenmp"])
        for attempt in attempts:
            try:
                done = subprocess.run([compiler, *attempt, str(SOURCE), "-o", tmp, "-lm"],
                                      capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise RuntimeError(f"cannot run the C compiler {compiler!r}: {e}") from e
            if done.returncode == 0:
                os.replace(tmp, path)
                return path
        raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr.strip()}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def kernel():
    """The loaded C function, or None (turned off, or it could not be built: warned once)."""
    global _kernel, _tried
    if _tried or not enabled():
        return _kernel if enabled() else None
    _tried = True
    try:
        fn = ctypes.CDLL(str(build())).minivllm_paged_decode_f32
    except (RuntimeError, OSError) as e:
        warnings.warn(f"minivllm: the CPU decode attention kernel is unavailable, using the "
                      f"slower torch path ({e}). Set {ENV}=torch to silence this.", stacklevel=2)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 11 + [ctypes.c_float, ctypes.c_int64]
    _kernel = fn
    return fn


def can_run(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this call may take the C kernel (which does not build it)."""
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32
            and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
            and not (torch.is_grad_enabled() and (q.requires_grad or kv_cache.requires_grad)))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                 sliding_window: int | None = None, num_threads: int | None = None) -> bool:
    """``out[i] = attention of q[i]`` over sequence i's context (its ``seq_lens[i]`` tokens, or
    the last ``sliding_window`` of them), for the first ``len(q)`` sequences, on
    ``num_threads`` threads (default: torch's). Returns False (nothing written) when the kernel
    is not available; raises ``ValueError`` on bad input (then ``out`` may be partly written)."""
    fn = kernel()
    if fn is None:
        return False
    n, heads, d = q.shape
    if n == 0:
        return True
    _, num_blocks, block_size, kv_heads, kd = kv_cache.shape
    if (kd != d or q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1
            or out.stride(1) != d or out.dtype != torch.float32):
        raise ValueError("paged_decode: q and out must be float32 rows of [heads, head_dim]")
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    lens = seq_lens[:n]
    lens = lens if lens.dtype == torch.int32 and lens.is_contiguous() else lens.int().contiguous()
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    if tables.shape[0] < n or lens.shape[0] < n:
        raise ValueError("paged_decode: fewer block tables or lengths than queries")
    status = fn(q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(),
                tables.data_ptr(), lens.data_ptr(), n, tables.stride(0), tables.shape[1], q.stride(0),
                out.stride(0), heads, kv_heads, d, block_size, num_blocks,
                sliding_window or 0, scale, num_threads or torch.get_num_threads())
    if status:
        raise ValueError(f"paged_decode: {ERRORS.get(status, f'error {status}')}")
    return True
