"""kvgen: an LLM inference engine in PyTorch.

Our own GPT-2 and Llama decoders, KV caches, logits processors and decoding
strategies; ``generate()`` for offline batches, ``LLM`` (a continuous-batching engine
over a paged KV cache) and ``load_model()`` for GGUF files and Hugging Face
checkpoints.
"""

import os

# Before torch's first allocation (so only when kvgen is imported before torch, as the CLI and the server do):
# tensors of 2 MiB and more on 2 MiB boundaries with transparent huge pages (PyTorch's alloc_cpu), so the packed
# weights stream with fewer TLB misses: a 1.2B-parameter file prefilled 3 % faster. Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from kvgen.engine import LLM, SamplingParams
from kvgen.errors import KvgenError
from kvgen.generation import GenerateOutput, GenerationConfig, generate
from kvgen.loader import load_model

__all__ = ["LLM", "GenerateOutput", "GenerationConfig", "KvgenError", "SamplingParams", "generate", "load_model"]
__version__ = "0.1.0"
