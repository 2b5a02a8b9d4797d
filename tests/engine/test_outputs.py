"""kvgen.engine.outputs: ``RequestOutput.add`` merges a request's streamed outputs as vLLM's does."""

from __future__ import annotations

import pytest

from kvgen.engine import EngineArgs, LLMEngine, SamplingParams
from kvgen.engine.outputs import RequestOutput
from kvgen.engine.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    from kvgen.loader import load_model

    # no prefix cache: the second run of the prompt computes exactly what the first did (bit-equal logprobs)
    return LLMEngine(*load_model(str(tiny_model_dir)), EngineArgs(num_blocks=64, enable_prefix_caching=False))


def _outputs(engine: LLMEngine, kind: RequestOutputKind) -> list[RequestOutput]:
    """Every output of one n=2 seeded request with logprobs, stop string and stop token (the same tokens each run)."""
    params = SamplingParams(n=2, seed=3, max_tokens=12, logprobs=2, output_kind=kind, stop_token_ids=[7])
    engine.add_request(kind.value, prompt_token_ids=[5, 6, 7, 8, 9], sampling_params=params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_add_aggregates_delta_outputs_into_the_cumulative_ones_as_vllm(engine):
    """vLLM's ``RequestOutput.add(next_output, aggregate)``: "finished |= next_output.finished"; a completion of the
    same index gets, when aggregating, "completion.text += next_completion.text", its token ids and logprobs
    extended and its cumulative_logprob, finish_reason and stop_reason replaced; without aggregating "the output
    [is replaced] with the new one"; a new index is appended. kvgen's RequestOutput had no ``add`` (AttributeError).
    The reference is the engine's own CUMULATIVE outputs of the same seeded request."""
    cumulative = _outputs(engine, RequestOutputKind.CUMULATIVE)
    deltas = _outputs(engine, RequestOutputKind.DELTA)
    merged = deltas[0]
    for delta in deltas[1:]:
        merged.add(delta, aggregate=True)
    replaced = cumulative[0]
    for output in cumulative[1:]:
        replaced.add(output, aggregate=False)
    final = cumulative[-1]
    assert merged.finished and replaced.finished and len(deltas) > 2
    for got in (merged, replaced):
        assert sorted(c.index for c in got.outputs) == [0, 1]
        for c in got.outputs:
            (want,) = [w for w in final.outputs if w.index == c.index]
            assert (c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) == (
                want.text, want.token_ids, want.logprobs, want.finish_reason, want.stop_reason)
            assert c.cumulative_logprob == pytest.approx(want.cumulative_logprob)


def test_add_keeps_the_first_error_of_the_merged_outputs():
    """kvgen's ``error`` / ``error_param`` (why the engine aborted a request) came only from the first output: merged
    DELTA outputs lost an abort's reason that the CUMULATIVE output carries."""
    from kvgen.engine.outputs import CompletionOutput

    def output(error: str | None, finished: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, "x", [5], None, None, "abort" if error else None)],
                             finished, error=error, error_param="structured_outputs" if error else None)

    merged = output(None, False)
    merged.add(output("no token can be generated", True), aggregate=True)
    assert (merged.error, merged.error_param, merged.finished) == ("no token can be generated", "structured_outputs",
                                                                   True)
    merged.add(output("a later error", True), aggregate=True)
    assert merged.error == "no token can be generated"
