"""``n > 1``: one prompt fans out to ``n`` child requests whose outputs merge back.

Children are ordinary requests (ids ``f"{index}_{request_id}"``, as vLLM) that
share the prompt's KV blocks through prefix caching. A seeded parent gives child
``i`` the seed ``seed + i``, so the completions differ but are reproducible.
Source: vLLM v1 ``vllm/v1/engine/parallel_sampling.py``.
"""

from __future__ import annotations

import dataclasses

from kvgen.engine.outputs import CompletionOutput, RequestOutput
from kvgen.engine.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parent's settings for one completion: ``n=1``, seed shifted by the child index."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, best_of=None, seed=seed)


class ParentRequest:
    """Collects the children's outputs of one ``n > 1`` request into ``RequestOutput``s with n completions."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.n = params.n
        self.output_kind = params.output_kind
        self.child_ids = [child_request_id(i, request_id) for i in range(self.n)]
        self._latest: dict[int, CompletionOutput] = {}
        self.max_num_generation_tokens = 0  # the metrics': the longest finished child, in tokens
        self.num_observed = 0  # children counted in the metrics (an aborted one never is)
        self._finished: set[int] = set()
        self._error: tuple[str, str | None] | None = None  # the first aborted child's (error, error_param)

    def merge(self, child_outputs: list[tuple[int, RequestOutput]]) -> RequestOutput | None:
        """One step's outputs of some children (child index, output) -> the parent's output, if any is due."""
        step: list[CompletionOutput] = []
        for index, output in child_outputs:
            completion = dataclasses.replace(output.outputs[0], index=index)
            self._latest[index] = completion
            step.append(completion)
            if output.finished:
                self._finished.add(index)
            if output.error is not None and self._error is None:
                self._error = (output.error, output.error_param)
        is_finished = len(self._finished) == self.n
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not is_finished:
            return None
        if self.output_kind is RequestOutputKind.DELTA:
            completions = sorted(step, key=lambda c: c.index)
        else:
            completions = [self._latest[i] for i in sorted(self._latest)]
        first = child_outputs[0][1]
        # the first child's error stays past its step: its aborted completion stays in FINAL_ONLY / CUMULATIVE outputs
        error, error_param = self._error or (None, None)
        return dataclasses.replace(first, request_id=self.request_id, outputs=completions, finished=is_finished,
                                   error=error, error_param=error_param)

    @property
    def is_finished(self) -> bool:
        return len(self._finished) == self.n
