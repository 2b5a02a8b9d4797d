"""Bench harness: the subprocess protocol, percentile, token timer, typed results -> JSON, flags from configs.

No timings are asserted; only the arithmetic and the plumbing are.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest

from kvgen.bench import harness
from kvgen.bench.decode import DecodeBenchConfig
from kvgen.bench.harness import (
    OMIT_IF_NONE,
    Progress,
    TokenTimer,
    latencies,
    peer_side,
    percentile,
    render,
    run_side,
    to_json,
)
from kvgen.bench.peers import RunStats, time_generation
from kvgen.bench.serve import ServeBenchConfig, split_workload
from kvgen.bench.workloads import make_workload
from kvgen.fields import add_config_flags, config_from_args


def test_run_side_round_trips_a_request_and_reports_failures() -> None:
    echo = "import json, sys; print(json.dumps({'got': json.load(sys.stdin)}))"
    assert run_side("echo", ["-c", echo], lambda _: None, {"ids": [1, 2, 3]}) == {"got": {"ids": [1, 2, 3]}}
    crash = run_side("crash", ["-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], lambda _: None, quiet=True)
    assert "status 3" in crash["error"] and "boom" in crash["error"]
    silent = run_side("silent", ["-c", "print('not json')"], lambda _: None)
    assert "no JSON report" in silent["error"]


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_is_numpys_linear_interpolation(q: float) -> None:
    values = np.random.default_rng(0).exponential(size=37).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert percentile([], q) is None


def test_latencies_measure_ttft_from_each_start_and_itl_within_requests() -> None:
    token_times, starts = [[1.0, 1.5, 2.5], [], [3.0]], [0.5, 0.0, 1.0]  # the empty request has no first token
    ttft, itl = [0.5, 2.0], [0.5, 1.0]
    expected = [float(np.percentile(v, q)) for v in (ttft, itl) for q in (50, 99)]
    assert list(latencies(token_times, starts).values()) == pytest.approx(expected)


def test_token_timer_skips_the_prompt_put() -> None:
    timer = TokenTimer()
    for value in ("prompt", 1, 2, 3):
        timer.put(value)
    assert len(timer.times) == 3 and len(timer.gaps()) == 2
    assert all(g >= 0 for g in timer.gaps())


def test_time_generation_takes_decode_from_the_timed_runs_own_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # a fake clock: 1-token runs' prefill costs 10, the timed run's 7, each later token 1 (as a noisy host might)
    now = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: now[0])

    def generate_fn(prompt: list[int], max_new_tokens: int, streamer: TokenTimer | None) -> RunStats:
        now[0] += 7.0 if streamer is not None else 10.0
        if streamer is not None:
            streamer.put(prompt)
        for i in range(max_new_tokens):
            now[0] += 1.0 if i else 0.0
            if streamer is not None:
                streamer.put([i])
        return RunStats(len(prompt), list(range(max_new_tokens)))

    timing = time_generation(generate_fn, [5, 6, 7], 9)
    assert timing.prefill_s == 10.0 and timing.total_s == 15.0  # the median 1-token run; the timed run's 7 + 8
    assert timing.decode_s == 8.0 and timing.num_decode_steps_timed == 8  # total_s - prefill_s would say 5.0
    assert timing.decode_tokens_per_s == 1.0 and timing.decode_step_s_median == 1.0


def test_to_json_omits_only_marked_none_fields() -> None:
    @dataclasses.dataclass
    class Inner:
        a: int
        b: float | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)
        c: float | None = None

    @dataclasses.dataclass
    class Outer:
        inner: Inner
        runs: dict[str, Inner]

    got = to_json(Outer(Inner(1), {"x": Inner(2, 0.5)}))
    assert got == {"inner": {"a": 1, "c": None}, "runs": {"x": {"a": 2, "b": 0.5, "c": None}}}


def test_flags_come_from_the_config_and_keep_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, DecodeBenchConfig)
    args = parser.parse_args([])
    assert config_from_args(DecodeBenchConfig, args, progress=False) == DecodeBenchConfig(progress=False)
    args = parser.parse_args(["--threads", "2", "--no-llama-cpp", "--prompt-tokens", "7", "--new-tokens", "5"])
    config = config_from_args(DecodeBenchConfig, args, progress=False)
    assert (config.num_threads, config.include_llama_cpp, config.include_transformers) == (2, False, True)
    assert (config.prompt_tokens, config.new_tokens, config.ttft_prompt_tokens) == (7, 5, 20)
    assert parser.parse_args(["--num-threads", "3"]).num_threads == 3
    assert "progress" not in vars(args)  # cli=False fields get no flag

    serve = argparse.ArgumentParser()
    add_config_flags(serve, ServeBenchConfig)
    assert list(serve.parse_args([]).concurrency) == [1, 4, 16]
    assert serve.parse_args(["--concurrency", "2", "8"]).concurrency == [2, 8]


def test_bench_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="new_tokens must be an int >= 2, got 1"):
        DecodeBenchConfig(new_tokens=1, progress=False)
    with pytest.raises(ValueError, match="concurrency must be an int >= 1, got 0"):
        ServeBenchConfig(concurrency=(0,))


def test_bench_dtype_defaults_to_the_loaders_default() -> None:
    from kvgen.loader import load_model

    default = inspect.signature(load_model).parameters["dtype"].default
    assert DecodeBenchConfig(progress=False).dtype == default
    assert DecodeBenchConfig(dtype="bfloat16", progress=False).dtype == "bfloat16"
    with pytest.raises(ValueError, match="num_threads must be an int >= 1, got 0"):
        DecodeBenchConfig(num_threads=0)


def test_render_tables_the_sides_and_lists_every_other_leaf() -> None:
    result = {"schema": "s/1", "workload": {"model": "m"}, "a": {"x": 0.123456, "big": 12345.6, "rss_bytes": 3 << 20,
              "ok": True, "rows": [{"m": 1}, {"m": 4}]}, "b": {"x": None, "error": "boom"},
              "c": {"nested": {"skipped": "not installed"}}}
    lines = render(result, ["a", "b"]).splitlines()
    assert lines[0] == "s/1" and lines[1].split() == ["a", "b"]
    assert [line.split() for line in lines[2:8]] == [["x", "0.1235", "-"], ["big", "12346", "-"], ["rss_bytes", "3", "MiB", "-"],
                                                     ["ok", "yes", "-"], ["rows.0.m", "1", "-"], ["rows.1.m", "4", "-"]]
    assert lines[8:] == ["workload.model: m", "b.error: boom", "c.nested.skipped: not installed"]


def test_peer_side_skips_a_disabled_peer_and_llama_cpp_on_a_directory(tmp_path: Path) -> None:
    log = Progress(False)
    assert peer_side("transformers", "decode", False, str(tmp_path), log, {}) == {"skipped": "include_transformers=False"}
    skipped = peer_side("llama_cpp", "decode", True, str(tmp_path), log, {})["skipped"]
    assert "Hugging Face directory" in skipped or "not installed" in skipped


def test_serve_runs_get_distinct_prompts_of_one_workload() -> None:
    """Each concurrency of ``kvgen bench serve`` sends its own prompts (a prefix cache warmed by an earlier run would
    flatter a later one's TTFT), and together they are one seeded ``make_workload``."""
    runs = split_workload(8, 3, vocab_size=1000, seed=4)
    whole = make_workload(24, 1000, seed=4)
    assert [len(w.prompt_token_ids) for w in runs] == [8, 8, 8]
    assert [p for w in runs for p in w.prompt_token_ids] == whole.prompt_token_ids
    assert [n for w in runs for n in w.output_lens] == whole.output_lens
    prompts = [tuple(p) for w in runs for p in w.prompt_token_ids]
    assert len(set(prompts)) == len(prompts)
