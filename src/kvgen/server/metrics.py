"""Prometheus metrics with vLLM's meanings under a ``kvgen:`` prefix.

Gauges are read from the engine at scrape time (``LLMEngine.get_stats``); counters and
histograms are fed by ``RequestTracker`` as a request's outputs arrive. Times are in
seconds (``time.monotonic``), token counts in tokens. Each app has its own registry.
Source: vLLM ``vllm/v1/metrics/loggers.py`` (names, buckets).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("kvgen.server")
disable_created_metrics()  # no *_created series (as vLLM)

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
               1920.0, 7680.0]


class _EngineCollector(Collector):
    """Gauges read from the engine when /metrics is scraped."""

    def __init__(self, engine: LLMEngine, server_metrics: ServerMetrics) -> None:
        self.engine, self.server_metrics = engine, server_metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats, name = self.engine.get_stats(), self.server_metrics.model_name
        values = [
            ("kvgen:num_requests_running", "Requests in the running batch.", stats.num_running_reqs),
            ("kvgen:num_requests_waiting", "Requests waiting to run (preempted ones included).", stats.num_waiting_reqs),
            ("kvgen:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full).", stats.kv_cache_usage),
            ("kvgen:kv_cache_free_blocks", "KV-cache blocks no request holds.", stats.num_free_blocks),
            ("kvgen:kv_cache_total_blocks", "KV-cache blocks in the pool.", stats.num_blocks),
            ("kvgen:prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / prompt tokens, since start.",
             self.server_metrics.prefix_cache_hit_rate()),
            ("kvgen:num_requests_in_server", "Requests accepted by the HTTP server and not yet finished.",
             self.server_metrics.num_in_server),
        ]
        for metric, doc, value in values:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], float(value))
            yield family
        args = self.engine.engine_args  # vLLM's cache_config_info: the pool's settings as labels, the value 1
        info = GaugeMetricFamily("kvgen:cache_config_info", "Information of the KV cache (labels); the value is 1.",
                                 labels=["model_name", "block_size", "cache_dtype", "enable_prefix_caching",
                                         "num_gpu_blocks"])
        info.add_metric([name, str(args.block_size), args.kv_cache_dtype, str(args.enable_prefix_caching),
                         str(stats.num_blocks)], 1.0)
        yield info
        if stats.num_draft_tokens is None:  # no speculative decoding
            return
        counters = [("kvgen:spec_decode_num_draft_tokens", "Draft tokens scheduled (n-gram speculative decoding).",
                     stats.num_draft_tokens),
                    ("kvgen:spec_decode_num_accepted_tokens", "Draft tokens kept.", stats.num_accepted_tokens or 0)]
        for metric, doc, value in counters:
            counter = CounterMetricFamily(metric, doc, labels=["model_name"])
            counter.add_metric([name], float(value))
            yield counter


class ServerMetrics:
    """The server's Prometheus registry and the request-level metrics it records."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.num_in_server = 0  # requests admitted by the HTTP layer, counted in sequences (n)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, ...
        self.registry.register(_EngineCollector(engine, self))
        labels, reg = ["model_name"], self.registry

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=reg)

        self.prompt_tokens = counter("kvgen:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("kvgen:generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter("kvgen:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("kvgen:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("kvgen:num_preemptions", "Preemptions (a request's KV freed, recomputed later).")
        self.request_success = counter("kvgen:request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.ttft = Histogram("kvgen:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("kvgen:inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("kvgen:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=E2E_BUCKETS, registry=reg)
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.preemptions, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)  # every series exists from the start, at 0 (as vLLM's)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self._num_queries = 0
        self._num_hits = 0

    def prefix_cache_hit_rate(self) -> float:
        return self._num_hits / self._num_queries if self._num_queries else 0.0

    def record_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self._num_queries += num_prompt_tokens
        self._num_hits += num_cached_tokens
        for c, v in ((self.prompt_tokens, num_prompt_tokens), (self.prefix_cache_queries, num_prompt_tokens),
                     (self.prefix_cache_hits, num_cached_tokens)):
            c.labels(self.model_name).inc(v)

    def record_embedding(self, request_id: str, num_prompt_tokens: int, seconds: float) -> None:
        """One finished /v1/embeddings request: its inputs' tokens, a "stop" success, its latency, a log line (the
        prefix cache, which embeddings do not use, is left out)."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(num_prompt_tokens)
        self.request_success.labels(name, "stop").inc()
        self.e2e.labels(name).observe(seconds)
        logger.info("request %s: embeddings prompt_tokens=%d total=%.3fs", request_id, num_prompt_tokens, seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTracker:
    """One engine request's timeline: feeds TTFT, ITL, E2E and the token counters, logs one line at the end.

    Timings are per completion (``n > 1``: per child sequence, as vLLM's child requests): each completion's first
    token is a TTFT, each later output of it an ITL, its finish an E2E.
    """

    def __init__(self, metrics: ServerMetrics, request_id: str) -> None:
        self.metrics, self.request_id = metrics, request_id
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}  # completion index -> when its latest token came
        self.num_prompt_tokens = 0
        self.num_generated = 0
        self.finish_reasons: list[str] = []

    def on_output(self, output: RequestOutput) -> None:
        """Record one (DELTA) output of the request."""
        now, name = time.monotonic(), self.metrics.model_name
        for completion in output.outputs:
            self._on_completion(completion, now)
        if self.first_token is None and self.last_token:
            self.first_token = now
            self.num_prompt_tokens = len(output.prompt_token_ids)
            self.metrics.record_prompt(len(output.prompt_token_ids), output.num_cached_tokens)
        if output.finished and output.metrics is not None and output.metrics.num_preemptions:
            self.metrics.preemptions.labels(name).inc(output.metrics.num_preemptions)

    def _on_completion(self, completion: CompletionOutput, now: float) -> None:
        """One completion's new tokens (a TTFT or an ITL) and, if it finished, its E2E."""
        name, num_new = self.metrics.model_name, len(completion.token_ids)
        if num_new:
            last = self.last_token.get(completion.index)
            if last is None:
                self.metrics.ttft.labels(name).observe(now - self.arrival)
            else:
                self.metrics.itl.labels(name).observe((now - last) / num_new)
            self.last_token[completion.index] = now
            self.num_generated += num_new
            self.metrics.generation_tokens.labels(name).inc(num_new)
        if completion.finish_reason is not None:
            self.finish_reasons.append(completion.finish_reason)
            self.metrics.e2e.labels(name).observe(now - self.arrival)

    def finish(self, is_aborted: bool) -> None:
        """Count the request by finish reason and log its line (``is_aborted``: the client left)."""
        reasons = ["abort"] if is_aborted else (self.finish_reasons or ["abort"])
        for reason in reasons:
            self.metrics.request_success.labels(self.metrics.model_name, reason).inc()
        ttft = "-" if self.first_token is None else f"{self.first_token - self.arrival:.3f}s"
        logger.info(
            "request %s: prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs finish=%s",
            self.request_id, self.num_prompt_tokens, self.num_generated, ttft,
            time.monotonic() - self.arrival, ",".join(reasons),
        )
