"""Scaled-dot-product attention with an optional logit softcap or attention sinks, for the dense (float) attention
paths.

Without either it is ``F.scaled_dot_product_attention``; with a softcap (Gemma 2's ``attn_logit_softcapping``) or
sinks (gpt-oss: one learned logit per head joins the softmax, its probability dropped) the scores are computed
eagerly and softmaxed, as transformers' ``eager_attention_forward`` does (SDPA has no hook between the scale and the
softmax). It sits here so that both the offline attention (``models.attention``) and
the paged cache's attention can call it without an import cycle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, T, D]; k, v [B, Hkv, S, D] (H a multiple of Hkv, head h reads KV head h // (H / Hkv)); attn_mask
    [B|1, 1, T, S] bool (True = may attend) or None; ``is_causal`` (T == S) as SDPA's. Returns [B, H, T, D] in q's
    dtype.

    ``softcap`` > 0: scores ``s = scale * q . k`` become ``softcap * tanh(s / softcap)`` before the mask and a
    float32 softmax (transformers 4.55 Gemma 2 ``eager_attention_forward``). ``sinks`` [H] float32: head h's softmax
    also runs over the logit ``sinks[h]``, whose probability is dropped (transformers 4.55 GptOss
    ``eager_attention_forward``). Source: Vaswani et al. 2017 eq. 1.
    """
    gqa = q.shape[1] != k.shape[1]
    if softcap <= 0 and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    probs = attention_probs(q, k, attn_mask, is_causal, scale, softcap, sinks).to(q.dtype)  # [B, H, T, S]
    out = probs.view(b, h_kv, -1, s) @ v  # [B, Hkv, G*T, D]: head h = j * G + g reads KV head j
    return out.view(b, h, t, d)  # [B, H, T, D]


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention weights of :func:`sdpa` (same arguments, no values): [B, H, T, S] float32, each query's softmax
    over its keys (0 where masked; with ``sinks``, the rows sum to less than 1). transformers 4.55's
    ``eager_attention_forward`` weights (``output_attentions``)."""
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, h_kv, h // h_kv * t, d)  # [B, Hkv, G*T, D]: the G heads sharing a KV head, then t
    scores = (qg @ k.transpose(-1, -2)).view(b, h_kv, h // h_kv, t, s) * scale  # [B, Hkv, G, T, S]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        attn_mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)[None, None]  # [1, 1, T, S]
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask[:, :, None], float("-inf"))  # mask [B|1, 1, 1, T, S]
    if sinks is not None:  # one more logit per head, its probability dropped
        sink = sinks.to(scores.dtype).view(1, h_kv, h // h_kv, 1, 1).expand(b, -1, -1, t, 1)  # [B, Hkv, G, T, 1]
        scores = torch.cat([scores, sink], dim=-1)  # [B, Hkv, G, T, S+1]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :s]  # [B, Hkv, G, T, S]
    return probs.reshape(b, h, t, s)  # [B, H, T, S]
