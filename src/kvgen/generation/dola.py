"""DoLa decoding: greedy search or sampling on the last layer's logits contrasted with an earlier layer's.

Each step the logits of a few "premature" layers (the LM head on the hidden state entering that layer) are
compared with the final logits; the layer whose distribution is furthest from the final one (Jensen-Shannon
divergence, averaged over the batch) is the contrast: scores = log_softmax(final) - log_softmax(premature) over the
tokens within a factor 10 of the final distribution's best (the others -inf). The logits processors and the token
choice then run on those scores as in greedy search or sampling.
Source: Chuang et al. 2024, "DoLa: Decoding by Contrasting Layers Improves Factuality in Large Language Models";
agrees with transformers 4.55 ``GenerationMixin._dola_decoding`` (``_dola_select_contrast``, ``_relative_top_filter``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvgen.generation.decoding import LoopContext, token_loop
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ops import choose_tokens, greedy


def premature_layers(dola_layers: str | list[int], num_layers: int, tie_word_embeddings: bool) -> list[int]:
    """The candidate layers (indices of hidden states: 0 = the embeddings, i = after i layers) for ``dola_layers``:
    'low' / 'high' as transformers picks them (every second layer of the lower / upper half, at most 20 layers deep;
    with tied embeddings from layer 2, whose early exit is not the identity), or the given indices below
    ``num_layers``. Raises ValueError when none is left."""
    start = 0 if not tie_word_embeddings else 2 if num_layers > 2 else 1 if num_layers == 2 else 0
    if not isinstance(dola_layers, str):
        layers = [i for i in dola_layers if i < num_layers]
    elif dola_layers == "low":
        layers = [start] if start == num_layers // 2 else list(
            range(start, num_layers // 2, 2) if num_layers <= 40 else range(start, 20, 2))
    else:  # "high"
        layers = list(range(num_layers // 2, num_layers, 2) if num_layers <= 40 else range(num_layers - 20, num_layers, 2))
    if not layers:
        raise ValueError(f"dola_layers={dola_layers!r} leaves no layer below the model's {num_layers} to contrast with")
    return layers


def relative_top_filter(final: torch.Tensor, base: torch.Tensor, relative_top: float = 0.1
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax of final and base logits [B, V]; where the final log-probability is below its best + log
    ``relative_top``, final becomes -inf and base -1e-3 (transformers' ``_relative_top_filter``)."""
    final_lp, base_lp = final.log_softmax(dim=-1), base.log_softmax(dim=-1)  # [B, V] each
    top = final_lp.max(dim=-1).values  # [B]
    thresh = torch.minimum(top, top + math.log(relative_top))[:, None]  # [B, 1]
    below = final_lp < thresh  # [B, V]
    return final_lp.masked_fill(below, -float("inf")), base_lp.masked_fill(below, -1e-3)


def contrast(layers: list[int], premature: dict[int, torch.Tensor], final: torch.Tensor) -> torch.Tensor:
    """The DoLa scores [B, V] float32 from the final logits [B, V] and each candidate's logits [B, V]: the candidate
    with the largest batch-mean Jensen-Shannon divergence from the final distribution (the first on ties)."""
    chosen = layers[0]
    if len(layers) > 1:
        stacked = torch.stack([premature[i] for i in layers])  # [L, B, V]
        average = 0.5 * (F.softmax(final, dim=-1)[None] + F.softmax(stacked, dim=-1))  # [L, B, V]
        kl_final = F.kl_div(F.log_softmax(final, dim=-1)[None], average, reduction="none").mean(-1)  # [L, B]
        kl_layer = F.kl_div(F.log_softmax(stacked, dim=-1), average, reduction="none").mean(-1)  # [L, B]
        chosen = layers[int((0.5 * (kl_final + kl_layer)).mean(-1).argmax())]
    final_lp, base_lp = relative_top_filter(final, premature[chosen])
    return final_lp - base_lp


def dola_decoding(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Greedy search or sampling (``ctx.config.do_sample``) on DoLa scores; ``output_logits`` keeps the final
    layer's logits, ``output_scores`` the processed DoLa scores, as transformers."""
    model, cfg, recorder = runner.model, ctx.config, runner.recorder
    assert cfg.dola_layers is not None and recorder is not None  # generate() records the premature layers' inputs
    layers = premature_layers(cfg.dola_layers, model.config.num_hidden_layers, model.config.tie_word_embeddings)

    def next_logits() -> tuple[torch.Tensor, torch.Tensor]:
        final = runner.next_logits()  # [N, V]; the forward's record holds each layer's input [N, T, C]
        hidden = recorder.steps[-1].hidden_states
        with torch.inference_mode():
            # transformers' lm_head(hidden_states[i]): no final softcap or logits_scaling on the early exits
            premature = {i: model.lm_head_logits(hidden[i][:, -1]) for i in layers}  # [N, V] each
        return contrast(layers, premature, final), final

    if cfg.do_sample:
        return token_loop(runner, ctx, lambda s: choose_tokens(s, True, ctx.generator).squeeze(1), next_logits)
    return token_loop(runner, ctx, greedy, next_logits)
