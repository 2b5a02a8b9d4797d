"""The decode bench runs the requested workload: exact prompt and new-token counts, every cache kind.

Timings are never asserted (they belong in ``kvgen bench``); only token counts are.
"""

from __future__ import annotations

import json

import torch

from kvgen.bench.decode import CACHE_KINDS, DecodeBenchConfig, compare
from kvgen.bench.peers import decode, kvgen_system
from kvgen.bench.workloads import seeded_prompt_ids
from kvgen.generation import GenerationConfig, generate


def test_kvgen_decode_generates_exactly_the_requested_tokens(tiny_llama: torch.nn.Module) -> None:
    model = tiny_llama
    config = DecodeBenchConfig(prompt_tokens=24, new_tokens=9, no_cache_new_tokens=5, include_transformers=False, num_prefill_repeats=1, progress=False)
    prompt_ids = seeded_prompt_ids(config.prompt_tokens, model.config.vocab_size, config.seed)  # [1, 24]
    # Make the model's EOS the very first greedy token: the bench must still run to full length.
    first = generate(model, prompt_ids, None, GenerationConfig(max_new_tokens=1)).new_token_ids[0][0]
    model.config.eos_token_id = first

    request = {"prompt_ids": prompt_ids[0].tolist(), "ttft_prompt_ids": [1, 2, 3], "num_prefill_repeats": 1,
               "new_tokens": config.new_tokens_per_cache(), "ttft_cache": "static"}
    side = decode(kvgen_system(model, 0.0), request, lambda _: None)
    report = side["configs"]

    assert set(report) == set(CACHE_KINDS)
    for cache, rep in report.items():
        assert "error" not in rep, (cache, rep)
        expected_new = config.no_cache_new_tokens if cache == "no_cache" else config.new_tokens
        assert rep["num_prompt_tokens"] == 24
        assert rep["num_requested_new_tokens"] == expected_new
        assert rep["num_new_tokens"] == expected_new
        assert len(rep["new_token_ids"]) == expected_new
        assert rep["num_decode_steps_timed"] == expected_new - 1  # every decode step was streamed and timed
    # Same greedy tokens with and without a cache: the three configurations decoded the same model.
    n = config.no_cache_new_tokens
    assert report["dynamic"]["new_token_ids"] == report["static"]["new_token_ids"]
    assert report["no_cache"]["new_token_ids"] == report["dynamic"]["new_token_ids"][:n]
    assert side["ttft_prompt_tokens"] == 3 and side["ttft_s"] > 0
    json.dumps(compare(side, {"skipped": "test"}))  # the report stays JSON-ready


def test_seeded_prompt_is_reproducible() -> None:
    a = seeded_prompt_ids(512, 49152, seed=0)
    b = seeded_prompt_ids(512, 49152, seed=0)
    assert a.shape == (1, 512) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert not torch.equal(a, seeded_prompt_ids(512, 49152, seed=1))
