"""Constrained beam search on the default model: token- and score-identical to transformers 4.55, the forced
words really appear, and each prompt of a padded batch gets the hypotheses it gets alone."""

from __future__ import annotations

import torch
from helpers import assert_batched_equals_alone, assert_padded_beams_match_transformers

from kvgen.generation import GenerationConfig, generate

NEW_TOKENS = 16


def _cases(tok) -> list[tuple[list[int], list]]:
    """(prompt, force_words_ids): a phrase, and a phrase plus a choice of two words."""
    lyon, lovely, charming = (tok.encode(w) for w in (" Lyon", " lovely", " charming"))
    story = tok.encode("Once upon a time, in a small village,")
    return [(tok.encode("The capital of France is"), [lyon]), (story, [tok.encode(" dragon"), [lovely, charming]])]


def test_constrained_beam_search_matches_transformers(ours_default, hf_default):
    model, tok = ours_default
    for prompt, force in _cases(tok):
        ids = torch.tensor([prompt])
        kwargs = {"num_beams": 4, "num_return_sequences": 2, "force_words_ids": force}
        ours = generate(model, ids, None, GenerationConfig(max_new_tokens=NEW_TOKENS, **kwargs))
        with torch.inference_mode():
            ref = hf_default.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, eos_token_id=tok.eos_token_ids,
                pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_scores=True, **kwargs)
        assert ours.sequences.tolist() == ref.sequences.tolist()
        torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores)
        best = tok.decode(ours.new_token_ids[0])
        words = [w if isinstance(w[0], list) else [w] for w in force]
        assert all(any(tok.decode(word).strip() in best for word in choice) for choice in words), best
        plain = generate(model, ids, None, GenerationConfig(max_new_tokens=NEW_TOKENS, num_beams=4))
        assert plain.sequences[0].tolist() != ours.sequences[0].tolist()  # the constraint changed the output


def test_batched_constrained_beam_search_gives_each_prompt_its_hypotheses_alone(ours_default):
    model, tok = ours_default
    (france, force), (story, _) = _cases(tok)
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, num_beams=4, num_return_sequences=2, force_words_ids=force,
                           cache_implementation="static")
    assert_batched_equals_alone(model, [france, story], tok.pad_token_id, cfg, rows_per_prompt=2)


def test_constrained_beam_search_with_stop_strings_matches_transformers(ours_default, hf_default,
                                                                       hf_default_tokenizer):
    """A stop string ends the search only when every beam's last token ends one at once (transformers)."""
    (france, force), (story, _) = _cases(ours_default[1])
    ours = assert_padded_beams_match_transformers(
        ours_default, hf_default, hf_default_tokenizer, [france, story], NEW_TOKENS, num_beams=4,
        num_return_sequences=2, force_words_ids=force, stop_strings=[".", ","])
    assert any("." in ours_default[1].decode(row) for row in ours.new_token_ids)  # beams ran past a stop string
