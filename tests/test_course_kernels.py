"""Chapter 09's checkers fail where they should, naming the mistake; an unsolved kernel's
NotImplementedError comes out of Triton's interpreter as itself; the package's own kernels
are out of reach while a learner's launcher runs. (The solved notebook, run by nbval, is the
passing case, engine included.)"""

import pytest
import torch

from minivllm.attention.torch_backend import paged_decode_attention
from minivllm.course import checks
from minivllm.model.layers import rms_norm

LOG2E = 1.4426950408889634


def _fails(check, component, *fragments):
    with pytest.raises(checks.CheckFailed) as info:
        check(component)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_launcher_that_calls_the_package_kernel_fails_saying_it_is_hidden():
    pytest.importorskip("triton")

    def delegating(x, residual, weight, eps):
        from minivllm.kernels import rms_norm as package

        return package.rms_norm(x, weight, eps, residual)

    _fails(checks.check_fused_add_rms_norm, delegating, "Exercise 9.1", "hides minivllm's version")
    from minivllm.kernels import rms_norm as package

    assert package.rms_norm.__name__ == "rms_norm"  # restored afterwards


def test_add_rms_norm_that_ignores_the_residual_fails_with_a_hint():
    def norm_only(x, residual, weight, eps):
        return rms_norm(x, weight, eps), x + residual

    _fails(checks.check_fused_add_rms_norm, norm_only, "normalise x + residual")


def test_add_rms_norm_returning_one_tensor_fails_stating_the_convention():
    _fails(checks.check_fused_add_rms_norm, lambda x, r, w, eps: rms_norm(x, w, eps, r)[0],
           "expected a tuple (out, new_residual)")


def test_online_softmax_in_base_e_fails_naming_the_base():
    def natural(s, v, m, l, acc):
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v

    _fails(checks.check_online_softmax, natural, "Exercise 9.2", "base 2")


def test_online_softmax_that_never_rescales_fails():
    def no_rescale(s, v, m, l, acc):
        m_new = torch.maximum(m, s.max(dim=1).values)
        p = torch.exp2(s - m_new[:, None])
        return m_new, l + p.sum(1), acc + p @ v

    _fails(checks.check_online_softmax, no_rescale, "acc / l after the last tile")


def test_paged_decode_that_reads_blocks_in_order_fails_naming_the_block_table():
    def in_order(q, cache, tables, lens, scale):
        ordered = torch.arange(tables.shape[1], dtype=torch.int32)[None].expand_as(tables)
        return paged_decode_attention(q, cache, ordered.contiguous(), lens, scale)

    _fails(checks.check_paged_decode, in_order, "Exercise 9.3", "look each token's block up")


def test_paged_decode_over_whole_blocks_fails_naming_the_mask():
    def whole_blocks(q, cache, tables, lens, scale):
        bs = cache.shape[2]
        return paged_decode_attention(q, cache, tables, (-(-lens // bs) * bs).to(torch.int32), scale)

    _fails(checks.check_paged_decode, whole_blocks, "mask t < seq_len")


def _partitions(q, cache, tables, lens, scale, splits):
    """Stage 1 in torch, as exercise 9.4 gives it: partitions that never ran hold NaN."""
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

    _fails(checks.check_split_decode, all_partitions, "Exercise 9.4", "never ran")


def test_a_reduction_without_the_max_weights_fails_stating_the_convention():
    def unweighted(q, cache, tables, lens, scale, splits):
        m, l, acc = _partitions(q, cache, tables, lens, scale, splits)
        ran = ~torch.isnan(m)
        return torch.where(ran[..., None], acc, 0).sum(2) / torch.where(ran, l, 0).sum(2)[..., None]

    _fails(checks.check_split_decode, unweighted, "out = sum_j 2**(m_j - M) acc_j")


def test_an_unsolved_kernel_raises_not_implemented_error_through_the_interpreter():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    if torch.cuda.is_available():
        pytest.skip("compiled for a GPU, a raise in a kernel is a compile error, not an exception")

    @triton.jit
    def unsolved(x_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        raise NotImplementedError("Exercise 9.1: write me")

    def launcher(x, residual, weight, eps):
        out = torch.empty_like(x)
        unsolved[(1,)](x, out, x.shape[-1], eps, BLOCK=128)
        return out, out

    with pytest.raises(NotImplementedError, match="Exercise 9.1: write me"):
        checks.check_fused_add_rms_norm(launcher)
