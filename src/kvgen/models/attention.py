"""Attention metadata, masks and the scaled-dot-product attention call.

The offline path (``generate()``) runs rectangular, left-padded batches: every
row has the same number of cache slots, and padding is described by a key
mask. Masks are built once per forward and shared by every layer. The engine
passes a ``PagedKVCache`` with ``PagedAttentionMetadata`` instead: one packed
row ``[1, N]`` of every scheduled token, attending through block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.kernels import KernelOps
from kvgen.kv_cache.paged import PagedAttentionMetadata
from kvgen.kv_cache.sdpa import sdpa
from kvgen.models.recording import RECORDER


@dataclass
class AttentionMetadata:
    """What attention needs besides q, k, v for one forward.

    attention_mask: [B, S] (0/1 or bool) over every cache slot *after* this
    forward (cached + new tokens); ``None`` means no padding anywhere.
    """

    attention_mask: torch.Tensor | None = None


def prepare_attention(
    attn_metadata: AttentionMetadata | PagedAttentionMetadata | None, kv_cache, num_new: int, window: int = 0
) -> torch.Tensor | PagedAttentionMetadata | None:
    """What every layer's attention gets: the paged metadata as is, else the offline mask.

    The offline mask is ``build_attention_mask`` of the cache's ``seq_length`` (0 without a cache) and ``window``
    (> 0: the sliding-window layers' mask; the paged path takes the window in ``attend``).
    """
    if isinstance(attn_metadata, PagedAttentionMetadata):
        return attn_metadata
    past = kv_cache.seq_length if kv_cache is not None else 0
    return build_attention_mask(attn_metadata.attention_mask if attn_metadata else None, past, num_new, window)


def advance_cache(kv_cache, mask: torch.Tensor | PagedAttentionMetadata | None, num_new: int) -> None:
    """After a forward, record ``num_new`` tokens in an offline cache (paged lengths live in the metadata)."""
    if kv_cache is not None and not isinstance(mask, PagedAttentionMetadata):
        kv_cache.advance(num_new)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    kv_cache,
    mask: torch.Tensor | PagedAttentionMetadata | None,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store k, v in the cache (if any) and attend: q [B, H, T, D]; k, v [B, Hkv, T, D] -> [B, H, T, D].

    With paged metadata, B = 1 and T = N packed tokens (``PagedKVCache.attend``, which applies ``window`` > 0: each
    query sees its last ``window`` positions); an offline mask carries its window already (``prepare_attention``).
    ``softcap`` > 0 (Gemma 2): scores capped to ``softcap * tanh(s / softcap)`` before the softmax. ``sinks`` [H]
    float32 (gpt-oss): one more logit in each head's softmax, its probability dropped.
    """
    if isinstance(mask, PagedAttentionMetadata):
        return kv_cache.attend(layer_idx, q, k, v, mask, scale, window, softcap, sinks)
    if kv_cache is not None:
        k, v = kv_cache.update(layer_idx, k, v)  # [B, Hkv, S, D]
    if (recorder := RECORDER.get()) is not None:  # generate(output_attentions=True)
        recorder.attention(layer_idx, q, k, mask, scale, softcap, sinks)
    return scaled_dot_product_attention(q, k, v, mask, scale, softcap, sinks)


def prepare_key_mask(
    attn_metadata: AttentionMetadata | PagedAttentionMetadata | None, kv_cache, shape: torch.Size
) -> torch.Tensor | PagedAttentionMetadata | None:
    """The kernel path's mask: paged metadata as is, else the key mask [B, S] bool over every slot
    after this forward (None: no padding). Causality is the kernels' own."""
    if isinstance(attn_metadata, PagedAttentionMetadata):
        return attn_metadata
    mask = attn_metadata.attention_mask if attn_metadata is not None else None
    if mask is None or bool(mask.all()):
        return None
    assert mask.shape == (shape[0], (kv_cache.seq_length if kv_cache is not None else 0) + shape[1]), mask.shape
    return mask.bool()


def attend_rows(
    qkv: torch.Tensor,
    batch: int,
    layer_idx: int,
    kv_cache,
    mask: torch.Tensor | PagedAttentionMetadata | None,
    kernels: KernelOps,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel path's attention from stacked rows: qkv [N, (H + 2 Hkv) D] (RoPE applied) ->
    [N, H D] float32, k and v stored in the cache first.

    N = B * T rows (``batch`` = B); ``mask`` is the key mask [B, S] (``prepare_key_mask``) or paged
    metadata. A cache with ``attend_rows`` (static, paged) does the write and the attention
    in one fused op; a cache with only ``update``, or none, goes through ``kernels.attention``.
    ``scale`` defaults to head_dim^-0.5; ``window`` > 0: each query sees only its last ``window`` slots; ``softcap``
    > 0: scores capped as in :func:`attend`; ``sinks`` [H] float32 as there.
    """
    scale = head_dim**-0.5 if scale is None else scale
    recorder = RECORDER.get()  # generate(output_attentions=True): the weights are recomputed below
    if isinstance(mask, PagedAttentionMetadata) or (hasattr(kv_cache, "attend_rows") and recorder is None):
        return kv_cache.attend_rows(layer_idx, qkv, mask, num_heads, scale, kernels, window, softcap, sinks)
    n, t = qkv.shape[0], qkv.shape[0] // batch
    past = kv_cache.seq_length if kv_cache is not None else 0
    q, k, v = qkv.view(batch, t, -1).split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.view(batch, t, num_heads, head_dim).transpose(1, 2)  # [B, H, T, D]
    if hasattr(kv_cache, "attend_rows"):  # recording: the fused op, then every key read back from the cache
        out = kv_cache.attend_rows(layer_idx, qkv, mask, num_heads, scale, kernels, window, softcap, sinks)
        k = kv_cache.keys(layer_idx, past + t)  # [B, Hkv, S, D]
    else:
        k = k.view(batch, t, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(batch, t, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)  # [B, Hkv, S, D]
        out = kernels.attention(q, k, v, mask, past, scale, window, softcap, sinks).view(n, -1)  # [N, H D]
    if recorder is not None:
        recorder.attention(layer_idx, q, k, build_attention_mask(mask, past, t, window), scale, softcap, sinks)
    return out


def build_attention_mask(
    attention_mask: torch.Tensor | None, past_len: int, num_new: int, window: int = 0
) -> torch.Tensor | None:
    """Boolean mask ``[B|1, 1, T, S]`` (True = may attend), or None for "attend to all".

    Query t sits at slot ``past_len + t``; it sees keys at slots <= its own that
    are not padding, and with ``window`` > 0 (a sliding-window layer) only those > its slot - window
    (transformers' ``sliding_window_overlay``). A query always sees its own slot, so padded queries get a
    finite (unused) output instead of NaN. Returns None when no mask is needed
    (no padding and a single new token, or no padding and no cache prefix, which
    the caller runs with ``is_causal``; and every key within the window).
    attention_mask: [B, S] with S = past_len + num_new, or None.
    """
    full = _full_attention_mask(attention_mask, past_len, num_new)
    total = past_len + num_new
    if window <= 0 or total <= window:  # no query is `window` slots past slot 0
        return full
    device = attention_mask.device if attention_mask is not None else None
    q_slot = torch.arange(past_len, total, device=device).view(num_new, 1)  # [T, 1]
    k_slot = torch.arange(total, device=device).view(1, total)  # [1, S]
    causal = (k_slot <= q_slot).view(1, 1, num_new, total) if full is None else full  # [B|1, 1, T, S]
    return causal & (k_slot > q_slot - window)  # [B|1, 1, T, S]; its own slot stays


def _full_attention_mask(attention_mask: torch.Tensor | None, past_len: int, num_new: int) -> torch.Tensor | None:
    """:func:`build_attention_mask` without a window."""
    total = past_len + num_new
    if attention_mask is None or bool(attention_mask.all()):
        if num_new == 1 or past_len == 0:
            return None
        q_slot = torch.arange(past_len, total).view(num_new, 1)  # [T, 1]
        k_slot = torch.arange(total).view(1, total)  # [1, S]
        return (k_slot <= q_slot).view(1, 1, num_new, total)  # [1, 1, T, S]
    assert attention_mask.shape[-1] == total, (attention_mask.shape, total)
    device = attention_mask.device
    q_slot = torch.arange(past_len, total, device=device).view(num_new, 1)  # [T, 1]
    k_slot = torch.arange(total, device=device).view(1, total)  # [1, S]
    causal = k_slot <= q_slot  # [T, S]
    valid = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return (causal & valid) | (k_slot == q_slot)  # [B, 1, T, S]


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with grouped-query heads.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D] with H a multiple of Hkv; mask:
    [B|1, 1, T, S] bool or None. Returns [B, H, T, D] in q's dtype.
    Source: Vaswani et al. 2017 eq. 1; GQA as in Ainslie et al. 2023.
    ``mask is None`` with T == S means causal (fresh prefill); with T == 1 it
    means attend to every key. ``softcap`` > 0: Gemma 2's capped scores; ``sinks`` [H]: gpt-oss's attention sinks
    (:func:`kvgen.kv_cache.sdpa.sdpa`).
    """
    b, h, num_new, d = q.shape
    h_kv, num_keys = k.shape[1], k.shape[2]
    if num_new == 1 and h != h_kv and sinks is None:  # (sinks: the eager path groups the heads itself)
        # Decode: fold the G = H / Hkv query heads sharing a KV head into the query-length
        # axis, so one plain MHA call over Hkv heads does GQA with no K/V copy (head
        # h = j * G + g reads KV head j, as HF repeat_kv). Measured faster than enable_gqa.
        q_grouped = q.reshape(b, h_kv, h // h_kv, d)  # [B, Hkv, G, D]
        out = sdpa(q_grouped, k, v, mask, scale=scale, softcap=softcap)  # [B, Hkv, G, D]
        return out.reshape(b, h, 1, d)  # [B, H, 1, D]
    is_causal = mask is None and num_new > 1 and num_new == num_keys
    return sdpa(q, k, v, mask, is_causal, scale, softcap, sinks)
