"""N-gram speculative decoding in the engine: the config (vLLM's), the scheduler's drafts and rollback with a fake
runner (no model), and on models: tokens equal to decoding without drafts, greedy and seeded."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvgen.engine import LLM, BlockManager, EngineArgs, SamplingParams, Scheduler
from kvgen.engine.model_runner import verify_drafts
from kvgen.engine.request import Request
from kvgen.engine.sampling_params import RequestOutputKind
from kvgen.engine.spec_decode import SpeculativeConfig
from kvgen.engine.types import ModelRunnerOutput, SchedulerOutput

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
EOS = 0


# ---------------------------------------------------------------- config


def test_config_takes_vllm_defaults_and_refuses_bad_values():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 5, 5)
    one = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (2, 2)
    assert EngineArgs(speculative_config=SPEC).speculative_config == SpeculativeConfig(**SPEC)
    bad = {
        "{": "must be JSON", "[3]": "JSON object", '{"method": "eagle", "num_speculative_tokens": 2}': "method must be 'ngram'",
        '{"method": "ngram"}': "needs num_speculative_tokens", '{"num_speculative_tokens": 0}': "num_speculative_tokens must be",
        '{"num_speculative_tokens": 2, "k": 1}': "unknown keys", '{"num_speculative_tokens": 2, "prompt_lookup_min": 0}':
        "prompt_lookup_min must be", '{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}': "<=",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            EngineArgs(speculative_config=text)


def test_config_names_the_bad_lookup_size_that_was_given():
    # vLLM checks each given size (pydantic ge=1) before copying one into the other: the error names the one given
    for name in ("prompt_lookup_max", "prompt_lookup_min"):
        for value in (0, "3", 2.5):
            with pytest.raises(ValueError, match=f"^{name} must be an int >= 1, got {value!r}"):
                SpeculativeConfig.parse({"num_speculative_tokens": 2, name: value})


def test_verify_drafts_keeps_drafts_up_to_the_first_difference():
    assert verify_drafts([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, plus the bonus token
    assert verify_drafts([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert verify_drafts([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert verify_drafts([], [3]) == [3]


# ---------------------------------------------------------------- scheduler + a fake runner


class PlannedRunner:
    """A fake model whose next token is plan[request][number of outputs so far]; checks what each step feeds."""

    def __init__(self, plans: dict[str, list[int]]):
        self.plans = plans
        self.drafts_fed: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, list[int]] = {}
        for s in out.scheduled:
            known = s.prompt_token_ids + s.output_token_ids
            k = len(s.spec_token_ids)
            assert s.token_ids[: len(s.token_ids) - k] == known[s.start_position :][: len(s.token_ids) - k]
            if k:  # a decode: the last token, then the drafts
                assert s.start_position == len(known) - 1 and s.token_ids == [known[-1], *s.spec_token_ids]
                assert s.needs_sample and len(s.block_table) * 4 >= len(known) + k
            self.drafts_fed[s.request_id] = self.drafts_fed.get(s.request_id, 0) + k
            if s.needs_sample:
                plan, n = self.plans[s.request_id], len(s.output_token_ids)
                sampled[s.request_id] = verify_drafts(s.spec_token_ids, plan[n : n + k + 1])
        return ModelRunnerOutput(sampled)


def _run(scheduler: Scheduler, runner: PlannedRunner, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        scheduler.add_request(r)
    done: dict[str, list[int]] = {}
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, runner.execute(out)):
            request = next(r for r in requests if r.request_id == o.request_id)
            if o.is_finished:
                done[o.request_id] = list(request.output_token_ids)
            else:  # kept drafts count as computed; the newest token is not
                assert request.num_computed_tokens == request.num_tokens - 1
    return done


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
                   eos_token_ids=(EOS,))


def test_scheduler_feeds_drafts_and_keeps_what_the_runner_accepts():
    loop = [7, 8, 9, 10]
    # "a" continues its repeating prompt (drafts accepted), "b" leaves it after 2 tokens of every 4 (drafts partly
    # rejected), "c" ends with EOS
    plans = {"a": (loop * 6)[:20], "b": [t for i in range(5) for t in (7, 8, 30 + 2 * i, 31 + 2 * i)], "c": [7, 8, 9, 10, 7, EOS, 9, 10]}
    bm = BlockManager(64, 4)
    scheduler = Scheduler(8, 64, bm, speculative_config=SpeculativeConfig(**SPEC))
    runner = PlannedRunner(plans)
    requests = [_request("a", loop * 2, 20), _request("b", loop * 2, 20), _request("c", loop * 2, 20)]
    done = _run(scheduler, runner, requests)
    assert done == {"a": plans["a"], "b": plans["b"], "c": [7, 8, 9, 10, 7, EOS]}  # nothing after EOS
    assert runner.drafts_fed["a"] > 0 and runner.drafts_fed["b"] > 0
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert bm.num_free_blocks == 64


def test_drafts_stay_within_max_tokens_the_budget_and_max_model_len():
    loop = [7, 8, 9]
    bm = BlockManager(64, 4)
    scheduler = Scheduler(8, 3, bm, max_model_len=20, speculative_config=SpeculativeConfig(**SPEC))
    runner = PlannedRunner({"a": loop * 10, "b": loop * 10})
    out = _run(scheduler, runner, [_request("a", loop * 2, 5)])
    assert out == {"a": (loop * 10)[:5]}
    scheduler.max_num_batched_tokens = 64
    assert _run(scheduler, runner, [_request("b", loop * 2, 14)]) == {"b": (loop * 10)[:14]}  # 6 + 14 = 20
    # steps of a budget of 3 tokens carry at most 2 drafts; max_tokens 5 and max_model_len 20 bound the rest
    assert runner.drafts_fed["a"] <= 4 and runner.drafts_fed["b"] > 0


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size():
    plans = {"a": [7, 8, 9] * 4, "b": [4, 5, 6] * 4}
    for limit, expect_drafts in ((1, False), (2, True)):
        scheduler = Scheduler(8, 64, BlockManager(64, 4), speculative_config=SpeculativeConfig(**SPEC, disable_by_batch_size=limit))
        runner = PlannedRunner(plans)
        assert _run(scheduler, runner, [_request(rid, plan[:6], 12) for rid, plan in plans.items()]) == plans
        assert (scheduler.num_draft_tokens > 0) == expect_drafts
    with pytest.raises(ValueError, match="disable_by_batch_size must be an int >= 1"):
        SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=0)


def test_drafts_never_take_the_blocks_other_decodes_need():
    # 5 blocks of 4: after the prefills a (7 tokens) and b (8) hold 2 each; a draft at position 8 would take the last
    # free block, which b's decode at position 8 needs (b would be preempted)
    plans = {"a": [7, 8, 9], "b": [6, 4]}
    requests = [_request("a", [7, 8, 9, 7, 8, 9, 7], 3), _request("b", [4, 5, 6, 4, 5, 6, 4, 5], 2)]
    scheduler = Scheduler(8, 64, BlockManager(5, 4), speculative_config=SpeculativeConfig(**SPEC))
    assert _run(scheduler, PlannedRunner(plans), requests) == plans
    assert [r.num_preemptions for r in requests] == [0, 0]


def test_the_draft_limit_adapts_to_acceptance_and_bounds_the_next_drafts():
    scheduler = Scheduler(8, 64, BlockManager(64, 4), speculative_config=SpeculativeConfig(**SPEC))
    request = _request("a", [7, 8, 9] * 4, 20)
    seen = []
    for is_all_accepted in (False, False, False, False, True, True, False):
        scheduler._adapt_num_spec_tokens(request, is_all_accepted)
        seen.append(request.num_spec_tokens_allowed)
    assert seen == [3, 2, 1, 1, 3, 4, 3]  # -1 after a rejection, +2 after a full acceptance, within [1, 4]
    request.num_spec_tokens_allowed = 2
    scheduler.add_request(request)
    scheduler.update_from_output(out := scheduler.schedule(), ModelRunnerOutput({"a": [7]}))  # prefill
    (decode,) = scheduler.schedule().scheduled
    assert decode.spec_token_ids == [8, 9] and out.scheduled[0].spec_token_ids == []


# ---------------------------------------------------------------- on models: the tokens of decoding without drafts


REPEATING = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38] * 4  # a prompt the tiny model tends to copy


def _generate(model_tok, params, spec=None, prompts=None, **engine_args):
    model, tok = model_tok
    # 16-token blocks (vLLM's GPU size): the small pools below preempt at these prompt lengths
    llm = LLM(model, tok, speculative_config=spec, **{"num_blocks": 256, "block_size": 16, **engine_args})
    prompts = prompts or [{"prompt_token_ids": REPEATING}, {"prompt_token_ids": REPEATING[3:27]}, "Hello there, hello there,"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, llm.llm_engine.scheduler


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    from kvgen.loader import load_model

    return load_model(str(tiny_model_dir))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, frequency_penalty=0.1, repetition_penalty=1.05, min_tokens=30),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=40, seed=11),
        SamplingParams(temperature=0.5, min_p=0.05, max_tokens=40, seed=5, frequency_penalty=0.1, logprobs=1),
    ],
    ids=["greedy_logprobs", "greedy_penalties", "seeded_top_k", "seeded_min_p_penalty"],
)
def test_tokens_equal_decoding_without_drafts(tiny_llama, params):
    plain, _ = _generate(tiny_llama, params)
    spec, scheduler = _generate(tiny_llama, params, SPEC)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    if params.logprobs is not None:
        for a, b in zip(spec, plain):
            assert [list(lp) for lp in a.outputs[0].logprobs] == [list(lp) for lp in b.outputs[0].logprobs]
            got, want = ([e.logprob for lp in o.outputs[0].logprobs for e in lp.values()] for o in (a, b))
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want))  # float32 tolerance: [k + 1, C] matmuls
    assert scheduler.num_accepted_tokens > 0  # drafts were really kept
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0, max_tokens=30, logprobs=1),
     SamplingParams(temperature=0.8, top_k=30, seed=4, max_tokens=30, logprobs=0)],
    ids=["greedy", "seeded"],
)
def test_cumulative_logprob_of_steps_with_drafts_equals_one_token_steps_and_transformers(tiny_llama, tiny_model_dir,
                                                                                        params):
    """A step that keeps drafts adds every kept token's logprob to cumulative_logprob, as one-token steps do; the
    reference is transformers' log_softmax of the raw logits at each position of the same tokens."""
    prompts = [{"prompt_token_ids": REPEATING}, {"prompt_token_ids": REPEATING[3:27]}]
    plain, _ = _generate(tiny_llama, params, prompts=prompts)
    spec, scheduler = _generate(tiny_llama, params, SPEC, prompts=prompts)
    assert scheduler.num_accepted_tokens > 0  # some steps kept several tokens
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    for prompt, a, b in zip(prompts, spec, plain):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        ids = torch.tensor([prompt["prompt_token_ids"] + a.token_ids])
        with torch.inference_mode():
            logits = ref(ids).logits[0, len(prompt["prompt_token_ids"]) - 1 : -1]  # [T, V]: the raw logits
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(a.token_ids)[:, None])[:, 0]  # [T]
        for out in (a, b):
            got = torch.tensor([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert out.cumulative_logprob == pytest.approx(want.sum().item(), abs=1e-3)


def test_stop_strings_cut_a_step_of_several_tokens_where_they_match(tiny_llama):
    model, tok = tiny_llama
    engine = LLM(model, tok, num_blocks=64, speculative_config=SPEC).llm_engine
    delta = SamplingParams(temperature=0, max_tokens=30, output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", prompt_token_ids=REPEATING, sampling_params=delta)
    steps = []
    while engine.has_unfinished_requests():
        steps += [o.outputs[0].token_ids for o in engine.step()]
    tokens = [t for step in steps for t in step]
    # the stop string is the text up to the first token of the first step that kept a draft: it completes inside
    # that step, and the step's later tokens must go
    num_before = next(sum(map(len, steps[:i])) for i, step in enumerate(steps) if len(step) > 1)
    stop = tok.decode(tokens[: num_before + 1])
    assert stop and stop != tok.decode(tokens[:num_before])
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True)
    (without,), _ = _generate(tiny_llama, params, prompts=[{"prompt_token_ids": REPEATING}])
    (with_drafts,), _ = _generate(tiny_llama, params, SPEC, prompts=[{"prompt_token_ids": REPEATING}])
    a, b = with_drafts.outputs[0], without.outputs[0]
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, "stop", stop)
    assert a.token_ids == tokens[: num_before + 1]


def test_engine_with_drafts_beside_structured_outputs_and_preemption(tiny_llama):
    from kvgen.engine import StructuredOutputsParams

    params = [SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")),
              SamplingParams(temperature=0.8, seed=2, max_tokens=30)]
    prompts = [{"prompt_token_ids": REPEATING}, {"prompt_token_ids": REPEATING[:12]}, {"prompt_token_ids": REPEATING[5:]}]
    plain, _ = _generate(tiny_llama, params, prompts=prompts)
    spec, scheduler = _generate(tiny_llama, params, SPEC, prompts=prompts, num_blocks=6)  # preempts
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_preemptions for o in spec) > 0 and scheduler.num_accepted_tokens > 0


def test_default_model_copies_code_in_fewer_steps_with_the_same_tokens(ours_default_auto):
    model, tok = ours_default_auto
    code = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    chat = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n" + code}],
                                   add_generation_prompt=True, tokenize=True)
    params = SamplingParams(temperature=0, max_tokens=48)
    results = {}
    for name, spec in (("plain", None), ("ngram", SPEC)):
        engine = LLM(model, tok, num_blocks=64, speculative_config=spec).llm_engine
        engine.add_request("r", prompt_token_ids=chat, sampling_params=params)
        num_steps, final = 0, None
        while engine.has_unfinished_requests():
            final = (engine.step() or [final])[-1]
            num_steps += 1
        results[name] = (final.outputs[0].token_ids, num_steps)
    assert results["ngram"][0] == results["plain"][0] and len(results["plain"][0]) > 20
    assert results["ngram"][1] < results["plain"][1] / 2


def test_parallel_sampling_prompt_logprobs_and_streamed_deltas_with_drafts(tiny_llama):
    params = SamplingParams(n=2, temperature=0.6, seed=9, max_tokens=30, prompt_logprobs=1, logprobs=1)
    (plain,), _ = _generate(tiny_llama, params, prompts=[{"prompt_token_ids": REPEATING}])
    (spec,), scheduler = _generate(tiny_llama, params, SPEC, prompts=[{"prompt_token_ids": REPEATING}])
    assert [c.token_ids for c in spec.outputs] == [c.token_ids for c in plain.outputs]
    assert [list(lp.items()) if lp else None for lp in spec.prompt_logprobs] == [
        list(lp.items()) if lp else None for lp in plain.prompt_logprobs]
    model, tok = tiny_llama
    engine = LLM(model, tok, num_blocks=64, speculative_config=SPEC).llm_engine
    engine.add_request("d", prompt_token_ids=REPEATING, sampling_params=SamplingParams(
        temperature=0, max_tokens=30, logprobs=0, output_kind=RequestOutputKind.DELTA))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0] for o in engine.step()]
    (greedy,), _ = _generate(tiny_llama, SamplingParams(temperature=0, max_tokens=30), prompts=[{"prompt_token_ids": REPEATING}])
    assert [t for d in deltas for t in d.token_ids] == greedy.outputs[0].token_ids
    assert "".join(d.text for d in deltas) == greedy.outputs[0].text
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas) and max(len(d.token_ids) for d in deltas) > 1
    assert scheduler.num_draft_tokens > 0  # the n=2 run verified drafts (and rewound its generators)


@pytest.mark.parametrize("budget", [2, 3, 5])
def test_drafts_fit_the_step_budget_and_what_max_model_len_lets_a_request_keep(budget):
    """Checked at every step: the tokens scheduled, drafts included, fit max_num_batched_tokens, and a decode's drafts
    plus the token sampled after them fit the room max_model_len leaves (a draft past it could never be kept)."""
    loop, max_model_len = [7, 8, 9], 16
    scheduler = Scheduler(8, budget, BlockManager(64, 4), max_model_len=max_model_len,
                          speculative_config=SpeculativeConfig(**SPEC))
    runner = PlannedRunner({"a": loop * 10, "b": loop * 10})
    for rid in ("a", "b"):
        scheduler.add_request(_request(rid, loop * 2, 30))
    num_drafts = 0
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled) <= budget
        for s in out.scheduled:
            num_tokens = scheduler.requests[s.request_id].num_tokens
            assert not s.spec_token_ids or num_tokens + len(s.spec_token_ids) + 1 <= max_model_len
            num_drafts += len(s.spec_token_ids)
        scheduler.update_from_output(out, runner.execute(out))
    assert num_drafts > 0 and not scheduler.has_unfinished_requests()
