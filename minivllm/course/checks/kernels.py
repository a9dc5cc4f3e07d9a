"""Checkers for chapter 09 (Triton kernels): three warm-up puzzles (a 2-D grid, a tiled
reduction, a tiled ``tl.dot``), then pieces of the real kernels: fused add + RMSNorm, the
online-softmax update, the block-table tile load, the split-K reduction.

Each kernel is reached through the launcher the notebook gives; the checker makes sure the
learner's ``@triton.jit`` piece ran. Cases are small, drawn at grading time (a failure names the
seed) and awkward (widths not a power of two, contexts ending inside a block, shuffled block
tables, partitions a short sequence never fills); then the kernel runs inside the engine on a
tiny Llama, whose greedy tokens must be the reference's. The package's kernels, launchers and
torch references are refused however they are reached (``grading.Exercise``).
"""

from __future__ import annotations

import functools
import importlib
import random
import sys
import types
from contextlib import contextmanager

import torch

from minivllm.attention.torch_backend import paged_decode_attention
from minivllm.course.checks.common import (
    CheckFailed, Exercise, compare_tensors, decodes_through, fail, first_difference,
    greedy_token_ids, passed, write_tiny_checkpoint,
)
from minivllm.course.grading import _triton_fn
from minivllm.model.layers import rms_norm as reference_rms_norm
from minivllm.testing import model_runner

# -- the package's kernels and torch references are the answer: refused however they are reached

KERNEL_MODULES = ("rms_norm", "attention_tile", "decode_attention", "prefill_attention",
                  "activation", "rotary_embedding", "reshape_and_cache")
TORCH_REFERENCES = tuple(  # the package's plain-torch versions of what the exercises write
    f"minivllm.attention.torch_backend:{name}" for name in (
        "paged_decode_attention", "paged_prefill_attention", "gather_context", "gather_blocks",
        "attend_group", "attend_decodes_by_rows")) + ("minivllm.model.layers:rms_norm",)


@functools.lru_cache(maxsize=1)
def package_answer() -> tuple[str, ...]:
    """Every kernel and launcher of ``minivllm.kernels`` (named where it is defined), and the
    torch references."""
    modules = {f"minivllm.kernels.{short}" for short in KERNEL_MODULES}
    names = list(TORCH_REFERENCES)
    for name in sorted(modules):
        try:
            module = importlib.import_module(name)
        except ImportError:  # no triton: no kernels to refuse
            continue
        for value in vars(module).values():
            fn = _triton_fn(value) or value
            if isinstance(fn, types.FunctionType) and fn.__module__ in modules:
                names.append(f"{fn.__module__}:{fn.__qualname__}")
    return tuple(dict.fromkeys(names))


def _unwrapped(fn):
    """``fn`` with the exception of an unsolved kernel (NotImplementedError) or of the grader
    (CheckFailed) raised as itself, not wrapped in Triton's InterpreterError."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            cause = e
            while type(cause).__name__ == "InterpreterError" and cause.__cause__ is not None:
                cause = cause.__cause__  # a jit function inside a kernel: wrapped twice
            if cause is not e and isinstance(cause, (NotImplementedError, CheckFailed)):
                raise cause from None
            raise
    return call


@contextmanager
def counting_runs(piece, launched: bool):
    """Count how often the learner's Triton ``piece`` ran: launches of a kernel, or calls of a
    device function from inside a kernel (the latter only in the interpreter; compiled, the
    call is inlined). Yields a one-element list, or None where nothing can be counted."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if _triton_fn(piece) is None or not launched and not (
            interpreter and isinstance(piece, interpreter.InterpretedFunction)):
        yield None
        return
    count = [0]
    attr = "run" if launched else "rewrite"
    real = getattr(type(piece), attr)
    if launched:
        def counted(*args, **kwargs):
            count[0] += 1
            return real(piece, *args, **kwargs)
        piece.run = counted
    else:
        rewritten = real(piece)

        def counted(*args, **kwargs):
            count[0] += 1
            return rewritten(*args, **kwargs)
        piece.rewrite = lambda: counted
    try:
        yield count
    finally:
        piece.__dict__.pop(attr, None)


def _grade(exercise: str, seed: int, launcher, piece, launched: bool, run_cases) -> None:
    """Refuse the package's answer in the learner's launcher and piece, then run the cases
    (``run_cases(launcher)``, the launcher watched) counting the learner's piece. A failure
    names the seed that repeats the cases."""
    try:
        ex = Exercise(exercise, answer=package_answer(),
                      allowed="torch and Triton (triton, triton.language)")
        if piece is not None:
            if _triton_fn(piece) is None:
                fail(exercise, f"expected your @triton.jit function, got {type(piece).__name__}")
            ex.inspect(piece)
        watched = _unwrapped(ex.take(launcher))
        with counting_runs(piece, launched) as count:
            run_cases(watched)
        if count is not None and count[0] == 0:
            how = "launch" if launched else "reach it through the given kernel, which calls"
            fail(exercise, f"the cases passed without running your {piece.__name__}: the launcher "
                           f"must {how} it")
    except CheckFailed as e:
        raise type(e)(f"{e} [cases drawn with seed={seed}: pass seed={seed} to the checker to "
                      "repeat them]") from None


# -- the tiny model the kernels are plugged into -------------------------------------------------

ENGINE = dict(skip_tokenizer_init=True, block_size=8, num_kv_blocks=64, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=32, attention_backend="torch",
              custom_ops="none", show_progress=False)


@functools.lru_cache(maxsize=1)
def tiny_engine():
    """An engine on a tiny random-weight Llama (GQA: 4 query heads over 2 KV heads, head_dim
    16), small blocks and a small token budget: chunked prefills, decodes beside them."""
    from minivllm import LLM

    return LLM(write_tiny_checkpoint("tiny-llama", seed=0), **ENGINE)


def _prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 30000) for _ in range(12)]  # two prompts share a block and a half
    return [{"prompt_token_ids": shared + [rng.randrange(3, 30000) for _ in range(n)]}
            for n in (9, 1)] + [{"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(n)]}
                                for n in (30, 5)]


def _greedy(llm) -> list[list[int]]:
    return [list(t) for t in greedy_token_ids(llm, _prompts(), max_tokens=6)]


@functools.lru_cache(maxsize=1)
def _reference_tokens() -> tuple:
    return tuple(tuple(t) for t in _greedy(tiny_engine()))


def _compare_in_engine(exercise: str, what: str, got: list[list[int]]) -> None:
    expected = _reference_tokens()
    if len(got) != len(expected):
        fail(exercise, f"with your {what} inside the engine, {len(got)} requests finished, "
                       f"expected {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        first = first_difference(g, e)
        if first is not None:
            fail(exercise, f"with your {what} inside the engine (tiny Llama, greedy), request {i}'s "
                           f"output goes wrong at token {first}: expected {list(e)}, got {list(g)}")


def _decode_in_engine(exercise: str, what: str, decode) -> None:
    """The tiny Llama's decodes through ``decode(q, kv_cache, block_tables, seq_lens, scale)``."""
    def batched(q, kv_cache, meta, scale):
        nd = len(q)
        got = decode(q, kv_cache, meta.block_tables[:nd].contiguous(),
                     meta.seq_lens[:nd].contiguous(), scale)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(q.shape):
            fail(exercise, f"inside the engine, decode attention of {nd} sequences returned "
                           f"{getattr(got, 'shape', type(got).__name__)}, expected a tensor of "
                           f"shape {tuple(q.shape)}")
        return got

    llm = tiny_engine()
    _reference_tokens()
    with decodes_through(llm, batched):
        got = _greedy(llm)
    _compare_in_engine(exercise, what, got)


def _seeded(exercise: str, seed: int | None):
    """(generator, seed): cases are drawn at grading time unless a seed is given, so no stored
    answer can pass; a failure names the seed that repeats it."""
    if seed is None:
        seed = random.SystemRandom().randrange(2 ** 31)
    return torch.Generator().manual_seed(seed), seed


# -- Warm-up puzzles 9.1-9.3: a 2-D grid, a tiled reduction, tl.dot ------------------------------

BIAS_CONVENTION = (
    "Expected: out[i, j] = x[i, j] + bias[j] for x [rows, cols] (row stride cols), float32. The "
    "grid is (row tiles, column tiles): program (pid_r, pid_c) owns rows pid_r * BLOCK_R + "
    "arange(BLOCK_R) and columns pid_c * BLOCK_C + arange(BLOCK_C), masked to the matrix.")


def check_bias_add(add_bias, kernel=None, exercise: str = "9.1", seed: int | None = None) -> None:
    """``add_bias(x [rows, cols], bias [cols]) -> [rows, cols]``, through the learner's kernel."""
    g, seed = _seeded(exercise, seed)
    shapes = [(1, 1), (3, 5), (16, 16), (17, 33)] + [
        (int(torch.randint(2, 40, (1,), generator=g)), int(torch.randint(2, 40, (1,), generator=g)))
        for _ in range(2)]

    def cases(fn):
        for shape in shapes:
            x, bias = torch.randn(shape, generator=g), torch.randn(shape[1], generator=g)
            got = fn(x.clone(), bias.clone())
            hint = None
            if isinstance(got, torch.Tensor) and got.shape == x.shape and shape[0] == shape[1] > 1 \
                    and torch.allclose(got, x + bias[:, None]):
                hint = "bias is indexed by the column, not the row."
            compare_tensors(exercise, f"add_bias(x of shape {shape})", got, x + bias, 1e-6, 1e-6,
                            BIAS_CONVENTION, hint)

    _grade(exercise, seed, add_bias, kernel, True, cases)
    passed(exercise, f"your kernel adds the bias on {len(shapes)} random shapes, edges masked.")


ROW_SUM_CONVENTION = (
    "Expected: out[i] = x[i, :].sum() for x [rows, cols] (row stride cols), float32, one program "
    "per row. Rows are longer than BLOCK: loop over the row in tiles of BLOCK columns, masking the "
    "last, and accumulate.")


def check_row_sums(row_sums, kernel=None, exercise: str = "9.2", seed: int | None = None) -> None:
    """``row_sums(x [rows, cols]) -> [rows]``: a tiled reduction in the learner's kernel."""
    g, seed = _seeded(exercise, seed)
    shapes = [(1, 1), (2, 16), (3, 17), (4, 100)] + [
        (int(torch.randint(1, 6, (1,), generator=g)),
         int(torch.randint(33, 130, (1,), generator=g))) for _ in range(2)]

    def cases(fn):
        for shape in shapes:
            x = torch.randn(shape, generator=g)
            got = fn(x.clone())
            hint = None
            if isinstance(got, torch.Tensor) and got.shape == (shape[0],) and shape[1] > 16:
                if torch.allclose(got, x[:, :16].sum(1), atol=1e-4):
                    hint = "only the first tile was summed: loop over the whole row."
                elif torch.allclose(got, x[:, -(shape[1] % 16 or 16):].sum(1), atol=1e-4):
                    hint = "each tile replaced the sum instead of adding to it."
            compare_tensors(exercise, f"row_sums(x of shape {shape})", got, x.sum(1), 1e-4, 1e-4,
                            ROW_SUM_CONVENTION, hint)

    _grade(exercise, seed, row_sums, kernel, True, cases)
    passed(exercise, f"your tiled reduction sums {len(shapes)} random matrices, rows of 1 to "
                     "129 columns in tiles of 16.")


MATMUL_CONVENTION = (
    "Expected: out = a @ b for a [M, K], b [K, N] (contiguous), float32. Program (pid_m, pid_n) "
    "computes the [BLOCK, BLOCK] tile of out at rows pid_m * BLOCK and columns pid_n * BLOCK, "
    "looping over K in steps of BLOCK: acc += tl.dot(a_tile, b_tile), loads masked (other=0).")


def check_tiled_matmul(matmul, kernel=None, exercise: str = "9.3", seed: int | None = None) -> None:
    """``matmul(a [M, K], b [K, N]) -> [M, N]`` through the learner's tiled tl.dot kernel."""
    g, seed = _seeded(exercise, seed)
    shapes = [(1, 1, 1), (16, 16, 16), (5, 7, 3), (33, 40, 17)] + [
        tuple(int(torch.randint(2, 40, (1,), generator=g)) for _ in range(3)) for _ in range(2)]

    def cases(fn):
        for m, k, n in shapes:
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            got = fn(a.clone(), b.clone())
            hint = None
            if isinstance(got, torch.Tensor) and got.shape == (m, n) and k > 16 and torch.allclose(
                    got, a[:, -(k % 16 or 16):] @ b[-(k % 16 or 16):], atol=1e-3):
                hint = "only the last K tile counts: add each tile's tl.dot to the accumulator."
            compare_tensors(exercise, f"matmul(a {m}x{k}, b {k}x{n})", got, a @ b, 1e-4, 1e-4,
                            MATMUL_CONVENTION, hint)

    _grade(exercise, seed, matmul, kernel, True, cases)
    passed(exercise, f"your tiled matmul matches a @ b on {len(shapes)} random shapes (edges "
                     "masked, K looped in tiles).")


# -- Exercise 9.4: fused add + RMSNorm -----------------------------------------------------------

ADD_NORM_CONVENTION = (
    "Expected: new_residual = x + residual, rounded to x's dtype; out = new_residual / "
    "sqrt(mean(new_residual**2 over the last dim) + eps), computed in float32, rounded to x's "
    "dtype, then multiplied by weight. Returns (out, new_residual), both shaped like x.")


def check_fused_add_rms_norm(fused_add_rms_norm, kernel=None, exercise: str = "9.4",
                             seed: int | None = None) -> None:
    """``fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)``."""
    g, seed = _seeded(exercise, seed)
    cases = []

    def run_cases(fn):
        for shape in [(1, 64), (3, 100), (5, 7), (2, 3, 33)]:
            for dtype in (torch.float32, torch.bfloat16):
                for eps in (1e-6, 0.5):
                    x = (torch.randn(shape, generator=g) * 3).to(dtype)
                    residual = torch.randn(shape, generator=g).to(dtype)
                    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
                    want_out, want_res = reference_rms_norm(x, weight, eps, residual)
                    got = fn(x.clone(), residual.clone(),
                                weight.clone(), eps)
                    what = f"fused_add_rms_norm(x of shape {shape}, {dtype}, eps={eps:g})"
                    if not (isinstance(got, tuple) and len(got) == 2):
                        fail(exercise, f"{what}: expected a tuple (out, new_residual), got "
                                       f"{type(got).__name__}. {ADD_NORM_CONVENTION}")
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    hint = None
                    if isinstance(got[0], torch.Tensor) and got[0].shape == x.shape:
                        plain = reference_rms_norm(x, weight, eps)
                        if torch.allclose(got[0].float(), plain.float(), atol=tol, rtol=tol):
                            hint = "out is the norm of x alone: normalise x + residual."
                    compare_tensors(exercise, f"{what}, new_residual", got[1], want_res, tol, tol,
                                    ADD_NORM_CONVENTION)
                    compare_tensors(exercise, f"{what}, out", got[0], want_out, tol, tol,
                                    ADD_NORM_CONVENTION, hint)
                    cases.append(what)

        def norm_op(x, weight, eps, residual=None):  # every RMSNorm of the model, via the kernel
            if residual is None:
                return fn(x, torch.zeros_like(x), weight, eps)[0]
            return fn(x, residual, weight, eps)

        from minivllm.model.layers import NATIVE_OPS, use_elementwise_ops

        llm = tiny_engine()
        _reference_tokens()
        model = model_runner(llm).model
        try:
            use_elementwise_ops(model, {"rms_norm": norm_op})
            got = _greedy(llm)
        finally:
            use_elementwise_ops(model, NATIVE_OPS)
        _compare_in_engine(exercise, "fused_add_rms_norm in every norm", got)

    _grade(exercise, seed, fused_add_rms_norm, kernel, True, run_cases)
    passed(exercise, f"fused_add_rms_norm matches the reference on {len(cases)} random cases, and "
                     "the tiny Llama with your kernel in every norm generates the reference "
                     "tokens.")


# -- Exercise 9.5: the online-softmax update -----------------------------------------------------

ONLINE_CONVENTION = (
    "Expected: with scores s [rows, tile] in base 2 (softmax weights are 2**s; -inf where masked) "
    "and the tile's values v [tile, d], return (m_new, l_new, acc_new) where m_new = max(m, "
    "max of s over the tile), l_new = l * 2**(m - m_new) + sum(2**(s - m_new)) and acc_new = "
    "acc * 2**(m - m_new) + 2**(s - m_new) @ v. After the last tile, acc / l is the attention.")


def _tiles(n: int, sizes: list[int]):
    start, i = 0, 0
    while start < n:
        size = sizes[i % len(sizes)]
        yield start, min(n, start + size)
        start += size
        i += 1


def check_online_softmax(online_softmax_update, exercise: str = "9.5",
                         seed: int | None = None) -> None:
    """``online_softmax_update(s, v, m, l, acc) -> (m, l, acc)`` in torch, folded tile by tile."""
    g, seed = _seeded(exercise, seed)
    cases = []

    def run_cases(fn):
        for rows, n, d in ((1, 5, 4), (4, 37, 16), (8, 64, 8), (3, 130, 32)):
            for sizes in ([16], [1], [7, 3, 16], [n]):
                for spread in (1.0, 30.0):
                    s = torch.randn(rows, n, generator=g) * spread
                    # a causal-like mask: row r sees the first n - r keys (never fewer than one)
                    keep = torch.arange(n)[None, :] < (n - torch.arange(rows))[:, None].clamp(min=1)
                    s = s.masked_fill(~keep, float("-inf"))
                    v = torch.randn(n, d, generator=g)
                    m = torch.full((rows,), float("-inf"))
                    l, acc = torch.zeros(rows), torch.zeros(rows, d)
                    for a, b in _tiles(n, sizes):
                        got = fn(s[:, a:b].clone(),
                                    v[a:b].clone(), m, l, acc)
                        if not (isinstance(got, tuple) and len(got) == 3):
                            fail(exercise, f"expected a tuple (m, l, acc), got "
                                           f"{type(got).__name__}. {ONLINE_CONVENTION}")
                        m, l, acc = got
                    what = f"{rows} rows of {n} scores (spread {spread:g}) in tiles of {sizes}"
                    compare_tensors(exercise, f"{what}: the running max m", m,
                                    s.max(dim=1).values, 1e-6, 1e-6, ONLINE_CONVENTION)
                    # 2**s = e**(s ln 2)
                    expected = torch.softmax(s * 0.6931471805599453, dim=1) @ v
                    hint = None
                    if isinstance(acc, torch.Tensor) and isinstance(l, torch.Tensor) and \
                            acc.shape == (rows, d):
                        natural = torch.softmax(s, dim=1) @ v
                        if torch.allclose(acc / l[:, None], natural, atol=1e-4, rtol=1e-4) \
                                and spread > 1:
                            hint = "you used e**s; the scores are in base 2: use 2**s (exp2)."
                    compare_tensors(exercise, f"{what}: acc / l after the last tile",
                                    acc / l[:, None], expected, 1e-4, 1e-4, ONLINE_CONVENTION, hint)
                    cases.append(what)
        _decode_in_engine(exercise, "online_softmax_update (a torch decode attention folding "
                                    "tiles of 8 keys)", _tiled_torch_decode(fn))

    _grade(exercise, seed, online_softmax_update, None, False, run_cases)
    passed(exercise, f"online_softmax_update matches softmax over {len(cases)} random score "
                     "matrices cut into tiles, and the tiny Llama decoding with it generates the "
                     "reference tokens.")


LOG2E = 1.4426950408889634


def _tiled_torch_decode(update, tile: int = 8):
    """A paged decode attention in torch that folds each sequence's keys ``tile`` at a time."""
    def decode(q, kv_cache, block_tables, seq_lens, scale):
        out = torch.empty_like(q)
        heads, kv_heads = q.shape[1], kv_cache.shape[3]
        block_size = kv_cache.shape[2]
        for i, n in enumerate(seq_lens.tolist()):
            pos = torch.arange(n)
            blocks = block_tables[i].long()[pos // block_size]
            k = kv_cache[0, blocks, pos % block_size].float().repeat_interleave(heads // kv_heads, 1)
            v = kv_cache[1, blocks, pos % block_size].float().repeat_interleave(heads // kv_heads, 1)
            for h in range(heads):
                s = (q[i, h].float() @ k[:, h].T)[None] * (scale * LOG2E)
                m = torch.full((1,), float("-inf"))
                l, acc = torch.zeros(1), torch.zeros(1, q.shape[-1])
                for a in range(0, n, tile):
                    m, l, acc = update(s[:, a:a + tile], v[a:a + tile, h], m, l, acc)
                out[i, h] = (acc / l[:, None])[0].to(q.dtype)
        return out
    return decode


CONTIGUOUS_CONVENTION = (
    "Expected: for each KV head, the attention of its group of query heads q [heads, d] over "
    "the keys and values k, v [n, kv_heads, d]: softmax(q k^T * scale) v, query head h using KV "
    "head h // (heads // kv_heads).")


def check_online_softmax_kernel(attention, update=None, exercise: str = "9.5",
                                seed: int | None = None) -> None:
    """``attention(q [heads, d], k [n, kv_heads, d], v, scale) -> [heads, d]``: the notebook's
    kernel, folding tiles with the learner's ``tl`` online-softmax update ``update``."""
    g, seed = _seeded(exercise, seed)
    cases = []

    def run_cases(fn):
        for heads, kv_heads, d in ((4, 2, 16), (3, 3, 8), (8, 1, 32)):
            for n in (1, 15, 16, 17, 70):
                for spread in (1.0, 20.0):
                    q = torch.randn(heads, d, generator=g) * spread
                    k = torch.randn(n, kv_heads, d, generator=g)
                    v = torch.randn(n, kv_heads, d, generator=g)
                    scale = d ** -0.5
                    group = heads // kv_heads
                    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                    expected = torch.einsum("hs,shd->hd", torch.softmax(
                        torch.einsum("hd,shd->hs", q, kk) * scale, dim=-1), vv)
                    got = fn(q.clone(), k.clone(), v.clone(), scale)
                    compare_tensors(exercise, f"attention of {heads} query heads over {n} keys "
                                    f"({kv_heads} KV heads, d={d}, query spread {spread:g})", got,
                                    expected, 1e-4, 1e-4,
                                    CONTIGUOUS_CONVENTION + " " + ONLINE_CONVENTION)
                    cases.append(n)

    _grade(exercise, seed, attention, update, False, run_cases)
    passed(exercise, f"the kernel with your tl online-softmax update matches softmax attention on "
                     f"{len(cases)} random cases (contexts of 1 to 70 keys in tiles of 16).")


# -- Exercises 9.6 and 9.7: paged decode attention, one partition or several ----------------------

PAGED_CONVENTION = (
    "Expected: for each sequence i, the attention of its query q[i] [heads, d] over its first "
    "seq_lens[i] tokens, token p read from block block_tables[i, p // block_size] at offset "
    "p % block_size of kv_cache [2 (K, V), num_blocks, block_size, kv_heads, d]; query head h "
    "uses KV head h // (heads // kv_heads).")


def _paged_cases(g: torch.Generator, extra_splits: bool):
    """(q, kv_cache, block_tables, seq_lens, scale, label, num_splits) on scattered blocks."""
    for heads, kv_heads, d, block_size in ((4, 2, 16, 8), (2, 2, 8, 4), (8, 1, 32, 16)):
        drawn = [int(x) for x in torch.randint(1, 100, (3,), generator=g)]
        for lens in ([1], [5, 64, 17], [33, 8, 1, 90], drawn):
            num_blocks = 64
            cache = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=g)
            width = max(-(-n // block_size) for n in lens) + 2  # tables longer than needed
            tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width]
                                  for _ in lens]).to(torch.int32)
            for i, n in enumerate(lens):  # what lies past a sequence's end must not be read
                used = -(-n // block_size)
                cache[:, tables[i, used - 1], n - (used - 1) * block_size:] += 40.0
                cache[:, tables[i, used:].long()] += 40.0
            q = torch.randn(len(lens), heads, d, generator=g)
            seq_lens = torch.tensor(lens, dtype=torch.int32)
            label = (f"{len(lens)} sequences of {lens} tokens, {heads} query heads over {kv_heads} "
                     f"KV heads, d={d}, block_size={block_size}")
            for splits in ((1, 2, 7) if extra_splits else (None,)):
                yield q, cache, tables, seq_lens, d ** -0.5, label, splits


def _paged_hint(got, q, cache, tables, seq_lens, scale) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != q.shape:
        return None
    block_size = cache.shape[2]
    whole = torch.clamp(-(-seq_lens // block_size) * block_size, min=1).to(torch.int32)
    if (whole != seq_lens).any() and torch.allclose(
            got, paged_decode_attention(q, cache, tables, whole, scale), atol=1e-3, rtol=1e-3):
        return ("you attended to every slot of the last block; only the first seq_len tokens are "
                "the sequence's (mask t < seq_len).")
    ordered = torch.arange(tables.shape[1], dtype=torch.int32)[None].expand_as(tables).contiguous()
    if torch.allclose(got, paged_decode_attention(q, cache, ordered, seq_lens, scale),
                      atol=1e-3, rtol=1e-3):
        return "you read blocks 0, 1, 2, ... in order: look each token's block up in the block table."
    return None


def check_paged_decode(paged_decode, load_kv_tile=None, exercise: str = "9.6",
                       seed: int | None = None) -> None:
    """``paged_decode(q, kv_cache, block_tables, seq_lens, scale) -> [seqs, heads, d]``: the
    notebook's kernel, reading each tile through the learner's ``load_kv_tile``."""
    g, seed = _seeded(exercise, seed)
    cases = []

    def run_cases(fn):
        for q, cache, tables, seq_lens, scale, label, _ in _paged_cases(g, extra_splits=False):
            expected = paged_decode_attention(q, cache, tables, seq_lens, scale)
            got = fn(q.clone(), cache.clone(), tables.clone(),
                        seq_lens.clone(), scale)
            compare_tensors(exercise, f"paged decode attention, {label}", got, expected, 1e-4,
                            1e-4, PAGED_CONVENTION, _paged_hint(got, q, cache, tables, seq_lens,
                                                                scale))
            cases.append(label)
        _decode_in_engine(exercise, "load_kv_tile (in the decode kernel)", fn)

    _grade(exercise, seed, paged_decode, load_kv_tile, False, run_cases)
    passed(exercise, f"the decode kernel with your load_kv_tile matches the reference on "
                     f"{len(cases)} random block tables, and the tiny Llama decoding with it "
                     "generates the reference tokens.")


SPLIT_CONVENTION = (
    "Expected: partition j of a sequence left its running max m_j, sum l_j and unnormalised "
    "output acc_j (only partitions that start before seq_len ran; the others hold garbage). "
    "With M = max_j m_j: out = sum_j 2**(m_j - M) acc_j / sum_j 2**(m_j - M) l_j.")


def check_split_decode(flash_decode, kernel=None, exercise: str = "9.7",
                       seed: int | None = None) -> None:
    """``flash_decode(q, kv_cache, block_tables, seq_lens, scale, num_splits) -> [seqs, heads, d]``:
    the notebook's split-K kernel, combined by the learner's reduction ``kernel``."""
    g, seed = _seeded(exercise, seed)
    cases = []

    def run_cases(fn):
        for q, cache, tables, seq_lens, scale, label, splits in _paged_cases(g, extra_splits=True):
            expected = paged_decode_attention(q, cache, tables, seq_lens, scale)
            got = fn(q.clone(), cache.clone(), tables.clone(),
                        seq_lens.clone(), scale, splits)
            hint = None
            if isinstance(got, torch.Tensor) and got.shape == q.shape and torch.isnan(got).any():
                hint = ("NaN: a partition that starts at or after seq_len never ran, and its m, l, "
                        "acc hold NaN; leave it out of the sums.")
            compare_tensors(exercise, f"flash-decoding with {splits} partitions, {label}", got,
                            expected, 1e-4, 1e-4, SPLIT_CONVENTION, hint)
            cases.append(label)
        _decode_in_engine(exercise, "split-K reduction (2 partitions per sequence)",
                          lambda *args: fn(*args, 2))

    _grade(exercise, seed, flash_decode, kernel, True, run_cases)
    passed(exercise, f"flash-decoding with your reduction matches the reference on {len(cases)} "
                     "random cases (1, 2 and 7 partitions, some never reached by short sequences), "
                     "and the tiny Llama decoding with it generates the reference tokens.")


__all__ = ["CheckFailed", "check_bias_add", "check_fused_add_rms_norm", "check_online_softmax",
           "check_online_softmax_kernel", "check_paged_decode", "check_row_sums",
           "check_split_decode", "check_tiled_matmul", "package_answer", "tiny_engine"]
