"""Diverse (group) beam search: token- and score-identical to transformers 4.55 on the default
model; each prompt of a padded batch gets the beams it gets alone."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_batched_equals_alone, assert_padded_beams_match_transformers

from kvgen.generation import GenerationConfig, generate
from kvgen.generation.group_beam_search import Hypotheses

NEW_TOKENS = 16

SETTINGS = {
    "2 groups of 2": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "num_return_sequences": 2},
    "3 groups of 2, early_stopping=True": {
        "num_beams": 6, "num_beam_groups": 3, "diversity_penalty": 0.5, "num_return_sequences": 3, "early_stopping": True
    },
}


def _prompts(tok) -> list[list[int]]:
    question = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    chat = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True)
    return [tok.encode("The capital of France is"), chat, tok.encode("Once upon a time, in a small village,")]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_group_beam_search_matches_transformers(ours_default, hf_default, name):
    model, tok = ours_default
    kwargs = SETTINGS[name]
    reasons = []
    for prompt in _prompts(tok):
        ids = torch.tensor([prompt])
        ours = generate(model, ids, None, GenerationConfig(max_new_tokens=NEW_TOKENS, **kwargs))
        with torch.inference_mode():
            ref = hf_default.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, eos_token_id=tok.eos_token_ids,
                pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_scores=True, **kwargs,
            )
        assert ours.sequences.tolist() == ref.sequences.tolist()
        torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores)
        reasons += ours.finish_reasons
    assert "stop" in reasons and "length" in reasons  # EOS hypotheses and max-length ones both ranked


def test_group_beam_search_with_stop_strings_matches_transformers(ours_default, hf_default, hf_default_tokenizer):
    """transformers stops group beam search only when every beam's last token ends a stop string at once; beams
    that ran past a match earlier do not count."""
    tok = ours_default[1]
    prompts = [tok.encode("The capital of France is"), tok.encode("Once upon a time, in a small village,")]
    ours = assert_padded_beams_match_transformers(ours_default, hf_default, hf_default_tokenizer, prompts, NEW_TOKENS,
                                                  **SETTINGS["2 groups of 2"], stop_strings=[".", ","])
    assert any(s in tok.decode(row) for row in ours.new_token_ids for s in ".,")  # beams ran past a match


def test_diversity_penalty_changes_the_later_groups(ours_default):
    model, tok = ours_default
    ids = torch.tensor([tok.encode("Once upon a time, in a small village,")])
    settings = {"max_new_tokens": 8, "num_beams": 4, "num_beam_groups": 2, "num_return_sequences": 4}
    plain = generate(model, ids, None, GenerationConfig(**settings, diversity_penalty=1e-6))  # 0 refused, as HF
    diverse = generate(model, ids, None, GenerationConfig(**settings, diversity_penalty=5.0))
    assert len(set(map(tuple, diverse.new_token_ids))) > len(set(map(tuple, plain.new_token_ids)))


def test_batched_group_beam_search_gives_each_prompt_its_beams_alone(ours_default):
    model, tok = ours_default
    prompts = _prompts(tok)
    cfg = GenerationConfig(max_new_tokens=12, cache_implementation="static", **SETTINGS["2 groups of 2"])
    assert_batched_equals_alone(model, prompts, tok.pad_token_id, cfg, rows_per_prompt=2)


def test_hypotheses_keep_the_n_best_and_apply_the_length_penalty():
    hyps = Hypotheses(num_beams=2, length_penalty=1.0, early_stopping=False, max_new_tokens=10)
    hyps.add([1, 2], -4.0, 2, "stop")  # score -2
    hyps.add([1, 3, 4], -3.0, 3, "stop")  # score -1
    hyps.add([1, 5], -10.0, 2, "stop")  # score -5: worse than both, dropped
    hyps.add([1, 6, 7, 8], -2.0, 4, "length")  # score -0.5: evicts -2
    assert sorted(score for score, _, _ in hyps.beams) == [-1.0, -0.5]
    assert hyps.worst_score == -1.0
    assert not hyps.is_done(best_sum_logprobs=-1.0, num_new=2)  # -0.5 > worst: a live beam may still win
    assert hyps.is_done(best_sum_logprobs=-4.0, num_new=2)
