"""``ConversationCache``: a chat's KV cache across turns (``kvgen chat``)."""

from __future__ import annotations

import torch

from kvgen.generation import GenerationConfig, generate
from kvgen.generation.conversation import ConversationCache
from kvgen.loader import load_model


def test_chat_reuses_the_conversations_cache_and_replies_as_a_full_prefill(tiny_model_dir):
    """Each turn prefills only the prompt after what the cache shares with it; replies equal a full prefill's."""
    model, tok = load_model(tiny_model_dir)
    history, messages, cfg = ConversationCache(model), [], GenerationConfig(max_new_tokens=8)
    for turn, question in enumerate(["Name three colours.", "And three more?", "Thanks!"]):
        messages.append({"role": "user", "content": question})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        cache = history.reuse(ids)
        reused = cache.seq_length
        assert (reused > len(ids) // 2) if turn else reused == 0  # the earlier turns come from the cache
        assert history.token_ids == ids[:reused]
        out = generate(model, torch.tensor([ids]), None, cfg, past_key_values=cache)
        assert out.new_token_ids == generate(model, torch.tensor([ids]), None, cfg).new_token_ids
        history.record(ids, out.new_token_ids[0])
        messages.append({"role": "assistant", "content": tok.decode(out.new_token_ids[0], skip_special_tokens=True)})
    # a prompt departing from the cached tokens early (an edited turn) crops the cache there
    assert history.reuse(ids[:3] + [7, 7]).seq_length == 3 and history.token_ids == ids[:3]
