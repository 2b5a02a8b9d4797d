"""The attention ops' sliding window (``window`` > 0: a query sees its last ``window`` slots; Gemma 3's sliding layers):
the C++ ops against their torch twins, and the twins against an explicit float64 mask as transformers'
``sliding_window_overlay`` builds it (kv_idx > q_idx - window)."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_inputs, float64_attention, paged_inputs

import kvgen.kernels as K

OPS = K.get_ops()
REF = K.reference_ops()


@pytest.mark.parametrize("t,s,window", [(1, 40, 6), (7, 20, 6), (5, 300, 260), (4, 9, 16), (20, 300, 260)])
def test_windowed_attention_matches_its_twin_and_the_float64_mask(t, s, window):
    """Decodes and prefills, a window that spans two 256-key chunks and one wider than the context; left padding in
    the second row; the window must change the result wherever a query is more than ``window`` slots in."""
    q, k, v = attention_inputs(2, 6, 2, t, s, 16, seed=s + t)
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[1, :3] = False
    past = s - t
    for key_mask in (None, mask):
        want64 = float64_attention(q, k, v, key_mask, past, 0.25, window)
        twin = REF.attention(q, k, v, key_mask, past, 0.25, window)
        torch.testing.assert_close(twin.double(), want64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(OPS.attention(q, k, v, key_mask, past, 0.25, window), twin, rtol=1e-5, atol=1e-5)
        unwindowed = OPS.attention(q, k, v, key_mask, past, 0.25)
        assert torch.equal(unwindowed, OPS.attention(q, k, v, key_mask, past, 0.25, 0))  # 0: no window
        if s > window:  # the last query is past the window: dropping it moves the output
            assert float((unwindowed - twin)[:, -1].abs().max()) > 1e-3
        else:
            torch.testing.assert_close(unwindowed, twin, rtol=1e-5, atol=1e-5)


def test_windowed_static_and_paged_ops_match_their_twins_and_each_other():
    """static_attention and paged_attention_qkv write the same slots as their twins and attend through the window;
    a sequence's paged rows equal the contiguous op's over the same keys."""
    g = torch.Generator().manual_seed(5)
    b, t, h, h_kv, d, past, window = 2, 3, 4, 2, 16, 9, 5
    qkv = torch.randn(b * t, (h + 2 * h_kv) * d, generator=g)
    caches = [torch.randn(b, h_kv, 16, d, generator=g).half() for _ in range(2)]
    mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    got = OPS.static_attention(qkv, mine[0], mine[1], None, past, h, 0.25, window)
    want = REF.static_attention(qkv, theirs[0], theirs[1], None, past, h, 0.25, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    assert float((got - OPS.static_attention(qkv, *[c.clone() for c in caches], None, past, h, 0.25)).abs().max()) > 1e-3
    # sequence 0: 12 positions over blocks 3, 0, 5 (a 3-token chunk at 9-11); sequence 1: a decode at 6
    rows, pools, slots, tables, qsl, seq_lens, bs = paged_inputs(qkv, h_kv, d, g)
    mine, theirs = [p.clone() for p in pools], [p.clone() for p in pools]
    got = OPS.paged_attention_qkv(rows, mine[0], mine[1], slots, tables, qsl, seq_lens, h, 0.25, window)
    want = REF.paged_attention_qkv(rows, theirs[0], theirs[1], slots, tables, qsl, seq_lens, h, 0.25, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    positions = torch.arange(12)
    blocks = tables[0][positions // bs]  # [12]
    k = mine[0][blocks, :, positions % bs].transpose(0, 1)[None]  # [12, Hkv, D] -> [1, Hkv, 12, D]
    v = mine[1][blocks, :, positions % bs].transpose(0, 1)[None]
    q = rows[:3, : h * d].view(3, h, d).transpose(0, 1)[None]  # [1, H, 3, D]
    contiguous = OPS.attention(q, k, v, None, 9, 0.25, window).reshape(3, h * d)  # [3, H D]
    torch.testing.assert_close(got[:3], contiguous, rtol=1e-6, atol=1e-6)
    if OPS.backend == "avx2":
        with pytest.raises(RuntimeError, match="window must be >= 0"):
            OPS.attention(q, k, v, None, 9, 0.25, -1)
