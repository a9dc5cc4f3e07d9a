"""Checkers for chapter 08 (serving, and measuring a server).

8.1 ``check_chat_stream``: the learner's server-sent events of ``/v1/chat/completions`` run in
a real server, and the ``openai`` client streams from it: role chunk first, deltas adding up to
the non-streamed answer, the finish reason, the usage chunk, ``[DONE]``.
8.2 ``check_benchmark_metrics``: raw client timestamps to TTFT, TPOT, ITL, latency, throughput
and goodput; on random traces it must give what ``minivllm bench serve`` computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import random
import threading

from minivllm.course.checks.common import Exercise, fail, passed

STREAM_CONVENTION = (
    "Expected, each event as 'data: <json>\\n\\n' with the same id, created, model and object "
    "'chat.completion.chunk': first a chunk whose choices[0].delta is {'role': 'assistant', "
    "'content': ''}; then one chunk per DELTA output that has text, delta {'content': text}; "
    "the finished output's chunk carries finish_reason (and delta {} if it has no text); "
    "with include_usage every chunk says \"usage\": null and a last chunk has choices [] and "
    "usage {prompt_tokens, completion_tokens, total_tokens}; then 'data: [DONE]\\n\\n'.")

PROMPTS = [
    ("What is the capital of France?", {}),
    ("Write a haiku about the sea.", {"stop": [","]}),
]


@contextlib.contextmanager
def serving(chat_stream=None, **engine_kwargs):
    """A minivllm server on a free port in a thread of this process; yields its base URL."""
    from minivllm.config import EngineArgs
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.api_server import build_app
    from minivllm.model_hub import BUNDLED_NAME

    args = dict(device="cpu", max_model_len=512, num_kv_blocks=256, multiprocess=False)
    engine = AsyncLLM.from_engine_args(EngineArgs(**{**args, **engine_kwargs}), show_progress=False)
    app = build_app(engine, [BUNDLED_NAME], chat_stream=chat_stream)
    with app_in_thread(app, engine) as url:
        yield url


@contextlib.contextmanager
def app_in_thread(app, engine):
    """Serve ``app`` (over ``engine``, an ``AsyncLLM``) with uvicorn on a free port, on a thread
    of this process; yields the base URL; stops the server, then the engine."""
    import uvicorn

    from minivllm.entrypoints.openai.api_server import _bind

    sock = _bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False,
                                           timeout_graceful_shutdown=1))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(sockets=[sock])),
                              daemon=True, name="course-server")
    thread.start()
    try:
        while not server.started and thread.is_alive():
            threading.Event().wait(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
        sock.close()
        loop.close()


def check_chat_stream(chat_stream, exercise: str = "8.1") -> None:
    import httpx
    import openai

    if not callable(chat_stream):
        fail(exercise, f"expected an async generator function, got {chat_stream!r}")
    ex = Exercise(exercise, answer=(
        "minivllm.entrypoints.openai.serving:chat_completion_stream_generator",),
        allowed="json, time and the RequestOutputs of outputs")
    chat_stream = ex.take(chat_stream, "chat_stream")
    _probe(chat_stream, exercise)  # an unsolved exercise raises here, not inside the server
    with serving(chat_stream) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        checked = 0
        for prompt, extra in PROMPTS:
            kwargs = dict(model=_model(client), temperature=0, max_tokens=16,
                          messages=[{"role": "user", "content": prompt}])
            kwargs.update(extra)
            full = client.chat.completions.create(**kwargs)
            for include_usage in (True, False):
                _check_one(exercise, client, kwargs, full, include_usage)
                checked += 1
        _check_raw(exercise, httpx, url, _model(client))
        ex.check_hits()  # a refusal the server turned into an error response
    passed(exercise, f"the openai client streamed {checked} chat completions from a minivllm "
                     f"server running your function: role first, content equal to the "
                     f"non-streamed answers, finish reasons, usage, and [DONE].")


def _probe(chat_stream, exercise: str) -> None:
    """Run the function once on a made-up one-token stream, outside any server: an exception
    (NotImplementedError while the exercise is unsolved) is raised here as it is."""
    from minivllm.course.loadtest import run_coroutine
    from minivllm.outputs import CompletionOutput, RequestOutput

    async def outputs():
        yield RequestOutput("probe", None, [1, 2], [CompletionOutput(0, "Hi", [3],
                                                                     finish_reason="length")], True)

    async def consume():
        stream = chat_stream("probe", "model", outputs(), True)
        if inspect.iscoroutine(stream):  # no yield in the body: not an async generator
            await stream  # (an unsolved exercise raises NotImplementedError here)
            return None
        return [event async for event in stream]

    if run_coroutine(consume) is None:
        fail(exercise, "chat_stream must be an async generator function (async def with yield): "
                       "each yield is one server-sent event. " + STREAM_CONVENTION)


def _model(client) -> str:
    return client.models.list().data[0].id


def _check_one(exercise, client, kwargs, full, include_usage: bool) -> None:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    try:
        chunks = list(client.chat.completions.create(stream=True, **kwargs, **options))
    except Exception as e:  # the client could not parse the stream
        fail(exercise, f"the openai client failed to read your stream: {type(e).__name__}: {e}. "
                       + STREAM_CONVENTION)
    where = f"streaming {kwargs['messages'][0]['content']!r} (include_usage={include_usage})"
    if not chunks:
        fail(exercise, f"{where}: no chunk came back. " + STREAM_CONVENTION)
    ids = {c.id for c in chunks}
    if len(ids) != 1:
        fail(exercise, f"{where}: chunks carry several ids {sorted(ids)}: one request, one id. "
                       + STREAM_CONVENTION)
    if any(c.object != "chat.completion.chunk" for c in chunks):
        fail(exercise, f"{where}: every chunk's object is 'chat.completion.chunk'. "
                       + STREAM_CONVENTION)
    first = chunks[0]
    if not first.choices or first.choices[0].delta.role != "assistant":
        fail(exercise, f"{where}: the first chunk must announce the role: choices[0].delta = "
                       f"{{'role': 'assistant', 'content': ''}}; got {first.model_dump()}. "
                       + STREAM_CONVENTION)
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    want = full.choices[0].message.content
    if text != want:
        fail(exercise, f"{where}: the deltas add up to {text!r}; the same request without "
                       f"streaming answered {want!r}. Send each DELTA output's text once, in "
                       f"order. " + STREAM_CONVENTION)
    reasons = [c.choices[0].finish_reason for c in with_choices]
    if reasons[-1] != full.choices[0].finish_reason or any(reasons[:-1]):
        fail(exercise, f"{where}: finish_reason per chunk {reasons}: expected None on every "
                       f"chunk but the last choice chunk, which says "
                       f"{full.choices[0].finish_reason!r}. " + STREAM_CONVENTION)
    usage_chunks = [c for c in chunks if c.usage is not None]
    if include_usage:
        if len(usage_chunks) != 1 or usage_chunks[0] is not chunks[-1] or chunks[-1].choices:
            fail(exercise, f"{where}: with stream_options.include_usage, exactly one chunk, the "
                           f"last, carries usage, with choices []; got usage on "
                           f"{len(usage_chunks)} chunk(s). " + STREAM_CONVENTION)
        u, w = chunks[-1].usage, full.usage
        got = (u.prompt_tokens, u.completion_tokens, u.total_tokens)
        expected = (w.prompt_tokens, w.completion_tokens, w.total_tokens)
        if got != expected:
            fail(exercise, f"{where}: usage (prompt, completion, total) {got}, expected "
                           f"{expected}: prompt tokens of the request, the output tokens of every "
                           f"DELTA output added up. " + STREAM_CONVENTION)
    elif usage_chunks:
        fail(exercise, f"{where}: usage was sent although the client did not ask for it "
                       f"(stream_options.include_usage). " + STREAM_CONVENTION)


def _check_raw(exercise, httpx, url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    raw = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).text
    if not raw.endswith("data: [DONE]\n\n"):
        fail(exercise, f"the stream must end with 'data: [DONE]\\n\\n'; it ends with "
                       f"{raw[-40:]!r}. " + STREAM_CONVENTION)
    events = raw.split("\n\n")[:-1]
    bad = [e for e in events if not e.startswith("data: ")]
    if bad:
        fail(exercise, f"every event is one line 'data: ...' followed by a blank line; got "
                       f"{bad[0][:80]!r}. " + STREAM_CONVENTION)
    bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    if any("usage" not in b for b in bodies) or any(b["usage"] is not None for b in bodies[:-1]):
        fail(exercise, "with include_usage, every chunk has a \"usage\" field: null, except the "
                       "last chunk's. " + STREAM_CONVENTION)
    if len({(b["created"], b["model"]) for b in bodies}) != 1:
        fail(exercise, "every chunk carries the same created time and model. " + STREAM_CONVENTION)


# -- 8.2 the benchmark's metrics ------------------------------------------------------------------

METRICS_CONVENTION = (
    "Expected, for the successful traces only (success: text came back, and exactly "
    "expected_tokens tokens): TTFT = chunk_times[0] - start; ITL = every gap between consecutive "
    "chunk_times, pooled over requests; E2EL = end - start; TPOT = (E2EL - TTFT) / "
    "(output_tokens - 1), for requests with at least 2 tokens; each summarised as mean_ms, "
    "median_ms, p99_ms in milliseconds, percentiles interpolated linearly between the sorted "
    "values (numpy's default); completed = successful requests; request_throughput and "
    "output_throughput per second of duration_s; goodput: requests meeting every SLO "
    "(value <= SLO; a missing TPOT counts as 0), and request_goodput = that / duration_s.")


def random_traces(rng: random.Random, n: int) -> tuple[list[dict], float]:
    """Client timestamps of ``n`` streamed requests (seconds), some failed, some one token."""
    traces, t_end = [], 0.0
    for _ in range(n):
        start = rng.uniform(0, 5)
        expected = rng.choice([1, 2, rng.randint(3, 40)])
        tokens = expected if rng.random() > 0.1 else max(0, expected - rng.randint(1, 3))
        t = start + rng.expovariate(4)
        chunk_times = []
        for _ in range(tokens if rng.random() > 0.05 else 0):
            chunk_times.append(t)
            t += rng.expovariate(30) * (10 if rng.random() < 0.05 else 1)
        end = t + rng.uniform(0, 0.01)
        t_end = max(t_end, end)
        traces.append({"start": start, "chunk_times": chunk_times, "end": end,
                       "output_tokens": tokens, "expected_tokens": expected,
                       "prompt_len": rng.randint(4, 300)})
    return traces, t_end


def reference_metrics(traces: list[dict], duration_s: float, slos_ms: dict[str, float]) -> dict:
    from minivllm.benchmarks.serve import RequestResult, summarize

    results = [RequestResult.from_timestamps(t["start"], t["chunk_times"], t["end"],
                                             t["output_tokens"], t["prompt_len"],
                                             t["expected_tokens"]) for t in traces]
    return summarize(results, duration_s, {k: v / 1000 for k, v in slos_ms.items()})


KEYS = ["completed", "request_throughput", "output_throughput"] + [
    f"{m}.{s}" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean_ms", "median_ms", "p99_ms")
]


def _get(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return KeyError
        d = d[part]
    return d


def check_benchmark_metrics(benchmark_metrics, exercise: str = "8.2", seed: int = 0) -> None:
    rng = random.Random(seed)
    benchmark_metrics = Exercise(exercise, answer=(
        "minivllm.benchmarks.serve:summarize", "minivllm.benchmarks.serve:RequestResult",
        "minivllm.benchmarks.serve:_stats", "minivllm.course.checks.serving:reference_metrics"),
        allowed="numpy and the traces").take(benchmark_metrics, "benchmark_metrics")

    cases = 0
    for trial in range(30):
        traces, t_end = random_traces(rng, rng.randint(3, 60))
        duration = t_end + rng.uniform(0, 1)
        slos = {}
        for key in ("ttft", "tpot", "e2el"):
            if rng.random() < 0.6:
                slos[key] = rng.choice([50.0, 150.0, 300.0, 1000.0, 3000.0])
        want = reference_metrics(traces, duration, slos)
        got = benchmark_metrics([dict(t, chunk_times=list(t["chunk_times"])) for t in traces],
                                duration, dict(slos))
        if not isinstance(got, dict):
            fail(exercise, f"expected a dict of figures, got {type(got).__name__}. "
                           + METRICS_CONVENTION)
        keys = KEYS + (["goodput.requests", "goodput.request_goodput"] if slos else [])
        for key in keys:
            w, g = _get(want, key), _get(got, key)
            if g is KeyError:
                fail(exercise, f"the result has no {key!r} (nested keys: {key.split('.')}). "
                               + METRICS_CONVENTION)
            same = (isinstance(g, (int, float)) and (
                (math.isnan(w) and math.isnan(g)) or math.isclose(w, g, rel_tol=1e-6, abs_tol=1e-9)))
            if not same:
                fail(exercise, f"trace set {trial} ({len(traces)} requests, "
                               f"{sum(not t['chunk_times'] or t['output_tokens'] != t['expected_tokens'] for t in traces)} "
                               f"failed, SLOs {slos} ms): {key} expected {w!r}, got {g!r}. "
                               + METRICS_CONVENTION)
        cases += 1
    passed(exercise, f"your figures equal minivllm bench serve's on {cases} random sets of traces "
                     f"(failed requests, one-token requests, ITL outliers, SLO combinations).")
