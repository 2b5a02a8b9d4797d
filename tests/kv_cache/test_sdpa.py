"""kvgen.kv_cache.sdpa: without a softcap it is torch's SDPA; with one it equals float64 attention with Gemma 2's
capped scores (transformers' eager_attention_forward), for grouped heads, a bool mask, causal prefill and the decode
fold the callers use, and the cap changes the result."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgen.kv_cache.sdpa import sdpa


def _float64(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale  # [B, H, T, S]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v.double().repeat_interleave(group, 1)  # [B, H, T, D]


def test_sdpa_softcap_matches_float64_and_zero_is_torch_sdpa():
    g = torch.Generator().manual_seed(3)
    b, h, h_kv, t, s, d = 2, 6, 2, 5, 9, 16
    q, k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, h_kv, s, d, generator=g), torch.randn(b, h_kv, s, d, generator=g)
    mask = torch.rand(b, 1, t, s, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.7, enable_gqa=True)
    assert torch.equal(sdpa(q, k, v, mask, scale=0.7), want)
    capped = sdpa(q, k, v, mask, scale=0.7, softcap=1.5)
    torch.testing.assert_close(capped.double(), _float64(q, k, v, mask, 0.7, 1.5), rtol=1e-5, atol=1e-5)
    assert float((capped - want).abs().max()) > 0.05
    kc, vc = k[:, :, :t], v[:, :, :t]  # causal prefill (T == S)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(sdpa(q, kc, vc, None, True, 0.7, 1.5).double(), _float64(q, kc, vc, causal, 0.7, 1.5),
                               rtol=1e-5, atol=1e-5)
    qd = q[:, :, -1:]  # one query per row, the G heads of a KV head folded into the query axis (the decode path)
    folded = sdpa(qd.reshape(b, h_kv, h // h_kv, d), k, v, mask[:, :, -1:], scale=0.7, softcap=1.5).reshape(b, h, 1, d)
    torch.testing.assert_close(folded.double(), _float64(qd, k, v, mask[:, :, -1:], 0.7, 1.5), rtol=1e-5, atol=1e-5)


def test_sdpa_sinks_match_float64_and_change_the_result():
    """gpt-oss's sinks [H]: each head's softmax runs over one more logit, dropped (helpers.float64_attention, as
    transformers' GptOss eager_attention_forward), for a mask, causal prefill and grouped heads; they move the output."""
    from helpers import float64_attention

    g = torch.Generator().manual_seed(5)
    b, h, h_kv, t, s, d = 2, 6, 2, 5, 9, 16
    q, k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, h_kv, s, d, generator=g), torch.randn(b, h_kv, s, d, generator=g)
    sinks = torch.randn(h, generator=g) + 1.0
    got = sdpa(q, k, v, None, False, 0.7, sinks=sinks)  # every key visible: the mask of float64_attention's past = S
    want = float64_attention(q, k, v, None, s, 0.7, sinks=sinks).transpose(1, 2)  # [B, H, T, D]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    kc, vc = k[:, :, :t], v[:, :, :t]  # causal prefill (T == S)
    got = sdpa(q, kc, vc, None, True, 0.7, sinks=sinks)
    torch.testing.assert_close(got.double(), float64_attention(q, kc, vc, None, 0, 0.7, sinks=sinks).transpose(1, 2),
                               rtol=1e-5, atol=1e-5)
    assert float((got - sdpa(q, kc, vc, None, True, 0.7)).abs().max()) > 0.05
