"""``kvgen.perplexity``: a window's NLL from its cached forward equals the NLL of a forward without a cache.

The float32 path is checked against transformers in ``test_cli.py``; here the quantized default path (one-op decoder
and fused cache attention, which ``window_nll`` takes by filling a static cache) is checked against the same weights'
forward without a cache (layer by layer, ``kernels.attention`` on the new keys).
"""

from __future__ import annotations

import math

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


def test_perplexity_is_token_weighted_as_transformers_on_uneven_windows(tiny_model) -> None:
    """31 tokens in windows of 10: 10, 10, 10 and a 1-token tail (dropped); every window's tokens 2..n are scored
    and the mean is over tokens, not windows (checked on transformers' logits of the same weights)."""
    ref, ours = tiny_model("llama")
    ids = torch.randint(0, 97, (31,), generator=torch.Generator().manual_seed(1)).tolist()
    ids[10:20] = [ids[10]] * 10  # a window much easier than the others: window-weighting would differ
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in (ids[0:10], ids[10:20], ids[20:30]):
            nll += float(F.cross_entropy(ref(torch.tensor([w])).logits[0, :-1], torch.tensor(w[1:]), reduction="sum"))
            count += len(w) - 1
    result = perplexity(ours, ids, 10)
    assert (result.num_windows, result.num_tokens_scored) == (3, count)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)


@pytest.mark.parametrize("token_ids,context_length,message", [
    ([1, 97], 8, "token_ids must be in [0, 97), got 97"),  # was IndexError (RuntimeError on the kernels)
    ([1, -1, 3], 8, "token_ids must be in [0, 97), got -1"),
    ([1.0, 2.0], 8, "token ids must be ints, got 1.0"),  # was RuntimeError from the embedding
    ([1, 2, 3], 8.0, "context_length must be an int, got 8.0"),  # was TypeError from range()
    ([1, 2, 3], "8", "context_length must be an int, got '8'"),
    ([1, 2, 3], True, "context_length must be an int, got True"),
])
def test_bad_input_is_a_value_error_naming_it(tiny_model, token_ids, context_length, message) -> None:
    _, ours = tiny_model("llama")
    with pytest.raises(ValueError) as e:
        perplexity(ours, token_ids, context_length)
    assert message in str(e.value)


def test_a_mean_nll_past_float_range_is_infinite_perplexity(tiny_model) -> None:
    """Weights of std 30 give a mean NLL of thousands of nats: perplexity is inf, as torch.exp of transformers' NLL
    (math.exp raised OverflowError: `kvgen perplexity` exited 1 with an internal error)."""
    ref, ours = tiny_model("llama", std=30.0, tie=True)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        nll = F.cross_entropy(ref(torch.tensor([ids])).logits[0, :-1], torch.tensor(ids[1:]))  # mean, nats
    result = perplexity(ours, ids, 64)
    assert result.mean_nll == pytest.approx(float(nll), rel=1e-4)
    assert result.perplexity == float(torch.exp(nll)) == math.inf
