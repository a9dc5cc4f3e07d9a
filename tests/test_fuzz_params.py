"""Every value a user can send, thrown at the engine: a clear ValueError (a 400 over HTTP) or a
normal answer; never a dead engine, never a KV block left allocated.

Before these bounds, one request could kill the engine for everyone: a seed past what a torch
generator takes, a top_k past int64 (numpy's row overflowed inside the core's step), a NaN
temperature, a lone surrogate in a prompt or a stop string (no tokenizer or msgpack encodes it).
"""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import INT64_MAX, INT64_MIN

EDGE_INTS = [0, 1, -1, -2, 63, 64, 65, 49151, 49152, INT64_MAX, INT64_MAX + 1, INT64_MIN,
             INT64_MIN - 1, 2**64 - 1, 2**64, 2**100, -(2**100)]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e-6, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 2.5, 1e300,
               math.inf, -math.inf, math.nan, -1.0]
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 80), st.integers())
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(0, 2), st.floats())
texts = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "\x00", "Paris"]))
anything = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.lists(ints, max_size=3))


FIELDS = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from(EDGE_FLOATS)),
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from(EDGE_FLOATS)),
    "top_k": st.one_of(st.integers(-1, 100), st.sampled_from(EDGE_INTS)),
    "max_tokens": st.one_of(st.integers(1, 80), st.sampled_from(EDGE_INTS)),
    "min_tokens": st.one_of(st.integers(0, 5), st.sampled_from(EDGE_INTS)),
    "seed": st.one_of(st.integers(), st.sampled_from(EDGE_INTS)),
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 49151), max_size=3),
                                st.lists(st.sampled_from(EDGE_INTS), max_size=3)),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
# mostly values of the right type over their whole range; now and then one of the wrong type
params_kwargs = st.tuples(
    st.fixed_dictionaries({}, optional=FIELDS),
    st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(sorted(FIELDS)), anything)),
).map(lambda t: {**t[0], **({t[1][0]: t[1][1]} if t[1] else {})})
prompts = st.one_of(
    texts,
    st.fixed_dictionaries({"prompt_token_ids": st.lists(ints, max_size=70)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 49151), min_size=1,
                                                        max_size=70)}),
    anything,
)
# a clear error names what is wrong (never e.g. "Overflow when unpacking long long" from inside
# the core's step)
NAMED = tuple(FIELDS) + ("prompt", "prompt_token_ids")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, show_progress=False, max_model_len=64, max_num_batched_tokens=64)


def test_int64_bounds_are_refused_by_name():
    for field, value in [("seed", 2**63), ("seed", INT64_MIN - 1), ("top_k", 2**64),
                         ("max_tokens", 2**63), ("min_tokens", 2**63), ("temperature", math.nan),
                         ("temperature", math.inf), ("top_p", math.nan)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**63])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["a\ud800"])
    SamplingParams(seed=INT64_MIN, top_k=INT64_MAX, max_tokens=INT64_MAX)  # the bounds themselves


def test_top_k_past_the_vocabulary_is_no_top_k(llm):
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    outs = [llm.generate(prompt, SamplingParams(seed=7, top_k=k, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for k in (0, 49152, INT64_MAX)]
    assert outs[0] == outs[1] == outs[2]


def _check_served_and_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["kv_blocks_used"] == 0


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kwargs=params_kwargs, prompt=prompts)
def test_llm_generate_answers_or_raises_value_error(llm, kwargs, prompt):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert str(e).startswith(NAMED), e
        params = None
    if params is not None:
        try:
            out = llm.generate(prompt, params, use_tqdm=False)
        except ValueError as e:
            assert str(e).startswith(NAMED), e
        else:
            c = out[0].outputs[0]
            assert c.finish_reason in ("stop", "length")
            assert 1 <= len(c.token_ids) <= params.max_tokens
    _check_served_and_clean(llm)


def test_engine_still_serves_after_the_fuzzing(llm):
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    _check_served_and_clean(llm)


# -- the same over HTTP ---------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, floats, texts),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=5), children, max_size=3)),
    max_leaves=6,
)
_FIELDS = {
    "temperature": floats, "top_p": floats, "top_k": ints, "max_tokens": ints,
    "max_completion_tokens": ints, "min_tokens": ints, "seed": ints, "n": ints,
    "stop": st.one_of(texts, st.lists(texts, max_size=3)), "stop_token_ids": st.lists(ints, max_size=3),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "model": st.sampled_from(["tiny", "x"]),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": json_values, "user": texts,
}
http_fields = st.fixed_dictionaries({}, optional={k: st.one_of(v, json_values)
                                                  for k, v in _FIELDS.items()})
completion_prompts = st.one_of(texts, st.lists(ints, max_size=8), st.lists(texts, max_size=2),
                               st.lists(st.lists(st.integers(0, 49151), max_size=4), max_size=2),
                               json_values)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]),
                                    "content": st.one_of(texts, json_values)}), max_size=2),
    json_values,
)


@pytest.fixture(scope="module")
def server(tiny_llama):
    from minivllm.benchmarks.common import ServerProcess

    proc = ServerProcess([tiny_llama, "--port", "0", "--max-model-len", "64",
                          "--served-model-name", "tiny", "--max-request-body-bytes", "100000"])
    proc.wait_ready(timeout=600)
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in "".join(proc.stderr)


def _kv_blocks_used(client) -> float:
    import re

    text = client.get("/metrics").text
    return float(re.search(r"^minivllm:kv_blocks_used(?:\{[^}]*\})? (\S+)$", text, re.M)[1])


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=http_fields, chat=st.booleans(), prompt=completion_prompts, msgs=messages)
def test_server_answers_or_gives_a_400(server, fields, chat, prompt, msgs):
    import httpx

    body = {**fields, ("messages" if chat else "prompt"): msgs if chat else prompt}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(base_url=server.url, timeout=60) as client:
        # allow_nan: the JSON a client may send includes NaN / Infinity (json.loads reads them)
        r = client.post(path, content=json.dumps(body, allow_nan=True),
                        headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
        if r.status_code != 200:
            assert r.json()["error"]["message"]
        assert client.get("/health").status_code == 200


@pytest.mark.slow
def test_openapi_schema_describes_the_request_bodies(server):
    import httpx

    spec = httpx.get(server.url + "/openapi.json").json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/CompletionRequest")
    completion = spec["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "temperature", "seed", "top_k"} <= set(completion["properties"])
    assert "prompt" in completion["required"]
    seed = next(s for s in completion["properties"]["seed"]["anyOf"] if s.get("type") == "integer")
    assert seed["maximum"] == INT64_MAX
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")


@pytest.mark.slow
def test_oversized_body_is_a_413_before_it_is_read(server):
    import socket
    from urllib.parse import urlparse

    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/completions", json={"prompt": "x" * 200_000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(50):
                yield b" " * 10_000

        r = client.post("/v1/completions", content=chunks(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}
                           ).status_code == 200
    # a declared 1 GB body is refused from its headers alone: nothing more is sent
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 413")


@pytest.mark.slow
def test_a_prompt_that_fills_max_model_len_is_answered(server):
    """64 prompt tokens on a server with --max-model-len 64 (what a fuzzed chat found: the
    engine core used to die storing the token sampled after them)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        # max_tokens null: whatever fits (as a chat without max_tokens), here the one token
        for stream in (False, True):
            r = client.post("/v1/completions", json={"prompt": list(range(100, 164)),
                                                     "max_tokens": None, "stream": stream})
            assert r.status_code == 200, r.text
            if not stream:
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "length"
                assert r.json()["usage"]["completion_tokens"] == 1
            else:
                assert '"finish_reason":"length"' in r.text.replace(" ", "")
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


@pytest.mark.slow
def test_every_endpoint_fuzzed_from_the_openapi_schema(server):
    """schemathesis builds requests from the server's own schema (valid ones and, in negative
    mode, ones that break it): never a 5xx, for every operation."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/health", "/metrics", "/v1/models"}
    for op in operations:
        # negative mode breaks what the schema describes: a GET without parameters has nothing
        modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * (op.method == "post")
        for mode in modes:
            @settings(max_examples=25, deadline=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                case.call_and_validate(checks=[not_a_server_error], timeout=60)

            fuzz()


@pytest.mark.slow
def test_server_after_fuzzing_is_healthy_with_no_block_in_use(server):
    import time

    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while _kv_blocks_used(client) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
