"""The throughput bench's engine profile: phase timings read by wrapping the engine from outside.

Wrapping must not change what the engine generates, and the counts it keeps must match the
workload (no timing is asserted beyond being non-negative).
"""

from __future__ import annotations

import torch

from kvgen.bench.throughput import finish_profile, profile_engine
from kvgen.engine import EngineArgs, LLMEngine, SamplingParams


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, list[int]], int]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
    tokens: dict[str, list[int]] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens, num_steps


def test_profile_counts_steps_and_packed_tokens_without_changing_tokens(tiny_llama: torch.nn.Module) -> None:
    model = tiny_llama
    args = EngineArgs(num_blocks=64, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 20)]
    plain, _ = _run(LLMEngine(model, None, args), prompts, 6)
    engine = LLMEngine(model, None, args)
    prof = profile_engine(engine)
    profiled, num_steps = _run(engine, prompts, 6)
    finish_profile(prof)
    assert profiled == plain
    assert prof.num_steps == num_steps
    # Every prompt token is prefilled once; each request then decodes max_tokens - 1 tokens (the first comes from prefill).
    assert prof.num_packed_tokens == sum(len(p) for p in prompts) + len(prompts) * (6 - 1)
    phases = (prof.schedule_s, prof.execute_s, prof.update_s, prof.output_s, prof.runner_prepare_s, prof.runner_forward_s,
              prof.runner_logits_s, prof.runner_sample_s)
    assert all(p >= 0 for p in phases)
    assert prof.runner_prepare_s + prof.runner_forward_s + prof.runner_logits_s + prof.runner_sample_s <= prof.execute_s
