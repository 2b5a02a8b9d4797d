"""Prometheus metrics with vLLM's meanings under a ``kvgen:`` prefix.

Gauges are read from the engine at scrape time (``LLMEngine.get_stats``); the token counters, the per-step and
the per-request histograms (E2E, queue / prefill / decode / inference times, token counts, ``n``, ``max_tokens``) are
fed by the engine after each step (``LLMEngine.stat_loggers``, from the engine's own timestamps, per ``n > 1`` child);
TTFT, inter-token latencies and the finish reasons by ``RequestTracker`` as a request's outputs reach the server.
Times are in seconds, token counts in tokens. Each app has its own registry.
Source: vLLM ``vllm/v1/metrics/loggers.py`` (names, buckets) and ``vllm/v1/metrics/stats.py`` (what is measured).
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
from kvgen.engine.output_processor import IterationStats
from kvgen.engine.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("kvgen.server")
disable_created_metrics()  # no *_created series (as vLLM)

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
               1920.0, 7680.0]  # also the queue / prefill / decode / inference times
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, to ``max_model_len``)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


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

        def histogram(name: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        tokens = build_1_2_5_buckets(engine.max_model_len)
        self.ttft = histogram("kvgen:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("kvgen:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("kvgen:e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = histogram("kvgen:request_queue_time_seconds", "Arrival to first scheduled (WAITING).",
                                    E2E_BUCKETS)
        self.inference_time = histogram("kvgen:request_inference_time_seconds",
                                        "First scheduled to last token (RUNNING, preemptions included).", E2E_BUCKETS)
        self.prefill_time = histogram("kvgen:request_prefill_time_seconds", "First scheduled to first token.",
                                      E2E_BUCKETS)
        self.decode_time = histogram("kvgen:request_decode_time_seconds", "First token to last token.", E2E_BUCKETS)
        self.tpot = histogram("kvgen:request_time_per_output_token_seconds",
                              "Per request: decode time / (generated tokens - 1).", ITL_BUCKETS)
        self.request_prompt_tokens = histogram("kvgen:request_prompt_tokens", "Prompt tokens per finished request.",
                                               tokens)
        self.request_generation_tokens = histogram("kvgen:request_generation_tokens",
                                                   "Generated tokens per finished request.", tokens)
        self.max_tokens = histogram("kvgen:request_params_max_tokens", "The max_tokens of finished requests.", tokens)
        self.n = histogram("kvgen:request_params_n", "The n of finished requests.", N_BUCKETS)
        self.max_num_generation_tokens = histogram("kvgen:request_max_num_generation_tokens",
                                                   "Generated tokens of a request's longest completion.", tokens)
        self.iteration_tokens = histogram("kvgen:iteration_tokens_total",
                                          "Tokens per engine step (prompts finishing prefill + generated).",
                                          ITERATION_TOKENS_BUCKETS)
        self.histograms = [self.ttft, self.itl, self.e2e, self.queue_time, self.inference_time, self.prefill_time,
                           self.decode_time, self.tpot, self.request_prompt_tokens, self.request_generation_tokens,
                           self.max_tokens, self.n, self.max_num_generation_tokens, self.iteration_tokens]
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.preemptions, *self.histograms):
            metric.labels(model_name)  # every series exists from the start, at 0 (as vLLM's)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self._num_queries = 0
        self._num_hits = 0
        engine.stat_loggers.append(self.record_iteration)

    def prefix_cache_hit_rate(self) -> float:
        return self._num_hits / self._num_queries if self._num_queries else 0.0

    def record_iteration(self, stats: IterationStats) -> None:
        """One engine step's tokens and finished requests (vLLM ``PrometheusStatLogger.record``; the step's thread)."""
        name = self.model_name
        self._num_queries += stats.num_prefix_cache_queries
        self._num_hits += stats.num_prefix_cache_hits
        for c, v in ((self.prompt_tokens, stats.num_prompt_tokens), (self.generation_tokens, stats.num_generation_tokens),
                     (self.prefix_cache_queries, stats.num_prefix_cache_queries),
                     (self.prefix_cache_hits, stats.num_prefix_cache_hits), (self.preemptions, stats.num_preempted_reqs)):
            c.labels(name).inc(v)
        if stats.num_prompt_tokens or stats.num_generation_tokens:  # not a step that only preempted
            self.iteration_tokens.labels(name).observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for n, num_tokens in zip(stats.n_params, stats.max_num_generation_tokens, strict=True):
            self.n.labels(name).observe(n)
            self.max_num_generation_tokens.labels(name).observe(num_tokens)
        for r in stats.finished_requests:
            for histogram, value in ((self.e2e, r.e2e_latency), (self.queue_time, r.queued_time),
                                     (self.prefill_time, r.prefill_time), (self.decode_time, r.decode_time),
                                     (self.inference_time, r.inference_time),
                                     (self.tpot, r.mean_time_per_output_token),
                                     (self.request_prompt_tokens, r.num_prompt_tokens),
                                     (self.request_generation_tokens, r.num_generation_tokens)):
                histogram.labels(name).observe(value)
            if r.max_tokens_param:
                self.max_tokens.labels(name).observe(r.max_tokens_param)

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
    """One engine request's timeline: feeds TTFT, ITL and the finish reasons, logs one line at the end.

    Timings are per completion (``n > 1``: per child sequence, as vLLM's child requests): each completion's first
    token is a TTFT, each later output of it an ITL (the engine's ``stat_loggers`` feed the rest).
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
        now = time.monotonic()
        for completion in output.outputs:
            self._on_completion(completion, now)
        if self.first_token is None and self.last_token:
            self.first_token = now
            self.num_prompt_tokens = len(output.prompt_token_ids)

    def _on_completion(self, completion: CompletionOutput, now: float) -> None:
        """One completion's new tokens (a TTFT or an ITL) and, if it finished, its finish reason."""
        name, num_new = self.metrics.model_name, len(completion.token_ids)
        if num_new:
            last = self.last_token.get(completion.index)
            if last is None:
                self.metrics.ttft.labels(name).observe(now - self.arrival)
            else:
                self.metrics.itl.labels(name).observe((now - last) / num_new)
            self.last_token[completion.index] = now
            self.num_generated += num_new
        if completion.finish_reason is not None:
            self.finish_reasons.append(completion.finish_reason)

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
