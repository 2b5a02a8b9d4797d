"""generate(past_key_values=...): a cache holding a prompt's first tokens is continued, not recomputed — the same
tokens and scores as prefilling the whole prompt, transformers' tokens with its own reused DynamicCache, and the
cache left holding the sequence but its last token (ready for the next chat turn)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import random_ids

from kvgen.errors import ContextLengthError
from kvgen.generation import GenerationConfig, generate, make_cache

NEW = 12


def _filled(model, prefix: torch.Tensor, kind: str = "dynamic"):
    """A cache of ``kind`` holding ``prefix`` [B, S] (a 1-token generate leaves the S prompt tokens)."""
    cache = make_cache(model, kind, prefix.shape[0], 64)
    generate(model, prefix, None, GenerationConfig(max_new_tokens=1), past_key_values=cache)
    assert cache.seq_length == prefix.shape[1]
    return cache


STRATEGIES = {
    "greedy": {},
    "sample": {"do_sample": True, "seed": 3, "top_k": 20},
    "beam_search": {"num_beams": 3, "num_return_sequences": 2},
    "prompt_lookup": {"prompt_lookup_num_tokens": 3},
}


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_reused_prefix_gives_the_tokens_and_scores_of_a_full_prefill(tiny_model, kind, strategy):
    ours = tiny_model("llama").ours
    ids = random_ids(1, 2 if strategy != "prompt_lookup" else 1, 20, 97)  # [B, 20]
    cfg = GenerationConfig(max_new_tokens=NEW, eos_token_id=[], output_scores=True, **STRATEGIES[strategy])
    want = generate(ours, ids, None, cfg)
    cache = _filled(ours, ids[:, :13], kind)
    got = generate(ours, ids, None, cfg, past_key_values=cache)
    assert got.new_token_ids == want.new_token_ids
    assert got.timings.prefill_s > 0
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_cache_is_left_holding_the_sequence_but_its_last_token(tiny_model):
    ours = tiny_model("llama").ours
    ids = random_ids(2, 1, 16, 97)  # [1, 16]
    cache = make_cache(ours)
    first = generate(ours, ids[:, :9], None, GenerationConfig(max_new_tokens=5, eos_token_id=[]), past_key_values=cache)
    assert cache.seq_length == 9 + 5 - 1
    # the next turn: the first answer, then more prompt tokens; only those after the cache's tokens are prefilled
    turn2 = torch.cat([first.sequences, ids[:, 9:]], dim=1)  # [1, 9 + 5 + 7]
    want = generate(ours, turn2, None, GenerationConfig(max_new_tokens=NEW, eos_token_id=[]))
    got = generate(ours, turn2, None, GenerationConfig(max_new_tokens=NEW, eos_token_id=[]), past_key_values=cache)
    assert got.new_token_ids == want.new_token_ids and cache.seq_length == turn2.shape[1] + NEW - 1
    cache.crop(4)  # a shorter shared prefix: the rest is prefilled again
    again = generate(ours, turn2, None, GenerationConfig(max_new_tokens=NEW, eos_token_id=[]), past_key_values=cache)
    assert again.new_token_ids == want.new_token_ids


def test_assisted_decoding_continues_a_cache(tiny_model):
    ours = tiny_model("llama").ours
    ids = random_ids(4, 1, 18, 97)
    cfg = GenerationConfig(max_new_tokens=NEW, eos_token_id=[], num_assistant_tokens=3)
    want = generate(ours, ids, None, cfg)
    cache = _filled(ours, ids[:, :10])
    got = generate(ours, ids, None, cfg, assistant_model=ours, past_key_values=cache)
    assert got.new_token_ids == want.new_token_ids and cache.seq_length == 18 + NEW - 1


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_greedy_tokens_equal_transformers_reusing_its_dynamic_cache(tiny_model, model_type):
    pair = tiny_model(model_type)
    ids = random_ids(5, 1, 24, 97)  # [1, 24]
    hf_cache = transformers.DynamicCache()
    with torch.inference_mode():
        pair.ref(ids[:, :15], past_key_values=hf_cache, use_cache=True)
        ref = pair.ref.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=hf_cache, do_sample=False,
                                max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
    got = generate(pair.ours, ids, None, GenerationConfig(max_new_tokens=NEW, eos_token_id=[]),
                   past_key_values=_filled(pair.ours, ids[:, :15]))
    assert got.new_token_ids[0] == ref[0, 24:].tolist()


def test_bad_caches_are_refused_naming_the_problem(tiny_model):
    ours, other = tiny_model("llama").ours, tiny_model("llama", kv_heads=4).ours
    ids = random_ids(6, 2, 10, 97)
    greedy = GenerationConfig(max_new_tokens=4)
    cases = [
        ({"past_key_values": {"k": 1}}, greedy, ids, "must be a kvgen DynamicCache or StaticCache"),
        ({"past_key_values": make_cache(ours, batch_size=2)}, greedy.replace(use_cache=False), ids, "use_cache=True"),
        ({"past_key_values": make_cache(ours, batch_size=2)}, greedy.replace(penalty_alpha=0.6, top_k=4), ids,
         "contrastive search"),
        ({"past_key_values": make_cache(other, batch_size=2)}, greedy, ids, "not made for this model"),
        ({"past_key_values": make_cache(ours, batch_size=1)}, greedy, ids, "holds 1 rows; input_ids has 2 prompts"),
        ({"past_key_values": _filled(ours, ids)}, greedy, ids, "must extend them by at least one"),
    ]
    for kwargs, cfg, batch, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(ours, batch, None, cfg, **kwargs)
    with pytest.raises(ValueError, match="unpadded batch"):
        generate(ours, ids, torch.tensor([[0] + [1] * 9, [1] * 10]), greedy, past_key_values=make_cache(ours, batch_size=2))
    with pytest.raises(ContextLengthError, match="StaticCache of 12 tokens"):
        generate(ours, ids, None, greedy, past_key_values=make_cache(ours, "static", 2, 12))
    # sampled prompt lookup drafts up to prompt_lookup_num_tokens past max_new_tokens: refused before it overflows
    lookup = GenerationConfig(max_new_tokens=2, prompt_lookup_num_tokens=3, do_sample=True, seed=0)
    with pytest.raises(ContextLengthError, match="StaticCache of 12 tokens.*with the drafts"):
        generate(ours, ids[:1], None, lookup, past_key_values=make_cache(ours, "static", 1, 12))
    assert generate(ours, ids[:1], None, lookup, past_key_values=make_cache(ours, "static", 1, 15)).num_new_tokens == [2]


def test_a_reused_prefix_on_the_default_models_kernels(ours_default_auto):
    """The quantized fast path (fp16 cache, the C++ attention over a prefix): the same greedy tokens."""
    model, tok = ours_default_auto
    ids = torch.tensor([tok.encode("The three primary colours are red, yellow and blue. The three secondary")])
    cfg = GenerationConfig(max_new_tokens=16, eos_token_id=[])
    want = generate(model, ids, None, cfg)
    for kind in ("dynamic", "static"):
        got = generate(model, ids, None, cfg, past_key_values=_filled(model, ids[:, :7], kind))
        assert got.new_token_ids == want.new_token_ids


@pytest.mark.parametrize("settings", [{"num_beams": 3, "num_return_sequences": 3}, {"num_beams": 3},
                                      {"do_sample": True, "best_of": 3, "num_return_sequences": 2, "seed": 5}])
def test_after_beams_or_ranked_samples_each_returned_row_continues_from_its_cache_row(tiny_model, settings):
    """The cache's rows at the last step are beams (or candidates) in search order, not the returned rows: it is left
    holding each returned row's prompt, so continuing every returned sequence equals a full prefill."""
    ours = tiny_model("llama").ours
    ids = random_ids(7, 1, 10, 97)  # [1, 10]
    cache = make_cache(ours)
    out = generate(ours, ids, None, GenerationConfig(max_new_tokens=6, eos_token_id=[], **settings), past_key_values=cache)
    turn2 = torch.cat([out.sequences, random_ids(8, 1, 5, 97).repeat(out.sequences.shape[0], 1)], dim=1)  # [N, 21]
    cfg = GenerationConfig(max_new_tokens=NEW, eos_token_id=[])
    want = generate(ours, turn2, torch.ones_like(turn2), cfg)
    got = generate(ours, turn2, torch.ones_like(turn2), cfg, past_key_values=cache)
    assert got.new_token_ids == want.new_token_ids
