"""The attention ops' sinks (``sinks`` [H]: one more logit in each head's softmax, whose probability is dropped;
gpt-oss's learned attention sinks): the C++ ops against their torch twins, the twins against float64 attention with
the sinks as transformers' GptOss ``eager_attention_forward`` applies them, over several 256-key chunks (the sink
enters the merge of the chunks once), with a window and left padding; leaving the sinks off moves the output far
more; a sink far below every score changes nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_inputs, float64_attention, paged_inputs

import kvgen.kernels as K

OPS = K.get_ops()
REF = K.reference_ops()
SCALE = 0.5


def _sinks(h: int, seed: int) -> torch.Tensor:
    """[H] float32 sink logits near the log of a softmax denominator over hundreds of keys (scores of random vectors
    of 16 at scale 0.5: standard deviation 2), so that they take a large share of the probability."""
    return torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2 + 6


@pytest.mark.parametrize("t,s,window", [(1, 40, 0), (7, 20, 0), (5, 600, 0), (6, 30, 8), (1, 300, 128),
                                            (20, 600, 0), (20, 300, 128)])  # 20 queries: a task a (query, KV head) pair
def test_attention_with_sinks_matches_its_twin_and_float64(t, s, window):
    """Decodes and prefills, keys over three 256-key chunks, sliding windows (gpt-oss: 128); left padding in the
    second row: the op equals its twin, which equals float64 attention with sinks; without the sinks, or with the
    sinks pushed far below the scores, the outputs are plain attention's."""
    q, k, v = attention_inputs(2, 6, 2, t, s, 16, seed=s + t)
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[1, :3] = False
    past, sinks = s - t, _sinks(6, s)
    for key_mask in (None, mask):
        want64 = float64_attention(q, k, v, key_mask, past, SCALE, window, sinks=sinks)
        twin = REF.attention(q, k, v, key_mask, past, SCALE, window, 0.0, sinks)
        torch.testing.assert_close(twin.double(), want64, rtol=1e-5, atol=1e-5)
        got = OPS.attention(q, k, v, key_mask, past, SCALE, window, 0.0, sinks)
        torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)
        plain = OPS.attention(q, k, v, key_mask, past, SCALE, window)
        assert float((plain - got).abs().max()) > 0.05
        buried = OPS.attention(q, k, v, key_mask, past, SCALE, window, 0.0, torch.full((6,), -1e4))
        torch.testing.assert_close(buried, plain, rtol=1e-6, atol=1e-6)


def test_static_and_paged_ops_with_sinks_match_their_twins():
    """static_attention, paged_attention_qkv and paged_attention apply the sinks as their twins do (a window on
    top); a sinks tensor of the wrong length is refused by name."""
    g = torch.Generator().manual_seed(11)
    b, t, h, h_kv, d, past, window = 2, 3, 4, 2, 16, 9, 5
    sinks = _sinks(h, 3)
    qkv = torch.randn(b * t, (h + 2 * h_kv) * d, generator=g)
    caches = [torch.randn(b, h_kv, 16, d, generator=g).half() for _ in range(2)]
    mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    got = OPS.static_attention(qkv, mine[0], mine[1], None, past, h, SCALE, window, 0.0, sinks)
    want = REF.static_attention(qkv, theirs[0], theirs[1], None, past, h, SCALE, window, 0.0, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    plain = OPS.static_attention(qkv, *[c.clone() for c in caches], None, past, h, SCALE, window)
    assert float((got - plain).abs().max()) > 0.05
    rows, pools, slots, tables, qsl, seq_lens, _ = paged_inputs(qkv, h_kv, d, g)
    mine, theirs = [p.clone() for p in pools], [p.clone() for p in pools]
    got = OPS.paged_attention_qkv(rows, mine[0], mine[1], slots, tables, qsl, seq_lens, h, SCALE, 0, 0.0, sinks)
    want = REF.paged_attention_qkv(rows, theirs[0], theirs[1], slots, tables, qsl, seq_lens, h, SCALE, 0, 0.0, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    q = rows[:, : h * d].reshape(4, h, d)  # [N, H, D]
    paged = OPS.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window, 0.0, sinks)
    want = REF.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window, 0.0, sinks)
    torch.testing.assert_close(paged, want, rtol=1e-5, atol=1e-5)
    plain = OPS.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window)
    assert float((paged - plain).abs().max()) > 0.05
    if OPS.backend == "avx2":
        with pytest.raises(RuntimeError, match=r"sinks must be \[H\] = \[4\]"):
            OPS.paged_attention(q, mine[0], mine[1], tables, qsl, seq_lens, SCALE, window, 0.0, sinks[:3])
