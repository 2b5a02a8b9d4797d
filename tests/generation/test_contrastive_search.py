"""Contrastive search: token-identical to transformers 4.55 on the default model, alone and in a
left-padded batch; the ranking rule on hand-made hidden states."""

from __future__ import annotations

import pytest
import torch
from helpers import left_pad, make_tiny_model

from kvgen.generation import GenerationConfig, generate
from kvgen.generation.contrastive_search import rank_candidates

NEW_TOKENS = 16


def _prompts(tok) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=True)
    return [tok.encode("The capital of France is"), chat, tok.encode("Once upon a time, in a small village,")]


def _hf(hf, tok, ids, mask, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return hf.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=tok.eos_token_ids,
            pad_token_id=tok.pad_token_id, **kwargs,
        )


@pytest.mark.parametrize("kwargs", [{"penalty_alpha": 0.6, "top_k": 4}, {"penalty_alpha": 0.3, "top_k": 6}])
def test_contrastive_search_matches_transformers_per_prompt(ours_default, hf_default, kwargs):
    model, tok = ours_default
    for prompt in _prompts(tok):
        ids = torch.tensor([prompt])
        ours = generate(model, ids, None, GenerationConfig(max_new_tokens=NEW_TOKENS, **kwargs))
        assert ours.sequences.tolist() == _hf(hf_default, tok, ids, torch.ones_like(ids), **kwargs).tolist()


def test_contrastive_search_padded_batch_matches_transformers_and_each_prompt_alone(ours_default, hf_default):
    model, tok = ours_default
    prompts = _prompts(tok)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, penalty_alpha=0.6, top_k=4, cache_implementation="static")
    batched = generate(model, ids, mask, cfg)
    assert batched.sequences.tolist() == _hf(hf_default, tok, ids, mask, penalty_alpha=0.6, top_k=4).tolist()
    for i, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), None, cfg)
        assert batched.new_token_ids[i] == alone.new_token_ids[0]
        assert batched.finish_reasons[i] == alone.finish_reasons[0]
    assert "stop" in batched.finish_reasons


def test_ranking_penalises_similarity_to_the_context_but_not_to_padding():
    context = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]]])  # [B=1, S=3, C=2]
    candidates = torch.tensor([[[2.0, 0.0], [1.0, -1.0]]])  # [1, K=2, C]: cos 1 with column 0 / with column 2
    probs = torch.tensor([[0.6, 0.4]])
    pad_last = torch.tensor([[1, 1, 0]])
    assert rank_candidates(context, candidates, probs, pad_last, penalty_alpha=0.0).tolist() == [0]  # greedy
    # 0.5*0.6 - 0.5*1 = -0.2 < 0.5*0.4 - 0.5*cos45 = -0.15: the repeat of column 0 loses
    assert rank_candidates(context, candidates, probs, pad_last, penalty_alpha=0.5).tolist() == [1]
    # counting column 2 as context makes candidate 1 a repeat too (0.2 - 0.5 = -0.3)
    assert rank_candidates(context, candidates, probs, torch.ones_like(pad_last), penalty_alpha=0.5).tolist() == [0]


def test_uncached_contrastive_search_scores_finished_rows_as_transformers_cached_run():
    """A row that finishes first keeps running on its chosen candidates (transformers' cache holds their keys, its
    input_ids the padding): without a cache, kvgen must feed the same tokens, not the padding it returns."""
    tiny = make_tiny_model("llama", std=0.5)
    ids, mask = left_pad([[5, 17, 33], [40, 8, 61, 22, 9], [70, 3]], 0)
    kwargs = {"penalty_alpha": 0.6, "top_k": 3, "max_new_tokens": 6, "pad_token_id": 0}
    probe = generate(tiny.ours, ids, mask, **kwargs)
    eos = probe.new_token_ids[0][1]  # row 0 stops after 2 tokens: 4 more steps as an idle row
    with torch.inference_mode():
        hf = tiny.ref.generate(ids, attention_mask=mask, eos_token_id=eos, return_dict_in_generate=True,
                               output_scores=True, **kwargs)
    ours = generate(tiny.ours, ids, mask, eos_token_id=eos, use_cache=False, output_scores=True, **kwargs)
    assert ours.finish_reasons[0] == "stop" and len(hf.scores) == 6
    assert ours.sequences.tolist() == hf.sequences.tolist()
    for step, (theirs, mine) in enumerate(zip(hf.scores, ours.scores, strict=True)):
        torch.testing.assert_close(mine, theirs, msg=lambda m, step=step: f"step {step}: {m}")
