"""``kvgen bench perplexity``: kvgen's default path vs ``float32`` vs llama.cpp on the same token ids.

Text: ``file``, else ``workloads.DEFAULT_TEXT``, tokenized once by kvgen's tokenizer (no
special tokens) and cut into non-overlapping ``context_length``-token windows
(:func:`kvgen.perplexity.windows`), each scored alone from position 0. kvgen scores them
with :func:`kvgen.perplexity.perplexity` at its default dtype and at ``float32``;
llama-cpp-python (``bench/peers.py``) returns its logits' summed NLL in float64.
Perplexity = exp(mean NLL in nats) over the same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from kvgen.bench.harness import (
    Progress,
    Side,
    default_dtype,
    environment_info,
    ratio,
    run_peer,
    set_threads,
    timed,
)
from kvgen.bench.workloads import DEFAULT_TEXT, read_text
from kvgen.fields import config_field as _f

SCHEMA = "kvgen.bench.perplexity/1"


@dataclass
class PerplexityBenchConfig:
    """What ``run_perplexity_bench`` measures (``context_length`` is checked by ``kvgen.perplexity``)."""

    model: str = _f("default", "a .gguf file, a Hugging Face directory or 'default' (SmolLM2-135M-Instruct)")
    dtype: str | None = _f(None, "kvgen's dtype, as load_model takes it (default: load_model's default)")
    file: str | None = _f(None, f"UTF-8 text (default: {DEFAULT_TEXT})")
    context_length: int = _f(512, "tokens per non-overlapping window")
    include_llama_cpp: bool = _f(True, "score with llama-cpp-python")
    num_threads: int | None = _f(None, "threads of every engine (default: physical cores)", flags=("--threads", "--num-threads"))
    progress: bool = _f(True, "progress lines on stderr", cli=False)


def _kvgen_side(model: str, dtype: str, text: str, context_length: int, log: Progress) -> tuple[Side, list[int]]:
    """Load kvgen at ``dtype``, tokenize ``text`` and score it; the report and the token ids."""
    from kvgen.loader import load_model
    from kvgen.perplexity import perplexity

    log(f"kvgen ({dtype}): loading {model}")
    (llm, tokenizer), load_s = timed(lambda: load_model(model, dtype=dtype))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    log(f"kvgen ({dtype}): scoring {len(token_ids)} tokens in {context_length}-token windows")
    result, score_s = timed(lambda: perplexity(llm, token_ids, context_length))
    log(f"kvgen ({dtype}): perplexity {result.perplexity:.4f} in {score_s:.1f} s")
    return {"dtype": dtype, **dataclasses.asdict(result), "load_s": load_s, "score_s": score_s}, token_ids


def _llama_cpp_side(model: str, token_ids: list[int], context_length: int, num_threads: int, log: Progress) -> Side:
    from kvgen.loader import resolve_model_path
    from kvgen.perplexity import windows

    path = resolve_model_path(model)
    if path.is_dir():
        return {"skipped": "llama.cpp reads GGUF files; the model is a Hugging Face directory"}
    request = {"model_path": str(path), "num_threads": num_threads, "context_length": context_length,
               "windows": windows(token_ids, context_length)}
    side = run_peer("llama_cpp", "perplexity", request, log)
    if "total_nll" in side:
        side["mean_nll"] = side["total_nll"] / side["num_tokens_scored"]
        side["perplexity"] = math.exp(side["mean_nll"])
        log(f"llama.cpp: perplexity {side['perplexity']:.4f}")
    return side


def relative_differences(sides: dict[str, Side]) -> dict[str, float | None]:
    """``a_vs_b = ppl(a) / ppl(b) - 1`` for each ordered pair of sides that has a perplexity (0.01 = 1 % higher)."""
    names = [n for n, s in sides.items() if "perplexity" in s]
    out: dict[str, float | None] = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            r = ratio(sides[a]["perplexity"], sides[b]["perplexity"])
            out[f"{a}_vs_{b}"] = r - 1 if r is not None else None
    return out


@dataclass
class PerplexityReport:
    """``run_perplexity_bench``'s result; each side has ``perplexity``, ``mean_nll`` (nats), counts and seconds."""

    schema: str
    env: dict[str, Any]
    kvgen_default: Side
    kvgen_float32: Side
    llama_cpp: Side
    text: dict[str, Any]
    workload: dict[str, Any]
    relative_differences: dict[str, float | None]


def run_perplexity_bench(config: PerplexityBenchConfig) -> PerplexityReport:
    """Perplexity of kvgen at its default dtype, at ``float32`` and of llama-cpp-python on the same windows.

    Raises ``ValueError`` for an unreadable text, ``context_length`` out of range or too few tokens.
    """
    log = Progress(config.progress, "[bench:perplexity]")
    threads, dtype = set_threads(config.num_threads), config.dtype or default_dtype()
    path, text = read_text(config.file)
    env = environment_info()
    default, token_ids = _kvgen_side(config.model, dtype, text, config.context_length, log)
    float32 = default if dtype == "float32" else _kvgen_side(config.model, "float32", text, config.context_length, log)[0]
    cpp = (_llama_cpp_side(config.model, token_ids, config.context_length, threads, log) if config.include_llama_cpp
           else {"skipped": "include_llama_cpp=False"})
    text_info = {"path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(), "num_chars": len(text),
                 "num_tokens": len(token_ids), "is_default_text": config.file is None}
    workload = {"model": config.model, "default_dtype": dtype, "context_length": config.context_length, "num_threads": threads,
                "windows": "non-overlapping, each scored alone from position 0; kvgen's tokenizer, no special tokens"}
    log("done")
    differences = relative_differences({"default": default, "float32": float32, "llama_cpp": cpp})
    return PerplexityReport(SCHEMA, env, default, float32, cpp, text_info, workload, differences)


def format_perplexity_report(result: dict[str, Any]) -> str:
    """A human summary of ``run_perplexity_bench``'s JSON result."""
    t, w = result["text"], result["workload"]
    lines = [f"perplexity bench: {t['path']} ({t['num_tokens']} tokens), {w['model']}, {w['context_length']}-token windows"]
    for name in ("kvgen_default", "kvgen_float32", "llama_cpp"):
        side = result[name]
        label = f"{name} ({side['dtype']})" if "dtype" in side else name
        value = f"{side['perplexity']:.4f}" if "perplexity" in side else side.get("skipped") or side.get("error")
        lines.append(f"{label:28}{value}")
    lines += [f"{k}: {v:+.3%}" for k, v in result["relative_differences"].items() if v is not None]
    return "\n".join(lines)
