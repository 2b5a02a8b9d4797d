"""Embeddings: a prompt's hidden states after the model's final norm, pooled into one vector.

What vLLM's pooling runner (``LLM.embed``, ``/v1/embeddings``) and llama.cpp's ``--embeddings`` serve: the
prompt runs once through the decoder, without the KV cache (nothing is generated), and its hidden states
[T, C] become one embedding [C] by the model's pooling: the last token's (decoder embedding models such as
Qwen3-Embedding), the mean over tokens, or the first token's ("cls"). ``dimensions`` keeps the first n values
(Matryoshka embeddings), then ``normalize`` scales to unit L2 norm (vLLM's order).
Source: vLLM ``PoolingParams`` / ``EmbeddingRequestOutput`` / ``Pooler``; llama.cpp ``llama_pooling_type``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgen.fields import check_int
from kvgen.models import CausalLM

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' 1_Pooling/config.json flags -> pooling type
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                                "pooling_mode_cls_token": "cls"}


@dataclass
class PoolingParams:
    """How one prompt's embedding is made (vLLM's ``PoolingParams`` for embeddings).

    dimensions: keep the first n values (Matryoshka), None = all ``hidden_size``; normalize: unit L2 norm.
    Raises ``ValueError`` for ``dimensions`` below 1 or a non-bool ``normalize``; the engine refuses ``dimensions``
    above the model's hidden size.
    """

    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, 1)
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


def pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden [T, C] -> [C] float32: the last row, the mean of the rows, or the first row ("cls")."""
    hidden = hidden.float()
    if pooling_type == "mean":
        return hidden.mean(dim=0)
    return hidden[-1] if pooling_type == "last" else hidden[0]


@torch.inference_mode()
def embed(model: CausalLM, token_ids: list[int], pooling_type: str, params: PoolingParams) -> list[float]:
    """One prompt's embedding: the model's forward over ``token_ids`` (no KV cache), :func:`pool`, the first
    ``params.dimensions`` values, L2-normalized if ``params.normalize``. Raises ``ValueError`` when
    ``dimensions`` exceeds the hidden size. The caller checks the ids (vocabulary, context)."""
    size = model.config.hidden_size
    if params.dimensions is not None and params.dimensions > size:
        raise ValueError(f"dimensions must be <= the model's hidden size ({size}), got {params.dimensions}")
    ids = torch.tensor([token_ids])  # [1, T]
    hidden = model(ids, torch.arange(ids.shape[1])[None], None, None)[0]  # [T, C]
    vector = pool(hidden, pooling_type)[: params.dimensions]  # [dimensions]
    if params.normalize:
        vector = F.normalize(vector, dim=0)
    return vector.tolist()
