"""Perplexity of a model on a token stream, over non-overlapping windows."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvgen.config import check_token_id_range
from kvgen.tokenizer.special_tokens import integer_ids

if TYPE_CHECKING:
    from kvgen.models import CausalLM


_MAX_EXP_ARG = math.log(sys.float_info.max)  # ~709.78


@dataclass
class PerplexityResult:
    """exp(mean NLL) over every scored token; NLL in nats."""

    perplexity: float
    mean_nll: float
    num_tokens_scored: int
    num_windows: int


def windows(token_ids: list[int], context_length: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``context_length`` tokens (the last may be shorter; 1-token tails dropped)."""
    if isinstance(context_length, bool) or not isinstance(context_length, numbers.Integral):
        raise ValueError(f"context_length must be an int, got {context_length!r}")
    if context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {context_length}")
    chunks = [token_ids[i : i + context_length] for i in range(0, len(token_ids), context_length)]
    return [c for c in chunks if len(c) >= 2]


@torch.inference_mode()
def window_nll(model: CausalLM, window: list[int]) -> float:
    """Summed NLL (nats) of tokens 2..n of ``window`` given the earlier ones.

    The forward fills a static KV cache of the window's length, as a prefill does (in chunks on the kernels:
    ``chunked_forward``): the quantized path then runs its one-op decoder and fused cache attention (a 512-token
    window of the default model 521 -> 458 ms), where a forward without a cache goes layer by layer; the NLL is the
    same to the bit (checked on the default model, auto and float32).
    """
    from kvgen.generation.runner import chunked_forward, make_cache

    ids = torch.tensor([window])  # [1, T]
    positions = torch.arange(len(window))[None]  # [1, T]
    hidden = chunked_forward(model, ids, positions, make_cache(model, "static", 1, len(window)), None)  # [1, T, C]
    logits = model.compute_logits(hidden[0, :-1])  # [T-1, V]
    return float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))


def perplexity(
    model: CausalLM,
    token_ids: list[int],
    context_length: int = 512,
    progress: Callable[[list[list[int]]], Iterable[list[int]]] | None = None,
) -> PerplexityResult:
    """Score ``token_ids`` window by window (see :func:`windows`).

    Raises ``ValueError`` when fewer than 2 tokens are given, an id is outside the model's vocabulary, or
    ``context_length`` is not an int in [2, the model's context window]. ``progress`` wraps the window list (e.g. tqdm).
    """
    token_ids = integer_ids(token_ids)
    # else the embedding lookup raises IndexError (float path) or RuntimeError (kernels)
    check_token_id_range("token_ids", token_ids, model.config.vocab_size, ValueError)
    max_ctx = model.config.max_position_embeddings
    chunks = windows(token_ids, context_length)  # checks context_length's type first
    if context_length > max_ctx:
        raise ValueError(f"context_length must be <= the model's context window ({max_ctx}), got {context_length}")
    if not chunks:
        raise ValueError(f"need at least 2 tokens to compute perplexity, got {len(token_ids)}")
    total_nll, total_tokens = 0.0, 0
    for chunk in progress(chunks) if progress else chunks:
        total_nll += window_nll(model, chunk)
        total_tokens += len(chunk) - 1
    mean = total_nll / total_tokens
    # math.exp raises OverflowError past ~709.78 nats (a degenerate model); torch.exp, the reference, gives inf
    return PerplexityResult(math.exp(mean) if mean < _MAX_EXP_ARG else math.inf, mean, total_tokens, len(chunks))
