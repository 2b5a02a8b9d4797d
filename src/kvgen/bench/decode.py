"""``kvgen bench decode``: batch-1 greedy prefill and decode speed, kvgen vs transformers and llama.cpp.

Workload (seeded): one prompt of ``prompt_tokens`` ids drawn uniformly from the
vocabulary by ``torch.Generator(seed)``; greedy decoding of exactly
``new_tokens`` tokens (EOS disabled), batch size 1. Each configuration (no KV
cache, dynamic cache, static cache) is warmed up by one untimed 2-token
generation, then timed by wall clock around the public ``generate`` call:

* ``prefill_s``: median over ``num_prefill_repeats`` runs of a 1-token generation
  (one forward over the prompt, logits of the last row, one argmax);
* ``decode_s = total_s - prefill_s`` where ``total_s`` times the full generation;
  ``decode_tokens_per_s = (new_tokens - 1) / decode_s`` (prefill yields the first token).

The same harness times every engine, so loop and sampling overhead counts on
every side. Without a cache each step re-reads the whole sequence (O(n^2)), so
that configuration runs only ``no_cache_new_tokens`` new tokens. Time to first
token (``ttft_s``) is the median 1-token generation of a ``ttft_prompt_tokens``
prompt (kvgen: static cache, its ``generate`` default). transformers (``python -c
... --side transformers``) and llama-cpp-python (``bench/llama_cpp_peer.py``, no
torch, same GGUF, same prompt ids, same thread count) run after kvgen, each in a
fresh subprocess so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from kvgen.bench.common import (
    GenerateFn,
    Progress,
    RunStats,
    TokenTimer,
    current_rss_bytes,
    default_dtype,
    environment_info,
    load_average,
    peak_rss_bytes,
    peer_torch_dtype,
    ratio,
    run_side,
    seeded_prompt_ids,
    set_threads,
    time_generation,
    time_to_first_token,
    timed,
)
from kvgen.bench.llama_cpp_peer import run_llama_cpp
from kvgen.fields import config_field

CACHE_KINDS = ("no_cache", "dynamic", "static")
SCHEMA = "kvgen.bench.decode/2"


_f = config_field


@dataclass
class DecodeBenchConfig:
    """What ``run_decode_bench`` measures. Raises ``ValueError`` for out-of-range values."""

    model: str = _f("default", "model: 'default', a .gguf file or a Hugging Face directory")
    dtype: str | None = _f(None, "kvgen's dtype, passed to load_model (default: load_model's default)")
    prompt_tokens: int = _f(512, "prompt length in tokens (seeded random ids)")
    new_tokens: int = _f(128, "greedy tokens generated per timed run (EOS disabled)")
    no_cache_new_tokens: int = _f(16, "new tokens for the O(n^2) no-cache runs")
    include_transformers: bool = _f(True, "also time transformers on the same weights (subprocess)")
    include_llama_cpp: bool = _f(True, "also time llama-cpp-python on the same GGUF (subprocess)")
    ttft_prompt_tokens: int = _f(20, "prompt length in tokens of the time-to-first-token runs")
    seed: int = _f(0, "seed of the prompt's torch.Generator")
    num_threads: int | None = _f(None, "threads of every engine (default: physical cores)")
    num_prefill_repeats: int = _f(3, "prefill timings per configuration; the median is reported")
    progress: bool = _f(True, "progress lines on stderr")

    def __post_init__(self) -> None:
        self.dtype = self.dtype or default_dtype()  # load_model validates it
        for name in ("prompt_tokens", "ttft_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("new_tokens", "no_cache_new_tokens"):
            if getattr(self, name) < 2:  # decode speed needs at least one step after prefill
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
        if self.num_prefill_repeats < 1:
            raise ValueError(f"num_prefill_repeats must be >= 1, got {self.num_prefill_repeats}")


def _kvgen_generate_fn(model: nn.Module, cache: str) -> GenerateFn:
    from kvgen.generation import GenerationConfig, generate

    cache_args: dict[str, Any] = {"use_cache": False} if cache == "no_cache" else {"cache_implementation": cache}

    def run(prompt_ids: torch.Tensor, max_new_tokens: int, streamer: TokenTimer | None) -> RunStats:
        # eos_token_id=[] disables EOS (an empty id list), so every run yields exactly max_new_tokens.
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0, **cache_args)
        out = generate(model, prompt_ids, None, config, streamer=streamer)
        return RunStats(out.prompt_length, out.new_token_ids[0], out.timings.prefill_s, out.timings.decode_s)

    return run


def _transformers_generate_fn(hf_model: nn.Module, cache: str) -> GenerateFn:
    cache_args: dict[str, Any] = {"use_cache": False} if cache == "no_cache" else {}
    if cache == "static":
        cache_args["cache_implementation"] = "static"
    eos = hf_model.generation_config.eos_token_id
    pad = hf_model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    def run(prompt_ids: torch.Tensor, max_new_tokens: int, streamer: TokenTimer | None) -> RunStats:
        with torch.inference_mode():
            out = hf_model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,  # suppresses EOS: fixed length
                pad_token_id=pad,
                streamer=streamer,
                **cache_args,
            )  # [1, T + max_new_tokens]
        return RunStats(prompt_ids.shape[1], out[0, prompt_ids.shape[1] :].tolist())

    return run


def measure_engine(
    make_fn: Callable[[str], GenerateFn],
    prompt_ids: torch.Tensor,
    config: DecodeBenchConfig,
    log: Callable[[str], None],
    name: str,
) -> dict[str, dict[str, Any]]:
    """Time every cache kind of one engine; a configuration that raises reports ``{"error": ...}``."""
    results: dict[str, dict[str, Any]] = {}
    for cache in CACHE_KINDS:
        n = config.no_cache_new_tokens if cache == "no_cache" else config.new_tokens
        log(f"{name}: {cache}: warm-up, prefill x{config.num_prefill_repeats}, {n} new tokens")
        try:
            results[cache] = time_generation(make_fn(cache), prompt_ids, n, config.num_prefill_repeats)
        except Exception as e:
            results[cache] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name}: {cache}: failed: {results[cache]['error']}")
            continue
        r = results[cache]
        log(f"{name}: {cache}: prefill {_num(r['prefill_tokens_per_s'], '.1f')} tokens/s, decode {_num(r['decode_tokens_per_s'], '.2f')} tokens/s")
    return results


def measure_ours(model: nn.Module, prompt_ids: torch.Tensor, config: DecodeBenchConfig, log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Time kvgen's ``generate`` on an already-built model, per cache kind (see module docstring).

    prompt_ids: [1, T] int64. Returns ``{cache_kind: report}``; token counts are
    ``num_prompt_tokens`` and ``num_new_tokens`` (what was actually generated).
    """
    return measure_engine(lambda cache: _kvgen_generate_fn(model, cache), prompt_ids, config, log or (lambda _: None), "kvgen")


def measure_transformers(hf_model: nn.Module, prompt_ids: torch.Tensor, config: DecodeBenchConfig, log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Time ``transformers`` ``generate`` on an already-built model, per cache kind (same harness as ours)."""
    return measure_engine(lambda cache: _transformers_generate_fn(hf_model, cache), prompt_ids, config, log or (lambda _: None), "transformers")


def _bench_kvgen(config: DecodeBenchConfig, log: Progress) -> dict[str, Any]:
    from kvgen.bench.kernels import qgemm_crossover, step_breakdown
    from kvgen.loader import load_model, resolve_model_path

    rss_before = current_rss_bytes()
    log(f"kvgen: loading {config.model} ({config.dtype})")
    (model, _tokenizer), load_s = timed(lambda: load_model(config.model, dtype=config.dtype))
    log(f"kvgen: loaded in {load_s:.2f} s")
    vocab_size = model.config.vocab_size
    configs = measure_ours(model, seeded_prompt_ids(config.prompt_tokens, vocab_size, config.seed), config, log)
    ttft_prompt_ids = seeded_prompt_ids(config.ttft_prompt_tokens, vocab_size, config.seed)  # [1, ttft_prompt_tokens]
    ttft_s = time_to_first_token(_kvgen_generate_fn(model, "static"), ttft_prompt_ids, config.num_prefill_repeats)
    log("kvgen: decode step breakdown and kernel crossover")
    breakdown = step_breakdown(model, seeded_prompt_ids(config.prompt_tokens, vocab_size, config.seed))
    return {
        "model_path": str(resolve_model_path(config.model)),
        "step_breakdown": breakdown,
        "qgemm_crossover": qgemm_crossover(),
        "vocab_size": vocab_size,
        "load_s": load_s,
        "rss_before_load_bytes": rss_before,
        "peak_rss_bytes": peak_rss_bytes(),
        "configs": configs,
        "ttft_s": ttft_s,
    }


def _bench_transformers_here(config: DecodeBenchConfig, vocab_size: int | None, log: Progress) -> dict[str, Any]:
    """The transformers side, in this process (the subprocess entry point calls this)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from kvgen.loader import resolve_model_path

    path = resolve_model_path(config.model)
    rss_before = current_rss_bytes()
    log(f"transformers {transformers.__version__}: loading {path.name}")
    kwargs: dict[str, Any] = {"torch_dtype": peer_torch_dtype(config.dtype)}
    if not path.is_dir():
        kwargs["gguf_file"] = path.name
    hf_model, load_s = timed(lambda: AutoModelForCausalLM.from_pretrained(path if path.is_dir() else path.parent, **kwargs).eval())
    log(f"transformers: loaded in {load_s:.2f} s")
    vocab_size = vocab_size or hf_model.config.vocab_size
    configs = measure_transformers(hf_model, seeded_prompt_ids(config.prompt_tokens, vocab_size, config.seed), config, log)
    ttft_prompt_ids = seeded_prompt_ids(config.ttft_prompt_tokens, vocab_size, config.seed)  # [1, ttft_prompt_tokens]
    ttft_s = time_to_first_token(_transformers_generate_fn(hf_model, "dynamic"), ttft_prompt_ids, config.num_prefill_repeats)
    return {
        "load_s": load_s,
        "rss_before_load_bytes": rss_before,
        "peak_rss_bytes": peak_rss_bytes(),
        "configs": configs,
        "ttft_s": ttft_s,
    }


def _bench_transformers_subprocess(config: DecodeBenchConfig, vocab_size: int, num_threads: int, log: Progress) -> dict[str, Any]:
    """Run the transformers side in a fresh interpreter so its peak RSS is its own; errors become ``{"error"}``."""
    args = ["--side", "transformers", "--model", config.model, "--dtype", str(config.dtype)]
    args += ["--prompt-tokens", str(config.prompt_tokens), "--new-tokens", str(config.new_tokens)]
    args += ["--no-cache-new-tokens", str(config.no_cache_new_tokens), "--ttft-prompt-tokens", str(config.ttft_prompt_tokens)]
    args += ["--seed", str(config.seed), "--threads", str(num_threads), "--vocab-size", str(vocab_size)]
    args += ["--num-prefill-repeats", str(config.num_prefill_repeats)] + ([] if config.progress else ["--quiet"])
    code = "import sys; from kvgen.bench.decode import main; sys.exit(main())"
    return run_side("transformers", ["-c", code, *args], log, quiet=not config.progress)


def _bench_llama_cpp(config: DecodeBenchConfig, vocab_size: int, num_threads: int, log: Progress) -> dict[str, Any]:
    """llama-cpp-python on the same GGUF, prompt ids and thread count, in its own torch-free process."""
    from kvgen.loader import resolve_model_path

    path = resolve_model_path(config.model)
    if path.is_dir():
        return {"skipped": "llama.cpp reads GGUF files; the model is a Hugging Face directory"}
    request = {
        "model_path": str(path),
        "num_threads": num_threads,
        "prompt_ids": seeded_prompt_ids(config.prompt_tokens, vocab_size, config.seed)[0].tolist(),
        "ttft_prompt_ids": seeded_prompt_ids(config.ttft_prompt_tokens, vocab_size, config.seed)[0].tolist(),
        "new_tokens": config.new_tokens,
        "num_prefill_repeats": config.num_prefill_repeats,
    }
    result = run_llama_cpp("decode", request, log, quiet=not config.progress)
    rep = result.get("configs", {}).get("kv_cache", {})
    if rep:
        log(f"llama.cpp: prefill {_num(rep['prefill_tokens_per_s'], '.1f')} tokens/s, decode {_num(rep['decode_tokens_per_s'], '.2f')} tokens/s")
    return result


RATIO_NOTE = (
    "kvgen over peer: > 1 is kvgen better for *_tokens_per_s and ttft_speedup (peer ttft_s / kvgen ttft_s); "
    "*_kvgen_over_peer < 1 is kvgen better (load seconds, peak RSS bytes). Against llama.cpp every kvgen cache kind "
    "is compared with its one configuration (kv_cache); prefill compares kvgen's static cache"
)


def compare(ours: dict[str, Any], theirs: dict[str, Any], their_config: str | None = None) -> dict[str, Any]:
    """Ratios kvgen / peer per comparable figure (see ``RATIO_NOTE``; None where a side is missing).

    ``their_config``: None compares each cache kind with the peer's same kind (transformers);
    a name compares every kvgen cache kind with that one peer configuration (llama.cpp).
    """

    def fig(side: dict[str, Any], cache: str, key: str) -> float | None:
        return side.get("configs", {}).get(cache, {}).get(key)

    kinds = CACHE_KINDS if their_config is None else ("dynamic", "static")
    ratios: dict[str, Any] = {
        "prefill_tokens_per_s": ratio(fig(ours, "static", "prefill_tokens_per_s"), fig(theirs, their_config or "static", "prefill_tokens_per_s")),
    }
    for key in ("decode_tokens_per_s", "decode_tokens_per_s_at_median_step"):
        for cache in kinds:
            ratios[f"{key}_{cache}"] = ratio(fig(ours, cache, key), fig(theirs, their_config or cache, key))
    their_best = max((v for c in theirs.get("configs", {}) if (v := fig(theirs, c, "decode_tokens_per_s")) is not None), default=None)
    ratios["decode_tokens_per_s_static_vs_their_best"] = ratio(fig(ours, "static", "decode_tokens_per_s"), their_best)
    ratios["ttft_speedup"] = ratio(theirs.get("ttft_s"), ours.get("ttft_s"))
    ratios["load_s_kvgen_over_peer"] = ratio(ours.get("load_s"), theirs.get("load_s"))
    ratios["peak_rss_kvgen_over_peer"] = ratio(ours.get("peak_rss_bytes"), theirs.get("peak_rss_bytes"))
    return ratios


def greedy_agreement(ours: dict[str, Any], theirs: dict[str, Any], cache: str = "dynamic", their_config: str | None = None) -> dict[str, Any]:
    """How many leading greedy tokens of the two engines agree (a sanity check that both ran the same model)."""
    a = ours.get("configs", {}).get(cache, {}).get("new_token_ids")
    b = theirs.get("configs", {}).get(their_config or cache, {}).get("new_token_ids")
    if a is None or b is None:
        return {"num_compared_tokens": 0, "num_leading_equal_tokens": None}
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return {
        "num_compared_tokens": min(len(a), len(b)),
        "num_leading_equal_tokens": n,
        "kvgen_first_new_token_ids": a[:16],
        "peer_first_new_token_ids": b[:16],
    }


def run_decode_bench(
    model: str = "default",
    dtype: str | None = None,
    prompt_tokens: int = 512,
    new_tokens: int = 128,
    include_transformers: bool = True,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Benchmark batch-1 prefill and greedy decode of kvgen, transformers and llama-cpp-python on one model.

    ``options`` are further :class:`DecodeBenchConfig` fields (``include_llama_cpp``,
    ``ttft_prompt_tokens``, ``no_cache_new_tokens``, ``seed``, ``num_threads``,
    ``num_prefill_repeats``). Returns a JSON-ready dict: ``env``, ``workload``, ``kvgen``,
    ``transformers``, ``llama_cpp`` (each peer may be ``{"skipped"|"error": ...}``),
    ``ratios`` (``vs_transformers``, ``vs_llama_cpp``) and ``greedy_agreement``; seconds in
    ``*_s``, speeds in ``*_tokens_per_s``, memory in ``*_bytes``. Progress goes to stderr.
    Raises ``ValueError`` for bad settings and the loader's errors for a bad model.
    """
    config = DecodeBenchConfig(model, dtype, prompt_tokens, new_tokens, include_transformers=include_transformers, progress=progress, **options)
    log = Progress(config.progress)
    num_threads = set_threads(config.num_threads)
    result: dict[str, Any] = {"schema": SCHEMA, "env": environment_info(), "workload": _workload(config, num_threads)}
    load = result["env"]["load_average_1m"]
    if load is not None and load > 0.5:
        log(f"warning: 1-minute load average is {load:.2f}; other processes share these cores, timings will be contended")
    ours = result["kvgen"] = _bench_kvgen(config, log)
    if not config.include_transformers:
        result["transformers"] = {"skipped": "include_transformers=False"}
    elif result["env"]["transformers_version"] is None:
        result["transformers"] = {"skipped": "transformers is not installed"}
    else:
        result["transformers"] = _bench_transformers_subprocess(config, ours["vocab_size"], num_threads, log)
    if config.include_llama_cpp:
        result["llama_cpp"] = _bench_llama_cpp(config, ours["vocab_size"], num_threads, log)
    else:
        result["llama_cpp"] = {"skipped": "include_llama_cpp=False"}
    hf, cpp = result["transformers"], result["llama_cpp"]
    result["ratios"] = {"note": RATIO_NOTE, "vs_transformers": compare(ours, hf), "vs_llama_cpp": compare(ours, cpp, "kv_cache")}
    result["greedy_agreement"] = {"vs_transformers": greedy_agreement(ours, hf), "vs_llama_cpp": greedy_agreement(ours, cpp, "static", "kv_cache")}
    for side in (ours, hf, cpp):  # token ids served the agreement checks; keep the report short
        for rep in side.get("configs", {}).values():
            rep.pop("new_token_ids", None)
    result["env"]["load_average_1m_at_end"] = load_average()
    log("done")
    return result


def _workload(config: DecodeBenchConfig, num_threads: int) -> dict[str, Any]:
    workload = asdict(config)
    workload.pop("progress")
    workload |= {
        "num_threads": num_threads,
        "transformers_dtype": str(peer_torch_dtype(str(config.dtype))).removeprefix("torch."),
        "batch_size": 1,
        "decoding": "greedy, EOS disabled (kvgen: eos_token_id=[]; transformers: min_new_tokens=max_new_tokens; "
        "llama.cpp: top_k=1, its generate never stops, cut at new_tokens)",
        "prompt": f"{config.prompt_tokens} token ids uniform over [0, vocab_size) from torch.Generator().manual_seed({config.seed}), "
        "the same ids for every engine",
        "no_cache_note": f"no-cache runs generate {config.no_cache_new_tokens} tokens instead of {config.new_tokens} (O(n^2) per sequence)",
        "timing": "wall clock; prefill_s = median of 1-token runs; decode_s = total_s - prefill_s; "
        "decode_tokens_per_s = (num_new_tokens - 1) / decode_s; decode_step_s_* = gaps between streamed tokens "
        "(decode_tokens_per_s_at_median_step = 1 / median gap, robust to outliers); one untimed 2-token warm-up per configuration; "
        f"ttft_s = median 1-token generation of a {config.ttft_prompt_tokens}-token prompt (kvgen: static cache; transformers: dynamic)",
        "peak_rss_note": "VmHWM of each process: kvgen in the calling process, transformers and llama.cpp (no torch) each in its own subprocess",
    }
    return workload


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def format_decode_report(result: dict[str, Any]) -> str:
    """A human table of ``run_decode_bench``'s result (speeds in tokens/s, memory in MiB)."""
    env, work = result["env"], result["workload"]
    sides = (result["kvgen"], result.get("transformers", {}), result.get("llama_cpp", {}))
    vs = (result.get("ratios", {}).get("vs_transformers", {}), result.get("ratios", {}).get("vs_llama_cpp", {}))
    lines = [
        f"decode bench: {work['model']} ({work['dtype']}), prompt {work['prompt_tokens']} tokens, "
        f"{work['new_tokens']} new tokens (no cache: {work['no_cache_new_tokens']}), batch 1, greedy, {work['num_threads']} threads",
        f"torch {env['torch_version']}, transformers {env['transformers_version']}, {env['processor']}, {env['platform']}",
    ]
    for name, side in zip(("transformers", "llama.cpp"), sides[1:]):
        if "skipped" in side or "error" in side:
            lines.append(f"{name}: {side.get('skipped') or side.get('error')}")
    lines += ["", f"{'':28}{'kvgen':>10}{'transformers':>14}{'llama.cpp':>11}{'kvgen/hf':>10}{'kvgen/cpp':>11}"]

    def row(label: str, key: str, ratio_key: str, fmt: str, cache: str | None = None, scale: float = 1.0) -> None:
        values = []
        for side, cfg in zip(sides, (cache, cache, None if cache == "no_cache" else "kv_cache")):
            v = side.get("configs", {}).get(cfg, {}).get(key) if cache else side.get(key)
            values.append(_num(v / scale if v is not None else None, fmt))
        r = [_num(x.get(ratio_key), ".2f") for x in vs]
        lines.append(f"{label:28}{values[0]:>10}{values[1]:>14}{values[2]:>11}{r[0]:>10}{r[1]:>11}")

    row("load (s)", "load_s", "load_s_kvgen_over_peer", ".2f")
    row("peak RSS (MiB)", "peak_rss_bytes", "peak_rss_kvgen_over_peer", ".0f", scale=1 << 20)
    row("TTFT (s; ratio: speedup)", "ttft_s", "ttft_speedup", ".3f")
    row("prefill static (tokens/s)", "prefill_tokens_per_s", "prefill_tokens_per_s", ".1f", "static")
    for cache in CACHE_KINDS:
        row(f"decode {cache} (tokens/s)", "decode_tokens_per_s", f"decode_tokens_per_s_{cache}", ".2f", cache)
    for side_name, side in zip(("kvgen", "transformers", "llama.cpp"), sides):
        for cache, rep in side.get("configs", {}).items():
            if "error" in rep:
                lines.append(f"{side_name} {cache}: {rep['error']}")
    for peer, agree in result.get("greedy_agreement", {}).items():
        if agree.get("num_compared_tokens"):
            lines.append(f"greedy tokens {peer}: first {agree['num_leading_equal_tokens']} of {agree['num_compared_tokens']} equal")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvgen.bench.decode``: the bench, or with ``--side transformers`` its transformers half."""
    parser = argparse.ArgumentParser(prog="python -m kvgen.bench.decode", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-cache-new-tokens", type=int, default=16)
    parser.add_argument("--ttft-prompt-tokens", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", "--num-threads", dest="num_threads", type=int, default=None)
    parser.add_argument("--num-prefill-repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt id range (default: the model's vocabulary)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--side", choices=["transformers"], default=None, help="time only that peer (used by the subprocess)")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = parser.parse_args(argv)
    config = DecodeBenchConfig(
        a.model, a.dtype, a.prompt_tokens, a.new_tokens, a.no_cache_new_tokens, include_transformers=not a.no_transformers,
        include_llama_cpp=not a.no_llama_cpp, ttft_prompt_tokens=a.ttft_prompt_tokens, seed=a.seed, num_threads=a.num_threads,
        num_prefill_repeats=a.num_prefill_repeats, progress=not a.quiet,
    )
    if a.side:
        set_threads(config.num_threads)
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
            result = _bench_transformers_here(config, a.vocab_size, Progress(config.progress, "[bench:transformers]"))
    else:
        result = run_decode_bench(**asdict(config))
    print(json.dumps(result, indent=2) if a.json or a.side else format_decode_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
