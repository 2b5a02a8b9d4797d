"""kvgen: an LLM inference engine in PyTorch.

Our own GPT-2 and Llama decoders, KV caches, logits processors and decoding
strategies; ``generate()`` for offline batches, ``LLM`` (a continuous-batching engine
over a paged KV cache) and ``load_model()`` for GGUF files and Hugging Face
checkpoints.

The names below are imported on first use (PEP 562), so that ``import kvgen.cli`` and
``kvgen --help`` do not import torch (1.5 s of a 2.6 s ``kvgen --help``); so are the subpackages
(``kvgen.generation.make_cache``, ``kvgen.kernels.kernel_isa()``, ``kvgen.engine``) after a plain ``import kvgen``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgen.engine import LLM, SamplingParams
    from kvgen.errors import KvgenError
    from kvgen.generation import GenerateOutput, GenerationConfig, generate
    from kvgen.loader import load_model

_EXPORTS = {"LLM": "kvgen.engine", "SamplingParams": "kvgen.engine", "KvgenError": "kvgen.errors",
            "GenerateOutput": "kvgen.generation", "GenerationConfig": "kvgen.generation",
            "generate": "kvgen.generation", "load_model": "kvgen.loader"}

__all__ = ["LLM", "GenerateOutput", "GenerationConfig", "KvgenError", "SamplingParams", "generate", "load_model"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``kvgen.LLM`` and the other public names, imported from their modules on first access; a subpackage or
    module (``kvgen.generation``, ``kvgen.kernels``, ...) is imported as ``import kvgen.<name>`` would."""
    if name not in _EXPORTS:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # also binds it as this module's attribute
        raise AttributeError(f"module 'kvgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
