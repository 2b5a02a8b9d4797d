"""Offline generation: ``generate()``, ``GenerationConfig``, ``GenerateOutput``."""

from kvgen.generation.config import GenerationConfig, Strategy
from kvgen.generation.generate import generate
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import make_cache

__all__ = ["GenerateOutput", "GenerateTimings", "GenerationConfig", "Strategy", "generate", "make_cache"]
