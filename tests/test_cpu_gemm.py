"""Linear layers through oneDNN with prepacked weights, and through minivllm's own panels for a
decode step's few rows (``minivllm/model/cpu_gemm.py``, ``few_rows_linear`` in
``minivllm/cpu_kernels.cpp``)."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams, cpu_kernels
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
    if cpu_kernels.library() is not None:  # the decode steps go through the panels
        assert all(m.panel_weight is not None for m in slots)
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
    monkeypatch.setenv(cpu_gemm.ENV, "onedn")
    with pytest.raises(ValueError, match="auto, onednn or torch"):
        cpu_gemm.should_pack(cpu, torch.float32)


def _layer(out_features, in_features, bias, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    layer.packed_weight = layer.panel_weight = None
    return layer


needs_kernels = pytest.mark.skipif(cpu_kernels.library() is None,
                                   reason="minivllm's CPU kernels did not build")


@needs_kernels
def test_few_rows_results_do_not_depend_on_the_row_count():
    """Each row's sums run in one order whatever the row count up to few_rows_max(), so a
    request's logits do not depend on what shares its step (docs/hot_path.md)."""
    layer = _layer(200, 576, True, seed=3)
    cpu_gemm.pack_linear_weights(layer, min_numel=0)
    x = torch.randn(cpu_gemm.few_rows_max(), 576)
    alone = torch.cat([cpu_gemm.linear(layer, x[i:i + 1]) for i in range(len(x))])
    for rows in (7, 16, 29, len(x)):
        assert torch.equal(cpu_gemm.linear(layer, x[:rows]), alone[:rows]), rows


@needs_kernels
@pytest.mark.parametrize("out_features,in_features,bias", [
    (37, 19, True),     # neither a multiple of 16 outputs nor of 8 inputs: the last panel partial
    (48, 64, False),
    (30, 40, True),     # one pair of panels, its second one partial
    (200, 576, True)])  # the bundled model's input width, threads sharing the panels
def test_few_rows_equal_f_linear(out_features, in_features, bias):
    layer = _layer(out_features, in_features, bias, seed=out_features)
    assert cpu_gemm.pack_linear_weights(layer, min_numel=0) == 1
    panels = layer.panel_weight
    assert panels.shape == ((out_features + 15) // 16, in_features, 16)
    # every tile split (one-panel tiles of 6 or 16 rows, pairs of 14)
    for rows in [*range(1, 17), 23, 24, 25, 28, 29, 42, 43, 64, cpu_gemm.few_rows_max()]:
        x = torch.randn(rows, in_features)
        got = torch.ops.minivllm_cpu.few_rows_linear(x, panels, layer.bias, out_features)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5, msg=f"{rows} rows")
    # leading dims (one of them a size-1 dim whose stride torch's contiguity ignores), and rows
    # a stride apart (a slice of wider rows)
    x3 = torch.randn(2, 3, in_features)
    ones = torch.randn(1, 4, in_features).transpose(0, 1)  # [4, 1, in], contiguous
    wide = torch.randn(5, in_features + 7)[:, :in_features]
    for x in (x3, ones, wide):
        torch.testing.assert_close(cpu_gemm.linear(layer, x),
                                   F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_linear_takes_the_panels_for_few_rows_only(monkeypatch):
    layer = _layer(64, 32, False)
    cpu_gemm.pack_linear_weights(layer, min_numel=0)
    taken = []
    real = cpu_gemm._few_rows_linear
    monkeypatch.setattr(cpu_gemm, "_few_rows_linear",
                        lambda x, *args: taken.append(x.shape[0]) or real(x, *args))
    most = cpu_gemm.few_rows_max()
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(cpu_gemm.linear(layer, x), F.linear(x, layer.weight),
                                   rtol=1e-5, atol=1e-5)
    strided = torch.randn(4, 64)[:, ::2]  # elements apart: oneDNN's
    cpu_gemm.linear(layer, strided)
    with torch.enable_grad():  # autograd: oneDNN's (the course's models with gradients)
        cpu_gemm.linear(layer, torch.randn(2, 32, requires_grad=True))
    assert taken == [1, most]


@needs_kernels
def test_few_rows_refuses_bad_input():
    layer = _layer(40, 24, True)
    cpu_gemm.pack_linear_weights(layer, min_numel=0)
    ops, x = torch.ops.minivllm_cpu, torch.randn(3, 24)
    for args, message in [
            ((torch.randn(3, 25), layer.panel_weight, None, 40), "panels must be"),
            ((x, layer.panel_weight, None, 49), "panels must be"),  # more outputs than packed
            ((x, layer.panel_weight, None, 32), "panels must be"),  # a whole panel too many
            ((x, layer.panel_weight, torch.randn(39), 40), "bias must be"),
            ((x.double(), layer.panel_weight, None, 40), "float32")]:
        with pytest.raises(ValueError, match=message):
            ops.few_rows_linear(*args)


@needs_kernels
def test_onednn_mode_packs_no_panels(monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV, "onednn")
    layer = _layer(64, 32, False)
    assert cpu_gemm.pack_linear_weights(layer, min_numel=0) == 1
    assert layer.packed_weight is not None and layer.panel_weight is None
    cpu_gemm.unpack_linear_weights(layer)
    assert layer.packed_weight is None and layer.panel_weight is None


def test_bundled_model_packs_its_large_weights(bundled_llm):
    model = _runner_model(bundled_llm)
    assert model.lm_head.packed_weight is not None
    if cpu_kernels.library() is not None:
        assert model.lm_head.panel_weight is not None
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.packed_weight is not None
    assert layer.self_attn.o_proj.packed_weight is not None  # 576 x 576, at PACK_MIN_NUMEL
    assert layer.input_layernorm.weight.numel() < cpu_gemm.PACK_MIN_NUMEL
