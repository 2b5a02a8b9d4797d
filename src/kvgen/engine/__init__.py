"""Continuous-batching engine: requests, scheduler, paged-KV bookkeeping, output processing.

The pure-Python half (this package's ``sampling_params``, ``request``, ``block_manager``,
``scheduler``, ``types``, ``outputs``, ``detokenizer``) touches no tensors and no model.
"""

from kvgen.engine.block_manager import DEFAULT_BLOCK_SIZE, BlockManager, hash_block
from kvgen.engine.detokenizer import OutputProcessor, ProcessedOutputs, RequestDetokenizer
from kvgen.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvgen.engine.request import Request, RequestStatus
from kvgen.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgen.engine.scheduler import Scheduler, SchedulingPolicy
from kvgen.engine.types import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockManager",
    "CompletionOutput",
    "EngineCoreOutput",
    "ModelRunnerOutput",
    "OutputProcessor",
    "ProcessedOutputs",
    "Request",
    "RequestDetokenizer",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "TokenLogprobs",
    "hash_block",
]
