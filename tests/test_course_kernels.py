"""Chapter 09's checkers fail where they should, naming the mistake; an unsolved kernel's
NotImplementedError comes out of Triton's interpreter as itself; a launcher or kernel that hands
the work to the package's own kernels or torch references fails, however it got hold of them
(imported under the expected name, aliased, launched directly, re-jitted, fetched at run time);
a constant answer fails; the solutions' warm-up kernels pass. (The solved notebook, run by
nbval, is the passing case of 9.4-9.7, engine included.)"""

import functools
import importlib
import os

import nbformat
import pytest
import torch

from minivllm.course import checks
from minivllm.course.checks import kernels as kernel_checks
from tests.course_helpers import fails

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG2E = 1.4426950408889634
INTERPRETED = not torch.cuda.is_available()


# -- mistakes, written here in plain torch (never through the package's own code) --------------

def _norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _paged(q, cache, tables, lens, scale):
    out = torch.empty_like(q)
    bs, heads, kv_heads = cache.shape[2], q.shape[1], cache.shape[3]
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        blocks = tables[i].long()[pos // bs]
        k = cache[0, blocks, pos % bs].repeat_interleave(heads // kv_heads, 1)
        v = cache[1, blocks, pos % bs].repeat_interleave(heads // kv_heads, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", w, v)
    return out


def test_add_rms_norm_that_ignores_the_residual_fails_with_a_hint():
    def norm_only(x, residual, weight, eps):
        return _norm(x, weight, eps), x + residual

    fails(checks.check_fused_add_rms_norm, norm_only, "normalise x + residual")


def test_add_rms_norm_returning_one_tensor_fails_stating_the_convention():
    fails(checks.check_fused_add_rms_norm, lambda x, r, w, eps: _norm(x + r, w, eps),
          "expected a tuple (out, new_residual)")


def test_online_softmax_in_base_e_fails_naming_the_base():
    def natural(s, v, m, l, acc):
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v

    fails(checks.check_online_softmax, natural, "Exercise 9.5", "base 2")


def test_online_softmax_that_never_rescales_fails():
    def no_rescale(s, v, m, l, acc):
        m_new = torch.maximum(m, s.max(dim=1).values)
        p = torch.exp2(s - m_new[:, None])
        return m_new, l + p.sum(1), acc + p @ v

    fails(checks.check_online_softmax, no_rescale, "acc / l after the last tile")


def test_paged_decode_that_reads_blocks_in_order_fails_naming_the_block_table():
    def in_order(q, cache, tables, lens, scale):
        ordered = torch.arange(tables.shape[1], dtype=torch.int32)[None].expand_as(tables)
        return _paged(q, cache, ordered.contiguous(), lens, scale)

    fails(checks.check_paged_decode, in_order, "Exercise 9.6", "look each token's block")


def test_paged_decode_over_whole_blocks_fails_naming_the_mask():
    def whole_blocks(q, cache, tables, lens, scale):
        bs = cache.shape[2]
        return _paged(q, cache, tables, (-(-lens // bs) * bs).to(torch.int32), scale)

    fails(checks.check_paged_decode, whole_blocks, "mask t < seq_len")


def _partitions(q, cache, tables, lens, scale, splits):
    """Stage 1 in torch, as exercise 9.7 gives it: partitions that never ran hold NaN."""
    seqs, heads, d = q.shape
    bs, kv_heads = cache.shape[2], cache.shape[3]
    part = -(-(-(-int(lens.max()) // splits)) // 16) * 16
    m = torch.full((seqs, heads, splits), float("nan"))
    l, acc = m.clone(), torch.full((seqs, heads, splits, d), float("nan"))
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        blocks = tables[i].long()[pos // bs]
        k = cache[0, blocks, pos % bs].repeat_interleave(heads // kv_heads, 1)
        v = cache[1, blocks, pos % bs].repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("hd,nhd->hn", q[i], k) * scale * LOG2E
        for j in range(splits):
            a, b = j * part, min(n, (j + 1) * part)
            if a < n:
                m[i, :, j] = s[:, a:b].max(1).values
                p = torch.exp2(s[:, a:b] - m[i, :, j, None])
                l[i, :, j], acc[i, :, j] = p.sum(1), torch.einsum("hn,nhd->hd", p, v[a:b])
    return m, l, acc


def test_a_reduction_that_reads_partitions_that_never_ran_fails_naming_them():
    def all_partitions(q, cache, tables, lens, scale, splits):
        m, l, acc = _partitions(q, cache, tables, lens, scale, splits)
        w = torch.exp2(m - m.max(dim=2, keepdim=True).values)
        return (w[..., None] * acc).sum(2) / (w * l).sum(2)[..., None]

    fails(checks.check_split_decode, all_partitions, "Exercise 9.7", "never ran")


def test_a_reduction_without_the_max_weights_fails_stating_the_convention():
    def unweighted(q, cache, tables, lens, scale, splits):
        m, l, acc = _partitions(q, cache, tables, lens, scale, splits)
        ran = ~torch.isnan(m)
        return torch.where(ran[..., None], acc, 0).sum(2) / torch.where(ran, l, 0).sum(2)[..., None]

    fails(checks.check_split_decode, unweighted, "out = sum_j 2**(m_j - M) acc_j", "seed=")


def test_an_unsolved_kernel_raises_not_implemented_error_through_the_interpreter():
    if not INTERPRETED:
        pytest.skip("compiled for a GPU, a raise in a kernel is a compile error, not an exception")

    @triton.jit
    def unsolved(x_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        raise NotImplementedError("Exercise 9.4: write me")

    def launcher(x, residual, weight, eps):
        out = torch.empty_like(x)
        unsolved[(1,)](x, out, x.shape[-1], eps, BLOCK=128)
        return out, out

    with pytest.raises(NotImplementedError, match="Exercise 9.4: write me"):
        checks.check_fused_add_rms_norm(launcher, unsolved)


def test_a_prefix_of_the_reference_tokens_fails_clearly(monkeypatch):
    monkeypatch.setattr(kernel_checks, "_reference_tokens", lambda: ((1, 2, 3), (4, 5)))
    message = fails(kernel_checks._compare_in_engine, functools.partial(kernel_checks.fail, "9.6"),
                    what="load_kv_tile", got=[[1, 2], [4, 5]])
    assert "request 0's output goes wrong at token 2" in message


# -- the warm-up puzzles: the solutions pass; a constant, a torch launcher fail -------------------

@functools.lru_cache(maxsize=1)
def _solution_namespace():
    """The solutions notebook's import cell and warm-up cells (9.1-9.3), run here."""
    cells = nbformat.read(os.path.join(ROOT, "solutions", "09_triton_kernels.ipynb"), 4).cells
    namespace: dict = {}
    for cell in cells:
        if cell.cell_type != "code" or "grade" in cell.metadata.get("tags", []):
            continue
        if "import triton" in cell.source or any(name in cell.source for name in (
                "def add_bias_kernel", "def row_sums_kernel", "def matmul_kernel")):
            exec(compile(cell.source, "solutions/09", "exec"), namespace)
    return namespace


def test_the_warm_up_solutions_pass(capsys):
    ns = _solution_namespace()
    checks.check_bias_add(ns["add_bias"], ns["add_bias_kernel"])
    checks.check_row_sums(ns["row_sums"], ns["row_sums_kernel"])
    checks.check_tiled_matmul(ns["matmul"], ns["matmul_kernel"])
    assert capsys.readouterr().out.count("passed") == 3


def test_a_launcher_that_computes_in_torch_and_skips_the_kernel_fails():
    ns = _solution_namespace()
    fails(checks.check_bias_add, lambda x, bias: x + bias, "without running your add_bias_kernel",
          kernel=ns["add_bias_kernel"])


def test_a_stored_answer_fails_on_cases_drawn_at_grading_time():
    ns = _solution_namespace()
    stored = {}

    def record(a, b):  # the answers of one grading run, replayed in order
        stored.setdefault("outs", []).append(ns["matmul"](a, b))
        return stored["outs"][-1]

    checks.check_tiled_matmul(record, ns["matmul_kernel"])
    replay = iter(stored["outs"])

    def constant(a, b):
        ns["matmul"](a[:1, :1].contiguous(), b[:1, :1].contiguous())  # the kernel does run
        return next(replay)

    fails(checks.check_tiled_matmul, constant, "Exercise 9.3", kernel=ns["matmul_kernel"])


def test_row_sums_of_the_first_tile_only_fails_with_a_hint():
    @triton.jit
    def first_tile(x_ptr, out_ptr, cols, BLOCK: tl.constexpr):
        c = tl.arange(0, BLOCK)
        tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + tl.program_id(0) * cols + c,
                                                            mask=c < cols, other=0.0), 0))

    def launcher(x):
        out = torch.empty(x.shape[0])
        first_tile[(x.shape[0],)](x, out, x.shape[1], BLOCK=16)
        return out

    fails(checks.check_row_sums, launcher, "loop over the whole row", kernel=first_tile)


# -- delegation: every way of handing the work to the package fails --------------------------------

def _rms_kernel():
    return importlib.import_module("minivllm.kernels.rms_norm")._rms_norm_kernel


def _launch_rms(kernel, x, residual, weight, eps):
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous()
    out, res = torch.empty_like(x2), torch.empty_like(x2)
    kernel[(x2.shape[0],)](x2, r2, out, res, weight, n, n, n, n, x2.shape[0], n, eps,
                           HAS_RESIDUAL=True, BLOCK_ROWS=1, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape), res.view(x.shape)


def test_the_package_launcher_under_the_expected_name_fails():
    from minivllm.kernels.rms_norm import rms_norm

    def fused_add_rms_norm(x, residual, weight, eps):
        return rms_norm(x, weight, eps, residual)

    fails(checks.check_fused_add_rms_norm, fused_add_rms_norm, "Exercise 9.4",
          "minivllm.kernels.rms_norm.rms_norm", "the package's own answer")


def test_launching_the_package_rms_norm_kernel_fails():
    from minivllm.kernels import rms_norm as package

    def launcher(x, residual, weight, eps):
        return _launch_rms(package._rms_norm_kernel, x, residual, weight, eps)

    fails(checks.check_fused_add_rms_norm, launcher, "_rms_norm_kernel")
    # handed over as the learner's kernel (a bare alias), it fails before any case runs
    add_rms_norm_kernel = package._rms_norm_kernel
    fails(checks.check_fused_add_rms_norm, launcher, "_rms_norm_kernel",
          kernel=add_rms_norm_kernel)


def test_a_fresh_jit_of_the_package_kernel_fails():
    add_rms_norm_kernel = triton.jit(_rms_kernel().fn)
    fails(checks.check_fused_add_rms_norm, lambda *a: None, "_rms_norm_kernel",
          kernel=add_rms_norm_kernel)


def test_the_package_fetched_at_run_time_is_hidden():
    def sneaky(x, residual, weight, eps):
        module = importlib.import_module("minivllm." + "kernels.rms_norm")
        return getattr(module, "rms_" + "norm")(x, weight, eps, residual)

    fails(checks.check_fused_add_rms_norm, sneaky, "the package's own answer")
    from minivllm.kernels import rms_norm as package

    assert package.rms_norm.__code__.co_name == "rms_norm"  # restored afterwards
    x = torch.randn(2, 8)
    assert package.rms_norm(x, torch.ones(8), 1e-6).shape == x.shape


def test_a_package_kernel_fetched_and_launched_at_run_time_fails():
    def fetched(x, residual, weight, eps):
        module = importlib.import_module("minivllm." + "kernels.rms_norm")
        return _launch_rms(getattr(module, "_rms_norm" + "_kernel"), x, residual, weight, eps)

    fails(checks.check_fused_add_rms_norm, fetched, "while it ran", "_rms_norm_kernel")

    def rejitted(x, residual, weight, eps):
        module = importlib.import_module("minivllm." + "kernels.rms_norm")
        kernel = triton.jit(getattr(module, "_rms_norm" + "_kernel").fn)
        return _launch_rms(kernel, x, residual, weight, eps)

    fails(checks.check_fused_add_rms_norm, rejitted, "while it ran", "_rms_norm_kernel")


def test_the_torch_reference_fails_as_a_launcher():
    from minivllm.model.layers import rms_norm

    fails(checks.check_fused_add_rms_norm, lambda x, r, w, eps: rms_norm(x, w, eps, r),
          "minivllm.model.layers.rms_norm")
    from minivllm.attention.torch_backend import paged_decode_attention

    fails(checks.check_paged_decode, paged_decode_attention, "Exercise 9.6",
          "torch_backend.paged_decode_attention")


def test_the_package_update_imported_under_the_expected_name_fails():
    from minivllm.kernels.attention_tile import online_softmax_update as online_softmax_update_tl

    @triton.jit
    def kernel(q_ptr, out_ptr):
        m, l, acc = online_softmax_update_tl(q_ptr, q_ptr, q_ptr, q_ptr, q_ptr, "ieee")

    def contiguous_decode(q, k, v, scale):
        kernel[(1,)](q, q)
        return q

    fails(checks.check_online_softmax_kernel, contiguous_decode, "Exercise 9.5",
          "attention_tile.online_softmax_update", update=online_softmax_update_tl)
    fails(checks.check_online_softmax_kernel, contiguous_decode,
          "attention_tile.online_softmax_update")


def test_the_package_tile_load_fails_as_load_kv_tile():
    from minivllm.kernels.attention_tile import load_kv_tile

    @triton.jit
    def kernel(q_ptr):
        k, v = load_kv_tile(q_ptr, q_ptr, q_ptr, 0, 0, 0, 0, 0, 1, 1, 1, 1)

    def paged_decode(q, kv_cache, block_tables, seq_lens, scale):
        kernel[(1,)](q)
        return q

    fails(checks.check_paged_decode, paged_decode, "attention_tile.load_kv_tile",
          load_kv_tile=load_kv_tile)
    from minivllm.kernels import decode_attention

    fails(checks.check_paged_decode, lambda *a: decode_attention.paged_decode_attention(*a),
          "decode_attention.paged_decode_attention")


def test_launching_the_package_reduce_kernel_fails():
    import minivllm.kernels.decode_attention as package

    def flash_decode(q, kv_cache, block_tables, seq_lens, scale, num_splits):
        m, l, acc = _partitions(q, kv_cache, block_tables, seq_lens, scale, num_splits)
        out = torch.empty_like(q)
        part = -(-(-(-int(seq_lens.max()) // num_splits)) // 16) * 16
        package._decode_reduce_kernel[(q.shape[0], q.shape[1])](
            out, acc, m, l, seq_lens, out.stride(0), out.stride(1), acc.stride(0), acc.stride(1),
            acc.stride(2), m.stride(0), m.stride(1), q.shape[2], part,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(q.shape[2]))
        return out

    fails(checks.check_split_decode, flash_decode, "_decode_reduce_kernel")
    combine_partitions_kernel = package._decode_reduce_kernel
    fails(checks.check_split_decode, flash_decode, "Exercise 9.7", "_decode_reduce_kernel",
          kernel=combine_partitions_kernel)


def test_the_watch_is_undone_after_a_check():
    import sys

    from minivllm.attention.torch_backend import paged_decode_attention

    fails(checks.check_paged_decode,
          lambda *a: importlib.import_module(
        "minivllm.attention.torch_backend").paged_decode_attention(*a),
          "torch_backend.paged_decode_attention")
    assert sys.getprofile() is None
    out = paged_decode_attention(torch.ones(1, 1, 4), torch.ones(2, 1, 1, 1, 4),
                                 torch.zeros(1, 1, dtype=torch.int32),
                                 torch.ones(1, dtype=torch.int32), 1.0)
    assert torch.allclose(out, torch.ones(1, 1, 4))


# -- chapter 09 never prints what its exercises ask for ------------------------------------------

ANSWERS_09 = ["minivllm.kernels.rms_norm:_rms_norm_kernel",
              "minivllm.kernels.attention_tile:load_kv_tile",
              "minivllm.kernels.attention_tile:online_softmax_update",
              "minivllm.kernels.decode_attention:_decode_reduce_kernel"]


def _lines(text):
    out = []
    for line in text.split("\n"):
        line = " ".join(line.split("#")[0].split())
        if len(line) >= 16 and not line.startswith(('"""', "def ", "@")):
            out.append(line)
    return out


def _unnumbered(text):
    """Source as the chapter's show_source prints it, without its line numbers."""
    import re

    return re.sub(r"(?m)^ *\d+  ", "", text)


def test_chapter_09_neither_prints_nor_writes_out_an_exercise_answer():
    import inspect

    from minivllm.course.grading import resolve

    nb = nbformat.read(os.path.join(ROOT, "chapters", "09_triton_kernels.ipynb"), 4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    printed = " ".join(" ".join(_unnumbered(o.get("text", "")).split()) for c in nb.cells
                       if c.cell_type == "code" for o in c.outputs)
    for name in ANSWERS_09:
        obj = resolve(name)
        body = _lines(inspect.getsource(getattr(obj, "fn", obj)).split(":\n", 1)[1])
        assert body
        for i in range(len(body) - 2):  # three consecutive lines of the answer, printed
            assert " ".join(body[i:i + 3]) not in printed, f"chapter 09 prints {name}"
        assert not any(f"show_source({name.split(':')[1]}" in c or name.split(":")[1] + ")" in c
                       for c in code if "show_source" in c or "getsource" in c), name
    solutions = nbformat.read(os.path.join(ROOT, "solutions", "09_triton_kernels.ipynb"), 4)
    answer_lines = []
    for cell in solutions.cells:
        inside = False
        for line in cell.source.split("\n"):
            if "### BEGIN SOLUTION" in line or "### END SOLUTION" in line:
                inside = "BEGIN" in line
            elif inside:
                answer_lines += [x for x in _lines(line) if len(x) >= 24]
    for i, cell in enumerate(code):  # two consecutive solution lines in one chapter cell
        for a, b in zip(answer_lines, answer_lines[1:]):
            assert not (a in cell and b in cell), f"chapter 09 code cell {i} repeats {a!r}, {b!r}"


def test_the_line_numbers_chapter_09_reads_the_kernels_by_are_current():
    import inspect

    from minivllm.kernels import decode_attention, reshape_and_cache

    def line(fn, n):
        return inspect.getsourcelines(fn.fn)[0][n - 1].strip()

    stage1 = decode_attention._decode_partition_kernel
    assert line(reshape_and_cache._reshape_and_cache_kernel, 9).startswith("tok = tl.program_id(0)")
    assert line(reshape_and_cache._reshape_and_cache_kernel, 18).startswith("dst = ")
    assert line(stage1, 16).startswith("seq = tl.program_id(0)")
    assert line(stage1, 27).startswith("g = tl.arange")
    assert line(stage1, 35).startswith("m_i = tl.full")
    assert line(stage1, 38).startswith("for tile in range")
    assert line(stage1, 47).startswith("m_i, l_i, acc = online_softmax_update")
    assert line(stage1, 49).startswith("if SINGLE_SPLIT")
    assert line(stage1, 59).startswith("tl.store(acc_ptr")
