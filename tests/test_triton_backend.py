"""The Triton backend end to end, the backend/kernel switch, and the CUDA-graph padding path.

On a CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by conftest.py), so
the engine runs tiny random-weight models: every family, a mixed batch with chunked prefill and
prefix-cache hits, compared with the plain-torch backend logit by logit and token by token.
"""

import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from minivllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from minivllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from minivllm.sample.sampler import Sampler  # noqa: E402
from minivllm.testing import model_runner  # noqa: E402
from minivllm.worker.cuda_graphs import cudagraph_batch_sizes  # noqa: E402

SMALL_ENGINE = dict(skip_tokenizer_init=True, block_size=8, num_kv_blocks=64, max_model_len=256,
                    max_num_seqs=4, max_num_batched_tokens=32, show_progress=False)


def recording_sampler():
    """A greedy sampler class that keeps every logits matrix it was given."""
    class Recording(Sampler):
        seen: list = []

        def forward(self, logits, meta):
            Recording.seen.append(logits.detach().clone())
            return super().forward(logits, meta)

    Recording.seen = []
    return Recording


def _runner(llm):
    return model_runner(llm)


def _workload(seed=0):
    """A prompt that fills the prefix cache, then four that share its first 3 blocks."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 30000) for _ in range(24)]
    first = [{"prompt_token_ids": shared + [rng.randrange(3, 30000) for _ in range(5)]}]
    batch = [{"prompt_token_ids": shared + [rng.randrange(3, 30000) for _ in range(n)]}
             for n in (40, 2, 21, 9)]
    return first, batch


def _generate_batch(llm):
    """The workload's batch alone, greedy: 4 -> 3 -> 2 requests, never a 1-token step."""
    _, batch = _workload()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 3, 6, 5)]
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def _generate(llm):
    """Greedy tokens; the batch's requests stop at different lengths, so it shrinks 4 -> 3 -> 2."""
    first, batch = _workload()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 3, 6, 5)]
    tokens = [o.outputs[0].token_ids for o in llm.generate(first, params[0], use_tqdm=False)]
    return tokens + [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def _run(path, backend, **kwargs):
    sampler = recording_sampler()
    llm = LLM(path, attention_backend=backend, sampler_cls=sampler, **{**SMALL_ENGINE, **kwargs})
    return llm, _generate(llm), sampler.seen


_RESULTS: dict = {}


def _run_cached(path, backend):
    """Runs the tests compare against, computed once per session."""
    if (path, backend) not in _RESULTS:
        _RESULTS[path, backend] = _run(path, backend)
    return _RESULTS[path, backend]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_triton_backend_matches_torch_on_mixed_chunked_prefix_batches(tiny_models, family,
                                                                      monkeypatch):
    path = tiny_models[family]
    torch_llm, torch_tokens, torch_logits = _run_cached(path, "torch")

    # the Triton run must not touch the torch backend, and must run both attention kernels
    def no_fallback(*args, **kwargs):
        raise AssertionError("the Triton backend fell back to the torch backend")

    monkeypatch.setattr(TorchAttentionBackend, "forward", no_fallback)
    import minivllm.attention.triton_backend as tb

    calls = {"decode": 0, "prefill": 0}
    for name, kind in (("paged_decode_attention", "decode"), ("paged_prefill_attention", "prefill")):
        original = getattr(tb, name)

        def counted(*args, _original=original, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(tb, name, counted)
    llm, tokens, logits = _RESULTS[path, "triton"] = _run(path, "triton")
    # fused elementwise kernels too (custom_ops="auto")
    assert _runner(llm).config.compilation_config.use_custom_ops
    assert calls["decode"] and calls["prefill"]

    # the workload did exercise what it claims to
    trace = llm.llm_engine.get_step_trace()
    kinds = [{kind for _, _, kind in step["scheduled"]} for step in trace]
    assert any(k == {"decode", "prefill"} for k in kinds), "no mixed decode + prefill step"
    chunks = [rid for step in trace for rid, _, kind in step["scheduled"] if kind == "prefill"]
    assert any(chunks.count(r) > 1 for r in chunks), "no prompt was chunked"
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
    assert len(trace) == len(torch_llm.llm_engine.get_step_trace())  # the same schedule

    assert tokens == torch_tokens
    assert len(logits) == len(torch_logits)
    for ours, ref in zip(logits, torch_logits):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_cuda_graph_padding_path_gives_the_same_logits(tiny_models):
    """The static-buffer, padded decode path (run eagerly on a CPU): 3 decodes padded to 4."""
    path = tiny_models["qwen3"]
    _, ref_tokens, ref_logits = _run_cached(path, "triton")

    sampler = recording_sampler()
    llm = LLM(path, attention_backend="triton", sampler_cls=sampler, **SMALL_ENGINE)
    runner = _runner(llm)
    assert runner.cuda_graphs is None  # no CUDA here: no graphs by default
    runner.capture_model(capture=False)
    graphs = runner.cuda_graphs
    assert graphs.sizes == [1, 2, 4]
    used = []
    original_run = graphs.run

    def run(input_ids, positions, meta):
        used.append((meta.num_seqs, graphs.padded_size(meta.num_seqs)))
        return original_run(input_ids, positions, meta)

    graphs.run = run
    tokens = _generate(llm)
    assert (3, 4) in used  # a batch really was padded
    assert tokens == ref_tokens
    for ours, ref in zip(sampler.seen, ref_logits):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_cudagraph_batch_sizes():
    assert cudagraph_batch_sizes(1) == [1]
    assert cudagraph_batch_sizes(3) == [1, 2, 4]
    assert cudagraph_batch_sizes(8) == [1, 2, 4, 8]
    assert cudagraph_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = cudagraph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert cudagraph_batch_sizes(2000)[-1] == 512


# -- the switch ----------------------------------------------------------------------------------
def _config(path, **kwargs):
    """The kernel choices (attention backend, custom ops, CUDA graphs) EngineArgs resolve to."""
    return EngineArgs(model=path, **kwargs).create_config().compilation_config


def test_cpu_defaults_are_plain_torch_without_graphs(tiny_llama):
    c = _config(tiny_llama)
    assert (c.attention_backend, c.use_custom_ops, c.use_cuda_graph) == ("torch", False, False)


def test_custom_ops_resolution(tiny_llama):
    assert _config(tiny_llama, attention_backend="triton").use_custom_ops  # auto follows Triton
    assert not _config(tiny_llama, attention_backend="triton", custom_ops="none").use_custom_ops
    assert not _config(tiny_llama, attention_backend="triton", compile=True).use_custom_ops
    assert _config(tiny_llama, custom_ops="all").use_custom_ops  # torch attention, fused norms
    with pytest.raises(ValueError, match="custom_ops"):
        _config(tiny_llama, custom_ops="some")
    with pytest.raises(ValueError, match="choose one"):
        _config(tiny_llama, custom_ops="all", compile=True)


def test_custom_ops_swap_the_model_ops(tiny_llama, monkeypatch):
    """custom_ops="all": the Triton kernels; by default on a CPU in float32, the C kernels
    (``cpu_kernels``) when they build; with those turned off, the plain torch functions."""
    from minivllm import cpu_kernels
    from minivllm.kernels import triton_elementwise_ops
    from minivllm.model.layers import NATIVE_OPS

    def ops(model):
        return {m.op for m in model.modules() if hasattr(m, "op_name")}

    fused = _runner(LLM(tiny_llama, custom_ops="all", **SMALL_ENGINE)).model
    assert ops(fused) == set(triton_elementwise_ops().values())
    default = ops(_runner(LLM(tiny_llama, **SMALL_ENGINE)).model)
    if cpu_kernels.library() is None:
        assert default == set(NATIVE_OPS.values())
    else:
        assert {op.__module__ for op in default} == {"minivllm.cpu_kernels"}
        assert {op.__name__ for op in default} == set(NATIVE_OPS)
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    assert ops(_runner(LLM(tiny_llama, **SMALL_ENGINE)).model) == set(NATIVE_OPS.values())


def test_triton_errors_say_what_is_missing(tiny_llama, monkeypatch):
    import minivllm.kernels as kernels

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _config(tiny_llama, attention_backend="triton")
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    for kwargs in (dict(attention_backend="triton"), dict(custom_ops="all")):
        with pytest.raises(ValueError, match="triton package is not installed"):
            _config(tiny_llama, **kwargs)
    assert _config(tiny_llama).attention_backend == "torch"


def test_import_and_generate_without_triton(tiny_llama):
    """Where triton cannot be imported, the package and the torch backend still work."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from minivllm import LLM, SamplingParams\n"
        "from minivllm.attention.backend import get_attention_backend\n"
        f"llm = LLM({tiny_llama!r}, show_progress=False, skip_tokenizer_init=True, max_model_len=64)\n"
        "c = llm.llm_engine.config.compilation_config\n"
        "assert c.attention_backend == 'torch' and not c.use_custom_ops\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "try:\n"
        "    get_attention_backend('triton')\n"
        "except ImportError as e:\n"
        "    assert 'needs the triton package' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_compile_gives_the_same_tokens_and_logits(tiny_models):
    """compile=True: torch.compile (inductor) fuses the plain-torch elementwise ops.

    The workload is the batch alone (every step carries at least 2 tokens), so inductor builds
    one dynamic graph per op variant instead of a second one specialised to 1 token: the same
    check at half the compile time."""
    path = tiny_models["llama"]  # fewest op variants to compile (no q/k norms)
    ref = LLM(path, attention_backend="torch", sampler_cls=recording_sampler(), **SMALL_ENGINE)
    ref_tokens, ref_logits = _generate_batch(ref), _runner(ref).sampler.seen
    llm = LLM(path, attention_backend="torch", sampler_cls=recording_sampler(), compile=True,
              **SMALL_ENGINE)
    tokens, logits = _generate_batch(llm), _runner(llm).sampler.seen
    assert not _runner(llm).config.compilation_config.use_custom_ops
    assert tokens == ref_tokens and len(logits) == len(ref_logits) > 0
    for ours, ref_l in zip(logits, ref_logits):
        torch.testing.assert_close(ours, ref_l, atol=1e-4, rtol=0)


# -- the command line ----------------------------------------------------------------------------
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_cli_custom_ops_flag(tiny_llama):
    out = _cli("generate", "hi", "--model", tiny_llama, "--max-tokens", "3", "--custom-ops", "all")
    assert out.returncode == 0, out.stderr
    no_interpreter = {**os.environ, "TRITON_INTERPRET": "0"}
    out = _cli("generate", "hi", "--model", tiny_llama, "--max-tokens", "3",
               "--attention-backend", "triton", env=no_interpreter)
    assert out.returncode == 2 and "TRITON_INTERPRET" in out.stderr, out.stderr


def test_cli_bench_kernels_quick(tmp_path):
    import json

    out = _cli("bench", "kernels", "--quick", "--json", str(tmp_path / "k.json"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "k.json").read_text())
    assert [r["context"] for r in result["decode"]] == [64, 200]
    assert all(r["achieved_GBps"] > 0 for r in result["decode"])
    assert result["interpreter"] == (not torch.cuda.is_available())
