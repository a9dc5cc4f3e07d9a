"""/metrics: Prometheus text, with vLLM's metric names under a ``minivllm:`` prefix.

Two sources feed it:

* the engine core's counters, sent with every batch of outputs (``scheduler_stats``): requests
  running and waiting, KV blocks used and the cache usage fraction, prefix-cache queries and
  hits (in tokens), preemptions. They are read when Prometheus scrapes, so a scrape never waits
  for the engine;
* the front end's view of each request: generated tokens as they arrive, and when a request
  finishes its time to first token, its inter-token latencies and its end-to-end latency.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minivllm.engine.messages import EngineCoreOutput
from minivllm.engine.async_llm import StatLoggerBase
from minivllm.outputs import RequestOutput

PREFIX = "minivllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# scheduler_stats key -> (metric name, help, kind)
_SCHEDULER_METRICS = {
    "num_running": ("num_requests_running", "Requests in the running batch.", "gauge"),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "gauge"),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by requests.", "gauge"),
    "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool.", "gauge"),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                             "counter"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                          "counter"),
    "num_preemptions": ("num_preemptions", "Requests preempted (KV blocks taken back).",
                        "counter"),
}


class _SchedulerStatsCollector:
    def __init__(self, logger: "PrometheusStatLogger") -> None:
        self.logger = logger

    def collect(self):
        stats = self.logger.scheduler_stats or {}
        labels = ["model_name"]
        for key, (name, doc, kind) in _SCHEDULER_METRICS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, doc, labels=labels)
            family.add_metric([self.logger.model_name], float(stats.get(key, 0)))
            yield family


class PrometheusStatLogger(StatLoggerBase):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.scheduler_stats: dict | None = None
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Output tokens generated.", labels, registry=reg
        ).labels(model_name)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels, registry=reg
        ).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=reg)
        for reason in ("stop", "length"):  # present (at 0) from the start
            self.request_success.labels(model_name, reason)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token (s).", labels,
            buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens (s).",
            labels, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to last token (s).", labels,
            buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        reg.register(_SchedulerStatsCollector(self))

    def record(
        self,
        scheduler_stats: dict | None,
        core_outputs: list[EngineCoreOutput],
        finished: list[RequestOutput],
    ) -> None:
        if scheduler_stats is not None:
            self.scheduler_stats = scheduler_stats
        new_tokens = sum(len(o.new_token_ids) for o in core_outputs)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        for out in finished:
            m = out.metrics
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.request_success.labels(self.model_name, out.outputs[0].finish_reason).inc()
            if m is None:
                continue
            if m.ttft is not None:
                self.ttft.observe(max(m.ttft, 0.0))
            for gap in m.tpots:
                self.itl.observe(gap)
            end = m.finished_time or m.last_token_time
            if end is not None:
                self.e2e.observe(max(end - m.arrival_time, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
