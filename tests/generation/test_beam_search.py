"""Beam search and beam sample: token- and score-identical to transformers 4.55 on the
default model, each prompt of a padded batch gets the beams it gets alone, seeded runs repeat."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_batched_equals_alone, left_pad

from kvgen.generation import GenerationConfig, generate
from kvgen.generation.streamers import TextStreamer

NEW_TOKENS = 16

SETTINGS = {
    "4 beams, all returned": {"num_beams": 4, "num_return_sequences": 4},
    "no_repeat_ngram, early_stopping=True": {
        "num_beams": 3, "no_repeat_ngram_size": 2, "early_stopping": True, "length_penalty": 0.8, "num_return_sequences": 2
    },
    "early_stopping=never, length_penalty=1.5": {
        "num_beams": 4, "early_stopping": "never", "length_penalty": 1.5, "num_return_sequences": 2
    },
}


def _prompts(tok) -> list[list[int]]:
    question = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    chat = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True)
    return [tok.encode("The capital of France is"), chat, tok.encode("Once upon a time, in a small village,")]


def _hf_generate(hf, tok, ids: torch.Tensor, **kwargs):
    with torch.inference_mode():
        return hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, eos_token_id=tok.eos_token_ids,
            pad_token_id=tok.pad_token_id, return_dict_in_generate=True, **{"output_scores": True, **kwargs},
        )


@pytest.mark.parametrize("name", list(SETTINGS))
def test_beam_search_matches_transformers(ours_default, hf_default, name):
    model, tok = ours_default
    kwargs = SETTINGS[name]
    reasons = []
    for i, prompt in enumerate(_prompts(tok)):
        ids = torch.tensor([prompt])
        with_logits = {"output_scores": True, "output_logits": True} if i == 0 else {}
        ours = generate(model, ids, None, GenerationConfig(max_new_tokens=NEW_TOKENS, **kwargs, **with_logits))
        ref = _hf_generate(hf_default, tok, ids, **kwargs, **with_logits)
        assert ours.sequences.tolist() == ref.sequences.tolist()
        torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores)
        assert ours.sequences.shape[0] == kwargs["num_return_sequences"]
        assert ours.sequences_scores.tolist() == sorted(ours.sequences_scores.tolist(), reverse=True)
        if with_logits:  # per-step processed log-probs and raw logits of every beam row
            assert len(ours.scores) == len(ref.scores) and len(ours.logits) == len(ref.logits)
            for got, want in zip(ours.scores + ours.logits, ref.scores + ref.logits):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        reasons += ours.finish_reasons
    assert "stop" in reasons and "length" in reasons  # EOS hypotheses and max-length ones both ranked


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batched_beam_search_gives_each_prompt_its_beams_alone(ours_default, cache):
    model, tok = ours_default
    prompts = _prompts(tok)
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, num_beams=3, num_return_sequences=2, cache_implementation=cache)
    assert_batched_equals_alone(model, prompts, tok.pad_token_id, cfg, rows_per_prompt=2)


def test_beam_sample_matches_transformers_for_the_same_seed(ours_default, hf_default):
    model, tok = ours_default
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "do_sample": True, "temperature": 0.8}
    for prompt in _prompts(tok)[:2]:
        ids = torch.tensor([prompt])
        ours = generate(model, ids, None, GenerationConfig(max_new_tokens=NEW_TOKENS, seed=1, **kwargs))
        torch.manual_seed(1)  # transformers draws from the global generator
        ref = _hf_generate(hf_default, tok, ids, **kwargs)
        assert ours.sequences.tolist() == ref.sequences.tolist()
        torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores)


def test_beam_sample_is_reproducible_per_seed(ours_default):
    model, tok = ours_default
    prompts = _prompts(tok)
    ids, mask = left_pad([prompts[0], prompts[2]], tok.pad_token_id)
    cfg = GenerationConfig(max_new_tokens=12, num_beams=2, do_sample=True, top_k=0, temperature=1.5, seed=5)
    a = generate(model, ids, mask, cfg)
    b = generate(model, ids, mask, cfg)
    c = generate(model, ids, mask, cfg.replace(seed=6))
    assert a.sequences.tolist() == b.sequences.tolist()
    assert a.sequences.tolist() != c.sequences.tolist()
    d = generate(model, ids, mask, cfg.replace(seed=None), generator=torch.Generator().manual_seed(5))
    assert d.sequences.tolist() == a.sequences.tolist()


def test_beam_finish_reasons_for_stop_strings_and_time(ours_default):
    model, tok = ours_default
    ids = torch.tensor([tok.encode("The capital of France is")])
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, num_beams=3, num_return_sequences=3, stop_strings=["."])
    out = generate(model, ids, None, cfg, tokenizer=tok)
    for reason, new_ids in zip(out.finish_reasons, out.new_token_ids):
        assert reason in ("stop_string", "length")
        assert ("." in tok.decode(new_ids)) == (reason == "stop_string")
    assert "stop_string" in out.finish_reasons
    timed = generate(model, ids, None, cfg.replace(stop_strings=None, max_time=1e-6))
    assert timed.finish_reasons == ["time"] * 3 and timed.num_new_tokens == [1, 1, 1]


def test_streamer_with_beams_raises(ours_default):
    model, tok = ours_default
    with pytest.raises(ValueError, match="streamer cannot be used with beam_search"):
        generate(model, torch.tensor([tok.encode("Hi")]), None, GenerationConfig(num_beams=2),
                 streamer=TextStreamer(tok))
