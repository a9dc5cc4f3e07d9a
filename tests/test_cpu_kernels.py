"""The C kernels (``minivllm/cpu_kernels.c``): decode attention against attention written out
densely (head dims it specializes, 64 and 128, and others; grouped-query ratios, block sizes,
sliding windows, one thread and several), bad block tables refused without a crash; the
elementwise ops against ``model/layers.py``'s torch functions, on shapes small and large enough
to be split between threads; without a compiler the torch code serves and one warning says so."""

import importlib

import pytest
import torch

from minivllm import cpu_kernels
from minivllm.attention import torch_backend
from minivllm.model.layers import NATIVE_OPS
from minivllm.attention.backend import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend
from tests.test_torch_attention import context, dense, paged_case, step_case

needs_kernel = pytest.mark.skipif(cpu_kernels.kernel() is None,
                                  reason="no C compiler: the kernel cannot be built here")


def run_kernel(q, cache, table, seq_lens, scale, window=None, num_threads=None):
    out = torch.full_like(q, float("nan"))
    assert cpu_kernels.paged_decode(q, cache, table, torch.tensor(seq_lens, dtype=torch.int32),
                                   scale, out, window, num_threads=num_threads)
    return out


@needs_kernel
# 20: not a multiple of 8, so full chunks of eight key rows take the plain loop, not dot8
@pytest.mark.parametrize("head_dim", [64, 128, 24, 20])
@pytest.mark.parametrize("kv_heads,heads_per_kv", [(1, 1), (3, 3), (2, 7), (4, 2)])
@pytest.mark.parametrize("block_size,window", [(4, None), (16, None), (1, 5), (16, 20)])
def test_kernel_equals_dense_attention(head_dim, kv_heads, heads_per_kv, block_size, window):
    gen = torch.Generator().manual_seed(head_dim + kv_heads * 10 + block_size)
    seq_lens = [1, 2, 15, 16, 17, 40, 33]  # block edges, one token, several blocks
    cache, table = paged_case(gen, seq_lens, kv_heads, head_dim, block_size)
    q = torch.randn(len(seq_lens), kv_heads * heads_per_kv, head_dim, generator=gen)
    scale = head_dim ** -0.5
    for threads in (1, 3):
        out = run_kernel(q, cache, table, seq_lens, scale, window, num_threads=threads)
        for i, n in enumerate(seq_lens):
            keys, values = context(cache, table, i, n)
            torch.testing.assert_close(out[i:i + 1], dense(q[i:i + 1], keys, values, [n - 1],
                                                           scale, window))


@needs_kernel
def test_kernel_softmax_over_large_score_gaps():
    """Scores far apart (one key dominates, others underflow): no inf or NaN, the dominant
    value wins, as in torch's softmax."""
    gen = torch.Generator().manual_seed(1)
    cache, table = paged_case(gen, [20], 1, 64, 4)
    q = torch.randn(1, 2, 64, generator=gen) * 40
    out = run_kernel(q, cache, table, [20], 1.0)
    keys, values = context(cache, table, 0, 20)
    torch.testing.assert_close(out, dense(q, keys, values, [19], 1.0))
    assert torch.isfinite(out).all()


@needs_kernel
@pytest.mark.parametrize("case", ["block id past the cache", "negative block id",
                                  "context longer than its table", "empty context"])
def test_kernel_refuses_bad_input(case):
    gen = torch.Generator().manual_seed(2)
    cache, table = paged_case(gen, [8, 8], 2, 16, 4)
    lens = [8, 8]
    if case == "block id past the cache":
        table[1, 1] = cache.shape[1]
    elif case == "negative block id":
        table[0, 0] = -1
    elif case == "context longer than its table":
        lens = [8, 4 * table.shape[1] + 1]
    else:
        lens = [8, 0]
    q = torch.randn(2, 4, 16, generator=gen)
    with pytest.raises(ValueError, match="paged_decode"):
        run_kernel(q, cache, table, lens, 0.25)
    # and the kernel still works afterwards
    table2 = paged_case(gen, [8, 8], 2, 16, 4)[1]
    run_kernel(q, cache, table2, [8, 8], 0.25)


def _decode_step(q, cache, table, seq_lens, scale=0.3):
    """The backend's forward for a step of decodes only, whose new K/V are the ones already in
    the cache at the last positions (so the write leaves the cache as it was)."""
    bs, kv_heads, d = cache.shape[2], cache.shape[3], cache.shape[4]
    slots = torch.tensor([int(table[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(seq_lens)])
    k = cache[0].reshape(-1, kv_heads, d)[slots].clone()
    v = cache[1].reshape(-1, kv_heads, d)[slots].clone()
    n = len(seq_lens)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=n, num_decodes=n, max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table, slot_mapping=slots, query_start_loc_cpu=qsl.numpy(),
        seq_lens_cpu=torch.tensor(seq_lens).numpy())
    backend = TorchAttentionBackend()
    with torch.inference_mode():
        return backend.forward(q, k, v, cache, backend.build_metadata(meta, bs), scale)


def _reference(q, cache, table, seq_lens, scale=0.3):
    from minivllm.attention.torch_backend import paged_decode_attention

    return paged_decode_attention(q, cache, table, torch.tensor(seq_lens), scale)


def test_backend_step_takes_the_kernel_for_decodes_only(monkeypatch):
    """In a step of decodes and prefill chunks the backend hands the decodes (first in the
    batch) to the kernel in one call, when it is there, and attends the chunks in torch."""
    calls = []
    real = cpu_kernels.paged_decode
    monkeypatch.setattr(cpu_kernels, "paged_decode",
                        lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))
    gen = torch.Generator().manual_seed(4)
    d, bs = 64, 4
    query_lens, seq_lens = [1, 1, 4], [7, 18, 6]
    cache, table, q, k, v, qsl, positions, meta = step_case(
        gen, query_lens, seq_lens, 3, 9, d, bs, num_decodes=2)
    backend = TorchAttentionBackend()
    with torch.inference_mode():
        out = backend.forward(q, k, v, cache, backend.build_metadata(meta, bs), d ** -0.5)
    assert calls == [2]
    for i, (ql, n) in enumerate(zip(query_lens, seq_lens)):
        keys, values = context(cache, table, i, n)
        lo = int(qsl[i])
        torch.testing.assert_close(out[lo:lo + ql], dense(q[lo:lo + ql], keys, values,
                                                          positions[lo:lo + ql], d ** -0.5))


def test_no_compiler_warns_once_and_the_torch_path_serves(monkeypatch, tmp_path):
    """A machine without a C compiler: one warning, and decodes run in torch with the same
    results; MINIVLLM_CPU_ATTENTION=torch turns the kernel off without a warning."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    fresh = importlib.reload(cpu_kernels)
    monkeypatch.setattr(torch_backend, "cpu_kernels", fresh)
    try:
        with pytest.warns(UserWarning, match="CPU kernels are unavailable"):
            assert fresh.kernel() is None
        assert fresh.kernel() is None  # warned once: a second ask is quiet
        gen = torch.Generator().manual_seed(6)
        seq_lens = [5, 12]
        cache, table = paged_case(gen, seq_lens, 3, 8)
        q = torch.randn(2, 9, 8, generator=gen)
        out = torch.empty_like(q)
        assert not fresh.paged_decode(q, cache, table, torch.tensor(seq_lens), 0.3, out)
        assert fresh.cpu_elementwise_ops(NATIVE_OPS) is None
        # the backend's own fallback: a step of these two decodes, through the torch code
        assert torch.equal(_decode_step(q, cache, table, seq_lens), _reference(q, cache, table,
                                                                              seq_lens))
        monkeypatch.setenv(cpu_kernels.ENV, "torch")
        assert fresh.kernel() is None and not fresh.can_run(q, cache)
    finally:
        monkeypatch.undo()
        importlib.reload(cpu_kernels)


@needs_kernel
def test_build_is_cached_and_keyed_by_source_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    first = cpu_kernels.build()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    other = cpu_kernels.library_path("cc", cpu_kernels.FLAGS + ["-DX"])
    assert other != first and other.parent == first.parent
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left


@needs_kernel
def test_kernel_is_not_used_where_autograd_needs_the_graph():
    gen = torch.Generator().manual_seed(8)
    cache, table = paged_case(gen, [5], 1, 8)
    q = torch.randn(1, 2, 8, generator=gen, requires_grad=True)
    assert not cpu_kernels.can_run(q, cache)
    with torch.no_grad():
        assert cpu_kernels.can_run(q, cache)
    assert not cpu_kernels.can_run(q.detach().double(), cache.double())


# -- the elementwise ops ----------------------------------------------------------------------

def _ops():
    ops = cpu_kernels.cpu_elementwise_ops(NATIVE_OPS)
    if ops is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    return ops


@pytest.mark.parametrize("rows,hidden", [(1, 8), (5, 64), (300, 576)])  # the last one threaded
def test_rms_norm_equals_torch(rows, hidden):
    ops, gen = _ops(), torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(ops["rms_norm"](x, weight, 1e-5),
                               NATIVE_OPS["rms_norm"](x, weight, 1e-5))
    out, new_residual = ops["rms_norm"](x, weight, 1e-5, residual)
    ref_out, ref_residual = NATIVE_OPS["rms_norm"](x, weight, 1e-5, residual)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)  # one add: exact
    # a strided view (the q/k norm of Qwen3 runs on [tokens, heads, head_dim] slices)
    wide = torch.randn(rows, 2 * hidden, generator=gen)
    torch.testing.assert_close(ops["rms_norm"](wide[:, :hidden], weight, 1e-5),
                               NATIVE_OPS["rms_norm"](wide[:, :hidden], weight, 1e-5))


@pytest.mark.parametrize("rows,d", [(1, 4), (7, 48), (64, 1536)])
def test_silu_and_mul_equals_torch(rows, d):
    ops, gen = _ops(), torch.Generator().manual_seed(d)
    x = torch.randn(rows, 2 * d, generator=gen) * 6  # large |gate| both ways
    torch.testing.assert_close(ops["silu_and_mul"](x), NATIVE_OPS["silu_and_mul"](x))


@pytest.mark.parametrize("tokens,heads,kv_heads,d", [(1, 2, 1, 8), (9, 9, 3, 64), (400, 9, 3, 64)])
def test_rotary_equals_torch(tokens, heads, kv_heads, d):
    ops, gen = _ops(), torch.Generator().manual_seed(tokens)
    cos_sin = torch.randn(512, d, generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)  # q, k: strided views
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d: (heads + kv_heads) * d].view(tokens, kv_heads, d)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    got, want = ops["rotary_embedding"](positions, q, k, cos_sin), \
        NATIVE_OPS["rotary_embedding"](positions, q, k, cos_sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(IndexError, match="outside"):
        ops["rotary_embedding"](torch.full((tokens,), 512), q, k, cos_sin)


def test_elementwise_ops_leave_autograd_to_torch():
    """With gradients wanted (the course's standalone models), each op is the torch one."""
    ops, gen = _ops(), torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen, requires_grad=True)
    weight = torch.randn(16, generator=gen)
    ops["rms_norm"](x, weight, 1e-6).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    g = torch.randn(3, 32, generator=gen, requires_grad=True)
    ops["silu_and_mul"](g).sum().backward()
    assert g.grad is not None


@needs_kernel
def test_queries_whose_heads_are_not_side_by_side_take_the_torch_path():
    gen = torch.Generator().manual_seed(9)
    cache, table = paged_case(gen, [6, 3], 2, 8)
    q = torch.randn(2, 8, 4, generator=gen).transpose(1, 2)  # [2, 4 heads, 8]: heads strided
    assert not cpu_kernels.can_run(q, cache)
    assert cpu_kernels.can_run(q.contiguous(), cache)
    assert torch.allclose(_decode_step(q, cache, table, [6, 3]),
                          _reference(q.contiguous(), cache, table, [6, 3]), atol=1e-6)


@needs_kernel
def test_loading_the_library_keeps_denormal_floats():
    """A library built with -ffast-math sets flush-to-zero for the whole process when loaded;
    this one must not: subnormal floats survive in Python and in torch."""
    import subprocess
    import sys

    code = ("from minivllm import cpu_kernels\n"
            "import torch\n"
            "assert cpu_kernels.library() is not None\n"
            "x = float('2.2250738585072014e-308')\n"
            "assert x / 2 > 0, 'Python flushes denormals'\n"
            "t = torch.tensor([1e-38]) * torch.tensor([1e-3])\n"
            "assert t.item() > 0, 'torch flushes denormals'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1500:]
