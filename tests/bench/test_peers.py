"""The peers of ``kvgen bench`` (``bench/peers.py``): the subprocess protocol, llama.cpp's NLL arithmetic, the ratios.

Timings are never asserted; token counts, key names, ratio directions and the
agreement of llama.cpp's perplexity with kvgen's are. Tests that run llama.cpp skip
when ``llama_cpp`` is not importable (CI installs ``.[test]``, not ``.[bench]``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvgen.bench import peers
from kvgen.bench.decode import compare
from kvgen.bench.harness import Progress, peer_side
from kvgen.bench.peers import window_nll
from kvgen.bench.perplexity import relative_differences
from kvgen.bench.throughput import _ratios, peer_summary
from kvgen.bench.workloads import Workload
from kvgen.perplexity import perplexity, windows

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp not importable (pip install -e '.[bench]')"
)
TEXT = (
    "The licenses for most software and other practical works are designed to take away your freedom to share "
    "and change the works. By contrast, the GNU General Public License is intended to guarantee your freedom to "
    "share and change all versions of a program, to make sure it remains free software for all its users."
)


def test_peer_script_runs_without_torch() -> None:
    """Run as the parent runs it (a file, its directory first on sys.path): its RSS must not include torch."""
    peer = Path(peers.__file__).resolve()
    code = (
        f"import sys, runpy; sys.path.insert(0, {str(peer.parent)!r}); "
        f"runpy.run_path({str(peer)!r}, run_name='peer'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_window_nll_equals_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(0)
    window = torch.randint(0, 50, (9,), generator=gen).tolist()
    logits = torch.randn(8, 50, generator=gen) * 4  # [T-1, V]: row i predicts window[i + 1]
    expected = float(F.cross_entropy(logits.double(), torch.tensor(window[1:]), reduction="sum"))
    assert window_nll(logits.numpy(), window) == pytest.approx(expected, rel=1e-12)


def test_decode_ratios_point_the_documented_way() -> None:
    ours = {"load_s": 1.0, "peak_rss_bytes": 100, "ttft_s": 0.05,
            "configs": {c: {"prefill_tokens_per_s": 600.0, "decode_tokens_per_s": 120.0} for c in ("no_cache", "dynamic", "static")}}
    cpp = {"load_s": 0.5, "peak_rss_bytes": 200, "ttft_s": 0.10, "configs": {"kv_cache": {"prefill_tokens_per_s": 300.0, "decode_tokens_per_s": 100.0}}}
    r = compare(ours, cpp, "kv_cache")
    assert r["prefill_tokens_per_s"] == 2.0 and r["decode_tokens_per_s_static"] == 1.2
    assert r["ttft_speedup"] == 2.0  # peer seconds / kvgen seconds: > 1, kvgen first token sooner
    assert r["load_s_kvgen_over_peer"] == 2.0 and r["peak_rss_kvgen_over_peer"] == 0.5
    assert "decode_tokens_per_s_no_cache" not in r  # llama.cpp has no no-cache configuration to compare with
    missing = compare(ours, {"skipped": "not installed"}, "kv_cache")
    assert missing["decode_tokens_per_s_static"] is None and missing["ttft_speedup"] is None
    json.dumps(r)


def test_throughput_ratios_keep_old_keys_and_add_vs_peers() -> None:
    result = {"kvgen_engine": {"generated_tokens_per_s": 300.0, "itl_p50_s": 0.1}, "kvgen_static": {"generated_tokens_per_s": 150.0},
              "transformers_static": {"generated_tokens_per_s": 100.0}, "llama_cpp": {"generated_tokens_per_s": 75.0, "itl_p50_s": 0.01}}
    r = _ratios(result)
    assert r["over_llama_cpp"] == r["vs_llama_cpp"]["generated_tokens_per_s"] == 4.0
    assert r["over_transformers_static"] == r["vs_transformers"]["generated_tokens_per_s"] == 3.0
    assert r["vs_llama_cpp"]["itl_p50_speedup"] == pytest.approx(0.1)
    assert r["over_kvgen_static"] == 2.0


def test_relative_differences_skip_sides_without_perplexity() -> None:
    sides = {"default": {"perplexity": 10.1}, "float32": {"perplexity": 10.0}, "llama_cpp": {"skipped": "x"}}
    assert relative_differences(sides) == {"default_vs_float32": pytest.approx(0.01)}


@needs_llama_cpp
def test_decode_task_runs_the_requested_workload(default_gguf_path: Path) -> None:
    request = {"num_threads": 1, "prompt_ids": list(range(100, 108)),
               "ttft_prompt_ids": [100, 101, 102, 103], "new_tokens": {"kv_cache": 3}, "num_prefill_repeats": 1}
    result = peer_side("llama_cpp", "decode", True, str(default_gguf_path), Progress(False), request)
    assert "error" not in result, result
    rep = result["configs"]["kv_cache"]
    assert (rep["num_prompt_tokens"], rep["num_new_tokens"], rep["num_decode_steps_timed"]) == (8, 3, 2)
    assert len(rep["new_token_ids"]) == 3 and result["ttft_prompt_tokens"] == 4
    assert result["is_torch_imported"] is False and result["peak_rss_bytes"] > 0 and result["num_threads"] == 1


@needs_llama_cpp
def test_throughput_task_generates_each_requested_length(default_gguf_path: Path) -> None:
    workload = Workload([[100, 101, 102, 103, 104], [200, 201, 202]], [3, 2])
    request = {"num_threads": 1, "prompt_token_ids": workload.prompt_token_ids,
               "output_lens": workload.output_lens}
    result = peer_summary(peer_side("llama_cpp", "throughput", True, str(default_gguf_path), Progress(False), request), workload)
    assert "error" not in result, result
    assert result["num_requests"] == 2 and result["num_useful_tokens"] == 5
    assert result["ttft_p50_s"] is not None and "token_times_s" not in result
    assert "num_generated_tokens_including_waste" not in result and result["load_s"] > 0  # one request at a time: no waste


@needs_llama_cpp
def test_llama_cpp_perplexity_agrees_with_kvgen_float32(default_gguf_path: Path, ours_default) -> None:
    """Same token ids, same windows: llama.cpp (its Q4_1 and Q8 activations) is close to kvgen's exact path;
    an off-by-one in the logits rows would put it far off."""
    model, tokenizer = ours_default
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ours = perplexity(model, ids, 32)
    request = {"num_threads": 1, "context_length": 32, "windows": windows(ids, 32)}
    theirs = peer_side("llama_cpp", "perplexity", True, str(default_gguf_path), Progress(False), request)
    assert "error" not in theirs, theirs
    assert theirs["num_tokens_scored"] == ours.num_tokens_scored and theirs["num_windows"] == ours.num_windows
    their_ppl = math.exp(theirs["total_nll"] / theirs["num_tokens_scored"])
    assert abs(their_ppl / ours.perplexity - 1) < 0.05, (their_ppl, ours.perplexity)
    assert np.isfinite(theirs["total_nll"])
