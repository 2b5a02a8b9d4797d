"""``ConversationCache``: one conversation's KV cache kept between ``generate()`` calls (``kvgen chat``)."""

from __future__ import annotations

from kvgen.generation.runner import make_cache
from kvgen.kv_cache import DynamicCache, StaticCache
from kvgen.models import CausalLM


class ConversationCache:
    """A chat's KV cache across turns, as llama.cpp's chat keeps its context: each turn prefills only the prompt
    tokens after the longest prefix it shares with the tokens the cache holds (the template re-renders earlier
    replies, which may tokenize differently from how they were generated)."""

    def __init__(self, model: CausalLM, kv_cache_dtype: str = "auto") -> None:
        """``kv_cache_dtype``: "auto" or "int8" (:func:`make_cache`, whose ``ValueError`` it raises)."""
        self.cache = make_cache(model, kv_cache_dtype=kv_cache_dtype)
        self.token_ids: list[int] = []  # what the cache holds, in order

    def reuse(self, prompt_ids: list[int]) -> DynamicCache | StaticCache:
        """The cache cropped to the prompt's shared prefix (at most all but its last token), for ``generate``."""
        shared = next((i for i, (a, b) in enumerate(zip(self.token_ids, prompt_ids)) if a != b),
                      min(len(self.token_ids), len(prompt_ids)))
        self.cache.crop(min(shared, len(prompt_ids) - 1))
        self.token_ids = self.token_ids[: self.cache.seq_length]
        return self.cache

    def record(self, prompt_ids: list[int], new_token_ids: list[int]) -> None:
        """After ``generate``, which leaves the cache holding the prompt and the reply but its last token."""
        self.token_ids = (prompt_ids + new_token_ids)[: self.cache.seq_length]
        assert len(self.token_ids) == self.cache.seq_length, (len(self.token_ids), self.cache.seq_length)
