"""``minivllm serve`` on the bundled model, started as README says, talked to with the official
``openai`` client: the server's greedy text equals offline ``LLM.generate``, streamed or not;
usage counts; every bad request gets its OpenAI-shaped 4xx and the server keeps serving."""

import asyncio
import os
import re
import shlex
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from minivllm import SamplingParams  # noqa: E402
from minivllm.benchmarks.common import ServerProcess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
pytestmark = pytest.mark.slow


def _readme_block(marker: str, lang: str) -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(rf"<!-- {marker} -->\s*```{lang}\n(.+?)\n```", readme, re.S)
    assert m, f"README must mark a {lang} block with <!-- {marker} -->"
    return m[1]


def _minivllm_command() -> list[str]:
    """How a user runs `minivllm`: the console script pip installed beside this Python."""
    script = os.path.join(os.path.dirname(sys.executable), "minivllm")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "minivllm.entrypoints.cli"]


@pytest.fixture(scope="module")
def server():
    """README's main command, run as a user runs it (plus --port 0: tests share the machine)."""
    main = _readme_block("main-command", "bash")
    serve = shlex.split(main.split("&&")[-1])
    assert serve[:2] == ["minivllm", "serve"], main
    proc = ServerProcess(serve[2:] + ["--port", "0"], command=_minivllm_command())
    proc.wait_ready(timeout=600)
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in "".join(proc.stderr)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_serve_help_lists_vllm_flags():
    out = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--block-size",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduler", "--dtype",
                 "--device", "--no-multiprocess"):
        assert flag in out.stdout, flag


def test_busy_port_is_a_clear_error_before_loading():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port",
                              str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
    assert "Loading weights" not in out.stderr


def test_start_up_prints_url_and_ready_line(server, bundled_path):
    out = "".join(server.stdout)
    assert out.startswith("minivllm serve: starting")
    assert f"minivllm serve: model {MODEL} in {bundled_path}\n" in out  # on every start
    assert "http://127.0.0.1:" in out and "ready" in out
    assert "Loading weights" in "".join(server.stderr)  # the progress bar


def test_readme_openai_example_runs(server):
    code = _readme_block("serve-client", "python").replace("http://127.0.0.1:8000", server.url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_completions_equal_offline_generate(client, bundled_llm):
    offline = bundled_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16),
                                   use_tqdm=False)
    tok = bundled_llm.get_tokenizer()
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice, ref in zip(resp.choices, offline):
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert resp.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in offline)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streamed_completion_equals_offline(client, bundled_llm):
    ref = bundled_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False)[0].outputs[0]
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 3  # it really streamed, token by token
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert text_chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_equals_offline_chat_streamed_and_not(client, bundled_llm):
    ref = bundled_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24),
                           use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                          temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        ref.outputs[0].token_ids)


def test_chat_max_completion_tokens_and_stop(client, bundled_llm):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION,
                                          max_completion_tokens=3, temperature=0)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    word = full.choices[0].text.split()[1]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                    stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full.choices[0].text[: full.choices[0].text.index(word)]


def test_cached_tokens_count_prefix_cache_hits(client):
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens whose K/V the prefix cache
    served. A new prompt has none; the same prompt again reuses every full 16-token block but
    the last token's."""
    prompt = "A unique prompt for the cached-tokens test: " + " ".join(
        f"word{i}" for i in range(24))
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    n = first.usage.prompt_tokens
    assert n > 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert again.choices[0].text == first.choices[0].text

    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2)
    client.chat.completions.create(**chat_kw)
    chat = client.chat.completions.create(**chat_kw)
    n = chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16


def test_continuous_usage_stats_put_running_usage_on_every_chunk(client, bundled_llm):
    ref = bundled_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12),
                               use_tqdm=False)[0]
    n_prompt, n_out = len(ref.prompt_token_ids), len(ref.outputs[0].token_ids)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                            temperature=0, stream=True, stream_options=options))
    text_chunks, last = chunks[:-1], chunks[-1]
    assert len(text_chunks) > 3 and all(c.choices for c in text_chunks)
    completed = [c.usage.completion_tokens for c in text_chunks]
    assert completed == sorted(completed) and completed[0] >= 1 and completed[-1] == n_out
    for c in text_chunks:
        assert c.usage.prompt_tokens == n_prompt
        assert c.usage.total_tokens == n_prompt + c.usage.completion_tokens
    assert last.choices == [] and last.usage.completion_tokens == n_out

    chat = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                               temperature=0, stream=True,
                                               stream_options=options))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert all(c.usage is not None for c in chat)
    assert chat[-2].usage.completion_tokens == chat[-1].usage.completion_tokens == 6

    # without include_usage the option adds nothing (as in vLLM)
    plain = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4,
                                           temperature=0, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_token_id_prompt_and_models_endpoint(client, bundled_llm):
    ids = bundled_llm.get_tokenizer().encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -3}, "top_k"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "logprobs": 3}, "logprobs"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi " * 9000}, "prompt"),  # longer than max_model_len (8192)
    ({"prompt": "hi", "max_tokens": 8192}, "max_tokens"),  # prompt + max_tokens > max_model_len
]
BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": QUESTION, "max_completion_tokens": -2}, "max_completion_tokens"),
    ({"messages": QUESTION, "n": 3}, "n"),
]


def _post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kw)


def _assert_error(r: httpx.Response, status: int, param: str | None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["param"] == param, err


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_is_a_400_and_next_request_works(server, client, body, param):
    _assert_error(_post(server, "/v1/completions", json={"model": MODEL, **body}), 400, param)
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_is_a_400(server, body, param):
    _assert_error(_post(server, "/v1/chat/completions", json={"model": MODEL, **body}), 400, param)


def test_malformed_and_odd_requests(server, client):
    _assert_error(_post(server, "/v1/completions", content=b'{"prompt": "hi",'), 400, None)
    _assert_error(_post(server, "/v1/completions", content=b"\xff\xfe"), 400, None)
    _assert_error(_post(server, "/v1/completions", json=["a list"]), 400, None)
    _assert_error(_post(server, "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}),
                  404, "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(server.url + "/no/such/path").status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_health_and_metrics(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket"):
        assert f"minivllm:{name}" in text, name
    tokens = re.search(r'minivllm:generation_tokens_total\{model_name="[^"]+"\} (\S+)', text)
    assert float(tokens[1]) >= 4


def test_concurrent_streams_with_async_client(server, bundled_llm):
    """Eight streams at once: each gets exactly its own offline text."""
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    refs = bundled_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(p):
            stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                                      temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        return await asyncio.gather(*[one(p) for p in prompts])

    assert asyncio.run(run()) == [r.outputs[0].text for r in refs]
