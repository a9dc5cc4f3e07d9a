"""Sliding-window attention (Mistral; Qwen2 with use_sliding_window): token-identical to
transformers on tiny random checkpoints whose window is much shorter than the prompts, under
chunked prefill and prefix caching, in the torch backend and in the Triton kernels."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.model.config import ModelConfig
from minivllm.testing import make_checkpoint
from tests.hf_reference import hf_greedy

WINDOW = 6
MISTRAL = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
               tie_word_embeddings=False)
# layer 0 full attention, layer 1 sliding (max_window_layers=1): both kinds in one model
QWEN2 = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
             sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=False)
PROMPTS = [list(range(100, 130)), list(range(100, 125)) + [7, 8, 9], [5] * 3, list(range(400, 419))]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def window_model(request, tmp_path_factory, bundled_path):
    preset = MISTRAL if request.param == "mistral" else QWEN2
    folder = str(tmp_path_factory.mktemp(request.param) / "m")
    return make_checkpoint(folder, preset, tokenizer_from=bundled_path, seed=5)


def test_config_reads_which_layers_slide(window_model):
    cfg = ModelConfig.from_pretrained(window_model)
    assert cfg.sliding_window == WINDOW
    assert cfg.sliding_window_layers == ([0, 1] if cfg.family == "llama" else [1])
    # Qwen2 without use_sliding_window attends fully, whatever sliding_window says
    plain = ModelConfig.from_dict({**QWEN2, "architectures": ["Qwen2ForCausalLM"],
                                   "vocab_size": 10, "use_sliding_window": False})
    assert plain.sliding_window is None


@pytest.mark.parametrize("engine_kwargs", [
    {}, dict(max_num_batched_tokens=7, block_size=4),  # chunks cross the window's edge
])
def test_greedy_tokens_equal_transformers(window_model, engine_kwargs):
    expected = [hf_greedy(window_model, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(window_model, show_progress=False, max_model_len=128, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [e[:NEW_TOKENS] for e in expected]
    # the same prompts again: served from the prefix cache, same tokens
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == got
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0


def test_window_changes_the_result(window_model, tmp_path, bundled_path):
    """Not a vacuous check: the same weights without the window give other tokens."""
    import json
    import shutil

    full = tmp_path / "full"
    shutil.copytree(window_model, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window"] = None
    cfg.pop("layer_types", None)
    (full / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    windowed = LLM(window_model, show_progress=False, max_model_len=128).generate(
        prompts, params, use_tqdm=False)
    unwindowed = LLM(str(full), show_progress=False, max_model_len=128).generate(
        prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in windowed] != [o.outputs[0].token_ids for o in unwindowed]


def test_reference_window_sees_only_the_last_keys():
    """The torch reference with a window equals plain attention over the window's keys only."""
    import torch

    from minivllm.attention.torch_backend import paged_decode_attention, paged_prefill_attention

    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 4, 4, 1, 8, generator=gen)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)  # positions 0..15
    keys = cache[0][table[0].long()].reshape(16, 8)
    values = cache[1][table[0].long()].reshape(16, 8)
    q = torch.randn(3, 1, 8, generator=gen)  # queries at positions 13, 14, 15

    def by_hand(query, pos, window):
        lo = max(0, pos - window + 1)
        w = torch.softmax(keys[lo:pos + 1] @ query * 0.5, 0)
        return w @ values[lo:pos + 1]

    out = paged_prefill_attention(q, cache, [0, 3], [16], table, 0.5, sliding_window=5)
    for j, pos in enumerate((13, 14, 15)):
        torch.testing.assert_close(out[j, 0], by_hand(q[j, 0], pos, 5))
    dec = paged_decode_attention(q[2:], cache, table, torch.tensor([16]), 0.5, sliding_window=5)
    torch.testing.assert_close(dec[0, 0], by_hand(q[2, 0], 15, 5))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no NaN even in masked lanes
@pytest.mark.parametrize("seed", range(4))
def test_triton_kernels_match_the_reference_with_a_window(seed):
    import random

    import torch

    from minivllm.kernels import decode_attention, prefill_attention
    from minivllm.attention.torch_backend import paged_decode_attention as ref_decode
    from minivllm.attention.torch_backend import paged_prefill_attention as ref_prefill
    from tests.test_kernels import ATOL, _paged_context, _prefill_case, _shapes

    rng = random.Random(700 + seed)
    num_kv_heads, num_heads, head_dim, block_size = _shapes(rng)
    window = rng.choice([1, 3, 17, 64, 100, 1000])
    scale = head_dim**-0.5
    # decode: contexts shorter and longer than the window, over several partitions
    seq_lens = [rng.choice([1, window, window + 1, rng.randint(1, 300)]) for _ in range(3)]
    cache, table = _paged_context(rng, seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = ref_decode(q, cache, table, lens, scale, sliding_window=window)
    for num_splits in (1, rng.randint(2, 5), None):
        out = decode_attention.paged_decode_attention(
            q, cache, table, lens, scale, max_seq_len=max(seq_lens), num_splits=num_splits,
            sliding_window=window)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=f"splits {num_splits}")
    # prefill: chunks longer than a query tile, after a prefix, windows inside and across tiles
    query_lens = [rng.choice([1, 5, 70, rng.randint(1, 130)]) for _ in range(3)]
    context_lens = [rng.choice([0, rng.randint(1, 150)]) for _ in range(3)]
    q, _, _, cache, table, qsl, seq_lens = _prefill_case(
        rng, query_lens, context_lens, num_kv_heads, num_heads, head_dim, block_size)
    expected = ref_prefill(q, cache, qsl, seq_lens, table, scale, sliding_window=window)
    out = prefill_attention.paged_prefill_attention(q, cache, qsl, seq_lens, table, scale,
                                                    sliding_window=window)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_triton_backend_equals_transformers(window_model):
    expected = [hf_greedy(window_model, p, NEW_TOKENS) for p in PROMPTS[:2]]
    llm = LLM(window_model, show_progress=False, max_model_len=128, attention_backend="triton",
              device="cpu", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [e[:NEW_TOKENS] for e in expected]
