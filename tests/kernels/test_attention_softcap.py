"""The attention ops' score softcap (``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap) before
the softmax; Gemma 2's attn_logit_softcapping): the C++ ops against their torch twins, the twins against float64
attention with the cap as transformers' Gemma 2 ``eager_attention_forward`` applies it, and the mutation (the cap
left off) far outside the tolerance. With a window too (Gemma 2's sliding layers)."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_inputs, float64_attention, paged_inputs

import kvgen.kernels as K

OPS = K.get_ops()
REF = K.reference_ops()
SCALE, CAP = 0.5, 2.0  # scores of random unit vectors of 16 reach ~8: the cap changes them


@pytest.mark.parametrize("t,s,window", [(1, 40, 0), (7, 20, 0), (5, 300, 0), (6, 30, 8), (20, 300, 0)])
def test_capped_attention_matches_its_twin_and_float64(t, s, window):
    """Decodes and prefills, keys over two 256-key chunks, a sliding window; left padding in the second row: the op
    equals its twin, which equals float64 capped attention, and leaving the cap off moves the output far more."""
    q, k, v = attention_inputs(2, 6, 2, t, s, 16, seed=s + t)
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[1, :3] = False
    past = s - t
    for key_mask in (None, mask):
        want64 = float64_attention(q, k, v, key_mask, past, SCALE, window, CAP)
        twin = REF.attention(q, k, v, key_mask, past, SCALE, window, CAP)
        torch.testing.assert_close(twin.double(), want64, rtol=1e-5, atol=1e-5)
        got = OPS.attention(q, k, v, key_mask, past, SCALE, window, CAP)
        torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)
        uncapped = OPS.attention(q, k, v, key_mask, past, SCALE, window)  # softcap defaults to 0: off
        assert torch.equal(uncapped, OPS.attention(q, k, v, key_mask, past, SCALE, window, 0.0))
        assert float((uncapped - twin).abs().max()) > 0.05


def test_capped_static_and_paged_ops_match_their_twins():
    """static_attention and paged_attention_qkv (and paged_attention) cap the scores as their twins do, with a window
    on top; dropping the cap moves them; a negative cap is refused by name."""
    g = torch.Generator().manual_seed(11)
    b, t, h, h_kv, d, past, window = 2, 3, 4, 2, 16, 9, 5
    qkv = torch.randn(b * t, (h + 2 * h_kv) * d, generator=g)
    caches = [torch.randn(b, h_kv, 16, d, generator=g).half() for _ in range(2)]
    mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    got = OPS.static_attention(qkv, mine[0], mine[1], None, past, h, SCALE, window, CAP)
    want = REF.static_attention(qkv, theirs[0], theirs[1], None, past, h, SCALE, window, CAP)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    uncapped = OPS.static_attention(qkv, *[c.clone() for c in caches], None, past, h, SCALE, window)
    assert float((got - uncapped).abs().max()) > 0.05
    # sequence 0: 12 positions over blocks 3, 0, 5 (a 3-token chunk at 9-11); sequence 1: a decode at 6
    rows, pools, slots, tables, qsl, seq_lens, _ = paged_inputs(qkv, h_kv, d, g)
    mine, theirs = [p.clone() for p in pools], [p.clone() for p in pools]
    got = OPS.paged_attention_qkv(rows, mine[0], mine[1], slots, tables, qsl, seq_lens, h, SCALE, 0, CAP)
    want = REF.paged_attention_qkv(rows, theirs[0], theirs[1], slots, tables, qsl, seq_lens, h, SCALE, 0, CAP)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    q = rows[:, : h * d].reshape(4, h, d)  # [N, H, D]
    paged = OPS.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window, CAP)
    torch.testing.assert_close(paged, REF.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window, CAP),
                               rtol=1e-5, atol=1e-5)
    uncapped = OPS.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window)
    assert float((paged - uncapped).abs().max()) > 0.05
    if OPS.backend == "avx2":
        with pytest.raises(RuntimeError, match="softcap must be >= 0"):
            OPS.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window, -1.0)
