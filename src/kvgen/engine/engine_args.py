"""``EngineArgs``: how an ``LLMEngine`` is built (vLLM names), validated once.

Sizes are in tokens, ``kv_cache_memory`` in bytes. Each field's ``help`` metadata
is there for the CLI to generate flags from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvgen.engine.block_manager import DEFAULT_BLOCK_SIZE
from kvgen.engine.generation_defaults import GENERATION_CONFIG_MODES, parse_override
from kvgen.engine.pooling import check_pooling_type
from kvgen.engine.scheduler import SchedulingPolicy
from kvgen.engine.spec_decode import SpeculativeConfig
from kvgen.fields import check_int, config_field
from kvgen.models import check_kv_cache_dtype
from kvgen.sampling.params import SEED_MAX, SEED_MIN

SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)  # "fcfs", "priority"
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes, when neither num_blocks nor kv_cache_memory is given

_f = config_field
# vLLM's other names of the dtypes (`--dtype half`, `--dtype float`)
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


@dataclass
class EngineArgs:
    """Engine settings. Raises ``ValueError`` naming the field and the value, or both
    fields of a contradictory pair (``num_blocks`` with ``kv_cache_memory``).
    """

    model: str = _f("default", "model: 'default', a .gguf file, a Hugging Face directory or a cached repo id",
                    flags=("--model", "-m"))  # -m: llama-server's, and kvgen generate's
    dtype: str = _f("auto", "weights: auto (a quantized GGUF runs from its blocks, fp16 KV cache), float32 (float), "
                            "bfloat16 or float16 (half)")
    quantization: str | None = _f(None, "encode a checkpoint's float matrices at load for the kernels: q8_0, q5_1, "
                                        "q5_0, q4_1 or q4_0 (llama.cpp's types; dtype auto only)")
    block_size: int = _f(DEFAULT_BLOCK_SIZE, "tokens per KV-cache block")
    num_blocks: int | None = _f(None, "KV-cache blocks in the pool (vLLM num_gpu_blocks); exclusive with kv_cache_memory")
    kv_cache_memory: int | None = _f(None, "KV-cache pool size in bytes (default 1 GiB when num_blocks is unset)",
                                     human_readable=True)
    kv_cache_dtype: str = _f("auto", "KV-cache storage: 'auto' (the model's: float16 on the kernels) or 'int8' (int8 "
                                     "values and a float32 scale per token and KV head: 1.9x the tokens in the same "
                                     "kv_cache_memory at head_dim 64; dtype auto only)")
    max_num_seqs: int = _f(64, "most requests running in one step")
    max_num_batched_tokens: int = _f(512, "most tokens (prefill chunks + decodes) in one step", human_readable=True)
    max_model_len: int | None = _f(None, "longest prompt + output in tokens (default: the model's context; 32k = "
                                         "32,000, 32K = 32,768, as vLLM)", human_readable=True)
    long_prefill_token_threshold: int | None = _f(
        None, "most prompt tokens one request prefills per step (None = up to the token budget); smaller keeps the "
        "other requests' decode steps short while a long prompt comes in")
    enable_prefix_caching: bool = _f(True, "reuse KV blocks of identical prompt prefixes")
    seed: int = _f(0, "seed of the RNG that seeds requests without their own seed")
    max_logprobs: int = _f(20, "largest SamplingParams.logprobs accepted; -1: the vocabulary size")
    scheduling_policy: str = _f("fcfs", "which waiting request runs first: 'fcfs' (arrival order) or 'priority' (the "
                                        "lowest request priority, then arrival; the least important is preempted)")
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = _f(
        None, 'n-gram speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (drafts copied from the prompt and output; greedy and seeded tokens unchanged)')
    generation_config: str = _f("auto", "sampling defaults for requests that leave them unset: 'auto' (the model "
                                        "directory's generation_config.json), 'vllm' (vLLM's own) or a directory")
    pooling_type: str | None = _f(None, "embeddings (LLM.embed, /v1/embeddings): pool the prompt's hidden states by "
                                        "'last', 'mean' or 'cls' (default: the model's own, else 'last')")
    override_generation_config: dict[str, Any] | str | None = _f(
        None, 'JSON object of sampling defaults over the generation config\'s, e.g. \'{"temperature": 0.5}\' '
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)")

    def __post_init__(self) -> None:
        from kvgen.loader import AUTO, DTYPES, check_load_options

        if isinstance(self.dtype, torch.dtype):  # vLLM's dtype takes a torch.dtype too
            self.dtype = next((name for name, dtype in DTYPES.items() if dtype == self.dtype), str(self.dtype))
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be one of {AUTO}, {', '.join(DTYPES)} or a torch.dtype, got {self.dtype!r}")
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        check_load_options(self.dtype, self.quantization)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name), 1)
        for name in ("num_blocks", "kv_cache_memory", "max_model_len", "long_prefill_token_threshold"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("max_logprobs", self.max_logprobs, -1)
        check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                f"num_blocks={self.num_blocks} conflicts with kv_cache_memory={self.kv_cache_memory}: give one pool size"
            )
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.generation_config, str) or (
                self.generation_config not in GENERATION_CONFIG_MODES
                and not Path(self.generation_config).expanduser().is_dir()):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        self.override_generation_config = parse_override(self.override_generation_config) or None
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype == "int8" and self.dtype != AUTO:
            raise ValueError(f"kv_cache_dtype='int8' needs dtype 'auto' (the kernels), got {self.dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if self.pooling_type is not None:
            check_pooling_type(self.pooling_type)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")

