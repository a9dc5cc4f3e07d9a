"""minivllm's CPU kernels in C (``cpu_kernels.c``), compiled on first use and called with ctypes.

Plain torch has no paged attention for a CPU: the torch backend gathers each decode group's
keys, multiplies them with one batched matmul and sums the values with ``F.embedding_bag``
(``attend_decodes_by_rows``), several passes over memory per layer. ``paged_decode`` reads each
context token's K and V rows once, straight from their blocks, with no padding and no copy, on
torch's threads. And a decoder layer's elementwise blocks are many small torch ops each (an
RMSNorm is seven, a rotary embedding twenty): ``rms_norm``, ``rotary_embedding`` and
``silu_and_mul`` here are one call each, with the signatures of ``model/layers.py``'s functions
(the model runner swaps them in on a CPU, as it swaps in Triton kernels on a GPU). vLLM's CPU
backend likewise runs its attention and these ops in native code of its own.

The first time an engine needs them, the C file is compiled with the machine's C compiler
(``$CC``, else ``cc``; ``-O3 -march=native -fopenmp``, no ``-ffast-math``) into minivllm's
cache folder (a file named by a hash of the source, the flags and the CPU, so a changed source
or another CPU builds anew) and loaded with ``ctypes``. Built with OpenMP, the kernels run on
torch's own OpenMP threads (the process has one OpenMP runtime, torch's). Without a compiler,
or when the build fails, the torch code runs and one warning says why.
``MINIVLLM_CPU_KERNELS=torch`` turns them off. They serve float32 tensors on a CPU only, and
never a call that needs autograd (the course's models with gradients on): those take the torch
code.

Their results equal the torch code's up to float rounding (other summation orders, and their
own ``exp``): ``tests/test_cpu_kernels.py`` checks each against it, and the greedy outputs
against transformers run with them.
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

ENV = "MINIVLLM_CPU_KERNELS"  # "c" (default) or "torch"
SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-fPIC", "-shared", "-pthread", "-fopenmp"]
# -fassociative-math (with the two before it) lets the compiler vectorize the dot products'
# sums, which it may then reorder. Not -ffast-math: a shared library linked with it turns on
# flush-to-zero for the whole process when it is loaded (denormal floats become 0 in torch and
# in Python too), which tests/test_cpu_kernels.py checks does not happen.
ERRORS = {1: "a sequence of length < 1",
          2: "a block id outside the KV cache, or a context longer than its block table",
          3: "out of memory", 4: "a bad shape (heads not a multiple of KV heads?)"}

_library = None
_tried = False
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


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
    return Path(cache_dir()) / "kernels" / f"cpu_kernels-{key}.so"


def build(compiler: str | None = None) -> Path:
    """Compile ``cpu_kernels.c`` unless this exact build is cached; returns the library's path.
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


_SIGNATURES = {  # C function: (return type, argument types)
    "minivllm_paged_decode_f32": (ctypes.c_int, [_P] * 6 + [_I] * 11 + [_F, _I]),
    "minivllm_rms_norm_f32": (None, [_P, _I, _P, _I, _P, _P, _I, _P, _I, _I, _I, _F, _I]),
    "minivllm_silu_and_mul_f32": (None, [_P, _I, _P, _I, _I, _I, _I]),
    "minivllm_rotary_f32": (ctypes.c_int, [_P, _P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I,
                                           _I]),
}


def library():
    """The loaded library (its functions typed), or None: turned off, or it could not be
    built (warned once)."""
    global _library, _tried
    if not enabled():
        return None
    if _tried:
        return _library
    _tried = True
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"minivllm: the CPU kernels are unavailable, using the slower torch code "
                      f"({e}). Set {ENV}=torch to silence this.", stacklevel=2)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    _library = lib
    return lib


def kernel():
    """The decode attention function, or None (see ``library``)."""
    lib = library()
    return None if lib is None else lib.minivllm_paged_decode_f32


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
    """Whether this decode attention may take the C kernel (which does not build it): float32
    on a CPU, no autograd, a contiguous cache and each query token's heads side by side."""
    return (enabled() and _plain(q, kv_cache) and kv_cache.is_contiguous()
            and _heads_side_by_side(q))


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
    if (kd != d or not _heads_side_by_side(q) or not _heads_side_by_side(out)
            or out.shape != q.shape or out.dtype != torch.float32):
        raise ValueError("paged_decode: q and out must be float32 rows of [heads, head_dim]")
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    lens = seq_lens[:n]
    lens = lens if lens.dtype == torch.int32 and lens.is_contiguous() else lens.int().contiguous()
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    if tables.shape[0] < n or lens.shape[0] < n:
        raise ValueError("paged_decode: fewer block tables or lengths than queries")
    status = fn(q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(),
                tables.data_ptr(), lens.data_ptr(), n, tables.stride(0), tables.shape[1],
                q.stride(0), out.stride(0), heads, kv_heads, d, block_size, num_blocks,
                sliding_window or 0, scale, num_threads or torch.get_num_threads())
    if status:
        raise ValueError(f"paged_decode: {ERRORS.get(status, f'error {status}')}")
    return True


# -- elementwise ops: layers.py's signatures; the torch code where the kernels cannot serve ---

def _rows(x: torch.Tensor) -> bool:
    """[..., n] whose last dim is contiguous and whose leading dims are one row stride"""
    return x.stride(-1) == 1 and (x.dim() <= 2 or x.is_contiguous())


def cpu_elementwise_ops(native: dict) -> dict | None:
    """C versions of ``native``'s ops (``model/layers.py``'s ``NATIVE_OPS``, by ``op_name``),
    each falling back to its native op for a call it cannot serve; None when the library is
    not there."""
    lib = library()
    if lib is None:
        return None
    native_rms_norm, native_rotary = native["rms_norm"], native["rotary_embedding"]
    native_silu_and_mul = native["silu_and_mul"]

    def rms_norm(x, weight, eps, residual=None):
        tensors = (x, weight) if residual is None else (x, weight, residual)
        if not (_plain(*tensors) and weight.is_contiguous() and all(map(_rows, tensors))):
            return native_rms_norm(x, weight, eps, residual)
        hidden = x.shape[-1]
        rows = x.numel() // hidden if hidden else 0
        x2, out = x.reshape(rows, hidden), torch.empty(x.shape, dtype=x.dtype)
        if residual is None:
            lib.minivllm_rms_norm_f32(x2.data_ptr(), x2.stride(0), None, 0, weight.data_ptr(),
                                      out.data_ptr(), hidden, None, 0, rows, hidden, eps,
                                      torch.get_num_threads())
            return out
        r2, new_residual = residual.reshape(rows, hidden), torch.empty(x.shape, dtype=x.dtype)
        lib.minivllm_rms_norm_f32(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0),
                                  weight.data_ptr(), out.data_ptr(), hidden,
                                  new_residual.data_ptr(), hidden, rows, hidden, eps,
                                  torch.get_num_threads())
        return out, new_residual

    def silu_and_mul(x):
        if not (_plain(x) and _rows(x)):
            return native_silu_and_mul(x)
        d = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        x2, out = x.reshape(rows, 2 * d), torch.empty(*x.shape[:-1], d, dtype=x.dtype)
        lib.minivllm_silu_and_mul_f32(x2.data_ptr(), x2.stride(0), out.data_ptr(), d, rows, d,
                                      torch.get_num_threads())
        return out

    def rotary_embedding(positions, q, k, cos_sin_cache):
        if not (_plain(q, k, cos_sin_cache) and positions.device.type == "cpu"
                and _heads_side_by_side(q) and _heads_side_by_side(k)
                and cos_sin_cache.is_contiguous() and cos_sin_cache.shape[-1] == q.shape[-1]):
            return native_rotary(positions, q, k, cos_sin_cache)
        tokens, heads, d = q.shape
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else (
            positions.to(torch.int64).contiguous())
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        bad = lib.minivllm_rotary_f32(pos.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(),
                                      k.stride(0), cos_sin_cache.data_ptr(),
                                      cos_sin_cache.shape[0], q_out.data_ptr(), k_out.data_ptr(),
                                      tokens, heads, k.shape[1], d, torch.get_num_threads())
        if bad:
            raise IndexError(f"rotary_embedding: a position outside [0, {cos_sin_cache.shape[0]})")
        return q_out, k_out

    return {"rms_norm": rms_norm, "rotary_embedding": rotary_embedding,
            "silu_and_mul": silu_and_mul}
