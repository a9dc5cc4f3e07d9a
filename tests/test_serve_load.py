"""``minivllm serve`` under load, on a tiny random-weight model (fast steps, so the HTTP side is
what is exercised): 500 requests at concurrency 64, 100 clients walking away mid-stream, the
API key, the benchmark client, and the engine core killed under load."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.benchmarks.common import ServerProcess  # noqa: E402

KEY = "test-key"
MODEL = "tiny"
# what the disconnect and core-kill tests ask for: no request may finish before its client
# walks away or the core dies, even on a loaded machine, where a client's event loop can stall
# for seconds while the tiny model decodes a hundred requests at hundreds of steps a second
# (2000 tokens once ran out under a full suite)
LONG = 16000
pytestmark = pytest.mark.slow


def _core_pid(server_pid: int) -> int:
    children = [p for p in psutil.Process(server_pid).children()
                if "spawn_main" in " ".join(p.cmdline())]
    assert len(children) == 1, children
    return children[0].pid


@pytest.fixture(scope="module")
def peaked_llama(tmp_path_factory, bundled_path) -> str:
    """The tiny llama with 10x the weight scale. Its logits spread ~4 instead of ~0.4, so greedy
    choices are far from ties: a random-weight model at the usual scale has top-2 margins under
    1e-3 in ~0.6% of steps, where the float rounding of a different batch composition (the
    server's batches are not the offline run's) can flip a token. This test checks that no
    response is mixed up or lost under load, so it needs answers that rounding cannot change."""
    from minivllm.testing import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("peaked") / "llama"), "llama",
                           tokenizer_from=bundled_path, seed=0, initializer_range=0.5,
                           max_position_embeddings=LONG + 384)


@pytest.fixture(scope="module")
def server(peaked_llama):
    proc = ServerProcess([peaked_llama, "--port", "0", "--max-model-len", str(LONG + 384),
                          "--api-key", KEY, "--served-model-name", MODEL])
    proc.wait_ready(timeout=600)
    proc.core_pid = _core_pid(proc.pid)
    yield proc
    assert proc.stop(signal.SIGINT) == 0  # Ctrl-C: a clean exit...
    assert not psutil.pid_exists(proc.core_pid) or \
        psutil.Process(proc.core_pid).status() == psutil.STATUS_ZOMBIE  # ...and no orphan


def _aclient(server, timeout: float = 120):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                              timeout=timeout)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    values = re.findall(rf"^minivllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, name
    return sum(float(v) for v in values)


async def _until(predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


def test_api_key_is_required_on_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_500_requests_at_concurrency_64_all_correct(server, peaked_llama):
    prompts = [f"Request number {i}: tell me about item {i * 7 % 101}" for i in range(500)]
    refs = LLM(peaked_llama, show_progress=False, max_model_len=512).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    finished_before = _metric(server, "request_success_total")

    async def run():
        client = _aclient(server)
        semaphore = asyncio.Semaphore(64)
        in_flight = peak = 0

        async def one(i: int, p: str):
            nonlocal in_flight, peak
            async with semaphore:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    if i % 2:
                        r = await client.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                                            temperature=0)
                        return r.choices[0].text, r.usage.completion_tokens
                    stream = await client.completions.create(
                        model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True,
                        stream_options={"include_usage": True})
                    chunks = [c async for c in stream]
                    return "".join(c.choices[0].text for c in chunks if c.choices), \
                        chunks[-1].usage.completion_tokens
                finally:
                    in_flight -= 1

        results = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        return results, peak

    results, peak = asyncio.run(run())
    assert peak == 64
    for (text, n), ref in zip(results, refs):
        assert text == ref.outputs[0].text
        assert n == len(ref.outputs[0].token_ids)
    assert _metric(server, "request_success_total") - finished_before == 500


def test_100_streaming_clients_disconnecting_free_every_kv_block(server):
    generated_before = _metric(server, "generation_tokens_total")
    finished_before = _metric(server, "request_success_total")

    async def run():
        async def one(i: int):
            async with httpx.AsyncClient(timeout=60,
                                         headers={"Authorization": f"Bearer {KEY}"}) as client:
                body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": LONG,
                        "ignore_eos": True, "stream": True}
                async with client.stream("POST", server.url + "/v1/completions",
                                         json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 3:
                            return  # walk away mid-stream: the connection closes

        await asyncio.gather(*[one(i) for i in range(100)])
        await _until(lambda: _metric(server, "kv_blocks_used") == 0
                     and _metric(server, "num_requests_running") == 0
                     and _metric(server, "num_requests_waiting") == 0)

    asyncio.run(run())
    assert _metric(server, "kv_blocks_used") == 0
    assert _metric(server, "request_success_total") == finished_before  # none ran to the end
    assert _metric(server, "generation_tokens_total") - generated_before < 100 * LONG / 2


def test_non_streaming_client_disconnect_aborts(server):
    async def run():
        client = _aclient(server, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(model=MODEL, prompt="Long", max_tokens=LONG,
                                            extra_body={"ignore_eos": True})
        await _until(lambda: _metric(server, "kv_blocks_used") == 0
                     and _metric(server, "num_requests_running") == 0)

    finished_before = _metric(server, "request_success_total")
    asyncio.run(run())
    assert _metric(server, "request_success_total") == finished_before


def _bench(server, tmp_path, *extra):
    path = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "bench", "serve", "--base-url",
         server.url, "--api-key", KEY, "--json", str(path), *extra],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(path.read_text()), out.stdout


def test_bench_serve_random_poisson_with_goodput_and_health(server, tmp_path):
    result, stdout = _bench(server, tmp_path, "--num-prompts", "24", "--random-input-len", "16",
                            "--random-output-len", "8", "--random-range-ratio", "0.5",
                            "--request-rate", "40", "--max-concurrency", "8",
                            "--goodput", "ttft:600000", "tpot:1", "--health-interval", "0.05")
    assert result["completed"] == 24 and result["failed"] == 0
    assert 24 * 4 <= result["total_output_tokens"] <= 24 * 12
    assert result["max_concurrency"] == 8 and result["request_throughput"] > 0
    for key in ("ttft", "tpot", "itl", "e2el"):
        s = result[key]
        assert 0 < s["median_ms"] <= s["p99_ms"] and s["mean_ms"] > 0
    assert result["e2el"]["mean_ms"] >= result["ttft"]["mean_ms"]
    assert result["goodput"]["requests"] <= 24  # tpot under 1 ms: hardly any qualify
    assert result["health"]["probes"] > 0
    assert "TTFT" in stdout and "P99" in stdout


def test_bench_serve_shared_prefix_hits_the_prefix_cache(server, tmp_path):
    hits_before = _metric(server, "prefix_cache_hits_total")
    result, _ = _bench(server, tmp_path, "--dataset", "shared-prefix", "--num-prompts", "12",
                       "--shared-prefix-len", "64", "--random-input-len", "8",
                       "--random-output-len", "4", "--max-concurrency", "4")
    assert result["completed"] == 12
    assert _metric(server, "prefix_cache_hits_total") - hits_before >= 11 * 64


def test_bench_serve_long_prompt(server, tmp_path):
    result, _ = _bench(server, tmp_path, "--dataset", "long-prompt", "--num-prompts", "10",
                       "--long-prompt-len", "400", "--long-prompt-fraction", "0.2",
                       "--random-input-len", "16", "--random-output-len", "8")
    assert result["completed"] == 10
    assert result["total_input_tokens"] == 2 * 400 + 8 * 16


def test_bench_serve_compare_runs_all_three_modes(tiny_llama, tmp_path):
    path = tmp_path / "compare.json"
    out = subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "bench", "serve-compare",
         "--server-args", f"{tiny_llama} --max-model-len 512", "--num-prompts", "8",
         "--max-concurrency", "4", "--random-input-len", "8", "--random-output-len", "4",
         "--json", str(path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(path.read_text())
    (one,) = result["rounds"]
    for mode in ("multiprocess", "inprocess"):
        assert one[mode]["completed"] == 8 and one[mode]["total_output_tokens"] == 32
        assert one[mode]["health"]["probes"] > 0
    assert one["offline"]["total_output_tokens"] == 32
    assert result["median_multiprocess_vs_inprocess_throughput"] == pytest.approx(
        one["multiprocess"]["output_throughput"] / one["inprocess"]["output_throughput"])


def test_killing_the_core_under_load_fails_cleanly(server):
    """Last in this file: the server is left without an engine (and must still stop cleanly)."""
    async def run():
        client = _aclient(server)

        async def one(i: int):
            if i % 2:
                await client.completions.create(model=MODEL, prompt=f"Go {i}", max_tokens=LONG,
                                                extra_body={"ignore_eos": True})
            else:
                stream = await client.completions.create(
                    model=MODEL, prompt=f"Go {i}", max_tokens=LONG, stream=True,
                    extra_body={"ignore_eos": True})
                async for _ in stream:
                    pass

        tasks = [asyncio.ensure_future(one(i)) for i in range(32)]
        await _until(lambda: _metric(server, "num_requests_running") >= 16)
        os.kill(server.core_pid, signal.SIGKILL)
        killed = time.monotonic()
        async with httpx.AsyncClient() as probe:
            while (await probe.get(server.url + "/health")).status_code == 200:
                await asyncio.sleep(0.02)
        unhealthy_after = time.monotonic() - killed
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        return results, unhealthy_after, time.monotonic() - killed

    results, unhealthy_after, elapsed = asyncio.run(run())
    # the front end sees the death within POLL_MS (0.1 s); the rest is the server answering
    # /health while it fails 32 requests, on a 2-core machine whose other core runs another
    # test file (1.65 s seen there once): the bounds tell a prompt failure from a hang
    assert unhealthy_after < 3.0, unhealthy_after
    assert elapsed < 8, elapsed  # every request got its answer: nothing hangs
    assert all(isinstance(r, openai.APIError) for r in results), results
    assert any("engine" in str(r) for r in results)
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
