"""``kvgen.perplexity``: a window's NLL from its cached forward equals the NLL of a forward without a cache.

The float32 path is checked against transformers in ``test_cli.py``; here the quantized default path (one-op decoder
and fused cache attention, which ``window_nll`` takes by filling a static cache) is checked against the same weights'
forward without a cache (layer by layer, ``kernels.attention`` on the new keys).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgen.perplexity import perplexity, window_nll, windows


def _uncached_nll(model: torch.nn.Module, window: list[int]) -> float:
    ids = torch.tensor([window])  # [1, T]
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(window))[None], None)  # [1, T, C]
        logits = model.compute_logits(hidden[0, :-1])  # [T-1, V]
    return float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))


@pytest.mark.parametrize("length", [2, 37, 300])
def test_window_nll_equals_the_uncached_forward(ours_default_auto, length: int) -> None:
    model, _ = ours_default_auto
    window = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    assert window_nll(model, window) == pytest.approx(_uncached_nll(model, window), rel=1e-6, abs=1e-5)


def test_perplexity_sums_the_windows(ours_default_auto) -> None:
    model, _ = ours_default_auto
    ids = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = windows(ids, 64)  # 64, 64, 22 tokens
    result = perplexity(model, ids, 64)
    nll = sum(_uncached_nll(model, c) for c in chunks)
    assert (result.num_windows, result.num_tokens_scored) == (3, 147)
    assert result.mean_nll == pytest.approx(nll / 147, rel=1e-6)
