"""``kvgen bench perplexity``: kvgen's default dtype vs ``float32`` vs llama.cpp on the same token ids (kvgen's
tokenizer), non-overlapping windows each scored alone from position 0; perplexity = exp(mean NLL in nats)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from typing import Any

from kvgen.bench import BenchConfig, BenchReport
from kvgen.bench import harness as h
from kvgen.bench.workloads import DEFAULT_TEXT, read_text
from kvgen.fields import config_field as _f
from kvgen.loader import load_model
from kvgen.perplexity import perplexity, windows

SCHEMA = "kvgen.bench.perplexity/1"
SIDES = ("kvgen_default", "kvgen_float32", "llama_cpp")  # the columns of its text table (harness.render)


@dataclasses.dataclass
class PerplexityBenchConfig(BenchConfig):
    """What ``run_perplexity_bench`` measures: ``context_length`` below 2 and an empty ``file`` are refused here,
    before any model loads; a ``context_length`` over the model's context window by ``kvgen.perplexity``."""

    file: str | None = _f(None, f"UTF-8 text (default: {DEFAULT_TEXT})")
    context_length: int = _f(512, "tokens per non-overlapping window", minimum=2)
    include_llama_cpp: bool = _f(True, "score with llama-cpp-python")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.file == "":  # it scored the default text, reported as not the default
            raise ValueError("file must not be empty, got ''")


def _kvgen_side(config: PerplexityBenchConfig, dtype: str, quantization: str | None, text: str, log: h.Progress
                ) -> tuple[h.Side, list[int]]:
    log(f"kvgen ({dtype}): loading {config.model}")
    (llm, tokenizer), load_s = h.timed(lambda: load_model(config.model, dtype, quantization))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    result, score_s = h.timed(lambda: perplexity(llm, token_ids, config.context_length))
    log(f"kvgen ({dtype}): perplexity {result.perplexity:.4f} of {len(token_ids)} tokens in {score_s:.1f} s")
    side = {"dtype": dtype, "quantization": quantization, **dataclasses.asdict(result)}
    return side | {"load_s": load_s, "score_s": score_s}, token_ids


def relative_differences(sides: dict[str, h.Side]) -> dict[str, float | None]:
    """``a_vs_b = ppl(a) / ppl(b) - 1`` for each ordered pair of sides with a perplexity (0.01: 1 % higher)."""
    with_ppl = [(n, s["perplexity"]) for n, s in sides.items() if "perplexity" in s]
    return {f"{a}_vs_{b}": pa / pb - 1 for (a, pa), (b, pb) in itertools.combinations(with_ppl, 2)}


@dataclasses.dataclass
class PerplexityReport(BenchReport):
    """``run_perplexity_bench``'s result; each side has ``perplexity``, ``mean_nll`` (nats), counts and seconds."""

    kvgen_default: h.Side
    kvgen_float32: h.Side
    llama_cpp: h.Side
    text: dict[str, Any]
    relative_differences: dict[str, float | None]


def run_perplexity_bench(config: PerplexityBenchConfig) -> PerplexityReport:
    """The bench (see the module docstring). ``ValueError``: unreadable text, bad ``context_length``, too few tokens."""
    log, threads, env = h.start(config, "[bench:perplexity]")
    path, text = read_text(config.file)
    default, token_ids = _kvgen_side(config, config.dtype, config.quantization, text, log)
    float32 = default if config.dtype == "float32" else _kvgen_side(config, "float32", None, text, log)[0]
    request = {"num_threads": threads, "context_length": config.context_length,
               "windows": windows(token_ids, config.context_length)}
    cpp = h.peer_side("llama_cpp", "perplexity", config.include_llama_cpp, config.model, log, request)
    if "total_nll" in cpp:
        cpp["mean_nll"] = cpp["total_nll"] / cpp["num_tokens_scored"]
        cpp["perplexity"] = math.exp(cpp["mean_nll"])
    text_info = {"path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(), "num_chars": len(text),
                 "num_tokens": len(token_ids), "is_default_text": config.file is None}
    workload = {"model": config.model, "default_dtype": config.dtype, "context_length": config.context_length,
                "num_threads": threads, "windows": "non-overlapping, each from position 0"}
    differences = relative_differences({"default": default, "float32": float32, "llama_cpp": cpp})
    return PerplexityReport(schema=SCHEMA, env=env, workload=workload, kvgen_default=default, kvgen_float32=float32,
                            llama_cpp=cpp, text=text_info, relative_differences=differences)
