"""Classifier-free guidance's unconditional branch: the model run on a second, unconditional sequence with its own
KV cache, one step per generated token (transformers 4.55 ``UnbatchedClassifierFreeGuidanceLogitsProcessor``'s
``get_unconditional_logits``; the guidance arithmetic is ``kvgen.sampling.logits_process``'s processor)."""

from __future__ import annotations

import torch

from kvgen.generation.runner import make_cache
from kvgen.kv_cache import DynamicCache, StaticCache
from kvgen.models import CausalLM
from kvgen.models.attention import AttentionMetadata


class UnconditionalBranch:
    """``branch(token_ids [N, T]) -> logits [N, V]`` float32 for the token after an unconditional sequence: on the
    first call ``negative_prompt_ids`` [N, S] (``negative_prompt_attention_mask`` [N, S], 1 = token, default all
    ones), or without them each row's last token of ``token_ids``; on later calls the last column of ``token_ids``
    (the token just generated) is appended. Rows are never reordered (transformers does not reorder them under beam
    search either); positions count the sequence's columns, padding included, as transformers' cache positions.
    Raises ValueError for a negative prompt whose rows differ from ``token_ids``'s."""

    def __init__(self, model: CausalLM, negative_prompt_ids: torch.Tensor | None = None,
                 negative_prompt_attention_mask: torch.Tensor | None = None) -> None:
        self.model, self.ids, self.mask = model, negative_prompt_ids, negative_prompt_attention_mask
        self.cache: DynamicCache | StaticCache | None = None  # made by the first call

    @torch.inference_mode()
    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            ids = token_ids[:, -1:] if self.ids is None else self.ids  # [N, S]
            if ids.dim() != 2 or ids.shape[0] != token_ids.shape[0]:
                raise ValueError(f"negative_prompt_ids must be [N, S] with the N = {token_ids.shape[0]} rows being "
                                 f"generated, got {tuple(ids.shape)}")
            mask = torch.ones_like(ids) if self.mask is None else self.mask.to(ids.device)
            if mask.shape != ids.shape:
                raise ValueError(f"negative_prompt_attention_mask shape {tuple(mask.shape)} must equal "
                                 f"negative_prompt_ids shape {tuple(ids.shape)}")
            self.cache = make_cache(self.model, "dynamic", ids.shape[0])
        else:
            assert self.mask is not None  # set by the first call
            ids = token_ids[:, -1:]  # [N, 1]
            mask = torch.cat([self.mask, self.mask.new_ones(ids.shape[0], 1)], dim=1)
        self.mask = mask
        assert self.cache is not None
        past = self.cache.seq_length
        positions = torch.arange(past, past + ids.shape[1]).expand(ids.shape[0], -1)  # [N, T]
        meta = AttentionMetadata(None if bool(mask.all()) else mask)
        hidden = self.model(ids, positions, self.cache, meta)  # [N, T, C]
        return self.model.compute_logits(hidden[:, -1])  # [N, V]
