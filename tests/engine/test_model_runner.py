"""ModelRunner: packing, per-request generators, logits only where sampled, against direct model calls."""

from __future__ import annotations

import torch

from kvgen.engine.model_runner import ModelRunner, pack_step
from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.types import ScheduledRequest, SchedulerOutput
from kvgen.kv_cache import PagedKVCache

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)


def _sched(rid, tokens, start, table, prompt, output=(), params=GREEDY, is_new=False, needs_sample=True):
    return ScheduledRequest(rid, list(tokens), start, list(table), needs_sample, params, list(prompt), list(output), is_new)


def _step(scheduled, finished=()) -> SchedulerOutput:
    return SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled), [], list(finished))


def _raw_logits(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits [V] from one uncached forward over ``tokens``."""
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        return model.compute_logits(model(ids, torch.arange(len(tokens))[None], None, None))[0, -1]


def test_pack_step_puts_decodes_first_and_samples_last_tokens():
    a = _sched("a", [5, 6, 7], 0, [3], [5, 6, 7])
    b = _sched("b", [9], 6, [1, 2], [1, 2, 3, 4, 5], [9])
    c = _sched("c", [1, 2], 4, [0, 4], [1, 2, 3, 4, 1, 2, 8], needs_sample=False)  # a middle chunk
    step = pack_step([a, b, c], BLOCK_SIZE)
    assert step.input_ids.tolist() == [[9, 5, 6, 7, 1, 2]]
    assert step.positions.tolist() == [[6, 0, 1, 2, 4, 5]]
    assert [s.request_id for s in step.sample_requests] == ["b", "a"]
    assert step.sample_rows.tolist() == [0, 3]
    assert step.attn_metadata.num_decodes == 1
    assert step.attn_metadata.slot_mapping.tolist() == [2 * 4 + 2, 12, 13, 14, 16, 17]


def test_greedy_tokens_and_logprobs_match_direct_model_calls(tiny_model):
    model = tiny_model("llama", eos_token_id=0).ours
    cache = PagedKVCache(2, 16, BLOCK_SIZE, 2, 16)
    runner = ModelRunner(model, cache, eos_token_ids=[0], seed=0)
    with_lp = SamplingParams(temperature=0.0, logprobs=3)
    prompts = {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13]}
    tables = {"a": [7, 2], "b": [4, 9]}
    out = runner.execute(_step([
        _sched("a", prompts["a"][:4], 0, tables["a"], prompts["a"], is_new=True, needs_sample=False),
        _sched("b", prompts["b"], 0, tables["b"], prompts["b"], params=with_lp, is_new=True),
    ]))
    assert set(out.sampled_token_ids) == {"b"}
    tokens = {"b": prompts["b"] + [out.sampled_token_ids["b"][0]], "a": list(prompts["a"])}
    raw = _raw_logits(model, prompts["b"])
    assert out.sampled_token_ids["b"][0] == int(raw.argmax())
    (lp,) = out.logprobs["b"]
    expected = torch.log_softmax(raw, -1)
    chosen = out.sampled_token_ids["b"][0]
    torch.testing.assert_close(torch.tensor(lp[chosen].logprob), expected.max(), rtol=1e-5, atol=1e-5)
    assert lp[chosen].rank == 1 and lp[chosen].decoded_token is None  # the output processor decodes
    top = expected.topk(3)
    assert list(lp) == top.indices.tolist() and [e.rank for e in lp.values()] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor([e.logprob for e in lp.values()]), top.values, rtol=1e-5, atol=1e-5)
    for _ in range(3):  # a: rest of its prompt, then decodes; b: decodes
        a_start = 4 if len(tokens["a"]) == 6 else len(tokens["a"]) - 1
        out = runner.execute(_step([
            _sched("a", tokens["a"][a_start:], a_start, tables["a"], prompts["a"], tokens["a"][6:]),
            _sched("b", tokens["b"][-1:], len(tokens["b"]) - 1, tables["b"], prompts["b"], tokens["b"][3:], params=with_lp),
        ]))
        for rid in ("a", "b"):
            assert out.sampled_token_ids[rid][0] == int(_raw_logits(model, tokens[rid]).argmax()), rid
            tokens[rid].append(out.sampled_token_ids[rid][0])
    assert runner.num_tracked_requests == 2
    runner.execute(_step([], finished=["a", "b"]))
    assert runner.num_tracked_requests == 0


def test_seeded_request_draws_the_same_tokens_alone_and_next_to_others(tiny_model):
    model = tiny_model("llama", eos_token_id=0).ours
    seeded = SamplingParams(temperature=1.0, seed=11)

    def run(extra: bool) -> list[int]:
        runner = ModelRunner(model, PagedKVCache(2, 32, BLOCK_SIZE, 2, 16), seed=0)
        prompt, drawn = [3, 4, 5], []
        for step in range(4):
            tokens = prompt + drawn
            start = 0 if step == 0 else len(tokens) - 1
            scheduled = [_sched("s", tokens[start:], start, [1, 2], prompt, drawn, params=seeded, is_new=step == 0)]
            if extra:
                other = SamplingParams(temperature=1.5)
                scheduled.insert(0, _sched(f"o{step}", [7, 8, 9, 10, 11][: step + 1], 0, [10 + step], [7, 8, 9, 10, 11][: step + 1], params=other, is_new=True))
            drawn.append(runner.execute(_step(scheduled)).sampled_token_ids["s"][0])
        return drawn

    assert run(extra=False) == run(extra=True)
