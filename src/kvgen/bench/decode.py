"""``kvgen bench decode``: batch-1 greedy prefill and decode speed per cache kind, kvgen vs transformers and
llama.cpp (subprocesses), timed by ``peers.time_generation``; ``ttft_s``; ms per decode step in and outside
linear layers; Q4_1 kernel vs dense float32 per M."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch.profiler import ProfilerActivity, profile

from kvgen.bench import BenchConfig, BenchReport, peers
from kvgen.bench import harness as h
from kvgen.bench.workloads import seeded_prompt_ids
from kvgen.fields import config_field as _f
from kvgen.generation.runner import make_cache
from kvgen.kernels import get_ops, kernel_isa, pack_gguf_rows
from kvgen.loader import DTYPES, load_model, resolve_model_path
from kvgen.models import CausalLM

CACHE_KINDS = ("no_cache", "dynamic", "static")
SIDES = ("kvgen", "transformers", "llama_cpp")  # the columns of its text table (harness.render)
SCHEMA = "kvgen.bench.decode/2"


@dataclasses.dataclass
class DecodeBenchConfig(BenchConfig):
    """What ``run_decode_bench`` measures. Raises ``ValueError`` for out-of-range values."""

    prompt_tokens: int = _f(512, "prompt length in tokens (seeded random ids)", minimum=1)
    new_tokens: int = _f(128, "greedy tokens generated per timed run (EOS disabled)", minimum=2)  # a step after prefill
    no_cache_new_tokens: int = _f(16, "new tokens for the O(n^2) no-cache runs", minimum=2)
    include_transformers: bool = _f(True, "time transformers (subprocess)")
    include_llama_cpp: bool = _f(True, "time llama-cpp-python (subprocess)")
    ttft_prompt_tokens: int = _f(20, "prompt tokens of the time-to-first-token runs", minimum=1)
    seed: int = _f(0, "seed of the prompt's torch.Generator")
    num_prefill_repeats: int = _f(3, "prefill timings per configuration; the median is reported", minimum=1)

    def new_tokens_per_cache(self) -> dict[str, int]:
        """Tokens each cache kind generates: ``no_cache_new_tokens`` without a cache, else ``new_tokens``."""
        return {c: self.no_cache_new_tokens if c == "no_cache" else self.new_tokens for c in CACHE_KINDS}


def _time_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    return h.timed(lambda: [fn() for _ in range(repeats)])[1] / repeats * 1e6


@torch.inference_mode()
def step_breakdown(model: CausalLM, prompt_ids: torch.Tensor, num_steps: int = 32) -> dict[str, Any]:
    """prompt_ids [1, T] int64; ms per static-cache decode step: total (as run), in linear layers (profiled, layer
    by layer: the same linear ops outside the one-op decoder), outside = total - linear."""
    cache = make_cache(model, "static", 1, prompt_ids.shape[1] + 2 * num_steps + 2)
    model(prompt_ids, torch.arange(prompt_ids.shape[1])[None], cache)

    def step() -> None:
        model.compute_logits(model(torch.tensor([[1]]), torch.tensor([[cache.seq_length]]), cache)[:, -1])  # [1, V]

    step_ms = _time_us(step, num_steps) / 1e3
    model.one_op_decoder = False  # layer by layer (the same numbers): the profiler sees every linear op
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(num_steps):
                step()
    finally:
        model.one_op_decoder = True
    linear_ops = ("kvgen::qgemm", "aten::linear", "kvgen::moe_experts_row", "kvgen::linear_f64")  # a row's experts (GLUs inside), MoE routers
    linear_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in linear_ops)
    linear_ms = linear_us / num_steps / 1e3
    return {"context_tokens": prompt_ids.shape[1], "num_steps": num_steps, "step_ms": step_ms, "linear_ms": linear_ms,
            "outside_linear_ms": step_ms - linear_ms, "note": "linear_ms profiled layer by layer (overhead included)"}


@torch.inference_mode()
def qgemm_crossover(out_features: int = 3072, in_features: int = 576, ms: tuple[int, ...] = (1, 4, 16, 64, 256, 512)
                    ) -> dict[str, Any]:
    """µs per call of the Q4_1 kernel vs dense float32 ``F.linear`` on the dequantized weight [N, K], per M."""
    ops, q4_1 = get_ops(), GGMLQuantizationType.Q4_1
    raw = quantize(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).numpy(), q4_1)
    dense, (weight_type, packed) = torch.from_numpy(dequantize(raw, q4_1)), pack_gguf_rows("Q4_1", [torch.tensor(raw)])
    rows = []
    for m in ms:
        x = torch.randn(m, in_features)  # [M, K]
        q_us = _time_us(partial(ops.qgemm, x, packed, weight_type, out_features, None), max(3, 2000 // m))
        d_us = _time_us(partial(F.linear, x, dense), max(3, 2000 // m))
        rows.append({"m": m, "qgemm_us": q_us, "dense_fp32_us": d_us, "qgemm_speedup": d_us / q_us})
    crossover = next((r["m"] for r in rows if r["dense_fp32_us"] < r["qgemm_us"]), None)
    return {"shape": [out_features, in_features], "backend": ops.backend, "isa": kernel_isa(), "rows": rows,
            "crossover_m": crossover}


def _figure(side: h.Side, config: str, key: str = "decode_tokens_per_s") -> Any:
    return side.get("configs", {}).get(config, {}).get(key)


def compare(ours: h.Side, theirs: h.Side, their_config: str | None = None) -> dict[str, float | None]:
    """Ratios kvgen / peer (None where missing) per cache kind, or against the peer's one ``their_config``."""
    def vs(cache: str, key: str) -> float | None:
        return h.ratio(_figure(ours, cache, key), _figure(theirs, their_config or cache, key))

    per_cache = {f"{key}_{c}": vs(c, key) for key in ("decode_tokens_per_s", "decode_tokens_per_s_at_median_step")
                 for c in (CACHE_KINDS if their_config is None else CACHE_KINDS[1:])}
    best = max((v for c in theirs.get("configs", {}) if (v := _figure(theirs, c)) is not None), default=None)
    return {"prefill_tokens_per_s": vs("static", "prefill_tokens_per_s"), **per_cache,
            "decode_tokens_per_s_static_vs_their_best": h.ratio(_figure(ours, "static"), best),
            "ttft_speedup": h.ratio(theirs.get("ttft_s"), ours.get("ttft_s")),
            "load_s_kvgen_over_peer": h.ratio(ours.get("load_s"), theirs.get("load_s")),
            "peak_rss_kvgen_over_peer": h.ratio(ours.get("peak_rss_bytes"), theirs.get("peak_rss_bytes"))}


def greedy_agreement(ours: h.Side, theirs: h.Side, cache: str = "dynamic", their_config: str | None = None
                     ) -> dict[str, Any]:
    """How many leading greedy tokens of the two engines agree (a check that both ran the same model)."""
    a, b = _figure(ours, cache, "new_token_ids"), _figure(theirs, their_config or cache, "new_token_ids")
    if a is None or b is None:
        return {"num_compared_tokens": 0, "num_leading_equal_tokens": None}
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"num_compared_tokens": min(len(a), len(b)), "num_leading_equal_tokens": n,
            "kvgen_first_new_token_ids": a[:16], "peer_first_new_token_ids": b[:16]}


@dataclasses.dataclass
class DecodeReport(BenchReport):
    """``run_decode_bench``'s result: seconds in ``*_s``, speeds in ``*_tokens_per_s``, memory in ``*_bytes``."""

    kvgen: h.Side
    transformers: h.Side
    llama_cpp: h.Side
    ratios: dict[str, Any]
    greedy_agreement: dict[str, Any]


def run_decode_bench(config: DecodeBenchConfig) -> DecodeReport:
    """The bench (see the module docstring); a peer may report ``skipped`` or ``error``. Raises the loader's errors,
    and ``ValueError`` for a prompt that leaves no room for ``new_tokens`` in the model's context."""
    log, threads, env = h.start(config)
    rss_before = h.rss_bytes()
    log(f"kvgen: loading {config.model} ({config.dtype})")
    (model, _), load_s = h.timed(lambda: load_model(config.model, config.dtype, config.quantization))
    context = model.config.max_position_embeddings
    # every timed run would fail, then the breakdown run on; the no-cache runs' error sat in the report (exit 0)
    for name, new in (("prompt_tokens", "new_tokens"), ("prompt_tokens", "no_cache_new_tokens"),
                      ("ttft_prompt_tokens", "new_tokens")):
        if getattr(config, name) + getattr(config, new) > context:
            raise ValueError(f"{name} + {new} must be <= the model's context window ({context}), got "
                             f"{getattr(config, name)} + {getattr(config, new)}")
    vocab_size = model.config.vocab_size
    prompt_ids, ttft_ids = (seeded_prompt_ids(n, vocab_size, config.seed)  # [1, n]
                            for n in (config.prompt_tokens, config.ttft_prompt_tokens))
    request = {"dtype": config.dtype, "num_threads": threads, "prompt_ids": prompt_ids[0].tolist(),
               "ttft_prompt_ids": ttft_ids[0].tolist(), "num_prefill_repeats": config.num_prefill_repeats,
               "progress": config.progress}
    ours = peers.decode(peers.kvgen_system(model, load_s), request | {
        "new_tokens": config.new_tokens_per_cache(), "ttft_cache": "static"}, lambda m: log(f"kvgen: {m}"))
    ours |= {"model_path": str(resolve_model_path(config.model)), "vocab_size": vocab_size,
             "rss_before_load_bytes": rss_before, "peak_rss_bytes": h.peak_rss_bytes()}  # before the diagnostics
    log("kvgen: decode step breakdown and kernel crossover")
    ours |= {"step_breakdown": step_breakdown(model, prompt_ids), "qgemm_crossover": qgemm_crossover()}
    hf, cpp = (h.peer_side(peer, "decode", on, config.model, log, request | {"new_tokens": n}) for peer, on, n in (
        ("transformers", config.include_transformers, config.new_tokens_per_cache()),
        ("llama_cpp", config.include_llama_cpp, {"kv_cache": config.new_tokens})))
    ratios = {"note": "> 1: kvgen better, except *_kvgen_over_peer; llama.cpp: its one kv_cache configuration",
              "vs_transformers": compare(ours, hf), "vs_llama_cpp": compare(ours, cpp, "kv_cache")}
    agreement = {"vs_transformers": greedy_agreement(ours, hf),
                 "vs_llama_cpp": greedy_agreement(ours, cpp, "static", "kv_cache")}
    workload = {k: v for k, v in dataclasses.asdict(config).items() if k != "progress"} | {
        "num_threads": threads, "batch_size": 1,
        "transformers_dtype": str(DTYPES.get(str(config.dtype), torch.float32)).removeprefix("torch."),
        "decoding": "greedy, EOS disabled", "prompt": f"seeded uniform ids (seed {config.seed}), same for all",
        "no_cache_note": f"no-cache runs generate {config.no_cache_new_tokens} tokens",
        "timing": "prefill_s: median 1-token run; decode_s: first to last streamed token; steps: their gaps",
        "peak_rss_note": "VmHWM of each process after its generation runs (kvgen: before its diagnostics)"}
    for rep in (rep for side in (ours, hf, cpp) for rep in side.get("configs", {}).values()):
        rep.pop("new_token_ids", None)  # they served the agreement checks
    env["load_average_1m_at_end"] = h.load_average()
    return DecodeReport(schema=SCHEMA, env=env, workload=workload, kvgen=ours, transformers=hf, llama_cpp=cpp,
                        ratios=ratios, greedy_agreement=agreement)
