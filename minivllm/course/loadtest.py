"""Chapter 07's load test: ``minivllm serve`` with the paced model runner (no model: each step
sleeps what an H100 serving Llama-3-8B would take), driven by ``bench serve``'s streaming
clients; then when each step's simulated GPU work ran is read back.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import tempfile
import threading

PACED_RUNNER = "minivllm.sim.paced_runner:PacedModelRunner"


def run_coroutine(make_coro):
    """Run ``make_coro()`` to completion on a fresh event loop in a thread (a notebook's kernel
    already runs a loop, so ``asyncio.run`` cannot be called from it)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # re-raises what the coroutine raised
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def client_args(base_url: str, num_clients: int, num_prompts: int, input_len: int,
                output_len: int, request_rate: float = float("inf"), health_interval: float = 0.0,
                goodput: list[str] | None = None, seed: int = 0) -> argparse.Namespace:
    """The options ``bench serve``'s client reads, as its command line would give them."""
    return argparse.Namespace(
        base_url=base_url, served_model_name=None, tokenizer=None, api_key=None,
        dataset="random", num_prompts=num_prompts, random_input_len=input_len,
        random_output_len=output_len, random_range_ratio=0.0, shared_prefix_len=0,
        num_prefixes=1, long_prompt_len=0, long_prompt_fraction=0.0,
        request_rate=request_rate, max_concurrency=num_clients, seed=seed, goodput=goodput,
        health_interval=health_interval)


def bench(args: argparse.Namespace, keep_results: bool = False) -> dict:
    """``minivllm bench serve`` against ``args.base_url``: its summary dict (with every
    request's ``RequestResult`` under "results" if ``keep_results``)."""
    from minivllm.benchmarks.serve import (
        load_prompt_tokenizer, make_requests, run_benchmark, served_model,
    )

    model, root = served_model(args)
    tok = load_prompt_tokenizer(args, root)
    requests = make_requests(args, len(tok), set(tok.all_special_ids))
    return run_coroutine(lambda: run_benchmark(args, requests, model, keep_results))


def gpu_timeline(steps: list[tuple[float, float, int]]) -> dict:
    """From the steps' (start, end, tokens): the gaps between steps, the busy fraction."""
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
    span = steps[-1][1] - steps[0][0] if steps else 0.0
    busy = sum(end - start for start, end, _ in steps)
    return {"num_steps": len(steps), "gaps_s": gaps, "span_s": span,
            "busy_fraction": busy / span if span else float("nan"),
            "tokens": sum(n for _, _, n in steps)}


def paced_server_run(multiprocess: bool, num_clients: int = 128, num_prompts: int = 256,
                     input_len: int = 64, output_len: int = 64, health_interval: float = 0.02,
                     server_flags: list[str] | None = None, seed: int = 0) -> dict:
    """One load test; returns bench serve's summary plus the simulated GPU's timeline."""
    from minivllm.benchmarks.common import ServerProcess

    fd, log = tempfile.mkstemp(prefix="minivllm-paced-", suffix=".log")
    os.close(fd)
    flags = ["--model-runner-cls", PACED_RUNNER, "--port", "0", "--max-num-seqs", str(num_clients),
             *(server_flags or []), *([] if multiprocess else ["--no-multiprocess"])]
    server = ServerProcess(flags, env={**os.environ, "MINIVLLM_PACED_LOG": log})
    try:
        url = server.wait_ready()
        summary = bench(client_args(url, num_clients, num_prompts, input_len, output_len,
                                    health_interval=health_interval, seed=seed))
    finally:
        server.stop()
    with open(log) as f:
        steps = [(float(a), float(b), int(n)) for a, b, n in (s.split() for s in f if s.strip())]
    os.remove(log)
    # the client's warm-up request (8 prompt tokens) came first: the load begins with a prefill
    steps = steps[next((i for i, s in enumerate(steps) if s[2] > 8), len(steps)):]
    return {"summary": summary, "steps": steps, **gpu_timeline(steps)}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name (labels dropped): value}; histograms' _sum and _count
    kept, their buckets dropped."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "_bucket{" in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        values[name_labels.split("{")[0]] = float(value)
    return values


class MetricsScraper:
    """Scrape ``/metrics`` every ``interval`` seconds on a thread, as Prometheus would."""

    def __init__(self, base_url: str, interval: float = 0.1) -> None:
        self.url = f"{base_url.rstrip('/')}/metrics"
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time.time(), values)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="metrics-scraper")

    def _run(self) -> None:
        import time

        import httpx
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                try:
                    self.samples.append((time.time(), parse_metrics(client.get(self.url).text)))
                except httpx.HTTPError:
                    pass
                self._stop.wait(self.interval)

    def __enter__(self) -> "MetricsScraper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def series(self, name: str) -> tuple[list[float], list[float]]:
        """(seconds since the first sample, values) of one metric."""
        if not self.samples:
            return [], []
        t0 = self.samples[0][0]
        return ([t - t0 for t, v in self.samples if name in v],
                [v[name] for t, v in self.samples if name in v])
