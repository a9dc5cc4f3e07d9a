"""A CPU step's decoder layers in one C++ call (``minivllm/worker/cpu_layers.py``,
``decoder_layers`` in ``minivllm/cpu_kernels.cpp``): the same floats as the Python forward, for
decodes and prefill chunks, panels and oneDNN alike, and the Python forward wherever something
the loop would bypass was changed."""

import pytest
import torch

from minivllm import LLM, SamplingParams, cpu_kernels
from minivllm.model import cpu_gemm
from minivllm.course.swap import swapped_scheduler
from minivllm.testing import make_checkpoint, model_runner

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None or not cpu_gemm.onednn_available(),
    reason="the CPU kernels or oneDNN are unavailable")

# Mistral with a window shorter than the prompts: every layer slides
MISTRAL = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
               tie_word_embeddings=False)
PROMPTS = [list(range(100, 130)), [5] * 3, list(range(400, 419)), list(range(900, 911))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def packed_llm(request, tiny_models, tmp_path_factory, bundled_path):
    """A tiny model with every linear layer packed (the bundled model's are large enough
    anyway; a tiny model's are not, by default)."""
    if request.param == "mistral":
        path = make_checkpoint(str(tmp_path_factory.mktemp("mistral") / "m"), MISTRAL,
                               tokenizer_from=bundled_path, seed=3)
    else:  # GQA and llama3 rope scaling; q/k/v biases
        path = tiny_models[request.param]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_gemm, "PACK_MIN_NUMEL", 0)
        llm = LLM(path, show_progress=False, max_model_len=256, block_size=4)
    return llm


def _compared(llm):
    """Wrap the loop so every step it serves is checked against the Python forward on the
    same inputs (which writes the same K/V into the same slots again); returns the count."""
    runner = model_runner(llm)
    loop = runner.cpu_layers
    run, served = loop.run, []

    def checked(input_ids, positions, meta, keep=None):
        hidden = run(input_ids, positions, meta)
        if hidden is not None:
            again = runner.model(input_ids, positions,
                                 runner.attention_backend.build_metadata(meta, runner.block_size))
            assert torch.equal(hidden, again)
            served.append((meta.num_decodes, meta.num_actual_tokens))
            if keep is not None:  # the sampled rows alone: the same rows of the same floats
                kept = run(input_ids, positions, meta, keep)
                rows = meta.query_start_loc[1:][keep].long() - 1
                assert kept.shape == (len(keep), hidden.shape[1])
                if meta.num_actual_tokens <= cpu_gemm.few_rows_max():
                    assert torch.equal(kept, hidden[rows])
                else:  # the last layer's kept rows take the panels, the step's took oneDNN
                    torch.testing.assert_close(kept, hidden[rows], rtol=1e-5, atol=1e-5)
                return kept
        return hidden

    loop.run = checked
    return served, lambda: vars(loop).pop("run")


def test_decode_steps_equal_the_python_forward(packed_llm):
    served, restore = _compared(packed_llm)
    try:
        outs = packed_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                   use_tqdm=False)
    finally:
        restore()
    assert (len(PROMPTS), len(PROMPTS)) in served  # all four decode side by side
    assert any(tokens > decodes for decodes, tokens in served)  # and the prefill step
    eager = LLM(model_runner(packed_llm).config.model_config.model_path, show_progress=False,
                max_model_len=256, block_size=4, enforce_eager=True)
    assert model_runner(eager).cpu_layers is None
    assert ([o.outputs[0].token_ids for o in outs] ==
            [o.outputs[0].token_ids for o in eager.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)])


def _three_steps(llm):
    """Runs a prompt and two decode steps; returns how many steps the loop served."""
    served, restore = _compared(llm)
    try:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        restore()
    return len(served)


@pytest.fixture
def llama(tiny_llama):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_gemm, "PACK_MIN_NUMEL", 0)
        return LLM(tiny_llama, show_progress=False, max_model_len=256)


def test_the_python_forward_runs_wherever_something_was_changed(llama):
    runner = model_runner(llama)
    model, layer = runner.model, runner.model.model.layers[1]
    assert _three_steps(llama) == 3  # the prefill and both decodes
    seen = []
    handle = layer.mlp.register_forward_hook(lambda *a: seen.append(1))
    assert _three_steps(llama) == 0 and len(seen) == 3  # the prefill and both decodes
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda *a: seen.append(5))  # a hook on every module
    assert _three_steps(llama) == 0 and seen.count(5) > 3
    handle.remove()
    forward = model.forward
    model.forward = lambda *a, **k: seen.append(2) or forward(*a, **k)
    assert _three_steps(llama) == 0 and seen.count(2) == 3
    del model.forward
    op = layer.mlp.act_fn.op
    layer.mlp.act_fn.op = lambda x: seen.append(3) or op(x)
    assert _three_steps(llama) == 0 and seen.count(3) == 3
    layer.mlp.act_fn.op = op
    backend_forward = layer.self_attn.backend.forward
    layer.self_attn.backend.forward = lambda *a, **k: seen.append(4) or backend_forward(*a, **k)
    assert _three_steps(llama) == 0 and seen.count(4) == 2 * 3  # two layers share it
    del layer.self_attn.backend.forward
    panels = layer.mlp.down_proj.panel_weight
    cpu_gemm.unpack_linear_weights(model)
    assert _three_steps(llama) == 0
    layer.mlp.down_proj.panel_weight = panels
    assert _three_steps(llama) == 0  # the others are still unpacked
    cpu_gemm.pack_linear_weights(model, min_numel=0)
    assert _three_steps(llama) == 3


def test_many_rows_take_onednn_and_prefill_chunks_share_steps_with_decodes(llama):
    served, restore = _compared(llama)
    try:  # 40 prompts of 4 tokens: more rows than the panels take; then 40 decodes
        llama.generate([{"prompt_token_ids": [7 + i, 8, 9, 10]} for i in range(40)],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
        with swapped_scheduler(llama, max_num_batched_tokens=64):  # a long prompt in chunks
            llama.generate([{"prompt_token_ids": [3]}, {"prompt_token_ids": list(range(50, 250))}],
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
    finally:
        restore()
    assert (0, 160) in served and (40, 40) in served
    assert cpu_gemm.few_rows_max() < 160
    assert any(0 < decodes and tokens - decodes > cpu_gemm.FEW_ROWS_MAX
               for decodes, tokens in served)  # a decode beside a chunk of the long prompt
    loop = model_runner(llama).cpu_layers
    with torch.enable_grad():  # autograd wanted: the kernels never serve it
        assert loop._arguments() is not None
        assert loop.run(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                        _decode_meta()) is None


def _decode_meta():
    from minivllm.attention.backend import AttentionMetadata
    one = torch.ones(1, dtype=torch.int32)
    return AttentionMetadata(num_actual_tokens=1, num_decodes=1, max_query_len=1, max_seq_len=1,
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             seq_lens=one, block_tables=torch.zeros(1, 4, dtype=torch.int32),
                             slot_mapping=torch.zeros(1, dtype=torch.int64))


def test_a_slot_outside_the_cache_raises_and_the_engine_goes_on(llama):
    runner = model_runner(llama)
    meta = _decode_meta()
    blocks, block_size = runner.kv_caches[0].shape[1:3]
    meta.slot_mapping = torch.tensor([blocks * block_size], dtype=torch.int64)
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the KV cache"):
        runner.cpu_layers.run(torch.tensor([5], dtype=torch.int32),
                              torch.zeros(1, dtype=torch.int64), meta)
    assert _three_steps(llama) == 3


@pytest.mark.parametrize("keep, dtype, why", [
    ([1], torch.int64, "every decode"), ([], torch.int64, "every decode"),
    ([1, 0], torch.int64, "rising order"), ([0, 0], torch.int64, "rising order"),
    ([0, 2], torch.int64, "the step's sequences"), ([-1, 0], torch.int64, "the step's sequences"),
    ([0, 1], torch.int32, "int64")])
def test_kept_rows_that_are_not_the_sampled_sequences_raise(llama, keep, dtype, why):
    runner = model_runner(llama)
    meta = _decode_meta()
    meta.seq_lens = torch.tensor([1, 1], dtype=torch.int32)  # a decode and a one-token prompt
    meta.query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)
    meta.block_tables = torch.zeros(2, 4, dtype=torch.int32)
    meta.block_tables[1, 0] = 1
    meta.slot_mapping = torch.tensor([0, runner.kv_caches[0].shape[2]], dtype=torch.int64)
    meta.num_actual_tokens = 2
    ids, positions = torch.tensor([5, 6], dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    with torch.inference_mode():
        whole = runner.cpu_layers.run(ids, positions, meta)
        assert torch.equal(runner.cpu_layers.run(ids, positions, meta, torch.tensor([0, 1])),
                           whole)
        assert torch.equal(runner.cpu_layers.run(ids, positions, meta, torch.tensor([0])),
                           whole[:1])
        with pytest.raises(ValueError, match=why):
            runner.cpu_layers.run(ids, positions, meta, torch.tensor(keep, dtype=dtype))
    assert _three_steps(llama) == 3


def test_engine_arguments_that_turn_it_off(tiny_llama):
    from minivllm.config import EngineArgs

    def flag(**kw):
        return EngineArgs(model=tiny_llama, **kw).create_config() \
            .compilation_config.use_cpu_layer_loop

    assert flag() and not flag(enforce_eager=True) and not flag(compile=True)
    assert not flag(tensor_parallel_size=2)
