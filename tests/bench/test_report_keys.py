"""Every bench report keeps the JSON keys the pre-refactor benches emitted (kvgen 2025-11, issue 9).

The expected key sets were read from real ``kvgen bench ... --json`` runs of the old code; they
are structure, not measurements. Typed results are built with placeholder numbers and
serialized; the ratio helpers run on hand-made sides. No bench is timed here.
"""

from __future__ import annotations

import dataclasses

from kvgen.bench.decode import CACHE_KINDS, DecodeReport, compare, greedy_agreement
from kvgen.bench.harness import to_json
from kvgen.bench.peers import GenerationTiming
from kvgen.bench.perplexity import PerplexityReport
from kvgen.bench.serve import LoadRun, ServeReport
from kvgen.bench.strategies import StrategiesReport, StrategyRun
from kvgen.bench.throughput import (
    EngineProfile,
    ThroughputReport,
    ThroughputSummary,
    _ratios,
)

GENERATION_KEYS = {
    "decode_s", "decode_step_s_median", "decode_step_s_p90", "decode_tokens_per_s", "decode_tokens_per_s_at_median_step",
    "num_decode_steps_timed", "num_new_tokens", "num_prompt_tokens", "num_requested_new_tokens", "prefill_s",
    "prefill_tokens_per_s", "total_s",
}
MODEL_SPLIT_KEYS = {"model_decode_s", "model_decode_tokens_per_s", "model_prefill_s"}
SUMMARY_KEYS = {"elapsed_s", "generated_tokens_per_s", "itl_p50_s", "itl_p99_s", "num_requests", "num_useful_tokens",
                "requests_per_s", "ttft_p50_s", "ttft_p99_s"}
PROFILE_KEYS = {"execute_s", "num_packed_tokens", "num_steps", "output_s", "runner_forward_s", "runner_logits_s",
                "runner_prepare_s", "runner_sample_s", "schedule_s", "update_s"}
LOAD_RUN_KEYS = {"concurrency", "elapsed_s", "itl_p50_s", "itl_p99_s", "num_output_tokens", "num_requests",
                 "output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s"}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _placeholder(cls: type, **values: object) -> object:
    return cls(**{f.name: values.get(f.name, 1.0) for f in dataclasses.fields(cls) if f.name in values or f.default is dataclasses.MISSING})


def test_top_level_keys() -> None:
    assert _fields(DecodeReport) == {"schema", "env", "workload", "kvgen", "transformers", "llama_cpp", "ratios", "greedy_agreement"}
    assert _fields(ThroughputReport) == {"schema", "env", "workload", "kvgen_engine", "kvgen_static", "kvgen_peak_rss_bytes",
                                         "transformers_static", "llama_cpp", "ratios"}
    assert _fields(StrategiesReport) == {"schema", "env", "workload", "strategies"}
    assert _fields(PerplexityReport) == {"schema", "env", "kvgen_default", "kvgen_float32", "llama_cpp", "text", "workload",
                                         "relative_differences"}
    assert _fields(ServeReport) == {"schema", "environment", "model", "num_threads", "workload", "kvgen", "llama_cpp_server", "ratios"}


def test_decode_keys() -> None:
    peer = to_json(_placeholder(GenerationTiming, new_token_ids=[1, 2]))
    ours = to_json(_placeholder(GenerationTiming, new_token_ids=[1, 2], model_prefill_s=0.1, model_decode_s=0.2, model_decode_tokens_per_s=3.0))
    assert set(peer) == GENERATION_KEYS | {"new_token_ids"}  # token ids are dropped after the agreement check
    assert set(ours) == GENERATION_KEYS | MODEL_SPLIT_KEYS | {"new_token_ids"}
    side = {"configs": dict.fromkeys(CACHE_KINDS, ours)}
    common = {"decode_tokens_per_s_static_vs_their_best", "load_s_kvgen_over_peer", "peak_rss_kvgen_over_peer",
              "prefill_tokens_per_s", "ttft_speedup"}
    per_cache = {f"{k}_{c}" for k in ("decode_tokens_per_s", "decode_tokens_per_s_at_median_step") for c in CACHE_KINDS}
    assert set(compare(side, side)) == common | per_cache
    assert set(compare(side, {"configs": {"kv_cache": peer}}, "kv_cache")) == common | {k for k in per_cache if not k.endswith("no_cache")}
    assert set(greedy_agreement(side, side)) == {"kvgen_first_new_token_ids", "num_compared_tokens", "num_leading_equal_tokens",
                                                 "peer_first_new_token_ids"}


def test_throughput_keys() -> None:
    summary = _placeholder(ThroughputSummary)
    assert set(to_json(summary)) == SUMMARY_KEYS
    summary.profile = EngineProfile()  # type: ignore[attr-defined]
    assert set(to_json(summary)) == SUMMARY_KEYS | {"profile"} and set(to_json(EngineProfile())) == PROFILE_KEYS
    summary.profile, summary.num_generated_tokens_including_waste = None, 3  # type: ignore[attr-defined]
    assert set(to_json(summary)) == SUMMARY_KEYS | {"num_generated_tokens_including_waste"}  # transformers_static
    vs = {"generated_tokens_per_s", "itl_p50_speedup", "peak_rss_kvgen_over_peer", "requests_per_s", "ttft_p50_speedup"}
    ratios = _ratios({})
    assert set(ratios) == {"note", "over_kvgen_static", "over_llama_cpp", "over_transformers_static", "vs_llama_cpp", "vs_transformers"}
    assert set(ratios["vs_llama_cpp"]) == set(ratios["vs_transformers"]) == vs


def test_strategies_and_serve_keys() -> None:
    assert set(to_json(StrategyRun(1.0, 3, 3.0))) == {"num_new_tokens", "seconds", "tokens_per_s"}  # transformers
    assert set(to_json(StrategyRun(1.0, 3, 3.0, 0.1, 0.9))) == {"model_decode_s", "model_prefill_s", "num_new_tokens", "seconds", "tokens_per_s"}
    assert set(to_json(_placeholder(LoadRun))) == LOAD_RUN_KEYS
