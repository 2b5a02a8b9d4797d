"""Continuous-batching engine: requests, scheduler, paged-KV bookkeeping, output processing.

The pure-Python half (this package's ``sampling_params``, ``request``, ``block_manager``,
``scheduler``, ``types``, ``outputs``, ``detokenizer``, ``output_processor``) touches no tensors and no model.
The tensor half: ``model_runner`` (requests -> packed tensors), ``sampler``, and the
fronts ``LLMEngine``, ``LLM`` and ``AsyncLLMEngine``.
"""

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from kvgen.engine.block_manager import DEFAULT_BLOCK_SIZE, BlockManager, hash_block
from kvgen.engine.detokenizer import IncrementalDetokenizer, RequestDetokenizer
from kvgen.engine.engine_args import EngineArgs
from kvgen.engine.llm import LLM
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.output_processor import OutputProcessor, ProcessedOutputs
from kvgen.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvgen.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from kvgen.engine.request import Request, RequestStatus
from kvgen.engine.sampler import Sampler
from kvgen.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from kvgen.engine.scheduler import Scheduler, SchedulingPolicy
from kvgen.engine.types import (
    EngineCoreOutput,
    Logprob,
    ModelRunnerOutput,
    PositionLogprobs,
    PromptLogprobs,
    SampleLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "LLM",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BlockManager",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineCoreOutput",
    "IncrementalDetokenizer",
    "LLMEngine",
    "Logprob",
    "ModelRunner",
    "ModelRunnerOutput",
    "OutputProcessor",
    "PoolingParams",
    "PositionLogprobs",
    "ProcessedOutputs",
    "PromptLogprobs",
    "Request",
    "RequestDetokenizer",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStatus",
    "SampleLogprobs",
    "Sampler",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "StructuredOutputsParams",
    "hash_block",
]
