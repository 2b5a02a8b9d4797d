"""Gemma 2 decoder (Gemma-2-2B, 9B, 27B; Gemma Team 2024) as Gemma 3's with what Gemma 2 changes.

Gemma 2 has Gemma 3's layer (embeddings scaled by sqrt(hidden_size), ``1 + w`` RMSNorms, sandwich norms, GeGLU, the
scale ``query_pre_attn_scalar^-0.5``, sliding-window layers from ``layer_types``) without q/k norms and with one
RoPE (``rope_theta``) for every layer; the config decides both (``use_qk_norm`` False, no ``rope_local_base_freq``),
so :class:`~kvgen.models.gemma3.Gemma3ForCausalLM` builds it. What Gemma 2 adds is logit softcapping: attention
scores ``s -> c * tanh(s / c)`` (``attn_logit_softcapping``, 50; after the scale, before the mask and softmax, on
every attention path: ``Gemma3Attention.softcap``) and the final logits likewise (``final_logit_softcapping``, 30;
:meth:`Gemma2ForCausalLM.compute_logits`). Outputs must agree with transformers 4.55 ``Gemma2ForCausalLM`` (eager
attention: its SDPA path drops the softcap) on the same weights; the GGUF graph is llama.cpp's ``llm_build_gemma2_iswa``.
"""

from __future__ import annotations

import torch

from kvgen.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 decoder with its LM head tied to ``embed_tokens`` (or separate) and final logit softcapping."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, then ``c * tanh(logits / c)`` with c = ``final_logit_softcapping`` (none when None): hidden
        [..., C] -> logits [..., V] float32. Source: transformers 4.55 ``Gemma2ForCausalLM.forward``."""
        logits = self.lm_head_logits(hidden)  # [..., V] float32
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
