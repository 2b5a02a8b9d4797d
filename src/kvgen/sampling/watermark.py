"""Green-list watermarking of generated text, and its detector (Kirchenbauer et al. 2023, "A Watermark for Large
Language Models" and "On the Reliability of Watermarks for Large Language Models").

Each step, a pseudo-random "green" share ``greenlist_ratio`` of the vocabulary, seeded by hashing the previous
token ("lefthash") or each candidate with its context ("selfhash"), gets ``bias`` added to its scores. The
detector counts how many tokens of a text are green for their prefix: a z-score far above chance says the text
was watermarked with the same key.
Source: transformers 4.55 ``WatermarkingConfig``, ``WatermarkLogitsProcessor`` and ``WatermarkDetector``, which
these must agree with id for id (the same ``torch.Generator`` seeds and permutations). Unlike transformers,
``ignore_repeated_ngrams`` really counts each distinct n-gram once (transformers keys its count by tensor
identity, so it never merges repeats).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.sampling.synthid import SynthIDTextWatermarkingConfig

SEEDING_SCHEMES = ("lefthash", "selfhash")
_TABLE_SIZE = 1_000_003
_NUM_SELFHASH_CANDIDATES = 40  # transformers looks at the 40 best candidates per step


@dataclass(frozen=True)
class WatermarkingConfig:
    """transformers ``WatermarkingConfig``: green share of the vocabulary, logit bias, hash key, seeding scheme
    and context width (tokens hashed by "selfhash"). Raises ``ValueError`` naming a bad field."""

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.greenlist_ratio < 1.0:
            raise ValueError(f"watermarking_config greenlist_ratio must be in (0, 1), got {self.greenlist_ratio!r}")
        if not math.isfinite(self.bias):
            raise ValueError(f"watermarking_config bias must be finite, got {self.bias!r}")
        if self.seeding_scheme not in SEEDING_SCHEMES:
            raise ValueError(f"watermarking_config seeding_scheme must be 'lefthash' or 'selfhash', got "
                             f"{self.seeding_scheme!r}")
        for name in ("hashing_key", "context_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "context_width" else 0):
                raise ValueError(f"watermarking_config {name} must be an int >= "
                                 f"{1 if name == 'context_width' else 0}, got {value!r}")

    @classmethod
    def of(cls, value: Any) -> WatermarkingConfig | SynthIDTextWatermarkingConfig:
        """A config from itself, a dict of its fields, or transformers' ``WatermarkingConfig``; a SynthID config (or
        a dict with ``ngram_len``) gives :class:`~kvgen.sampling.synthid.SynthIDTextWatermarkingConfig`. Raises
        ``ValueError`` for unknown keys or values."""
        if isinstance(value, (cls, SynthIDTextWatermarkingConfig)):
            return value
        if type(value).__name__ == "SynthIDTextWatermarkingConfig" or (isinstance(value, dict) and "ngram_len" in value):
            return SynthIDTextWatermarkingConfig.of(value)
        fields = value if isinstance(value, dict) else getattr(value, "__dict__", None)
        if not isinstance(fields, dict):
            raise ValueError(f"watermarking_config must be a WatermarkingConfig or a dict, got {value!r}")
        names = set(cls.__dataclass_fields__)
        if isinstance(value, dict) and (unknown := sorted(set(fields) - names)):
            raise ValueError(f"unknown watermarking_config key(s) {unknown}: expected some of {sorted(names)}")
        return cls(**{k: v for k, v in fields.items() if k in names})


class WatermarkLogitsProcessor:
    """Add ``bias`` to each row's green tokens: ``(token_ids [B, T], scores [B, V]) -> [B, V]`` float32.

    ``vocab_size``: the model's (the permutations' length; None: the scores' width, which is the same). Rows
    shorter than ``context_width`` are left alone.
    """

    def __init__(self, vocab_size: int | None, config: WatermarkingConfig) -> None:
        self.vocab_size, self.config = vocab_size, config
        self.rng = torch.Generator()
        self.rng.manual_seed(config.hashing_key)
        self.fixed_table = torch.randperm(_TABLE_SIZE, generator=self.rng)  # [1_000_003] selfhash's hash table

    def greenlist_ids(self, context: torch.Tensor) -> torch.Tensor:
        """The green ids [greenlist_size] int64 after ``context`` [T] (for "selfhash", the candidate last)."""
        cfg = self.config
        context = context[-cfg.context_width:]  # [<= context_width]
        if cfg.seeding_scheme == "selfhash":
            a = self.fixed_table[context % _TABLE_SIZE] + 1
            b = self.fixed_table[context[-1] % _TABLE_SIZE] + 1
            seed = int((cfg.hashing_key * a * b).min())
        else:
            seed = cfg.hashing_key * int(context[-1])
        self.rng.manual_seed(seed % (2**64 - 1))
        assert self.vocab_size is not None, "set by the first call"
        return torch.randperm(self.vocab_size, generator=self.rng)[: int(self.vocab_size * cfg.greenlist_ratio)]

    def _selfhash_greenlist(self, context: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The best 40 candidates of ``scores`` [V] that are green for ``context`` + themselves (all of them when V <
        40, where transformers fails)."""
        ranked = scores.sort(descending=True).indices  # [V]
        green = [ranked[i] for i in range(min(_NUM_SELFHASH_CANDIDATES, ranked.shape[0]))
                 if ranked[i] in self.greenlist_ids(torch.cat([context, ranked[i, None]]))]
        return torch.tensor(green, dtype=torch.long)

    def __call__(self, token_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if token_ids.shape[-1] < self.config.context_width:
            return scores
        if self.vocab_size is None:
            self.vocab_size = scores.shape[-1]
        out = scores.clone()  # [B, V]
        for row, context in enumerate(token_ids):
            if self.config.seeding_scheme == "selfhash":
                green = self._selfhash_greenlist(context, scores[row])
            else:
                green = self.greenlist_ids(context)
            out[row, green] = out[row, green] + self.config.bias
        return out


@dataclass
class WatermarkDetectorOutput:
    """Per row [B] (numpy-free lists): tokens scored, green tokens, their fraction, z-score, one-sided p-value
    (the logistic approximation transformers uses), prediction (z > threshold) and confidence (1 - p)."""

    num_tokens_scored: list[int]
    num_green_tokens: list[int]
    green_fraction: list[float]
    z_score: list[float]
    p_value: list[float]
    prediction: list[bool]
    confidence: list[float]


class WatermarkDetector:
    """Tells watermarked text from plain text (transformers ``WatermarkDetector``).

    ``vocab_size`` and ``bos_token_id`` are the model's; ``config`` the generation's green-list watermarking
    settings. Raises ``ValueError`` for a SynthID config (its detector is a trained Bayesian model).
    """

    def __init__(self, vocab_size: int, config: Any, bos_token_id: int | None = None,
                 ignore_repeated_ngrams: bool = False) -> None:
        found = WatermarkingConfig.of(config)
        if not isinstance(found, WatermarkingConfig):
            raise ValueError("WatermarkDetector detects the green-list watermark; SynthID text needs a trained "
                             "Bayesian detector (transformers' BayesianDetectorModel)")
        self.config = found
        self.processor = WatermarkLogitsProcessor(vocab_size, self.config)
        self.bos_token_id, self.ignore_repeated_ngrams = bos_token_id, ignore_repeated_ngrams

    def __call__(self, token_ids: torch.Tensor, z_threshold: float = 3.0) -> WatermarkDetectorOutput:
        """Score ``token_ids`` [B, T] int64 (the generated text, best without its prompt; a leading BOS in row 0
        drops the first column, as transformers). Raises ``ValueError`` when no token follows the first
        ``context_width``."""
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be [B, T], got shape {tuple(token_ids.shape)}")
        if token_ids.shape[1] and int(token_ids[0, 0]) == self.bos_token_id:
            token_ids = token_ids[:, 1:]
        width = self.config.context_width
        if token_ids.shape[1] - width < 1:
            raise ValueError(f"token_ids need at least {width + 1} tokens (context_width {width} plus one to score), "
                             f"got {token_ids.shape[1]}")
        n = width + (0 if self.config.seeding_scheme == "selfhash" else 1)  # tokens per scored n-gram
        scored, green = [], []
        for row in token_ids.tolist():
            ngrams = [tuple(row[i: i + n]) for i in range(len(row) - n + 1)]
            if self.ignore_repeated_ngrams:
                ngrams = list(dict.fromkeys(ngrams))
            scored.append(len(ngrams))
            green.append(sum(self._is_green(g) for g in ngrams))
        gamma = self.config.greenlist_ratio
        z = [(g - gamma * s) / math.sqrt(s * gamma * (1 - gamma)) for g, s in zip(green, scored)]
        p = [1 - 0.5 * (1 + math.copysign(1.0, v) * (1 - math.exp(-2 * v * v / math.pi))) if v else 0.5 for v in z]
        return WatermarkDetectorOutput(scored, green, [g / s for g, s in zip(green, scored)], z, p,
                                       [v > z_threshold for v in z], [1 - v for v in p])

    def _is_green(self, ngram: tuple[int, ...]) -> bool:
        context = torch.tensor(ngram if self.config.seeding_scheme == "selfhash" else ngram[:-1])
        return ngram[-1] in self.processor.greenlist_ids(context).tolist()
