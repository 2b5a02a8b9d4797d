"""SynthID text watermarking: tournament sampling's score update (Dathathri et al. 2024, "Scalable watermarking for
identifying large language model outputs", Nature 634).

Each step, every candidate token gets ``depth = len(keys)`` pseudo-random bits g (a table lookup of a hash of the
last ``ngram_len - 1`` tokens, the candidate and one key), and the distribution is reshaped layer by layer:
p <- p * (1 + g - E_p[g]), so tokens with more 1 bits gain mass while the distribution stays normalized. A context
seen in the last ``context_history_size`` steps of the row is left unwatermarked. The scores become the
log-probabilities of the reshaped distribution, to sample from.
Source: transformers 4.55 ``SynthIDTextWatermarkingConfig`` / ``SynthIDTextWatermarkLogitsProcessor`` /
``SynthIDTextWatermarkState``, which this must agree with bit for bit, quirks included: the context starts as
``ngram_len - 1`` zeros (not the prompt's tokens) and takes each new token from the second call on, and the state
follows row positions (beam reordering does not move it). Detection needs a trained Bayesian detector
(transformers' ``BayesianDetectorModel``), which kvgen does not ship.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_HASH_MULTIPLIER = 6364136223846793005  # newlib / musl linear congruential generator
_HASH_INCREMENT = 1
_MAX_TABLE_SIZE = 2**24


@dataclass(frozen=True)
class SynthIDTextWatermarkingConfig:
    """transformers ``SynthIDTextWatermarkingConfig``: n-gram length (the context is ``ngram_len - 1`` tokens), the
    watermarking keys (one tournament layer each), the sampling table (``sampling_table_size`` bits from
    ``torch.Generator(sampling_table_seed)``), the context history length in steps, whether the first
    ``ngram_len - 1`` steps are left alone, and ``debug_mode`` (scores replaced by ones first). Raises
    ``ValueError`` naming a bad field."""

    ngram_len: int
    keys: tuple[int, ...]
    context_history_size: int = 1024
    sampling_table_seed: int = 0
    sampling_table_size: int = 2**16
    skip_first_ngram_calls: bool = False
    debug_mode: bool = False

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("ngram_len", "context_history_size", "sampling_table_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"watermarking_config {name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.sampling_table_size > _MAX_TABLE_SIZE:
            raise ValueError(f"watermarking_config sampling_table_size must be <= 2**24, got {self.sampling_table_size}")
        if not is_int(self.sampling_table_seed):
            raise ValueError(f"watermarking_config sampling_table_seed must be an int, got {self.sampling_table_seed!r}")
        keys = self.keys
        if not isinstance(keys, (list, tuple)) or not keys or not all(is_int(k) and -2**63 <= k < 2**63 for k in keys):
            raise ValueError(f"watermarking_config keys must be a non-empty list of int64 values, got {keys!r}")
        object.__setattr__(self, "keys", tuple(keys))
        for name in ("skip_first_ngram_calls", "debug_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"watermarking_config {name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, value: Any) -> SynthIDTextWatermarkingConfig:
        """A config from itself, a dict of its fields or transformers' config. Raises ``ValueError`` for unknown keys
        or a missing ``ngram_len`` / ``keys``."""
        if isinstance(value, cls):
            return value
        fields = value if isinstance(value, dict) else getattr(value, "__dict__", {})
        names = set(cls.__dataclass_fields__)
        if isinstance(value, dict) and (unknown := sorted(set(fields) - names)):
            raise ValueError(f"unknown SynthID watermarking_config key(s) {unknown}: expected some of {sorted(names)}")
        if "ngram_len" not in fields or "keys" not in fields:
            raise ValueError("SynthID watermarking_config needs ngram_len and keys")
        return cls(**{k: v for k, v in fields.items() if k in names})


def accumulate_hash(current: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """The hash current [...] int64 extended by each value of data [..., n] int64 in turn: h = (h + x) * a + 1,
    wrapping at 64 bits (transformers' ``accumulate_hash``)."""
    for i in range(data.shape[-1]):
        current = (current + data[..., i]) * _HASH_MULTIPLIER + _HASH_INCREMENT
    return current


class SynthIDTextWatermarkLogitsProcessor:
    """The SynthID score update: ``(token_ids [B, T], scores [B, V]) -> [B, V]`` float32 log-probabilities.

    Stateful over one generation (each row's last ``ngram_len - 1`` tokens and context-hash history): make one per
    ``generate()`` call, as ``build_logits_processors`` does.
    """

    def __init__(self, config: SynthIDTextWatermarkingConfig) -> None:
        self.config = config
        generator = torch.Generator().manual_seed(config.sampling_table_seed)
        self.sampling_table = torch.randint(0, 2, (config.sampling_table_size,), generator=generator)  # [size] int64
        self.keys = torch.tensor(config.keys, dtype=torch.long)  # [depth]
        self.context: torch.Tensor | None = None  # [B, ngram_len - 1] int64
        self.context_history = torch.empty(0, dtype=torch.long)  # [B, context_history_size] int64
        self.num_calls = 0

    def g_values(self, context_hash: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The bits g [B, V, depth] int64 of every candidate token after contexts hashed to context_hash [B]."""
        candidates = accumulate_hash(context_hash[:, None], torch.arange(vocab_size)[None, :, None])  # [B, V]
        keys = accumulate_hash(candidates[:, :, None], self.keys[None, None, :, None])  # [B, V, depth]
        return self.sampling_table[keys % self.config.sampling_table_size]  # [B, V, depth]

    @staticmethod
    def update_scores(scores: torch.Tensor, g_values: torch.Tensor) -> torch.Tensor:
        """Tournament layers over softmax(scores) [B, V] with bits g_values [B, V, depth]; log-probabilities [B, V]
        (the float32 minimum where a probability is 0)."""
        probs = torch.softmax(scores, dim=1)  # [B, V]
        for i in range(g_values.shape[2]):
            g = g_values[:, :, i]  # [B, V]
            probs = probs * (1 + g - (g * probs).sum(dim=1, keepdim=True))
        log_probs = torch.log(probs)
        return torch.where(torch.isfinite(log_probs), log_probs, torch.finfo(log_probs.dtype).min)

    def __call__(self, token_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cfg, (batch, vocab) = self.config, scores.shape
        if cfg.debug_mode:
            scores = torch.ones_like(scores)
        if self.context is None:
            self.context = torch.zeros(batch, cfg.ngram_len - 1, dtype=torch.long)
            self.context_history = torch.zeros(batch, cfg.context_history_size, dtype=torch.long)
        else:
            self.context = torch.cat([self.context, token_ids[:, -1:]], dim=1)[:, 1:]  # [B, ngram_len - 1]
        self.num_calls += 1
        if cfg.skip_first_ngram_calls and self.num_calls < cfg.ngram_len:
            return scores
        context_hash = accumulate_hash(torch.ones(batch, dtype=torch.long), self.context)  # [B]
        updated = self.update_scores(scores, self.g_values(context_hash, vocab))  # [B, V]
        is_repeated = (self.context_history == context_hash[:, None]).any(dim=1, keepdim=True)  # [B, 1]
        self.context_history = torch.cat([context_hash[:, None], self.context_history], dim=1)[:, :-1]
        return torch.where(is_repeated, scores, updated)
