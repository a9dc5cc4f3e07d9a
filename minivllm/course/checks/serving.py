"""Chapter 08's graders: 8.1, a chat completion's server-sent events, read by the ``openai``
client from a real server; 8.2, a benchmark's figures from raw client timestamps."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import random
import threading

from minivllm.course.checks.common import Exercise

STREAM_CONVENTION = (
    "Expected, each event as 'data: <json>\\n\\n' with the same id, created, model and object "
    "'chat.completion.chunk': first a chunk whose choices[0].delta is {'role': 'assistant', "
    "'content': ''}; then one chunk per DELTA output that has text, delta {'content': text}; "
    "the finished output's chunk carries finish_reason (and delta {} if it has no text); "
    "with include_usage every chunk says \"usage\": null and a last chunk has choices [] and "
    "usage {prompt_tokens, completion_tokens, total_tokens}; then 'data: [DONE]\\n\\n'.")
PROMPTS = [("What is the capital of France?", {}),
           ("Write a haiku about the sea.", {"stop": [","]})]


@contextlib.contextmanager
def app_in_thread(app, engine):
    """Serve ``app`` on a thread and a free port; yields its URL, then stops it and ``engine``."""
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
    """``chat_stream(request_id, model, outputs, include_usage)``: an async generator of events."""
    import httpx
    import openai

    from minivllm.config import EngineArgs
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.api_server import build_app
    from minivllm.model_hub import BUNDLED_NAME

    ex = Exercise(exercise, STREAM_CONVENTION,
                  ("minivllm.entrypoints.openai.serving:chat_completion_stream_generator",),
                  allowed="json, time and the RequestOutputs of outputs")
    if not callable(chat_stream):
        ex.fail(f"expected an async generator function, got {chat_stream!r}.")
    chat_stream = ex.take(chat_stream, "chat_stream")
    _probe(ex, chat_stream)  # an unsolved exercise raises here, not inside the server
    args = EngineArgs(device="cpu", max_model_len=512, num_kv_blocks=256, multiprocess=False)
    engine = AsyncLLM.from_engine_args(args, show_progress=False)
    with app_in_thread(build_app(engine, [BUNDLED_NAME], chat_stream=chat_stream), engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for prompt, extra in PROMPTS:
            kwargs = dict(model=model, temperature=0, max_tokens=16,
                          messages=[{"role": "user", "content": prompt}], **extra)
            full = client.chat.completions.create(**kwargs)
            for include_usage in (True, False):
                _check_stream(ex, client, kwargs, full, include_usage)
        body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        _check_events(ex, httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).text)
        ex.check_hits()  # a refusal the server turned into an error response
    ex.passed(f"the openai client streamed {2 * len(PROMPTS)} chat completions from a minivllm "
              f"server running your function: role first, content equal to the "
              f"non-streamed answers, finish reasons, usage, and [DONE].")


def _probe(ex: Exercise, chat_stream) -> None:
    """Run ``chat_stream`` outside any server: an unsolved exercise raises here as it is."""
    from minivllm.course.loadtest import run_coroutine
    from minivllm.outputs import CompletionOutput, RequestOutput

    async def consume():
        async def outputs():
            out = CompletionOutput(0, "Hi", [3], finish_reason="length")
            yield RequestOutput("probe", None, [1, 2], [out], True)

        stream = chat_stream("probe", "model", outputs(), True)
        if inspect.iscoroutine(stream):  # no yield in the body: not an async generator
            await stream  # (an unsolved exercise raises NotImplementedError here)
            return None
        return [event async for event in stream]

    if run_coroutine(consume) is None:
        ex.fail("chat_stream must be an async generator function (async def with yield): each "
                "yield is one server-sent event.")


def _check_stream(ex: Exercise, client, kwargs, full, include_usage: bool) -> None:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    try:
        chunks = list(client.chat.completions.create(stream=True, **kwargs, **options))
    except Exception as e:  # the client could not parse the stream
        ex.fail(f"the openai client failed to read your stream: {type(e).__name__}: {e}.")

    def expect(ok, message: str) -> None:
        if not ok:
            ex.fail(f"streaming {kwargs['messages'][0]['content']!r} (include_usage="
                    f"{include_usage}): {message}")

    expect(chunks, "no chunk came back.")
    ids = {c.id for c in chunks}
    expect(len(ids) == 1, f"chunks carry several ids {sorted(ids)}: one request, one id.")
    expect(all(c.object == "chat.completion.chunk" for c in chunks),
           "every chunk's object is 'chat.completion.chunk'.")
    expect(chunks[0].choices and chunks[0].choices[0].delta.role == "assistant",
           f"the first chunk must announce the role: choices[0].delta = {{'role': 'assistant', "
           f"'content': ''}}; got {chunks[0].model_dump()}.")
    choices = [c.choices[0] for c in chunks if c.choices]
    text = "".join(c.delta.content or "" for c in choices)
    want, reason = full.choices[0].message.content, full.choices[0].finish_reason
    expect(text == want, f"the deltas add up to {text!r}; the same request without streaming "
                         f"answered {want!r}. Send each DELTA output's text once, in order.")
    reasons = [c.finish_reason for c in choices]
    expect(reasons[-1] == reason and not any(reasons[:-1]),
           f"finish_reason per chunk {reasons}: expected None on every chunk but the last "
           f"choice chunk, which says {reason!r}.")
    with_usage = [c for c in chunks if c.usage is not None]
    if not include_usage:
        expect(not with_usage, "usage was sent although the client did not ask for it "
                               "(stream_options.include_usage).")
        return
    expect(len(with_usage) == 1 and with_usage[0] is chunks[-1] and not chunks[-1].choices,
           f"with stream_options.include_usage, exactly one chunk, the last, carries usage, with "
           f"choices []; got usage on {len(with_usage)} chunk(s).")
    got, expected = ((u.prompt_tokens, u.completion_tokens, u.total_tokens)
                     for u in (chunks[-1].usage, full.usage))
    expect(got == expected, f"usage (prompt, completion, total) {got}, expected {expected}: "
                            f"prompt tokens of the request, the output tokens of every DELTA "
                            f"output added up.")


def _check_events(ex: Exercise, raw: str) -> None:
    """The raw event stream of a request with include_usage."""
    if not raw.endswith("data: [DONE]\n\n"):
        ex.fail(f"the stream must end with 'data: [DONE]\\n\\n'; it ends with {raw[-40:]!r}.")
    events = raw.split("\n\n")[:-1]
    bad = [e for e in events if not e.startswith("data: ")]
    if bad:
        ex.fail(f"every event is one line 'data: ...' followed by a blank line; got "
                f"{bad[0][:80]!r}.")
    bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    if any("usage" not in b for b in bodies) or any(b["usage"] is not None for b in bodies[:-1]):
        ex.fail("with include_usage, every chunk has a \"usage\" field: null, except the last "
                "chunk's.")
    if len({(b["created"], b["model"]) for b in bodies}) != 1:
        ex.fail("every chunk carries the same created time and model.")


# -- 8.2 -----------------------------------------------------------------------------------------

METRICS_CONVENTION = (
    "Expected, for the successful traces only (success: text came back, and exactly "
    "expected_tokens tokens): TTFT = chunk_times[0] - start; ITL = every gap between consecutive "
    "chunk_times, pooled over requests; E2EL = end - start; TPOT = (E2EL - TTFT) / "
    "(output_tokens - 1), for requests with at least 2 tokens; each summarised as mean_ms, "
    "median_ms, p99_ms in milliseconds, percentiles interpolated linearly between the sorted "
    "values (numpy's default); completed = successful requests; request_throughput and "
    "output_throughput per second of duration_s; goodput: requests meeting every SLO "
    "(value <= SLO; a missing TPOT counts as 0), and request_goodput = that / duration_s.")
KEYS = ["completed", "request_throughput", "output_throughput"] + [
    f"{m}.{s}" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean_ms", "median_ms", "p99_ms")
]
GOODPUT_KEYS = ["goodput.requests", "goodput.request_goodput"]  # when there are SLOs


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


def _get(d: dict, key: str):
    """``d[a][b]`` for the key ``"a.b"``; KeyError (the class) when it is not there."""
    for part in key.split("."):
        d = d.get(part, KeyError) if isinstance(d, dict) else KeyError
    return d


def check_benchmark_metrics(benchmark_metrics, exercise: str = "8.2", seed: int = 0) -> None:
    """``benchmark_metrics(traces, duration_s, slos_ms) -> dict``, as ``minivllm bench serve``."""
    rng = random.Random(seed)
    ex = Exercise(exercise, METRICS_CONVENTION, (
        "minivllm.benchmarks.serve:summarize", "minivllm.benchmarks.serve:RequestResult",
        "minivllm.benchmarks.serve:_stats", "minivllm.course.checks.serving:reference_metrics"),
        allowed="numpy and the traces")
    benchmark_metrics = ex.take(benchmark_metrics, "benchmark_metrics")
    trials = 30
    for trial in range(trials):
        traces, t_end = random_traces(rng, rng.randint(3, 60))
        duration = t_end + rng.uniform(0, 1)
        slos = {key: rng.choice([50.0, 150.0, 300.0, 1000.0, 3000.0])
                for key in ("ttft", "tpot", "e2el") if rng.random() < 0.6}
        want = reference_metrics(traces, duration, slos)
        got = benchmark_metrics([dict(t, chunk_times=list(t["chunk_times"])) for t in traces],
                                duration, dict(slos))
        if not isinstance(got, dict):
            ex.fail(f"expected a dict of figures, got {type(got).__name__}.")
        failed = sum(not t["chunk_times"] or t["output_tokens"] != t["expected_tokens"]
                     for t in traces)
        for key in KEYS + (GOODPUT_KEYS if slos else []):
            w, g = _get(want, key), _get(got, key)
            if g is KeyError:
                ex.fail(f"the result has no {key!r} (nested keys: {key.split('.')}).")
            same = isinstance(g, (int, float)) and (
                (math.isnan(w) and math.isnan(g)) or math.isclose(w, g, rel_tol=1e-6, abs_tol=1e-9))
            if not same:
                ex.fail(f"trace set {trial} ({len(traces)} requests, {failed} failed, SLOs {slos} "
                        f"ms): {key} expected {w!r}, got {g!r}.")
    ex.passed(f"your figures equal minivllm bench serve's on {trials} random sets of traces "
              f"(failed requests, one-token requests, ITL outliers, SLO combinations).")
