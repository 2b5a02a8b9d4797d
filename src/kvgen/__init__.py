"""kvgen: an LLM inference engine in PyTorch.

Our own GPT-2 and Llama decoders, KV caches, logits processors and decoding
strategies; ``generate()`` for offline batches, ``LLM`` (a continuous-batching engine
over a paged KV cache) and ``load_model()`` for GGUF files and Hugging Face
checkpoints.
"""

from kvgen.engine import LLM, SamplingParams
from kvgen.errors import KvgenError
from kvgen.generation import GenerateOutput, GenerationConfig, generate
from kvgen.loader import load_model

__all__ = ["LLM", "GenerateOutput", "GenerationConfig", "KvgenError", "SamplingParams", "generate", "load_model"]
__version__ = "0.1.0"
