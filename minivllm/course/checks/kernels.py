"""Graders for chapter 09 (Triton kernels): warm-up puzzles, then pieces of the real kernels, on
cases drawn at grading time (a failure names the seed), then inside a tiny Llama's engine."""

from __future__ import annotations

import functools
import importlib
import random
import sys
import types
from contextlib import contextmanager, nullcontext
from itertools import cycle, product

import torch

from minivllm.attention.torch_backend import paged_decode_attention
from minivllm.course.checks.common import (
    CheckFailed, Exercise, close, decodes_through, fail, first_difference, greedy_token_ids,
    native_answer, passed, write_tiny_checkpoint,
)
from minivllm.course.checks.model import ATTENTION_OPS, TORCH_ATTENTION, op_swapped
from minivllm.course.grading import _triton_fn
from minivllm.model.layers import rms_norm as reference_rms_norm
from minivllm.testing import model_runner

KERNEL_MODULES = ("rms_norm", "attention_tile", "decode_attention", "prefill_attention",
                  "activation", "rotary_embedding", "reshape_and_cache")
LOG2E = 1.4426950408889634
ENGINE = dict(skip_tokenizer_init=True, block_size=8, num_kv_blocks=64, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=32, attention_backend="torch",
              custom_ops="none", show_progress=False)


@functools.lru_cache(maxsize=1)
def package_answer() -> tuple[str, ...]:
    """Refused: every kernel and launcher of ``minivllm.kernels``, the torch references."""
    modules = {f"minivllm.kernels.{short}" for short in KERNEL_MODULES}
    names = list(TORCH_ATTENTION) + ["minivllm.model.layers:rms_norm"]
    for name in sorted(modules):
        try:
            module = importlib.import_module(name)
        except ImportError:  # no triton: no kernels to refuse
            continue
        fns = [_triton_fn(value) or value for value in vars(module).values()]
        names += [f"{fn.__module__}:{fn.__qualname__}" for fn in fns
                  if isinstance(fn, types.FunctionType) and fn.__module__ in modules]
    return tuple(dict.fromkeys(names))


def _unwrapped(fn):
    """``fn``, raising NotImplementedError or CheckFailed out of Triton's InterpreterError."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            cause = e
            while type(cause).__name__ == "InterpreterError" and cause.__cause__ is not None:
                cause = cause.__cause__
            if cause is not e and isinstance(cause, (NotImplementedError, CheckFailed)):
                raise cause from None
            raise
    return call


@contextmanager
def counting_runs(piece, launched: bool):
    """Yields [how often the learner's ``piece`` ran]: its launches, or (interpreted only;
    compiled, it is inlined) its calls from a kernel; None where nothing can be counted."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if _triton_fn(piece) is None or not launched and not (
            interpreter and isinstance(piece, interpreter.InterpretedFunction)):
        yield None
        return
    count, attr = [0], "run" if launched else "rewrite"
    real = functools.partial(type(piece).run, piece) if launched else type(piece).rewrite(piece)
    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    setattr(piece, attr, counted if launched else lambda: counted)
    try:
        yield count
    finally:
        piece.__dict__.pop(attr, None)


def _grade(number: str, convention: str, seed, launcher, piece, launched: bool, run,
           message: str) -> None:
    """``run(ex, watched launcher, generator)`` gives the number of cases n, the piece must have
    run, then ``message`` (with n) is printed; a failure names the seed."""
    seed = random.SystemRandom().randrange(2 ** 31) if seed is None else seed
    ex = Exercise(number, convention, native_answer(package_answer(), *ATTENTION_OPS),
                  "torch and Triton (triton, triton.language)")
    try:
        if piece is not None:
            if _triton_fn(piece) is None:
                ex.fail(f"expected your @triton.jit function, got {type(piece).__name__}")
            ex.inspect(piece)
        watched = _unwrapped(ex.take(launcher))
        with counting_runs(piece, launched) as count:
            cases = run(ex, watched, torch.Generator().manual_seed(seed))
        if count is not None and count[0] == 0:
            how = "launch" if launched else "reach it through the given kernel, which calls"
            ex.fail(f"the cases passed without running your {piece.__name__}: the launcher must "
                    f"{how} it")
    except CheckFailed as e:
        raise type(e)(f"{e} [cases drawn with seed={seed}: pass seed={seed} to the checker to "
                      "repeat them]") from None
    passed(number, message.format(n=cases))


def _rows(rows, then=None):
    """A ``run``: each row (what, args, expected, tol, mistakes) of ``rows(generator)`` through
    the launcher must give ``expected``; then ``then(launcher)``."""
    def run(ex: Exercise, fn, g) -> int:
        n = 0
        for n, (what, args, expected, tol, mistakes) in enumerate(rows(g), 1):
            got = fn(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
            ex.compare_tensors(what, got, expected, tol, tol, mistakes=mistakes)
        if then is not None:
            then(fn)
        return n
    return run


def _drawn(g, count: int, *ranges) -> list[tuple[int, ...]]:
    return [tuple(int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ranges)
            for _ in range(count)]


# -- the tiny model the kernels are plugged into -------------------------------------------------

@functools.lru_cache(maxsize=1)
def tiny_engine():
    """A tiny random-weight Llama, small blocks and budget: chunked prefills beside decodes."""
    from minivllm import LLM
    return LLM(write_tiny_checkpoint("tiny-llama", seed=0), **ENGINE)


def _greedy(llm) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 30000) for _ in range(12)]  # two prompts share a block and a half
    prompts = [shared + [rng.randrange(3, 30000) for _ in range(n)] for n in (9, 1)]
    prompts += [[rng.randrange(3, 30000) for _ in range(n)] for n in (30, 5)]
    return [list(t) for t in greedy_token_ids(llm, [{"prompt_token_ids": p} for p in prompts],
                                              max_tokens=6)]


@functools.lru_cache(maxsize=1)
def _reference_tokens() -> tuple:
    return tuple(tuple(t) for t in _greedy(tiny_engine()))


def _compare_in_engine(failed, what: str, got: list[list[int]]) -> None:
    """``got`` against the tiny Llama's reference tokens; ``failed(message)`` raises."""
    expected = _reference_tokens()
    if len(got) != len(expected):
        failed(f"with your {what} inside the engine, {len(got)} requests finished, expected "
               f"{len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        first = first_difference(g, e)
        if first is not None:
            failed(f"with your {what} inside the engine (tiny Llama, greedy), request {i}'s "
                   f"output goes wrong at token {first}: expected {list(e)}, got {list(g)}")


def _in_engine(exercise: str, what: str, decode=None, norm=None) -> None:
    """The tiny Llama decoding through ``decode(q, kv_cache, block_tables, seq_lens, scale)`` or
    normalising through ``norm`` must give the reference tokens."""
    def batched(q, kv_cache, meta, scale):
        got = decode(q, kv_cache, meta.block_tables[:len(q)].contiguous(),
                     meta.seq_lens[:len(q)].contiguous(), scale)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(q.shape):
            fail(exercise, f"inside the engine, decode attention of {len(q)} sequences returned "
                           f"{getattr(got, 'shape', type(got).__name__)}, expected a tensor of "
                           f"shape {tuple(q.shape)}")
        return got
    llm = tiny_engine()
    _reference_tokens()  # before anything is swapped
    swapped = op_swapped(model_runner(llm).model, "rms_norm", lambda m: norm) if norm else None
    with decodes_through(llm, decode and batched), swapped or nullcontext():
        got = _greedy(llm)
    _compare_in_engine(functools.partial(fail, exercise), what, got)


# -- Warm-up puzzles 9.1-9.3: a 2-D grid, a tiled reduction, tl.dot ------------------------------

BIAS_CONVENTION = (
    "Expected: out[i, j] = x[i, j] + bias[j] for x [rows, cols] (row stride cols), float32. The "
    "grid is (row tiles, column tiles): program (pid_r, pid_c) owns rows pid_r * BLOCK_R + "
    "arange(BLOCK_R) and columns pid_c * BLOCK_C + arange(BLOCK_C), masked to the matrix.")
ROW_SUM_CONVENTION = (
    "Expected: out[i] = x[i, :].sum() for x [rows, cols] (row stride cols), float32, one program "
    "per row. Rows are longer than BLOCK: loop over the row in tiles of BLOCK columns, masking the "
    "last, and accumulate.")
MATMUL_CONVENTION = (
    "Expected: out = a @ b for a [M, K], b [K, N] (contiguous), float32. Program (pid_m, pid_n) "
    "computes the [BLOCK, BLOCK] tile of out at rows pid_m * BLOCK and columns pid_n * BLOCK, "
    "looping over K in steps of BLOCK: acc += tl.dot(a_tile, b_tile), loads masked (other=0).")


def check_bias_add(add_bias, kernel=None, exercise: str = "9.1", seed: int | None = None) -> None:
    """``add_bias(x [rows, cols], bias [cols]) -> [rows, cols]``, through the learner's kernel."""
    def rows(g):
        for shape in [(1, 1), (3, 5), (16, 16), (17, 33)] + _drawn(g, 2, (2, 40), (2, 40)):
            x, bias = torch.randn(shape, generator=g), torch.randn(shape[1], generator=g)
            yield f"add_bias(x of shape {shape})", (x, bias), x + bias, 1e-6, [
                (lambda y: shape[0] == shape[1] > 1 and close(y, x + bias[:, None], 1e-8, 1e-5),
                 "bias is indexed by the column, not the row.")]
    _grade(exercise, BIAS_CONVENTION, seed, add_bias, kernel, True, _rows(rows),
           "your kernel adds the bias on {n} random shapes, edges masked.")


def check_row_sums(row_sums, kernel=None, exercise: str = "9.2", seed: int | None = None) -> None:
    """``row_sums(x [rows, cols]) -> [rows]``: a tiled reduction in the learner's kernel."""
    def rows(g):
        for shape in [(1, 1), (2, 16), (3, 17), (4, 100)] + _drawn(g, 2, (1, 6), (33, 130)):
            x, last = torch.randn(shape, generator=g), shape[1] % 16 or 16
            yield f"row_sums(x of shape {shape})", (x,), x.sum(1), 1e-4, [
                (lambda y: shape[1] > 16 and close(y, x[:, :16].sum(1), 1e-4, 1e-5),
                 "only the first tile was summed: loop over the whole row."),
                (lambda y: shape[1] > 16 and close(y, x[:, -last:].sum(1), 1e-4, 1e-5),
                 "each tile replaced the sum instead of adding to it.")]
    _grade(exercise, ROW_SUM_CONVENTION, seed, row_sums, kernel, True, _rows(rows),
           "your tiled reduction sums {n} random matrices, rows of 1 to 129 columns in tiles of "
           "16.")


def check_tiled_matmul(matmul, kernel=None, exercise: str = "9.3", seed: int | None = None) -> None:
    """``matmul(a [M, K], b [K, N]) -> [M, N]`` through the learner's tiled tl.dot kernel."""
    def rows(g):
        for m, k, n in [(1, 1, 1), (16, 16, 16), (5, 7, 3), (33, 40, 17)] + _drawn(
                g, 2, (2, 40), (2, 40), (2, 40)):
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            last = k % 16 or 16
            yield f"matmul(a {m}x{k}, b {k}x{n})", (a, b), a @ b, 1e-4, [
                (lambda y: k > 16 and close(y, a[:, -last:] @ b[-last:], 1e-3, 1e-5),
                 "only the last K tile counts: add each tile's tl.dot to the accumulator.")]
    _grade(exercise, MATMUL_CONVENTION, seed, matmul, kernel, True, _rows(rows),
           "your tiled matmul matches a @ b on {n} random shapes (edges masked, K looped in "
           "tiles).")


# -- Exercise 9.4: fused add + RMSNorm -----------------------------------------------------------

ADD_NORM_CONVENTION = (
    "Expected: new_residual = x + residual, rounded to x's dtype; out = new_residual / "
    "sqrt(mean(new_residual**2 over the last dim) + eps), computed in float32, rounded to x's "
    "dtype, then multiplied by weight. Returns (out, new_residual), both shaped like x.")


def check_fused_add_rms_norm(fused_add_rms_norm, kernel=None, exercise: str = "9.4",
                             seed: int | None = None) -> None:
    """``fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)``."""
    def run(ex, fn, g):
        cases = list(product([(1, 64), (3, 100), (5, 7), (2, 3, 33)],
                             (torch.float32, torch.bfloat16), (1e-6, 0.5)))
        for shape, dtype, eps in cases:
            x = (torch.randn(shape, generator=g) * 3).to(dtype)
            residual = torch.randn(shape, generator=g).to(dtype)
            weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
            got = fn(x.clone(), residual.clone(), weight.clone(), eps)
            what = f"fused_add_rms_norm(x of shape {shape}, {dtype}, eps={eps:g})"
            if not (isinstance(got, tuple) and len(got) == 2):
                ex.fail(f"{what}: expected a tuple (out, new_residual), got {type(got).__name__}.")
            want_out, want_res = reference_rms_norm(x, weight, eps, residual)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            ex.compare_tensors(f"{what}, new_residual", got[1], want_res, tol, tol)
            ex.compare_tensors(f"{what}, out", got[0], want_out, tol, tol, mistakes=[
                (lambda y: close(y, reference_rms_norm(x, weight, eps), tol, tol),
                 "out is the norm of x alone: normalise x + residual.")])

        def norm(x, weight, eps, residual=None):  # every RMSNorm of the model, via the kernel
            if residual is None:
                return fn(x, torch.zeros_like(x), weight, eps)[0]
            return fn(x, residual, weight, eps)
        _in_engine(exercise, "fused_add_rms_norm in every norm", norm=norm)
        return len(cases)
    _grade(exercise, ADD_NORM_CONVENTION, seed, fused_add_rms_norm, kernel, True, run,
           "fused_add_rms_norm matches the reference on {n} random cases, and the tiny Llama with "
           "your kernel in every norm generates the reference tokens.")


# -- Exercise 9.5: the online-softmax update -----------------------------------------------------

ONLINE_CONVENTION = (
    "Expected: with scores s [rows, tile] in base 2 (softmax weights are 2**s; -inf where masked) "
    "and the tile's values v [tile, d], return (m_new, l_new, acc_new) where m_new = max(m, "
    "max of s over the tile), l_new = l * 2**(m - m_new) + sum(2**(s - m_new)) and acc_new = "
    "acc * 2**(m - m_new) + 2**(s - m_new) @ v. After the last tile, acc / l is the attention.")
CONTIGUOUS_CONVENTION = (
    "Expected: for each KV head, the attention of its group of query heads q [heads, d] over "
    "the keys and values k, v [n, kv_heads, d]: softmax(q k^T * scale) v, query head h using KV "
    "head h // (heads // kv_heads).")


def _fold(ex: Exercise, update, s, v, sizes):
    """(m, l, acc) after folding the scores ``s`` and values ``v`` in tiles cycling ``sizes``."""
    m = torch.full((s.shape[0],), float("-inf"))
    l, acc = torch.zeros(s.shape[0]), torch.zeros(s.shape[0], v.shape[-1])
    start = 0
    for size in cycle(sizes):
        if start >= s.shape[1]:
            return m, l, acc
        got = update(s[:, start:start + size].clone(), v[start:start + size].clone(), m, l, acc)
        if not (isinstance(got, tuple) and len(got) == 3):
            ex.fail(f"expected a tuple (m, l, acc), got {type(got).__name__}.")
        m, l, acc = got
        start += size


def _tiled_torch_decode(ex: Exercise, update):
    """A paged decode attention in torch, folding each sequence's keys 8 at a time."""
    def decode(q, kv_cache, block_tables, seq_lens, scale):
        out = torch.empty_like(q)
        group, block_size = q.shape[1] // kv_cache.shape[3], kv_cache.shape[2]
        for i, n in enumerate(seq_lens.tolist()):
            pos = torch.arange(n)
            blocks = block_tables[i].long()[pos // block_size]
            k, v = (kv_cache[j, blocks, pos % block_size].float().repeat_interleave(group, 1)
                    for j in (0, 1))
            for h in range(q.shape[1]):
                s = (q[i, h].float() @ k[:, h].T)[None] * (scale * LOG2E)
                m, l, acc = _fold(ex, update, s, v[:, h], [8])
                out[i, h] = (acc / l[:, None])[0].to(q.dtype)
        return out
    return decode


def check_online_softmax(online_softmax_update, exercise: str = "9.5",
                         seed: int | None = None) -> None:
    """``online_softmax_update(s, v, m, l, acc) -> (m, l, acc)`` in torch, folded tile by tile."""
    def run(ex, fn, g):
        cases = [(rows, n, d, sizes, spread) for rows, n, d in (
            (1, 5, 4), (4, 37, 16), (8, 64, 8), (3, 130, 32)) for sizes in (
            [16], [1], [7, 3, 16], [n]) for spread in (1.0, 30.0)]
        for rows, n, d, sizes, spread in cases:
            # a causal-like mask: row r sees the first n - r keys (never fewer than one)
            keep = torch.arange(n)[None, :] < (n - torch.arange(rows))[:, None].clamp(min=1)
            s = (torch.randn(rows, n, generator=g) * spread).masked_fill(~keep, float("-inf"))
            v = torch.randn(n, d, generator=g)
            m, l, acc = _fold(ex, fn, s, v, sizes)
            what = f"{rows} rows of {n} scores (spread {spread:g}) in tiles of {sizes}"
            ex.compare_tensors(f"{what}: the running max m", m, s.max(dim=1).values, 1e-6, 1e-6)
            got = acc / l[:, None]
            ex.compare_tensors(f"{what}: acc / l after the last tile", got,
                               torch.softmax(s * 0.6931471805599453, dim=1) @ v,  # 2**s
                               1e-4, 1e-4, mistakes=[  # = e**(s ln 2)
                                   (lambda y: spread > 1 and close(y, torch.softmax(s, 1) @ v),
                                    "you used e**s; the scores are in base 2: use 2**s (exp2).")])
        _in_engine(exercise, "online_softmax_update (a torch decode attention folding tiles of 8 "
                             "keys)", _tiled_torch_decode(ex, fn))
        return len(cases)
    _grade(exercise, ONLINE_CONVENTION, seed, online_softmax_update, None, False, run,
           "online_softmax_update matches softmax over {n} random score matrices cut into tiles, "
           "and the tiny Llama decoding with it generates the reference tokens.")


def check_online_softmax_kernel(attention, update=None, exercise: str = "9.5",
                                seed: int | None = None) -> None:
    """``attention(q [heads, d], k [n, kv_heads, d], v, scale) -> [heads, d]``: the notebook's
    kernel, folding tiles with the learner's ``tl`` online-softmax update ``update``."""
    def rows(g):
        for (heads, kv_heads, d), n, spread in product(
                ((4, 2, 16), (3, 3, 8), (8, 1, 32)), (1, 15, 16, 17, 70), (1.0, 20.0)):
            q = torch.randn(heads, d, generator=g) * spread
            k, v = (torch.randn(n, kv_heads, d, generator=g) for _ in range(2))
            kk, vv = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
            w = torch.softmax(torch.einsum("hd,shd->hs", q, kk) * d ** -0.5, dim=-1)
            yield (f"attention of {heads} query heads over {n} keys ({kv_heads} KV heads, d={d}, "
                   f"query spread {spread:g})", (q, k, v, d ** -0.5),
                   torch.einsum("hs,shd->hd", w, vv), 1e-4, [])
    _grade(exercise, CONTIGUOUS_CONVENTION + " " + ONLINE_CONVENTION, seed, attention, update,
           False, _rows(rows), "the kernel with your tl online-softmax update matches softmax "
           "attention on {n} random cases (contexts of 1 to 70 keys in tiles of 16).")


# -- Exercises 9.6 and 9.7: paged decode attention, one partition or several ----------------------

PAGED_CONVENTION = (
    "Expected: for each sequence i, the attention of its query q[i] [heads, d] over its first "
    "seq_lens[i] tokens, token p read from block block_tables[i, p // block_size] at offset "
    "p % block_size of kv_cache [2 (K, V), num_blocks, block_size, kv_heads, d]; query head h "
    "uses KV head h // (heads // kv_heads).")
SPLIT_CONVENTION = (
    "Expected: partition j of a sequence left its running max m_j, sum l_j and unnormalised "
    "output acc_j (only partitions that start before seq_len ran; the others hold garbage). "
    "With M = max_j m_j: out = sum_j 2**(m_j - M) acc_j / sum_j 2**(m_j - M) l_j.")


def _paged_rows(g, splits):
    """Rows for ``_rows``: random sequences on scattered blocks, each with every ``splits``."""
    for heads, kv_heads, d, block_size in ((4, 2, 16, 8), (2, 2, 8, 4), (8, 1, 32, 16)):
        drawn = [int(x) for x in torch.randint(1, 100, (3,), generator=g)]
        for lens in ([1], [5, 64, 17], [33, 8, 1, 90], drawn):
            cache = torch.randn(2, 64, block_size, kv_heads, d, generator=g)
            width = max(-(-n // block_size) for n in lens) + 2  # tables longer than needed
            tables = torch.stack([torch.randperm(64, generator=g)[:width]
                                  for _ in lens]).to(torch.int32)
            for i, n in enumerate(lens):  # what lies past a sequence's end must not be read
                used = -(-n // block_size)
                cache[:, tables[i, used - 1], n - (used - 1) * block_size:] += 40.0
                cache[:, tables[i, used:].long()] += 40.0
            q, seq_lens = torch.randn(len(lens), heads, d, generator=g), torch.tensor(lens).int()
            whole = torch.clamp(-(-seq_lens // block_size) * block_size, min=1).int()
            ordered = torch.arange(width).int()[None].expand_as(tables).contiguous()
            scale = d ** -0.5
            args = (q, cache, tables, seq_lens, scale)
            expected = paged_decode_attention(*args)
            label = (f"{len(lens)} sequences of {lens} tokens, {heads} query heads over {kv_heads} "
                     f"KV heads, d={d}, block_size={block_size}")
            mistakes = [
                (lambda y: (whole != seq_lens).any() and close(y, paged_decode_attention(
                    q, cache, tables, whole, scale), 1e-3, 1e-3),
                 "you attended to every slot of the last block; only the first seq_len tokens are "
                 "the sequence's (mask t < seq_len)."),
                (lambda y: close(y, paged_decode_attention(q, cache, ordered, seq_lens, scale),
                                 1e-3, 1e-3),
                 "you read blocks 0, 1, 2, ... in order: look each token's block up in the block "
                 "table."),
                (lambda y: torch.isnan(y).any(),
                 "NaN: a partition that starts at or after seq_len never ran, and its m, l, acc "
                 "hold NaN; leave it out of the sums.")]
            for split in splits:
                if split is None:
                    yield f"paged decode attention, {label}", args, expected, 1e-4, mistakes[:2]
                else:
                    yield (f"flash-decoding with {split} partitions, {label}", args + (split,),
                           expected, 1e-4, mistakes[2:])


def check_paged_decode(paged_decode, load_kv_tile=None, exercise: str = "9.6",
                       seed: int | None = None) -> None:
    """``paged_decode(q, kv_cache, block_tables, seq_lens, scale) -> [seqs, heads, d]``: the
    notebook's kernel, reading each tile through the learner's ``load_kv_tile``."""
    _grade(exercise, PAGED_CONVENTION, seed, paged_decode, load_kv_tile, False, _rows(
        lambda g: _paged_rows(g, [None]),
        lambda fn: _in_engine(exercise, "load_kv_tile (in the decode kernel)", fn)),
        "the decode kernel with your load_kv_tile matches the reference on {n} random block "
        "tables, and the tiny Llama decoding with it generates the reference tokens.")


def check_split_decode(flash_decode, kernel=None, exercise: str = "9.7",
                       seed: int | None = None) -> None:
    """``flash_decode(q, kv_cache, block_tables, seq_lens, scale, num_splits) -> [seqs, heads,
    d]``: the notebook's split-K kernel, combined by the learner's reduction ``kernel``."""
    _grade(exercise, SPLIT_CONVENTION, seed, flash_decode, kernel, True, _rows(
        lambda g: _paged_rows(g, [1, 2, 7]),
        lambda fn: _in_engine(exercise, "split-K reduction (2 partitions per sequence)",
                              lambda *args: fn(*args, 2))),
        "flash-decoding with your reduction matches the reference on {n} random cases (1, 2 and 7 "
        "partitions, some never reached by short sequences), and the tiny Llama decoding with it "
        "generates the reference tokens.")

