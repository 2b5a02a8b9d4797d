"""Embeddings: a prompt's hidden states after the model's final norm, pooled into one vector.

What vLLM's pooling runner (``LLM.embed``, ``/v1/embeddings``) and llama.cpp's ``--embeddings`` serve: the
prompt runs once through the decoder (with a KV cache of its own, in chunks of the engine's token budget per step;
nothing is generated), and its hidden states [T, C] become one embedding [C] by the model's pooling: the last
token's (decoder embedding models such as Qwen3-Embedding), the mean over tokens, or the first token's ("cls"). ``dimensions`` keeps the first n values
(Matryoshka embeddings), then ``normalize`` scales to unit L2 norm (vLLM's order).
Source: vLLM ``PoolingParams`` / ``EmbeddingRequestOutput`` / ``Pooler``; llama.cpp ``llama_pooling_type``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgen.engine.sampling_params import check_truncate_prompt_tokens
from kvgen.fields import check_int
from kvgen.generation.runner import make_cache
from kvgen.models import CausalLM

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' 1_Pooling/config.json flags -> pooling type
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                                "pooling_mode_cls_token": "cls"}


@dataclass
class PoolingParams:
    """How one prompt's embedding is made (vLLM's ``PoolingParams`` for embeddings).

    dimensions: keep the first n values (Matryoshka), None = all ``hidden_size``; normalize: unit L2 norm (None: the
    default, True, as vLLM's); truncate_prompt_tokens: embed only the prompt's last k tokens (-1: ``max_model_len``; None: all).
    Raises ``ValueError`` for ``dimensions`` below 1, a ``normalize`` neither bool nor None or ``truncate_prompt_tokens`` other
    than -1 or [1, 2**31 - 1]; the engine refuses ``dimensions`` above the model's hidden size and
    ``truncate_prompt_tokens`` above ``max_model_len``.
    """

    dimensions: int | None = None
    normalize: bool | None = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, 1)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.normalize is None:  # vLLM's "not set": the embedding task's default
            self.normalize = True
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")


@dataclass
class EmbeddingOutput:
    """embedding: the pooled vector, ``dimensions`` float values (vLLM ``EmbeddingOutput``)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM ``EmbeddingRequestOutput``); ``prompt_token_ids``: the tokens it pooled."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def default_pooling_type(model: CausalLM, model_path: str | Path | None = None) -> str:
    """The model's own pooling: a GGUF file's ``{arch}.pooling_type``, a Hugging Face directory's
    sentence-transformers ``1_Pooling/config.json``, else "last" (vLLM's default for a decoder)."""
    if (gguf := model.config.extra.get("pooling_type")) is not None:
        return str(gguf)
    config = Path(model_path) / "1_Pooling" / "config.json" if model_path is not None else None
    if config is not None and config.is_file():
        try:
            modes = json.loads(config.read_text())
        except (OSError, ValueError):
            modes = {}
        found = [kind for flag, kind in _SENTENCE_TRANSFORMERS_MODES.items() if modes.get(flag) is True]
        if len(found) == 1:
            return found[0]
    return "last"


def check_pooling_type(pooling_type: str) -> str:
    """``pooling_type`` if it is one of :data:`POOLING_TYPES`, else ``ValueError``."""
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
    return pooling_type


class EmbeddingJob:
    """One prompt's embedding, computed ``chunk_size`` tokens per :meth:`step` (keys and values kept in a
    ``DynamicCache`` of its own for the later chunks), so an engine can run its steps between the chunks of a long
    prompt. Pooling: the last row ("last"), the first chunk's first row ("cls"), the mean of every row ("mean").

    token_ids: the prompt (the caller checks vocabulary and context); the result equals one forward over the whole
    prompt up to float rounding. Raises ``ValueError`` when ``params.dimensions`` exceeds the hidden size.
    """

    def __init__(self, model: CausalLM, request_id: str, token_ids: list[int], pooling_type: str,
                 params: PoolingParams, chunk_size: int) -> None:
        size = model.config.hidden_size
        if params.dimensions is not None and params.dimensions > size:
            raise ValueError(f"dimensions must be <= the model's hidden size ({size}), got {params.dimensions}")
        self.model, self.request_id, self.token_ids = model, request_id, token_ids
        self.pooling_type, self.params, self.chunk_size = pooling_type, params, chunk_size
        # a cache even for one chunk: the kernels' fused cache-write-and-attend beats their cache-free attention
        # (0.82 vs 0.94 s for 480 tokens of the default model)
        self.cache = make_cache(model, "dynamic", 1, len(token_ids))
        self.num_computed_tokens = 0
        self._pooled: torch.Tensor | None = None  # [C] float32: the last / first row, or the sum of rows ("mean")

    @property
    def is_finished(self) -> bool:
        return self.num_computed_tokens == len(self.token_ids)

    @torch.inference_mode()
    def step(self) -> bool:
        """Run the next chunk of the prompt; True once every token has run."""
        start = self.num_computed_tokens
        end = min(start + self.chunk_size, len(self.token_ids))
        ids = torch.tensor([self.token_ids[start:end]])  # [1, n]
        hidden = self.model(ids, torch.arange(start, end)[None], self.cache, None)[0].float()  # [n, C]
        if self.pooling_type == "mean":
            rows = hidden.sum(dim=0)  # [C]
            self._pooled = rows if self._pooled is None else self._pooled + rows
        elif self.pooling_type == "last":
            self._pooled = hidden[-1]
        elif self._pooled is None:  # "cls": the prompt's first row
            self._pooled = hidden[0]
        self.num_computed_tokens = end
        return self.is_finished

    def output(self) -> EmbeddingRequestOutput:
        """The finished job's embedding: pooled, cut to ``dimensions``, normalized (``normalize``)."""
        assert self.is_finished and self._pooled is not None
        vector = self._pooled / len(self.token_ids) if self.pooling_type == "mean" else self._pooled
        vector = vector[: self.params.dimensions]  # [dimensions]
        if self.params.normalize:
            vector = F.normalize(vector, dim=0)
        return EmbeddingRequestOutput(self.request_id, self.token_ids, EmbeddingOutput(vector.tolist()))
