"""Checks that need a CUDA device (skipped cleanly without one; tools/gpu_check.sh runs them).

* the kernels at real shapes in float32, bfloat16 and float16, against the torch references
  evaluated in float32 on the same (rounded) inputs, with dtype-aware tolerances;
* the engine on the GPU: Triton vs torch backend, CUDA graphs vs eager, compile=True, each
  giving the same greedy tokens and logits in float32.

TF32 is switched off so float32 matmuls (the references' and the kernels') are exact float32.
The models are tiny random-weight checkpoints written here (no tokenizer, no download).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from minivllm.testing import TINY_PRESETS, make_checkpoint

    root = tmp_path_factory.mktemp("gpu-models")
    return {name: make_checkpoint(str(root / name), name, seed=i)
            for i, name in enumerate(TINY_PRESETS)}


def _paged(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    ids = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[at:at + n]
        at += n
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen,
                        device="cuda").to(dtype)
    return cache, table


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_long_contexts(dtype):
    from minivllm.attention.torch_backend import paged_decode_attention as ref_decode
    from minivllm.kernels import decode_attention as da

    seq_lens = [1, 17, 1000, 5003, 32768, 20001]
    cache, table = _paged(seq_lens, 16, 8, 128, dtype)
    q = torch.randn(len(seq_lens), 16, 128, device="cuda").to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    expected = ref_decode(q.float(), cache.float(), table, lens, 128**-0.5)
    for splits in (None, 1):
        out = da.paged_decode_attention(q, cache, table, lens, 128**-0.5, num_splits=splits)
        torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_chunks_and_prefixes(dtype):
    from minivllm.attention.torch_backend import paged_prefill_attention as ref_prefill
    from minivllm.kernels import prefill_attention as pa
    from minivllm.kernels import reshape_and_cache as rc

    query_lens, context_lens, block_size = [300, 1, 77, 1024], [0, 500, 1999, 16], 16
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    cache, table = _paged(seq_lens, block_size, 8, 128, dtype, seed=1)
    total = sum(query_lens)
    q = torch.randn(total, 16, 128, device="cuda").to(dtype)
    k = torch.randn(total, 8, 128, device="cuda").to(dtype)
    v = torch.randn(total, 8, 128, device="cuda").to(dtype)
    slots, qsl = [], [0]
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        slots += [int(table[i, p // block_size]) * block_size + p % block_size for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    rc.reshape_and_cache(k, v, cache, torch.tensor(slots, device="cuda"))
    expected = ref_prefill(q.float(), cache.float(), qsl, seq_lens, table, 128**-0.5)
    out = pa.paged_prefill_attention(q, cache, qsl, seq_lens, table, 128**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_kernels(dtype):
    from minivllm.kernels import activation, rms_norm, rotary_embedding
    from minivllm.model.layers import rms_norm as ref_rms_norm
    from minivllm.model.layers import rotary_embedding as ref_rotary
    from minivllm.model.layers import silu_and_mul as ref_silu_and_mul
    from minivllm.model.layers import RotaryEmbedding

    tol = dict(atol=TOL[dtype] * 4, rtol=TOL[dtype])
    x = torch.randn(300, 1024, device="cuda").to(dtype)
    r = torch.randn(300, 1024, device="cuda").to(dtype)
    w = torch.randn(1024, device="cuda").to(dtype)
    out, res = rms_norm.rms_norm(x, w, 1e-6, r)
    ref_out, ref_res = ref_rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    gate_up = torch.randn(300, 2 * 3072, device="cuda").to(dtype)
    torch.testing.assert_close(activation.silu_and_mul(gate_up).float(),
                               ref_silu_and_mul(gate_up).float(), **tol)
    cos_sin = RotaryEmbedding(128, 40960, 1e6).cos_sin_cache(torch.device("cuda"))
    qkv = torch.randn(300, (16 + 16) * 128, device="cuda").to(dtype)
    q, k = qkv[:, :2048].view(300, 16, 128), qkv[:, 2048:3072].view(300, 8, 128)
    pos = torch.randint(0, 40960, (300,), device="cuda")
    for a, b in zip(rotary_embedding.rotary_embedding(pos, q, k, cos_sin),
                    ref_rotary(pos, q, k, cos_sin)):
        torch.testing.assert_close(a.float(), b.float(), **tol)


# -- the engine on the GPU -----------------------------------------------------------------------
def _gpu_run(path, **kwargs):
    from minivllm import LLM
    from tests.test_triton_backend import SMALL_ENGINE, _generate, recording_sampler

    sampler = recording_sampler()
    llm = LLM(path, sampler_cls=sampler,
              **{**SMALL_ENGINE, "device": "cuda", "dtype": "float32", **kwargs})
    return llm, _generate(llm), sampler.seen


def _assert_same(a, b, atol=1e-3):
    (_, tokens_a, logits_a), (_, tokens_b, logits_b) = a, b
    assert tokens_a == tokens_b
    assert len(logits_a) == len(logits_b)
    for x, y in zip(logits_a, logits_b):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_triton_backend_matches_torch_on_gpu(gpu_models, family):
    triton_run = _gpu_run(gpu_models[family])  # the CUDA default: Triton, fused ops, graphs
    config = triton_run[0].llm_engine.config.compilation_config
    assert config.attention_backend == "triton" and config.use_custom_ops and config.use_cuda_graph
    _assert_same(triton_run, _gpu_run(gpu_models[family], attention_backend="torch",
                                      custom_ops="none"))


def test_cuda_graphs_match_eager_and_are_replayed(gpu_models, monkeypatch):
    from minivllm.worker.cuda_graphs import DecodeCudaGraphs
    from tests.test_triton_backend import _runner

    replayed = []
    original_run = DecodeCudaGraphs.run

    def run(self, input_ids, positions, meta):
        size = self.padded_size(meta.num_seqs)
        replayed.append((meta.num_seqs, size, size in self.graphs))
        return original_run(self, input_ids, positions, meta)

    monkeypatch.setattr(DecodeCudaGraphs, "run", run)
    graphs_run = _gpu_run(gpu_models["qwen3"])
    graphs = _runner(graphs_run[0]).cuda_graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.sizes == [1, 2, 4]
    assert (3, 4, True) in replayed and all(captured for _, _, captured in replayed)
    eager_run = _gpu_run(gpu_models["qwen3"], enforce_eager=True)
    assert _runner(eager_run[0]).cuda_graphs is None
    _assert_same(graphs_run, eager_run)


def test_compile_matches_eager_on_gpu(gpu_models):
    compiled = _gpu_run(gpu_models["llama"], compile=True)
    assert not compiled[0].llm_engine.config.compilation_config.use_custom_ops
    _assert_same(compiled, _gpu_run(gpu_models["llama"], enforce_eager=True))


def test_bf16_engine_with_graphs_runs(gpu_models):
    llm, tokens, _ = _gpu_run(gpu_models["qwen3"], dtype="bfloat16")
    assert [len(t) for t in tokens] == [6, 6, 3, 6, 5]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0


def test_long_chunked_prompt_same_tokens_with_a_sync_after_every_step(gpu_models):
    """The pinned-buffer fence's probe: a prompt of 15 chunks (14 steps that sample nothing, so
    nothing syncs them) gives the same tokens as with a device sync after every step."""
    import random

    from minivllm import LLM, SamplingParams
    from tests.test_triton_backend import _runner

    rng = random.Random(5)
    prompt = [rng.randrange(3, 30000) for _ in range(1800)]
    tokens = []
    for sync in (False, True):
        llm = LLM(gpu_models["qwen3"], skip_tokenizer_init=True, show_progress=False,
                  device="cuda", dtype="float32", max_num_batched_tokens=128, max_num_seqs=4,
                  max_model_len=2048, num_kv_blocks=160, block_size=16)
        runner = _runner(llm)
        if sync:
            original = runner.execute_model

            def execute_model(so, original=original):
                out = original(so)
                torch.cuda.synchronize()
                return out

            runner.execute_model = execute_model
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        tokens.append(out[0].outputs[0].token_ids)
        del llm, runner
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


def test_default_dtype_follows_the_device(gpu_models):
    from minivllm import LLM

    llm = LLM(gpu_models["llama"], skip_tokenizer_init=True, show_progress=False,
              num_kv_blocks=64, block_size=8, max_model_len=256)
    expected = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16
    assert llm.llm_engine.config.model_config.dtype == expected  # the checkpoint is float32
