"""The CPU kernels (``minivllm/cpu_kernels.cpp``, torch operators): decode and prefill attention
against attention written out densely (head dims they specialize or take, grouped-query ratios,
block sizes, sliding windows, chunks after a cached context, one thread and several), bad block
tables refused without a crash; the elementwise ops against ``model/layers.py``'s torch
functions, on shapes small and large enough to be split between threads; torch.compile tracing
them; one OpenMP runtime in the process; the build (with a stand-in compiler: cached by compiler
version and flags, built once by processes that ask at once, its first error shown, a launcher
in $CXX); without a compiler the torch code serves and one warning says so. Nothing here builds
at import: the ``ops`` fixture builds (or finds) the library the first time a test needs it."""

import importlib
import sys
import threading

import numpy as np
import pytest
import torch

from minivllm import cpu_kernels
from minivllm.attention import torch_backend
from minivllm.model.layers import NATIVE_OPS
from minivllm.attention.backend import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend
from tests.attention_cases import context, dense, paged_case, step_case


@pytest.fixture(scope="module")
def ops():
    """torch.ops.minivllm_cpu, built on first use; the test is skipped without a compiler."""
    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    return cpu_kernels.library()


def run_kernel(q, cache, table, seq_lens, scale, window=None, num_threads=None):
    out = torch.full_like(q, float("nan"))
    assert cpu_kernels.paged_decode(q, cache, table, torch.tensor(seq_lens, dtype=torch.int32),
                                   scale, out, window, num_threads=num_threads)
    return out


# 20: not a multiple of 8, so full chunks of eight key rows take the plain loop, not dot8_heads
@pytest.mark.parametrize("head_dim", [64, 128, 24, 20])
@pytest.mark.parametrize("kv_heads,heads_per_kv", [(1, 1), (3, 3), (2, 7), (4, 2)])
@pytest.mark.parametrize("block_size,window", [(4, None), (16, None), (1, 5), (16, 20)])
def test_kernel_equals_dense_attention(ops, head_dim, kv_heads, heads_per_kv, block_size,
                                      window):
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


def test_kernel_softmax_over_large_score_gaps(ops):
    """Scores far apart (one key dominates, others underflow): no inf or NaN, the dominant
    value wins, as in torch's softmax."""
    gen = torch.Generator().manual_seed(1)
    cache, table = paged_case(gen, [20], 1, 64, 4)
    q = torch.randn(1, 2, 64, generator=gen) * 40
    out = run_kernel(q, cache, table, [20], 1.0)
    keys, values = context(cache, table, 0, 20)
    torch.testing.assert_close(out, dense(q, keys, values, [19], 1.0))
    assert torch.isfinite(out).all()


BAD_TABLES = ["block id past the cache", "negative block id", "context longer than its table"]


def _break_table(case, cache, table, lens):
    """Two sequences of 8 tokens in blocks of 4: spoil ``table`` (in place) or ``lens`` the way
    ``case`` of ``BAD_TABLES`` says; returns the lengths to pass."""
    if case == "block id past the cache":
        table[1, 1] = cache.shape[1]
    elif case == "negative block id":
        table[0, 0] = -1
    elif case == "context longer than its table":
        lens = [8, 4 * table.shape[1] + 1]
    return lens


@pytest.mark.parametrize("case", BAD_TABLES + ["empty context"])
def test_kernel_refuses_bad_input(ops, case):
    gen = torch.Generator().manual_seed(2)
    cache, table = paged_case(gen, [8, 8], 2, 16, 4)
    lens = [8, 0] if case == "empty context" else _break_table(case, cache, table, [8, 8])
    q = torch.randn(2, 4, 16, generator=gen)
    with pytest.raises(ValueError, match="paged_decode"):
        run_kernel(q, cache, table, lens, 0.25)
    # and the kernel still works afterwards
    table2 = paged_case(gen, [8, 8], 2, 16, 4)[1]
    run_kernel(q, cache, table2, [8, 8], 0.25)


def run_prefill(q, cache, table, query_lens, seq_lens, scale, window=None, num_threads=None):
    out = torch.full_like(q, float("nan"))
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    assert cpu_kernels.paged_prefill(q, cache, table, torch.tensor(seq_lens, dtype=torch.int32),
                                     qsl, scale, out, window, num_threads=num_threads)
    return out


# query lengths: one token, a chunk after a cached context, an empty one, several 16-query
# tiles (the last one partial), a chunk ending mid-block
PREFILL_CASE = ([1, 5, 0, 40, 17, 16], [1, 37, 9, 40, 60, 16])


@pytest.mark.parametrize("head_dim", [64, 128, 16])
@pytest.mark.parametrize("kv_heads,heads_per_kv", [(1, 1), (3, 3), (2, 7)])
@pytest.mark.parametrize("block_size,window", [(4, None), (16, None), (1, 5), (32, 20)])
def test_prefill_kernel_equals_dense_attention(ops, head_dim, kv_heads, heads_per_kv,
                                               block_size, window):
    gen = torch.Generator().manual_seed(head_dim + kv_heads * 10 + block_size)
    query_lens, seq_lens = PREFILL_CASE
    cache, table = paged_case(gen, seq_lens, kv_heads, head_dim, block_size)
    q = torch.randn(sum(query_lens), kv_heads * heads_per_kv, head_dim, generator=gen)
    scale = head_dim ** -0.5
    for threads in (1, 3):
        out = run_prefill(q, cache, table, query_lens, seq_lens, scale, window, threads)
        lo = 0
        for i, (ql, n) in enumerate(zip(query_lens, seq_lens)):
            keys, values = context(cache, table, i, n)
            torch.testing.assert_close(out[lo:lo + ql], dense(
                q[lo:lo + ql], keys, values, list(range(n - ql, n)), scale, window))
            lo += ql


def test_prefill_kernel_softmax_over_large_score_gaps(ops):
    """Scores far apart, and the largest in a later chunk than the first: the running maximum
    rescales what came before, with no inf or NaN."""
    gen = torch.Generator().manual_seed(1)
    cache, table = paged_case(gen, [40], 1, 16, 4)
    q = torch.randn(20, 2, 16, generator=gen) * 40
    out = run_prefill(q, cache, table, [20], [40], 1.0)
    keys, values = context(cache, table, 0, 40)
    # scores of hundreds: a float32 score's last bit, summed in another order, moves its
    # weight by about 1e-5
    torch.testing.assert_close(out, dense(q, keys, values, list(range(20, 40)), 1.0),
                               atol=1e-4, rtol=1e-4)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("case", BAD_TABLES + ["more queries than tokens", "queries past q"])
def test_prefill_kernel_refuses_bad_input(ops, case):
    gen = torch.Generator().manual_seed(2)
    cache, table = paged_case(gen, [8, 8], 2, 16, 4)
    query_lens = [3, 8]  # sequence 0's 3 new tokens at positions 5-7 see all its blocks
    lens = [2, 8] if case == "more queries than tokens" else _break_table(case, cache, table,
                                                                           [8, 8])
    q = torch.randn(10 if case == "queries past q" else 11, 4, 16, generator=gen)
    out, qsl = torch.empty_like(q), torch.tensor([0, 3, 11], dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_prefill"):
        ops.paged_prefill(q, cache, table, torch.tensor(lens, dtype=torch.int32), qsl, 0.25,
                          out, 0, 0)
    # and the kernel still works afterwards
    table2 = paged_case(gen, [8, 8], 2, 16, 4)[1]
    run_prefill(torch.randn(11, 4, 16, generator=gen), cache, table2, query_lens, [8, 8], 0.25)


def test_prefill_kernel_leaves_other_head_sizes_to_torch(ops):
    gen = torch.Generator().manual_seed(3)
    cache, table = paged_case(gen, [6], 1, 20, 4)
    q = torch.randn(6, 2, 20, generator=gen)
    out = torch.full_like(q, float("nan"))
    assert not cpu_kernels.paged_prefill(q, cache, table, torch.tensor([6]),
                                         torch.tensor([0, 6]), 0.3, out)
    assert out.isnan().all()


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


@pytest.mark.parametrize("head_dim", [64, 24])
def test_backend_step_takes_one_kernel_call_for_decodes_and_one_for_chunks(monkeypatch, head_dim):
    """In a step of decodes and prefill chunks the backend hands the decodes (first in the
    batch) to the decode kernel in one call and the chunks to the prefill kernel in one call,
    when they are there; a head size the prefill kernel does not take (24) is attended in
    torch, with the same results."""
    calls = []
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda q, *a, real=real, name=name, **k: (
            calls.append((name, q.shape[0])) or real(q, *a, **k)))
    gen = torch.Generator().manual_seed(4)
    d, bs = head_dim, 4
    query_lens, seq_lens = [1, 1, 4, 20], [7, 18, 6, 33]
    cache, table, q, k, v, qsl, positions, meta = step_case(
        gen, query_lens, seq_lens, 3, 9, d, bs, num_decodes=2)
    backend = TorchAttentionBackend()
    with torch.inference_mode():
        out = backend.forward(q, k, v, cache, backend.build_metadata(meta, bs), d ** -0.5)
    assert calls == [("paged_decode", 2), ("paged_prefill", 26)]
    for i, (ql, n) in enumerate(zip(query_lens, seq_lens)):
        keys, values = context(cache, table, i, n)
        lo = int(qsl[i])
        torch.testing.assert_close(out[lo:lo + ql], dense(q[lo:lo + ql], keys, values,
                                                          positions[lo:lo + ql], d ** -0.5))


def test_no_compiler_warns_once_and_the_torch_path_serves(monkeypatch, tmp_path):
    """A machine without a C++ compiler: one warning, and decodes run in torch with the same
    results; MINIVLLM_CPU_KERNELS=torch turns the kernels off without a warning."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    fresh = importlib.reload(cpu_kernels)
    monkeypatch.setattr(fresh, "_registered", lambda: False)  # a process that has not loaded it
    monkeypatch.setattr(torch_backend, "cpu_kernels", fresh)
    try:
        with pytest.warns(UserWarning, match="CPU kernels are unavailable.*no-such-compiler"):
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


# -- the build, with a stand-in compiler (a real build takes seconds of the suite's time) -----

FAKE_CXX = """#!{python}
# logs its arguments; --version prints $FAKE_CXX_VERSION; fails where $FAKE_CXX_FAIL says;
# otherwise writes the -o file after $FAKE_CXX_SLEEP seconds
import os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_CXX_LOG"], "a") as f:
    f.write(" ".join(args) + "\\n")
if "--version" in args:
    print(os.environ.get("FAKE_CXX_VERSION", "fake c++ 1.0"))
    sys.exit(0)
if os.environ.get("FAKE_CXX_FAIL") and "-c" in args:
    march = "-march=native" in args
    sys.stderr.write("In file included from x.h:1,\\n" + ("cpu_kernels.cpp:1:1: error: "
                     "unknown -march=native" if march else "error: some later problem") + "\\n")
    sys.exit(1)
time.sleep(float(os.environ.get("FAKE_CXX_SLEEP", "0")))
open(args[args.index("-o") + 1], "w").write("a library")
"""


@pytest.fixture
def fake_cxx(monkeypatch, tmp_path):
    """$CXX is a stand-in compiler (its log: the returned path); the cache is empty."""
    script = tmp_path / "fake-c++"
    script.write_text(FAKE_CXX.replace("{python}", sys.executable))
    script.chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("FAKE_CXX_LOG", str(log))
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_versions", {})
    return log


def _compiles(log):
    return [line for line in log.read_text().splitlines() if " -c " in f" {line} "]


def test_build_is_cached_and_keyed_by_compiler_version_and_flags(fake_cxx, monkeypatch):
    first = cpu_kernels.build()
    assert cpu_kernels.build() == first and len(_compiles(fake_cxx)) == 1  # not rebuilt
    assert first.read_text() == "a library"
    compile_line, = _compiles(fake_cxx)
    assert "-O3" in compile_line.split() and "-fopenmp" in compile_line.split()
    link = [ln for ln in fake_cxx.read_text().splitlines() if "-shared" in ln.split()]
    assert link and not any("fopenmp" in ln or "gomp" in ln for ln in link)  # torch's runtime
    # no temporary left, only the library and its lock
    assert sorted(p.suffix for p in first.parent.iterdir()) == [".lock", ".so"]
    monkeypatch.setenv("FAKE_CXX_VERSION", "fake c++ 2.0")
    monkeypatch.setattr(cpu_kernels, "_versions", {})
    upgraded = cpu_kernels.build()
    assert upgraded != first and upgraded.parent == first.parent and len(_compiles(fake_cxx)) == 2
    flags = cpu_kernels.library_path(cpu_kernels.compiler(), cpu_kernels.FLAGS + ["-DX"])
    assert flags not in (first, upgraded)


def test_processes_asking_at_once_build_once(fake_cxx, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_SLEEP", "0.5")
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(cpu_kernels.build()))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 2 and paths[0] == paths[1] and len(_compiles(fake_cxx)) == 1


def test_a_failed_build_shows_the_first_error(fake_cxx, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_FAIL", "1")
    with pytest.raises(RuntimeError, match="unknown -march=native") as failed:
        cpu_kernels.build()
    assert "later problem" not in str(failed.value)
    assert len(_compiles(fake_cxx)) == 1 + len(cpu_kernels.FALLBACKS)  # every flag set tried


def test_cxx_may_be_a_launcher_and_a_compiler(fake_cxx, monkeypatch, tmp_path):
    """$CXX="ccache g++": split like a shell (here the stand-in launches "g++", which it only
    logs); a launcher that is not installed fails with its name."""
    monkeypatch.setenv("CXX", f"{fake_cxx.parent / 'fake-c++'} g++")
    cpu_kernels.build()
    assert all(line.startswith("g++ ") for line in fake_cxx.read_text().splitlines())
    monkeypatch.setenv("CXX", f"{tmp_path / 'no-such-ccache'} g++")
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler .*no-such-ccache g\\+\\+"):
        cpu_kernels.build()


def test_kernel_is_not_used_where_autograd_needs_the_graph(ops):
    gen = torch.Generator().manual_seed(8)
    cache, table = paged_case(gen, [5], 1, 8)
    q = torch.randn(1, 2, 8, generator=gen, requires_grad=True)
    assert not cpu_kernels.can_run(q, cache)
    with torch.no_grad():
        assert cpu_kernels.can_run(q, cache)
    assert not cpu_kernels.can_run(q.detach().double(), cache.double())


# -- the elementwise ops ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def c_ops(ops):
    """The elementwise ops as the model runner swaps them in (by layers.py's names)."""
    return cpu_kernels.cpu_elementwise_ops(NATIVE_OPS)


@pytest.mark.parametrize("rows,hidden", [(1, 8), (5, 64), (300, 576)])  # the last one threaded
def test_rms_norm_equals_torch(c_ops, rows, hidden):
    ops, gen = c_ops, torch.Generator().manual_seed(rows)
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
def test_silu_and_mul_equals_torch(c_ops, rows, d):
    ops, gen = c_ops, torch.Generator().manual_seed(d)
    x = torch.randn(rows, 2 * d, generator=gen) * 6  # large |gate| both ways
    torch.testing.assert_close(ops["silu_and_mul"](x), NATIVE_OPS["silu_and_mul"](x))


@pytest.mark.parametrize("tokens,heads,kv_heads,d", [(1, 2, 1, 8), (9, 9, 3, 64), (400, 9, 3, 64)])
def test_rotary_equals_torch(c_ops, tokens, heads, kv_heads, d):
    ops, gen = c_ops, torch.Generator().manual_seed(tokens)
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


def test_elementwise_ops_leave_autograd_to_torch(c_ops):
    """With gradients wanted (the course's standalone models), each op is the torch one."""
    ops, gen = c_ops, torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen, requires_grad=True)
    weight = torch.randn(16, generator=gen)
    ops["rms_norm"](x, weight, 1e-6).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    g = torch.randn(3, 32, generator=gen, requires_grad=True)
    ops["silu_and_mul"](g).sum().backward()
    assert g.grad is not None


def test_queries_whose_heads_are_not_side_by_side_take_the_torch_path(ops):
    gen = torch.Generator().manual_seed(9)
    cache, table = paged_case(gen, [6, 3], 2, 8)
    q = torch.randn(2, 8, 4, generator=gen).transpose(1, 2)  # [2, 4 heads, 8]: heads strided
    assert not cpu_kernels.can_run(q, cache)
    assert cpu_kernels.can_run(q.contiguous(), cache)
    assert torch.allclose(_decode_step(q, cache, table, [6, 3]),
                          _reference(q.contiguous(), cache, table, [6, 3]), atol=1e-6)


def test_torch_compile_puts_the_ops_in_its_graph(ops, c_ops):
    """torch.compile traces through the ops (their fake implementations give the shapes): they
    are nodes of its graph, with no graph break, and the compiled function computes what the
    eager one does."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(positions, x, residual, weight, gate_up, cos_sin, q, k, cache, table, lens, out):
        h, residual = c_ops["rms_norm"](x, weight, 1e-6, residual)
        q, k = c_ops["rotary_embedding"](positions, q, k, cos_sin)
        ops.paged_decode.default(q, cache, table, lens, 0.125, out, 0, 0)
        return h, residual, c_ops["silu_and_mul"](gate_up), k

    gen = torch.Generator().manual_seed(11)
    cache, table = paged_case(gen, [5, 9], 2, 64)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    args = [torch.tensor([4, 8]), torch.randn(2, 32, generator=gen),
            torch.randn(2, 32, generator=gen), torch.randn(32, generator=gen),
            torch.randn(2, 48, generator=gen), torch.randn(16, 64, generator=gen),
            torch.randn(2, 4, 64, generator=gen), torch.randn(2, 2, 64, generator=gen), cache,
            table.int(), lens]
    eager_out, compiled_out = torch.empty(2, 4, 64), torch.empty(2, 4, 64)
    with torch.inference_mode():
        want = layer(*args, eager_out)
        got = torch.compile(layer, backend=backend, fullgraph=True)(*args, compiled_out)
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {f"minivllm_cpu.{name}.default" for name in (
        "fused_add_rms_norm", "rotary_embedding", "paged_decode", "silu_and_mul")} <= targets
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)


def test_one_openmp_runtime_is_loaded(ops):
    """The kernels run on torch's threads: the library links no OpenMP runtime of its own, so
    the process maps one (torch's), not a second beside it."""
    import re

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        pytest.skip("no /proc/self/maps here")
    runtimes = set(re.findall(r"\S*/lib(?:gomp|iomp5|omp)[^/\s]*\.so[^/\s]*$", maps, re.M))
    assert len(runtimes) == 1, runtimes
    assert any("minivllm" not in path for path in runtimes)


def test_a_fresh_process_builds_on_use_only_and_keeps_denormal_floats(ops):
    """Importing this test module builds nothing (the fixture does, when a test runs). And a
    library built with -ffast-math sets flush-to-zero for the whole process when loaded; this
    one must not: subnormal floats survive in Python and in torch."""
    import subprocess
    from pathlib import Path

    code = ("import tests.test_cpu_kernels\n"
            "from minivllm import cpu_kernels\n"
            "assert not cpu_kernels._tried, 'importing the tests built the kernels'\n"
            "import torch\n"
            "assert cpu_kernels.library() is not None\n"
            "x = float('2.2250738585072014e-308')\n"
            "assert x / 2 > 0, 'Python flushes denormals'\n"
            "t = torch.tensor([1e-38]) * torch.tensor([1e-3])\n"
            "assert t.item() > 0, 'torch flushes denormals'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-1500:]


# -- the sampler's exponential race -----------------------------------------------------------

def _hash32(x: np.ndarray) -> np.ndarray:
    """race_sample's integer hash, in numpy (uint64 holding uint32 values)."""
    mask = np.uint64(0xFFFFFFFF)
    for shift, mul in ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB)):
        x = ((x ^ (x >> np.uint64(shift))) * np.uint64(mul)) & mask
    return x ^ (x >> np.uint64(14))


def _race_uniforms(key: int, vocab: int) -> np.ndarray:
    """The u in (0, 1) that race_sample draws for a row with this key: the midpoints of 2^23
    cells, in float64, each exactly a float32 (which the kernel computes in)."""
    key &= (1 << 64) - 1
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    h = _hash32((_hash32(np.arange(vocab, dtype=np.uint64) ^ k0) + k1) & np.uint64(0xFFFFFFFF))
    u = ((h >> np.uint64(9)).astype(np.float64) + 0.5) * 2.0 ** -23
    assert np.array_equal(u.astype(np.float32).astype(np.float64), u)
    return u


def test_race_sample_is_the_argmax_of_p_over_its_noise(ops):
    """Each row's token is argmax p / -log(u) for the u its key gives (recomputed here in
    float64): the kernel's noise, its log and its argmax are what they say; rows of other
    widths and strides too, and keys with the top bit set."""
    gen = torch.Generator().manual_seed(5)
    for rows, vocab in ((16, 49152), (3, 1000), (5, 7)):
        probs = torch.softmax(torch.randn(rows, vocab + 3, generator=gen) * 3, -1)[:, :vocab]
        keys = torch.empty(rows, dtype=torch.int64).random_(generator=gen)
        keys[0] = -(2**63) + 12345
        got = ops.race_sample(probs, keys).tolist()
        for i in range(rows):
            u = _race_uniforms(int(keys[i]), vocab)
            assert 0 < u.min() and u.max() < 1 and np.float32(u.max()) < 1
            assert got[i] == int(np.argmax(probs[i].double().numpy() / -np.log(u)))


def test_race_sample_draws_each_token_with_its_probability(ops):
    """200,000 rows with independent keys: each token's frequency within 4 standard errors
    of its probability, and a token of probability 0 never drawn."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625 - 1e-4, 1e-4, 0.0])
    n = 200_000
    keys = torch.empty(n, dtype=torch.int64).random_(generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(ops.race_sample(p.repeat(n, 1), keys), minlength=len(p)).double()
    assert counts[-1] == 0
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((counts / n - p.double()).abs() <= 4 * se + 1e-12).all(), counts / n


def test_race_sample_refuses_bad_input(ops):
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="keys"):
        ops.race_sample(probs, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="keys"):
        ops.race_sample(probs, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="probs"):
        ops.race_sample(probs[:, ::2], torch.zeros(2, dtype=torch.int64))
