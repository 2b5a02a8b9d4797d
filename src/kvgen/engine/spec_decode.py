"""N-gram speculative decoding in the engine: ``SpeculativeConfig`` (vLLM's ``speculative_config``) and the drafts.

Each decode step of a running request feeds its last token plus up to ``num_speculative_tokens`` drafted ids
(:func:`kvgen.sampling.ngram.find_draft` over prompt and output); the runner samples a token at each of those
k + 1 positions, each from the logits processed with the history it would have had, and keeps the drafts up to
the first one that differs from its position's token, then that token. A draft is a point mass, so "sample and
compare" is the rejection sampling of Leviathan et al. 2023 (accept with probability p(draft); on rejection the
token is a draw from p without the draft), and only the kept positions spend a draw of the request's generator:
greedy and seeded requests get the tokens they get without drafts. Since tokens never depend on how many drafts a
step carries, each request's draft limit adapts (transformers' heuristic: +2 after a fully kept draft, else -1):
verifying k drafts is compute-bound on this CPU, so drafts that keep failing shrink to one.
Source: vLLM ``SpeculativeConfig`` (names, ngram defaults) and v1 ``NgramProposer``; transformers' prompt lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvgen.engine.request import Request
from kvgen.fields import check_int, json_object
from kvgen.sampling.ngram import find_draft

_NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min and _max when neither is given


@dataclass
class SpeculativeConfig:
    """``method`` "ngram" (the only one: no draft model); ``num_speculative_tokens`` drafts per step at most;
    n-grams of ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens are matched (5 .. 5 when neither is given,
    else the one given for both, as vLLM); no drafts in a step with more than ``disable_by_batch_size`` running
    requests (None: always drafts). On this CPU the quantized matmul is compute-bound past ~4 rows, so a batch
    of 8 requests verifying 4 drafts each decodes at about half the tokens/s of plain decoding (measured): set
    ``disable_by_batch_size`` (e.g. 2) on a busy server. Raises ``ValueError`` naming the field."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram' (no draft models here), got {self.method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):  # checked as given, before one fills the other
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = _NGRAM_DEFAULT
        self.prompt_lookup_max = self.prompt_lookup_min if self.prompt_lookup_max is None else self.prompt_lookup_max
        self.prompt_lookup_min = self.prompt_lookup_max if self.prompt_lookup_min is None else self.prompt_lookup_min
        if self.disable_by_batch_size is not None:
            check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        assert low is not None and high is not None  # filled above
        if low > high:
            raise ValueError(f"prompt_lookup_min must be <= prompt_lookup_max, got {low} > {high}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a config, a dict or its JSON text (the CLI's ``--speculative-config``). Raises ``ValueError``."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object("speculative_config", value)
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {[f.name for f in fields(cls)]}")
        return cls(**value)


class NgramProposer:
    """Drafts for a request's next step from its own tokens (pure Python, no model)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_num_tokens)`` ids for ``request`` (none for a structured-output
        request: its grammar has to accept each token before the next is masked)."""
        cfg = self.config
        assert cfg.num_speculative_tokens and cfg.prompt_lookup_max and cfg.prompt_lookup_min  # set in __post_init__
        num = min(max_num_tokens, cfg.num_speculative_tokens)
        if num < 1 or request.grammar is not None:
            return []
        eos = () if request.sampling_params.ignore_eos else request.eos_token_ids
        return find_draft(request.all_token_ids, cfg.prompt_lookup_max, num, eos, cfg.prompt_lookup_min)
