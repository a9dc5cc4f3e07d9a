"""Every Triton kernel against its plain-torch reference, float32, randomised shapes.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported): exact float32 on numpy, slow, so shapes stay small except for one
"largest" case per attention kernel. Each case draws its own shapes from a seeded generator:
block sizes, head counts, GQA ratios, head dims (powers of two and not), contexts that end
mid-block, empty-context prefill, scattered block tables, padding slots.
"""

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from minivllm.kernels import activation, decode_attention, prefill_attention  # noqa: E402
from minivllm.kernels import reshape_and_cache, rms_norm, rotary_embedding  # noqa: E402

# the torch references the kernels must equal (the engine's own torch path)
from minivllm.attention.torch_backend import paged_decode_attention as ref_decode  # noqa: E402
from minivllm.attention.torch_backend import paged_prefill_attention as ref_prefill  # noqa: E402
from minivllm.attention.torch_backend import write_to_kv_cache as ref_write  # noqa: E402
from minivllm.model.layers import rms_norm as ref_rms_norm  # noqa: E402
from minivllm.model.layers import rotary_embedding as ref_rotary  # noqa: E402
from minivllm.model.layers import silu_and_mul as ref_silu_and_mul  # noqa: E402

from tests.attention_cases import paged_case  # noqa: E402

ATOL = 2e-5  # float32: only the order of the sums differs


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _paged_context(rng: random.Random, seq_lens, block_size, num_kv_heads, head_dim):
    """``paged_case`` drawn from ``rng``: scattered block tables (no block shared), padded with
    0 past each sequence's last block and sometimes wider than the longest needs."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return paged_case(gen, seq_lens, num_kv_heads, head_dim, block_size,
                      extra_width=rng.randint(0, 2))


def _shapes(rng):
    num_kv_heads = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 4, 8])  # query heads per KV head (GQA ratio)
    head_dim = rng.choice([16, 32, 48, 64, 128])
    block_size = rng.choice([1, 4, 8, 16, 32])
    return num_kv_heads, num_kv_heads * group, head_dim, block_size


# -- reshape_and_cache ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_reshape_and_cache_matches_reference(seed):
    rng = random.Random(seed)
    num_kv_heads, num_heads, head_dim, block_size = _shapes(rng)
    num_blocks, n = rng.randint(4, 12), rng.randint(1, 40)
    n = min(n, num_blocks * block_size)
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[torch.rand(n) < 0.2] = -1  # padding tokens: not written
    # k and v as strided views into one packed projection, as the model produces them
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(n, num_kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    expected = cache.clone()
    ref_write(k, v, expected, slots)
    reshape_and_cache.reshape_and_cache(k, v, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


# -- decode attention ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(10))
def test_decode_attention_matches_reference(seed):
    rng = random.Random(100 + seed)
    num_kv_heads, num_heads, head_dim, block_size = _shapes(rng)
    num_seqs = rng.randint(1, 5)
    seq_lens = [rng.choice([1, 2, block_size, block_size + 1, rng.randint(1, 300)])
                for _ in range(num_seqs)]
    cache, table = _paged_context(rng, seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(num_seqs, num_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = ref_decode(q, cache, table, lens, scale)
    # one partition, several (flash-decoding + reduce), and the automatic choice
    for num_splits in (1, rng.randint(2, 5), None):
        out = decode_attention.paged_decode_attention(q, cache, table, lens, scale,
                                                      max_seq_len=max(seq_lens), num_splits=num_splits)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=f"num_splits={num_splits}")


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no NaN even in masked lanes
def test_decode_grid_sized_for_longer_contexts_than_present():
    """A CUDA graph sizes the grid for max_model_len; shorter sequences must still be exact,
    and a padding row with an empty context gives zeros, not NaN."""
    rng = random.Random(7)
    cache, table = _paged_context(rng, [37, 5, 1], 16, 2, 32)
    q = torch.randn(3, 4, 32)
    lens = torch.tensor([37, 5, 1], dtype=torch.int32)
    expected = ref_decode(q, cache, table, lens, 0.2)
    out = decode_attention.paged_decode_attention(q, cache, table, lens, 0.2, max_seq_len=4096)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    empty = decode_attention.paged_decode_attention(
        q[:1], cache, table[:1], torch.tensor([0], dtype=torch.int32), 0.2, max_seq_len=600)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_decode_writes_into_out_slice():
    rng = random.Random(3)
    cache, table = _paged_context(rng, [20, 9], 8, 2, 16)
    q = torch.randn(2, 4, 16)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    buf = torch.full((5, 4, 16), float("nan"))
    decode_attention.paged_decode_attention(q, cache, table, lens, 0.25, out=buf[1:3])
    torch.testing.assert_close(buf[1:3], ref_decode(q, cache, table, lens, 0.25),
                               atol=ATOL, rtol=0)
    assert buf[0].isnan().all() and buf[3:].isnan().all()


def test_decode_attention_largest_shape():
    """Qwen3-0.6B's attention shape (16 query heads over 8 KV heads, head_dim 128), 3k context."""
    rng = random.Random(11)
    seq_lens = [3001, 1500]
    cache, table = _paged_context(rng, seq_lens, 16, 8, 128)
    q = torch.randn(2, 16, 128)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = ref_decode(q, cache, table, lens, 128**-0.5)
    out = decode_attention.paged_decode_attention(q, cache, table, lens, 128**-0.5)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


# -- prefill attention ---------------------------------------------------------------------------
def _prefill_case(rng, query_lens, context_lens, num_kv_heads, num_heads, head_dim, block_size):
    """Cache holding every sequence's earlier context, then the new tokens written at their slots
    (as the backend does before attention); the reference also gets the new k/v directly."""
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    cache, table = _paged_context(rng, seq_lens, block_size, num_kv_heads, head_dim)
    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_dim)
    k = torch.randn(total, num_kv_heads, head_dim)
    v = torch.randn(total, num_kv_heads, head_dim)
    slots, qsl = [], [0]
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        for p in range(c, c + n):
            slots.append(int(table[i, p // block_size]) * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
    ref_write(k, v, cache, torch.tensor(slots))
    return q, k, v, cache, table, qsl, seq_lens


@pytest.mark.parametrize("seed", range(10))
def test_prefill_attention_matches_reference(seed):
    rng = random.Random(200 + seed)
    num_kv_heads, num_heads, head_dim, block_size = _shapes(rng)
    num_seqs = rng.randint(1, 4)
    # fresh prompts (empty context), chunks after a prefix ending mid-block, 1-token chunks,
    # chunks longer than one query tile
    query_lens = [rng.choice([1, 3, rng.randint(1, 80), 70]) for _ in range(num_seqs)]
    context_lens = [rng.choice([0, 0, block_size - 1 if block_size > 1 else 0, rng.randint(1, 150)])
                    for _ in range(num_seqs)]
    q, k, v, cache, table, qsl, seq_lens = _prefill_case(
        rng, query_lens, context_lens, num_kv_heads, num_heads, head_dim, block_size)
    scale = head_dim**-0.5
    expected = ref_prefill(q, cache, qsl, seq_lens, table, scale)
    out = prefill_attention.paged_prefill_attention(q, cache, qsl, seq_lens, table, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    # device tensors instead of lists give the same answer
    out_t = prefill_attention.paged_prefill_attention(
        q, cache, torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        table, scale)
    torch.testing.assert_close(out_t, expected, atol=ATOL, rtol=0)


def test_prefill_attention_largest_shape():
    """Qwen3-0.6B's attention shape: a 100-token chunk after a 150-token prefix, a fresh prompt."""
    rng = random.Random(12)
    q, k, v, cache, table, qsl, seq_lens = _prefill_case(rng, [100, 40], [150, 0], 8, 16, 128, 16)
    expected = ref_prefill(q, cache, qsl, seq_lens, table, 128**-0.5)
    out = prefill_attention.paged_prefill_attention(q, cache, qsl, seq_lens, table, 128**-0.5)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


# -- elementwise ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_rms_norm_matches_reference(seed):
    rng = random.Random(300 + seed)
    hidden = rng.choice([16, 64, 96, 576, 1024])
    rows = rng.randint(1, 70)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(rms_norm.rms_norm(x, weight, 1e-6),
                               ref_rms_norm(x, weight, 1e-6), atol=ATOL, rtol=1e-6)
    out, new_res = rms_norm.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = ref_rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-6)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)


def test_rms_norm_over_heads_of_a_strided_view():
    """Qwen3's q_norm: normalise each head of q, a view into the packed qkv projection."""
    qkv = torch.randn(9, (4 + 2 * 2) * 32)
    q = qkv[:, : 4 * 32].view(9, 4, 32)
    weight = torch.randn(32)
    out = rms_norm.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref_rms_norm(q, weight, 1e-6), atol=ATOL, rtol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_rotary_embedding_matches_reference(seed):
    from minivllm.model.layers import RotaryEmbedding

    rng = random.Random(400 + seed)
    num_kv_heads, num_heads, head_dim, _ = _shapes(rng)
    head_dim = rng.choice([16, 32, 64, 128])  # rotary needs an even head_dim
    n = rng.randint(1, 50)
    rope = RotaryEmbedding(head_dim, 4096, base=rng.choice([10000.0, 1e6]))
    cos_sin = rope.cos_sin_cache(torch.device("cpu"))
    positions = torch.randint(0, 4096, (n,))
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
    q_out, k_out = rotary_embedding.rotary_embedding(positions, q, k, cos_sin)
    q_ref, k_ref = ref_rotary(positions, q, k, cos_sin)
    torch.testing.assert_close(q_out, q_ref, atol=ATOL, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref, atol=ATOL, rtol=1e-6)


@pytest.mark.parametrize("d,rows", [(64, 33), (96, 5), (1500, 3)])
def test_silu_and_mul_matches_reference(d, rows):
    x = torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(d)) * 4
    torch.testing.assert_close(activation.silu_and_mul(x), ref_silu_and_mul(x),
                               atol=ATOL, rtol=1e-6)
    x3 = x.view(1, rows, 2 * d)
    assert activation.silu_and_mul(x3).shape == (1, rows, d)


# -- canary --------------------------------------------------------------------------------------
def test_interpreter_canary_kernels_really_run():
    """If triton was imported before TRITON_INTERPRET=1 was set, or a kernel silently did nothing,
    outputs come back as zeros (or whatever the buffer held): check known nonzero answers."""
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    # RMSNorm of a constant row is the weight itself
    weight = torch.arange(1.0, 33.0)
    out = rms_norm.rms_norm(torch.full((3, 32), 5.0), weight, 1e-12)
    torch.testing.assert_close(out, weight.expand(3, 32), atol=1e-5, rtol=1e-5)
    # attention over values that are all 2.0 gives 2.0, whatever the scores
    rng = random.Random(0)
    cache, table = _paged_context(rng, [45], 16, 2, 32)
    cache[1] = 2.0
    q = torch.randn(1, 4, 32)
    lens = torch.tensor([45], dtype=torch.int32)
    for splits in (1, 3):
        out = decode_attention.paged_decode_attention(q, cache, table, lens, 0.1, num_splits=splits)
        assert torch.allclose(out, torch.full_like(out, 2.0)), f"num_splits={splits}: {out.flatten()[:4]}"
    out = prefill_attention.paged_prefill_attention(torch.randn(5, 4, 32), cache, [0, 5], [45],
                                                    table, 0.1)
    assert torch.allclose(out, torch.full_like(out, 2.0))
    # a written cache slot holds the new key
    k = torch.full((1, 2, 32), 3.0)
    reshape_and_cache.reshape_and_cache(k, -k, cache, torch.tensor([int(table[0, 1]) * 16 + 4]))
    assert torch.equal(cache[0, table[0, 1], 4], k[0]) and torch.equal(cache[1, table[0, 1], 4], -k[0])
