"""Offline generation: ``generate()``, ``GenerationConfig``, ``GenerateOutput``; the constraints of constrained beam
search and the watermarks of ``watermarking_config`` (the green list's with its detector, SynthID's), under
transformers' names."""

from kvgen.generation.config import GenerationConfig, Strategy
from kvgen.generation.constraints import DisjunctiveConstraint, PhrasalConstraint
from kvgen.generation.generate import generate
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import make_cache
from kvgen.sampling.synthid import SynthIDTextWatermarkingConfig
from kvgen.sampling.watermark import WatermarkDetector, WatermarkingConfig

__all__ = ["DisjunctiveConstraint", "GenerateOutput", "GenerateTimings", "GenerationConfig", "PhrasalConstraint",
           "Strategy", "SynthIDTextWatermarkingConfig", "WatermarkDetector", "WatermarkingConfig", "generate",
           "make_cache"]
