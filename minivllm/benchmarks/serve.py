"""``minivllm bench serve``: an online benchmark client for a running OpenAI-compatible server.

Like vLLM's ``bench serve``: requests are sent to ``/v1/completions`` as streams, arriving as a
Poisson process at ``--request-rate`` per second (``inf``: all at once), at most
``--max-concurrency`` in flight. Every request asks for an exact number of tokens (greedy,
``ignore_eos``), with prompts of random token ids from one of three datasets:

* ``random`` — input and output lengths around ``--random-input-len`` / ``--random-output-len``;
* ``shared-prefix`` — every prompt starts with one of ``--num-prefixes`` shared prefixes of
  ``--shared-prefix-len`` tokens (a system prompt): the prefix cache's workload;
* ``long-prompt`` — short chats decoding while ``--long-prompt-fraction`` of the requests bring
  ``--long-prompt-len``-token prompts: the chunked-prefill workload (watch P99 ITL).

Per request it records TTFT, the gap between streamed chunks (ITL), TPOT and end-to-end
latency; it reports their mean, median and P99, request and token throughput, goodput under
``--goodput`` SLOs, and with ``--health-interval`` the latency of /health while it runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

from minivllm.benchmarks.common import machine_info, percentile, random_token_prompts, write_json

DATASETS = ("random", "shared-prefix", "long-prompt")
SLO_KEYS = ("ttft", "tpot", "e2el")


def add_parser(subparsers, add_engine_args=None) -> None:
    p = subparsers.add_parser("serve", help="online serving benchmark against a running server")
    add_client_args(p)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=main)


def add_client_args(p) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default=None, help="default: the server's first model")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for the prompts (default: the served model's folder, when local)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--shared-prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--long-prompt-fraction", type=float, default=0.1)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:100 e2el:5000")
    p.add_argument("--health-interval", type=float, default=0.0,
                   help="seconds between /health probes while the benchmark runs (0: none)")


# -- the workload -----------------------------------------------------------------------------

@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(args, vocab_size: int, avoid: set[int]) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    out_lens = _lengths(rng, n, args.random_output_len, args.random_range_ratio)
    in_lens = _lengths(rng, n, args.random_input_len, args.random_range_ratio)
    if args.dataset == "random":
        prompts = random_token_prompts(rng, in_lens, vocab_size, avoid)
    elif args.dataset == "shared-prefix":
        prefixes = random_token_prompts(rng, [args.shared_prefix_len] * args.num_prefixes,
                                        vocab_size, avoid)
        suffixes = random_token_prompts(rng, in_lens, vocab_size, avoid)
        prompts = [prefixes[i % len(prefixes)] + s for i, s in enumerate(suffixes)]
    else:  # long-prompt: a few long prompts among short chats
        long_ids = set(rng.sample(range(n), max(1, round(n * args.long_prompt_fraction))))
        lens = [args.long_prompt_len if i in long_ids else k for i, k in enumerate(in_lens)]
        prompts = random_token_prompts(rng, lens, vocab_size, avoid)
    return [BenchRequest(p, o) for p, o in zip(prompts, out_lens)]


# -- one request ------------------------------------------------------------------------------

@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @classmethod
    def from_timestamps(cls, start: float, chunk_times: list[float], end: float,
                        output_tokens: int, prompt_len: int = 0,
                        expected_tokens: int | None = None) -> "RequestResult":
        """A request's figures from what the client saw: when it sent the request (``start``),
        when each chunk carrying text arrived, when the stream ended (seconds, one clock), and
        the completion tokens the usage chunk reported. TTFT: first chunk - start; ITL: the
        gaps between chunks; latency: end - start; TPOT: (latency - TTFT) / (tokens - 1).
        It succeeded if text came back and, when ``expected_tokens`` is given, that many tokens."""
        result = cls(prompt_len=prompt_len, output_tokens=output_tokens)
        if chunk_times:
            result.ttft = chunk_times[0] - start
            result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        result.latency = end - start
        result.success = bool(chunk_times) and (expected_tokens is None
                                                or output_tokens == expected_tokens)
        if not result.success:
            result.error = (f"got {output_tokens} tokens, asked for {expected_tokens}"
                            if chunk_times else "no text came back")
        return result


async def send_request(client, url: str, model: str, req: BenchRequest) -> RequestResult:
    payload = {
        "model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(req.prompt_token_ids))
    start = time.perf_counter()
    chunk_times: list[float] = []
    output_tokens = 0
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    chunk_times.append(time.perf_counter())
        return RequestResult.from_timestamps(start, chunk_times, time.perf_counter(), output_tokens,
                                             len(req.prompt_token_ids), req.output_len)
    except Exception as e:  # a refused connection, a dropped stream: counted as failed
        result.error = f"{type(e).__name__}: {e}"
    return result


# -- the run ----------------------------------------------------------------------------------

async def _probe_health(client, url: str, interval: float, latencies: list[float],
                        stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            r = await client.get(url)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t)
        except Exception:
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def run_benchmark(args, requests: list[BenchRequest], model: str,
                        keep_results: bool = False) -> dict:
    """Send the requests, summarize the figures; ``keep_results``: also return every request's
    ``RequestResult`` (under "results"), for plots of whole distributions."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8)
    base = args.base_url.rstrip("/")
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                 headers=headers) as client:
        warm = await send_request(client, url, model, BenchRequest(requests[0].prompt_token_ids[:8], 2))
        if not warm.success:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        semaphore = asyncio.Semaphore(limit)
        rng = random.Random(args.seed + 1)

        async def limited(req: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send_request(client, url, model, req)

        health: list[float] = []
        stop = asyncio.Event()
        prober = None
        if args.health_interval > 0:
            prober = asyncio.create_task(
                _probe_health(client, f"{base}/health", args.health_interval, health, stop))
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        if prober is not None:
            await prober
    summary = summarize(results, duration, parse_goodput(args.goodput), health)
    if keep_results:
        summary["results"] = results
    return summary


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"goodput: expected KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        slos[key] = float(value) / 1000
    return slos


def _stats(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"mean_ms": sum(ms) / len(ms) if ms else float("nan"),
            "median_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float],
              health: list[float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": _stats([r.ttft for r in ok]),
        "tpot": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": _stats([gap for r in ok for gap in r.itl]),
        "e2el": _stats([r.latency for r in ok]),
    }
    if slos:
        def meets(r: RequestResult) -> bool:
            values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
            return all(values[k] <= v for k, v in slos.items())

        good = sum(1 for r in ok if meets(r))
        summary["goodput"] = {"slos_ms": {k: v * 1000 for k, v in slos.items()},
                              "requests": good, "request_goodput": good / duration}
    if health:
        summary["health"] = {**_stats(health), "max_ms": max(health) * 1000, "probes": len(health)}
    return summary


def print_summary(title: str, s: dict) -> None:
    print(f"============ {title} ============")
    print(f"successful requests:        {s['completed']}  (failed: {s['failed']})")
    print(f"duration (s):               {s['duration_s']:.2f}")
    print(f"request throughput (req/s): {s['request_throughput']:.2f}")
    print(f"output throughput (tok/s):  {s['output_throughput']:.1f}")
    print(f"total throughput (tok/s):   {s['total_token_throughput']:.1f}")
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        m = s[key]
        print(f"{name + ' (ms)':<18} mean {m['mean_ms']:9.1f}  median {m['median_ms']:9.1f}  "
              f"P99 {m['p99_ms']:9.1f}")
    if "goodput" in s:
        g = s["goodput"]
        print(f"goodput (req/s):            {g['request_goodput']:.2f}  under {g['slos_ms']} ms")
    if "health" in s:
        h = s["health"]
        print(f"/health (ms)       mean {h['mean_ms']:9.1f}  median {h['median_ms']:9.1f}  "
              f"P99 {h['p99_ms']:9.1f}  max {h['max_ms']:.1f}  ({h['probes']} probes)")
    for err in s["errors"]:
        print(f"error: {err}")


def load_prompt_tokenizer(args, root: str | None):
    from minivllm.engine.processor import load_tokenizer
    from minivllm.model_hub import resolve_model

    path = args.tokenizer
    if path is None:
        path = root if root and os.path.isdir(root) else resolve_model(None)
    return load_tokenizer(path)


def served_model(args) -> tuple[str, str | None]:
    """(model name to send, its folder as the server reports it) from /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    models = r.json()["data"]
    name = args.served_model_name or models[0]["id"]
    root = next((m.get("root") for m in models if m["id"] == name), None)
    return name, root


def main(args) -> int:
    model, root = served_model(args)
    tok = load_prompt_tokenizer(args, root)
    requests = make_requests(args, len(tok), set(tok.all_special_ids))
    summary = asyncio.run(run_benchmark(args, requests, model))
    print_summary(f"bench serve: {args.dataset}, {len(requests)} requests, "
                  f"rate {args.request_rate}, max concurrency {args.max_concurrency}", summary)
    write_json(args.json, {"benchmark": "serve", "machine": machine_info(), "model": model,
                           "dataset": args.dataset, "num_prompts": len(requests),
                           "request_rate": str(args.request_rate),
                           "max_concurrency": args.max_concurrency, **summary})
    return 0 if summary["failed"] == 0 else 1
