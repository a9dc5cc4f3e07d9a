"""Linear layers through oneDNN with prepacked weights (``minivllm/model/cpu_gemm.py``)."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.model import cpu_gemm
from minivllm.testing import model_runner
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch without oneDNN")


def _runner_model(llm):
    return model_runner(llm).model


@pytest.mark.parametrize("rows,out_features,in_features,bias", [
    (1, 96, 64, False), (7, 192, 64, True), (40, 512, 128, False)])
def test_packed_linear_equals_f_linear(rows, out_features, in_features, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    layer.packed_weight = None
    x = torch.randn(rows, in_features)
    strided = torch.randn(rows, 2 * in_features)[:, ::2]  # a non-contiguous input
    assert cpu_gemm.pack_linear_weights(layer, min_numel=0) == 1
    for inp in (x, strided):
        torch.testing.assert_close(cpu_gemm.linear(layer, inp),
                                   F.linear(inp, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    cpu_gemm.unpack_linear_weights(layer)
    assert layer.packed_weight is None
    assert torch.equal(cpu_gemm.linear(layer, x), F.linear(x, layer.weight, layer.bias))


def test_small_weights_stay_with_f_linear():
    layer = torch.nn.Linear(64, 64)
    layer.packed_weight = None
    assert cpu_gemm.pack_linear_weights(layer) == 0 and layer.packed_weight is None


@pytest.mark.parametrize("family", ["llama-tied", "qwen2"])  # tied lm_head; q/k/v biases
def test_every_weight_packed_greedy_identical_to_transformers(tiny_models, family, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "PACK_MIN_NUMEL", 0)
    path = tiny_models[family]
    llm = LLM(path, show_progress=False, max_model_len=256)
    model = _runner_model(llm)
    slots = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert slots and all(m.packed_weight is not None for m in slots)
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time " * 6]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, tok.encode(prompt), 24), prompt


def test_environment_variable_turns_packing_off(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    assert cpu_gemm.should_pack(cpu, torch.float32)
    assert not cpu_gemm.should_pack(cpu, torch.bfloat16)
    assert not cpu_gemm.should_pack(torch.device("meta"), torch.float32)
    monkeypatch.setenv(cpu_gemm.ENV, "torch")
    assert not cpu_gemm.should_pack(cpu, torch.float32)


def test_bundled_model_packs_its_large_weights(bundled_llm):
    model = _runner_model(bundled_llm)
    assert model.lm_head.packed_weight is not None
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.packed_weight is not None
    assert layer.self_attn.o_proj.packed_weight is not None  # 576 x 576, at PACK_MIN_NUMEL
    assert layer.input_layernorm.weight.numel() < cpu_gemm.PACK_MIN_NUMEL
