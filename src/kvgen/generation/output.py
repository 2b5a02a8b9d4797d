"""``GenerateOutput``: the one return type of ``generate()``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerateTimings:
    """Wall-clock seconds spent in the first forward (prefill) and in later steps (decode, drafting included);
    ``num_decode_steps``: the model's forwards after the prefill (fewer than the tokens when drafts are kept)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_decode_steps: int = 0


@dataclass
class GenerateOutput:
    """Result of ``generate()``, whatever the strategy.

    sequences: [N, T + T_new] int64, N = B * num_return_sequences; the first
    ``prompt_length`` columns are the (left-padded) prompts, then new tokens;
    a row that finished early is filled with ``pad_token_id``.
    finish_reasons: per row, "stop" (EOS), "length", "stop_string" or "time".
    scores / logits: per step, [R, V] float32 processed scores / raw logits
    (only when ``output_scores`` / ``output_logits``); R = N, except for beam
    strategies, where the rows are the B * num_beams live beams of that step
    (as transformers; beam strategies score log-softmax, then processors; constrained beam search adds each
    beam's running score, as transformers does).
    sequences_scores: [N] float32, best first per prompt: beam strategies give
    sum of processed log-probs / generated_len ** length_penalty (as
    transformers), sample-and-rank the same over raw-logit log-probs; None otherwise.
    hidden_states (``output_hidden_states``): per forward of the model, one tensor [R, T_step, C] per layer input
    (the embeddings first) and one after the final norm (L + 1 in all); T_step is the prompt's length at the
    prefill (the tokens not in ``past_key_values``), then 1 (every column without a KV cache).
    attentions (``output_attentions``): per forward, one tensor [R, H, T_step, S] float32 per layer, the
    attention weights over the S keys cached after that forward (transformers' eager attention and dynamic
    cache; its static cache pads S with zeros to the cache's length). R as ``scores``' rows; both as transformers'
    ``hidden_states`` / ``attentions``; None unless asked.
    """

    sequences: torch.Tensor
    prompt_length: int
    finish_reasons: list[str]
    num_new_tokens: list[int]
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    sequences_scores: torch.Tensor | None = None
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    timings: GenerateTimings = field(default_factory=GenerateTimings)

    @property
    def new_token_ids(self) -> list[list[int]]:
        """Per row, the generated ids (ending with EOS when stopped on EOS; no trailing padding)."""
        rows = self.sequences[:, self.prompt_length :].tolist()
        return [row[:n] for row, n in zip(rows, self.num_new_tokens)]
