"""``prefill_chunk_size``: the prompt prefilled a few tokens per forward (transformers' ``_prefill_chunking``: every
prompt token but the last in chunks, then the last as the first step), with greedy search and sampling only."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyModel, left_pad, make_tiny_model

from kvgen.generation import GenerationConfig, generate

PROMPTS = [[5, 17, 42, 8, 61, 3, 29, 14, 9, 77], [11, 70], [88, 4, 19, 33]]  # 10, 2 and 4 tokens
IDS, MASK = left_pad(PROMPTS, 1)  # [3, 10]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return make_tiny_model(request.param, std=0.5)


@pytest.mark.parametrize("settings", [{}, {"do_sample": True, "seed": 4, "num_return_sequences": 2}])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunked_prefill_gives_the_unchunked_tokens_and_scores(tiny: TinyModel, settings: dict, cache: str) -> None:
    """A padded batch, chunks of 3 (four forwards before the last prompt column): tokens and every step's scores
    as one prefill forward gives them."""
    common = {"max_new_tokens": 8, "eos_token_id": [], "pad_token_id": 1, "output_scores": True,
              "cache_implementation": cache, **settings}
    whole = generate(tiny.ours, IDS, MASK, **common)
    chunked = generate(tiny.ours, IDS, MASK, prefill_chunk_size=3, **common)
    assert chunked.sequences.tolist() == whole.sequences.tolist()
    assert chunked.scores is not None and whole.scores is not None
    for got, want in zip(chunked.scores, whole.scores, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_matches_transformers(tiny: TinyModel) -> None:
    """One unpadded prompt: transformers' tokens, and its recorded first step (the last prompt column only)."""
    ids = torch.tensor([PROMPTS[0]])
    common = {"max_new_tokens": 6, "pad_token_id": 1, "prefill_chunk_size": 4, "output_hidden_states": True}
    with torch.inference_mode():
        ref = tiny.ref.generate(ids, eos_token_id=None, return_dict_in_generate=True, **common)
    ours = generate(tiny.ours, ids, None, eos_token_id=[], **common)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert ours.hidden_states is not None
    assert ours.hidden_states[0][-1].shape == ref.hidden_states[0][-1].shape == (1, 1, tiny.ours.config.hidden_size)
    torch.testing.assert_close(ours.hidden_states[0][-1], ref.hidden_states[0][-1], rtol=1e-4, atol=5e-4)


def test_prefill_chunk_size_refusals() -> None:
    with pytest.raises(ValueError, match="prefill_chunk_size works with greedy search or sampling only"):
        GenerationConfig(prefill_chunk_size=4, num_beams=2)
    with pytest.raises(ValueError, match="prefill_chunk_size=4 conflicts with use_cache=False"):
        GenerationConfig(prefill_chunk_size=4, use_cache=False)
    with pytest.raises(ValueError, match=r"prefill_chunk_size must be an int in \[1, 2147483647\], got 0"):
        GenerationConfig(prefill_chunk_size=0)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunked_prefill_on_the_kernel_path(ours_default_auto, cache: str) -> None:
    """The quantized default model: chunks of 5 over a 40-token prompt give the tokens of one prefill."""
    model, tokenizer = ours_default_auto
    ids = torch.tensor([tokenizer.encode("A KV cache keeps the keys and values of earlier tokens, so that each new "
                                         "token attends to them without recomputing the whole prompt. Explain why:")])
    assert ids.shape[1] > 20
    kwargs = {"max_new_tokens": 12, "cache_implementation": cache}
    assert generate(model, ids, None, prefill_chunk_size=5, **kwargs).new_token_ids == generate(
        model, ids, None, **kwargs).new_token_ids


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_long_prefill_on_the_kernels_goes_in_chunks_with_the_same_bits(ours_default_auto, monkeypatch, cache: str
                                                                        ) -> None:
    """Over ``PREFILL_CHUNK_TOKENS`` tokens (8 here) a prefill on the kernels goes in column chunks (a left-padded
    batch of 2: 4 columns a forward) with no option set: every step's scores and the tokens are those of one
    forward, to the bit, and so is a perplexity window's NLL."""
    from kvgen.generation import runner
    from kvgen.perplexity import window_nll

    model, tokenizer = ours_default_auto
    rows = [tokenizer.encode("Paged attention stores the KV cache in fixed-size blocks, so that"), tokenizer.encode(
        "The capital of France is")]
    ids, mask = left_pad(rows, 0)  # [2, T]
    kwargs = {"max_new_tokens": 5, "output_scores": True, "cache_implementation": cache, "eos_token_id": []}
    forwards = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *args: forwards.append(args[0].shape) or forward(*args))
    monkeypatch.setattr(runner, "PREFILL_CHUNK_TOKENS", 1 << 30)
    whole, whole_nll = generate(model, ids, mask, **kwargs), window_nll(model, rows[0])
    assert forwards[0] == ids.shape and len(forwards) == 1 + 4 + 1  # prefill, 4 steps, the window
    monkeypatch.setattr(runner, "PREFILL_CHUNK_TOKENS", 8)
    forwards.clear()
    chunked, chunked_nll = generate(model, ids, mask, **kwargs), window_nll(model, rows[0])
    num_chunks = -(-ids.shape[1] // 4)
    assert forwards[:num_chunks] == [(2, min(4, ids.shape[1] - c)) for c in range(0, ids.shape[1], 4)]
    assert len(forwards) == num_chunks + 4 + -(-len(rows[0]) // 8)
    assert chunked.sequences.tolist() == whole.sequences.tolist()
    assert chunked.scores is not None and whole.scores is not None
    assert all(torch.equal(a, b) for a, b in zip(chunked.scores, whole.scores, strict=True))
    assert chunked_nll == whole_nll


def test_the_float32_path_prefills_in_one_forward(tiny: TinyModel, monkeypatch) -> None:
    """Without kernels (transformers' matrix products, whose results depend on their shapes) a long prompt still
    goes in one forward."""
    from kvgen.generation import runner

    monkeypatch.setattr(runner, "PREFILL_CHUNK_TOKENS", 2)
    forwards = []
    forward = tiny.ours.forward
    monkeypatch.setattr(tiny.ours, "forward", lambda *args: forwards.append(args[0].shape) or forward(*args))
    generate(tiny.ours, IDS, MASK, max_new_tokens=2, pad_token_id=1, eos_token_id=[])
    assert forwards == [IDS.shape, (3, 1)]
