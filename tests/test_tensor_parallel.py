"""Tensor parallelism on this CPU with gloo: every family split across 2 ranks (and a 6-head
model across 3) gives the greedy tokens of the unsplit model, through ``LLM`` and through
``minivllm serve``; a killed worker fails the requests in flight within a second; no process
is left behind. Sizes the model cannot be split into are refused before anything loads."""

import asyncio
import os
import signal
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.benchmarks.tensor_parallel import collective_figures, executor_of, recorded_steps
from minivllm.config import EngineArgs
from minivllm.model.config import ModelConfig
from minivllm.model.parallel_layers import check_tensor_parallel_size, kv_head_partition
from minivllm.testing import TINY_PRESETS, engine_core, make_checkpoint

PROMPTS = ["Hello, my name is", "The capital of France is a city that",
           " ".join(str(i) for i in range(30))]  # long enough to be prefilled in chunks
ENGINE = dict(max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def peaked_models(tmp_path_factory, bundled_path) -> dict[str, str]:
    """Every family's tiny model (and the 6-head one) at 10x the weight scale: greedy choices
    far from ties, so the different summation order of split matmuls cannot flip a token."""
    root = tmp_path_factory.mktemp("tp-models")
    return {name: make_checkpoint(str(root / name), name, tokenizer_from=bundled_path, seed=i,
                                  initializer_range=0.5)
            for i, name in enumerate([*TINY_PRESETS, "llama-mqa6"])}


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _reference(path: str) -> list[list[int]]:
    return _greedy(LLM(path, show_progress=False, **ENGINE))


def test_kv_heads_split_or_replicated():
    assert [kv_head_partition(8, 4, r) for r in range(4)] == [(2, 0), (2, 2), (2, 4), (2, 6)]
    # fewer KV heads than ranks: one per rank, each replicated on tp / kv neighbouring ranks
    assert [kv_head_partition(2, 4, r) for r in range(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [kv_head_partition(1, 3, r) for r in range(3)] == [(1, 0)] * 3
    with pytest.raises(ValueError, match="neither split evenly nor replicated"):
        kv_head_partition(2, 3, 0)


def test_sizes_that_do_not_fit_are_refused(peaked_models):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by "
                                         r"tensor_parallel_size \(3\)"):
        EngineArgs(peaked_models["llama"], tensor_parallel_size=3).create_config()
    shape = ModelConfig.from_pretrained(peaked_models["llama-mqa6"])
    shape.num_key_value_heads = 4  # 6 heads split 3 ways, but 4 KV heads neither split nor replicate
    with pytest.raises(ValueError, match=r"\(3\) and num_key_value_heads \(4\)"):
        check_tensor_parallel_size(shape, 3)
    with pytest.raises(ValueError, match="needs 'mp'"):
        EngineArgs(peaked_models["llama"], tensor_parallel_size=2,
                   distributed_executor_backend="uni").create_config()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineArgs(peaked_models["llama"], tensor_parallel_size=0).create_config()


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_slice(peaked_models, tp):
    """Built as rank r of tp (no process group needed to load), every sharded parameter holds
    rank r's rows or columns of the checkpoint: heads, KV heads (replicated at tp=4, which has
    more ranks than the llama preset's 2 KV heads), MLP features, vocabulary."""
    import torch

    from minivllm.distributed import parallel_state
    from minivllm.model.loader import load_model

    path = peaked_models["llama"]
    c = ModelConfig.from_pretrained(path)
    full = dict(load_model(path, c, torch.device("cpu"), torch.float32, False).named_parameters())
    d, heads, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    q_full, k_full, v_full = full["model.layers.0.self_attn.qkv_proj.weight"].split(
        [heads * d, kv * d, kv * d])
    inter = c.intermediate_size
    for rank in range(tp):
        with parallel_state.patch_tensor_parallel_rank(rank, tp):
            shard = dict(load_model(path, c, torch.device("cpu"), torch.float32, False)
                         .named_parameters())
        assert parallel_state.get_tensor_model_parallel_world_size() == 1  # restored
        hq = heads // tp
        kv_local, kv_first = max(1, kv // tp), rank * kv // tp  # kv=2: tp=2 -> 1 each; tp=4 -> shared
        q, k, v = shard["model.layers.0.self_attn.qkv_proj.weight"].split(
            [hq * d, kv_local * d, kv_local * d])
        assert torch.equal(q, q_full[rank * hq * d:(rank + 1) * hq * d])
        assert torch.equal(k, k_full[kv_first * d:(kv_first + kv_local) * d])
        assert torch.equal(v, v_full[kv_first * d:(kv_first + kv_local) * d])
        o = shard["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(o, full["model.layers.0.self_attn.o_proj.weight"][
            :, rank * hq * d:(rank + 1) * hq * d])
        n = inter // tp
        gate, up = shard["model.layers.1.mlp.gate_up_proj.weight"].split([n, n])
        gate_full, up_full = full["model.layers.1.mlp.gate_up_proj.weight"].split([inter, inter])
        assert torch.equal(gate, gate_full[rank * n:(rank + 1) * n])
        assert torch.equal(up, up_full[rank * n:(rank + 1) * n])
        assert torch.equal(shard["model.layers.1.mlp.down_proj.weight"],
                           full["model.layers.1.mlp.down_proj.weight"][:, rank * n:(rank + 1) * n])
        rows = c.vocab_size // tp
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(shard[name], full[name][rank * rows:(rank + 1) * rows])
        assert torch.equal(shard["model.norm.weight"], full["model.norm.weight"])  # replicated


def _workers(llm: LLM):
    return engine_core(llm).model_executor.workers


@pytest.mark.slow
@pytest.mark.parametrize("family,tp", [(f, 2) for f in TINY_PRESETS] + [("llama-mqa6", 3)])
def test_llm_tensor_parallel_matches_size_1(peaked_models, family, tp):
    path = peaked_models[family]
    expected = _reference(path)
    llm = LLM(path, show_progress=False, tensor_parallel_size=tp, **ENGINE)
    workers = _workers(llm)
    assert len(workers) == tp and all(w.is_alive() for w in workers)
    executor = executor_of(llm)
    before = executor.collective_rpc("collective_stats", output_rank=0)[0]
    with recorded_steps(executor) as steps:
        assert _greedy(llm) == expected
    counted = collective_figures(
        before, executor.collective_rpc("collective_stats", output_rank=0)[0], steps)
    # per step: 2 all-reduces per layer and the embedding's, each [tokens, hidden] float32
    c = ModelConfig.from_pretrained(path)
    assert counted["all_reduce_calls"] == len(steps) * (2 * c.num_hidden_layers + 1)
    per_token = (2 * c.num_hidden_layers + 1) * c.hidden_size * 4
    assert counted["all_reduce_bytes"] == counted["tokens"] * per_token
    stats = llm.llm_engine.engine_core.call_utility("get_broadcast_stats")
    assert stats["steps"] >= 16 and stats["bytes"] > 0
    llm.llm_engine.shutdown()
    assert not any(w.is_alive() for w in workers)  # no process left behind


@pytest.mark.slow
def test_in_process_engine_dies_cleanly_when_a_worker_is_killed(peaked_models):
    """LLM (the core in this process): a killed worker raises EngineDeadError within a second,
    every later call raises it too, and the other worker is stopped."""
    from minivllm.engine.exceptions import EngineDeadError

    llm = LLM(peaked_models["llama"], show_progress=False, tensor_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    workers = _workers(llm)
    engine.add_request("a", "Hello", SamplingParams(max_tokens=500, ignore_eos=True))
    engine.step()
    os.kill(workers[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker 1"):
        while True:
            engine.step()
    assert time.monotonic() - killed < 1.0
    with pytest.raises(EngineDeadError):
        llm.generate("again", GREEDY, use_tqdm=False)
    workers[0].join(5)
    assert not any(w.is_alive() for w in workers)  # no process left behind
    llm.llm_engine.shutdown()  # still safe to call


@pytest.mark.slow
def test_torchrun_ranks_match_size_1(peaked_models):
    """One process per rank started by torchrun, as across machines: rank 0 runs the engine and
    broadcasts each step through torch.distributed; the output is size 1's."""
    import socket
    import subprocess
    import sys

    path = peaked_models["qwen3"]
    llm = LLM(path, show_progress=False, **ENGINE)
    params = SamplingParams(max_tokens=16, temperature=0.0)  # what `minivllm generate` asks
    expected = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text
    assert len(expected) > 16  # 16 tokens of text, no early end
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "minivllm.entrypoints.cli", "generate", "--model", path, "-tp", "2",
           "--distributed-executor-backend", "external_launcher", "--max-model-len", "128",
           "--num-kv-blocks", "64", "--max-tokens", "16", PROMPTS[0]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f">>> {PROMPTS[0]}\n{expected}\n" in out.stdout


# -- through `minivllm serve` -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_server(peaked_models):
    from minivllm.benchmarks.common import ServerProcess

    pytest.importorskip("httpx")
    proc = ServerProcess([peaked_models["llama"], "--port", "0", "-tp", "2",
                          "--max-num-batched-tokens", "32"])
    proc.wait_ready(timeout=600)
    yield proc
    proc.stop(signal.SIGINT)


def _spawned(pid: int) -> list:
    """The processes ``pid`` spawned with multiprocessing (not its resource tracker)."""
    import psutil

    return [p for p in psutil.Process(pid).children() if "spawn_main" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_serve_tensor_parallel_matches_size_1(tp_server, peaked_models):
    import httpx

    llm = LLM(peaked_models["llama"], show_progress=False, **ENGINE)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    got = []
    for prompt in PROMPTS:
        r = httpx.post(tp_server.url + "/v1/completions", timeout=120, json={
            "model": peaked_models["llama"], "prompt": prompt, "max_tokens": 16,
            "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == expected


@pytest.mark.slow
def test_killing_a_worker_fails_requests_in_flight_within_a_second(tp_server, peaked_models):
    """Last on this server: it is left without an engine, and must still stop cleanly."""
    import httpx
    import psutil

    [core] = _spawned(tp_server.pid)
    workers = _spawned(core.pid)
    assert len(workers) == 2, workers
    processes = [core, *workers]

    async def run():
        started = asyncio.Event()

        async def one(client: httpx.AsyncClient, i: int):
            body = {"model": peaked_models["llama"], "prompt": f"Go {i}", "max_tokens": 2000,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", tp_server.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text"' in line:
                        started.set()
                    if "error" in line:
                        return time.monotonic(), line
            return time.monotonic(), "stream ended"

        async with httpx.AsyncClient(timeout=30) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(4)]
            await asyncio.wait_for(started.wait(), 60)
            os.kill(workers[-1].pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        return killed, results

    killed, results = asyncio.run(run())
    for ended, line in results:
        assert "error" in line, line  # failed, not finished: 2000 tokens take far longer
        assert ended - killed < 1.0, ended - killed
    r = httpx.get(tp_server.url + "/health")
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    assert tp_server.stop(signal.SIGINT) == 0
    time.sleep(0.5)
    left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left  # no process left behind


def test_patched_rank_is_checked_and_restored():
    from minivllm.distributed import parallel_state

    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        with parallel_state.patch_tensor_parallel_rank(2, 2):
            pass
    with pytest.raises(RuntimeError):
        with parallel_state.patch_tensor_parallel_rank(1, 4):
            assert parallel_state.get_tensor_model_parallel_rank() == 1
            assert parallel_state.get_tensor_model_parallel_world_size() == 4
            raise RuntimeError("a failing build")
    assert parallel_state.get_tensor_model_parallel_rank() == 0
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
