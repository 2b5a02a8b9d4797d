"""Sample-and-rank (best_of): seeded runs repeat, the returned samples are the best-scored of
all drawn, in score order, and each score equals a recomputation from the model's logits."""

from __future__ import annotations

import pytest
import torch
from helpers import left_pad

from kvgen.generation import GenerationConfig, generate
from kvgen.generation.runner import positions_from_mask

NEW_TOKENS = 16


def _batch(tok):
    question = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    chat = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True)
    rows = [tok.encode("Once upon a time, in a small village,"), chat]
    return rows, *left_pad(rows, tok.pad_token_id)


def _model_logprob(model, prompt: list[int], new_ids: list[int]) -> float:
    """Sum of log softmax(raw logits) of ``new_ids`` after ``prompt``, one uncached forward."""
    ids = torch.tensor([prompt + new_ids])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions_from_mask(torch.ones_like(ids))))  # [1, T, V]
    logprobs = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)  # [T_new, V]
    return float(logprobs.gather(1, torch.tensor(new_ids)[:, None]).sum())


@pytest.fixture(scope="module")
def ranked(ours_default):
    model, tok = ours_default
    rows, ids, mask = _batch(tok)
    cfg = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=True, best_of=4, num_return_sequences=4, temperature=0.7, seed=11
    )
    return rows, ids, mask, cfg, generate(model, ids, mask, cfg)


def test_scores_are_recomputed_from_the_models_logits_and_sorted(ours_default, ranked):
    model, _ = ours_default
    rows, _, _, _, out = ranked
    assert out.sequences.shape[0] == 8 and out.sequences_scores.shape == (8,)
    for i, new_ids in enumerate(out.new_token_ids):
        expected = _model_logprob(model, rows[i // 4], new_ids) / len(new_ids)  # length_penalty=1.0: mean
        assert out.sequences_scores[i].item() == pytest.approx(expected, abs=1e-4)
    for p in range(2):
        scores = out.sequences_scores[4 * p : 4 * p + 4].tolist()
        assert scores == sorted(scores, reverse=True)
    assert "stop" in out.finish_reasons  # the chat prompt's samples end on EOS; its score counts the EOS


def test_fewer_returned_sequences_are_the_best_of_the_same_draws(ours_default, ranked):
    model, _ = ours_default
    _, ids, mask, cfg, everything = ranked
    best = generate(model, ids, mask, cfg.replace(num_return_sequences=2))
    for p in range(2):
        assert best.new_token_ids[2 * p : 2 * p + 2] == everything.new_token_ids[4 * p : 4 * p + 2]
        torch.testing.assert_close(
            best.sequences_scores[2 * p : 2 * p + 2], everything.sequences_scores[4 * p : 4 * p + 2]
        )


def test_seeded_sample_and_rank_is_reproducible(ours_default, ranked):
    model, _ = ours_default
    _, ids, mask, cfg, first = ranked
    again = generate(model, ids, mask, cfg.replace(seed=None), generator=torch.Generator().manual_seed(11))
    other = generate(model, ids, mask, cfg.replace(seed=12))
    assert again.sequences.tolist() == first.sequences.tolist()
    assert other.sequences.tolist() != first.sequences.tolist()


def test_length_penalty_zero_ranks_by_total_log_probability(ours_default, ranked):
    model, _ = ours_default
    rows, ids, mask, cfg, _ = ranked
    out = generate(model, ids, mask, cfg.replace(length_penalty=0.0, num_return_sequences=4))
    for i, new_ids in enumerate(out.new_token_ids):
        assert out.sequences_scores[i].item() == pytest.approx(_model_logprob(model, rows[i // 4], new_ids), abs=1e-3)
