"""kvgen.engine.scheduler: no model — build requests, schedule, hand-make runner outputs, update."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.engine.block_manager import BlockManager, cdiv
from kvgen.engine.request import Request, RequestStatus
from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.scheduler import Scheduler, SchedulingPolicy
from kvgen.engine.types import (
    NO_TOKEN,
    EngineCoreOutput,
    Logprob,
    ModelRunnerOutput,
    SchedulerOutput,
)

EOS = 0


def make_request(request_id: str, prompt: list[int] | int, arrival_time: float = 0.0, priority: int = 0, **params):
    prompt_ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling_params=SamplingParams(**params),
        arrival_time=arrival_time,
        priority=priority,
        eos_token_ids=(EOS,),
    )


def position_token(request_id: str, position: int) -> int:
    """The fake model's next token: a function of (request, position) only, never EOS."""
    return 100 + position


class FakeRunner:
    """Stands in for the ModelRunner: keeps a fake KV pool of token ids and checks what it is fed.

    Every position the step attends to must hold the request's own token at that position,
    so a wrong block table, a bad prefix-cache hit or an early eviction fails here.
    """

    def __init__(self, block_manager: BlockManager, next_token=position_token):
        self.block_size = block_manager.block_size
        self.kv: list[list[int | None]] = [[None] * self.block_size for _ in range(block_manager.num_blocks)]
        self.next_token = next_token
        self.known: set[str] = set()  # runner-side state (e.g. seeded generators) by request id

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            self.known.discard(request_id)
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            assert s.is_new == (s.request_id not in self.known)
            self.known.add(s.request_id)
            tokens = s.prompt_token_ids + s.output_token_ids
            end = s.start_position + len(s.token_ids)
            assert s.token_ids == tokens[s.start_position : end]
            assert len(s.block_table) == cdiv(end, self.block_size)
            for p in range(s.start_position, end):  # write this step's KV
                self.kv[s.block_table[p // self.block_size]][p % self.block_size] = tokens[p]
            for p in range(end):  # attend to every position so far
                assert self.kv[s.block_table[p // self.block_size]][p % self.block_size] == tokens[p], (s, p)
            assert s.needs_sample == (end == len(tokens))
            if s.needs_sample:
                sampled[s.request_id] = [self.next_token(s.request_id, end)]
        return ModelRunnerOutput(sampled)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
    assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(out.scheduled) <= scheduler.max_num_seqs and len(scheduler.running) <= scheduler.max_num_seqs
    return out, scheduler.update_from_output(out, runner.execute(out))


def setup(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, max_num_batched_tokens: int = 64, **kw):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(max_num_seqs, max_num_batched_tokens, bm, **kw), FakeRunner(bm)


def drain(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> dict[str, EngineCoreOutput]:
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finals
        for o in step(scheduler, runner)[1]:
            if o.is_finished:
                assert o.request_id not in finals
                finals[o.request_id] = o
    raise AssertionError("requests never finished")


def scheduled_counts(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: len(s.token_ids) for s in out.scheduled}


# ---------------------------------------------------------------- budgets and chunked prefill


def test_rejects_bad_limits() -> None:
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        Scheduler(0, 8, bm)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an int >= 1, got -1"):
        Scheduler(1, 8, bm, long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="'lifo'"):
        Scheduler(1, 8, bm, policy="lifo")


def test_chunked_prefill_progression() -> None:
    scheduler, runner = setup(max_num_batched_tokens=8)
    r = make_request("a", 20, max_tokens=3)
    scheduler.add_request(r)
    computed = []
    for expected_chunk in (8, 8, 4):
        out, outputs = step(scheduler, runner)
        (s,) = out.scheduled
        assert len(s.token_ids) == expected_chunk and s.needs_sample == (expected_chunk == 4)
        computed.append(r.num_computed_tokens)
    assert computed == [8, 16, 20]
    assert outputs == [EngineCoreOutput("a", [120])] and r.output_token_ids == [120]
    out, outputs = step(scheduler, runner)  # decode: one token at position 20
    assert out.scheduled[0].token_ids == [120] and out.scheduled[0].start_position == 20
    assert r.num_computed_tokens == 21 and r.output_token_ids == [120, 121]


def test_decode_and_prefill_share_a_step() -> None:
    scheduler, runner = setup(max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", 3, max_tokens=10))
    step(scheduler, runner)  # a's whole prompt
    scheduler.add_request(make_request("b", 12, max_tokens=10))
    out, _ = step(scheduler, runner)
    assert scheduled_counts(out) == {"a": 1, "b": 5}  # decode first, then the rest of the budget
    assert [s.needs_sample for s in out.scheduled] == [True, False]
    out, _ = step(scheduler, runner)
    assert scheduled_counts(out) == {"a": 1, "b": 5}
    out, _ = step(scheduler, runner)
    assert scheduled_counts(out) == {"a": 1, "b": 2} and out.scheduled[1].needs_sample


def test_long_prefill_token_threshold_caps_chunks() -> None:
    scheduler, runner = setup(max_num_batched_tokens=64, long_prefill_token_threshold=4)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", [5] * 10))
    out, _ = step(scheduler, runner)
    assert scheduled_counts(out) == {"a": 4, "b": 4}


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler, runner = setup(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, 3, max_tokens=2 if rid == "a" else 5))
    out, _ = step(scheduler, runner)
    assert list(scheduled_counts(out)) == ["a", "b"]
    out, outputs = step(scheduler, runner)  # a finishes (2 tokens)
    assert list(scheduled_counts(out)) == ["a", "b"] and outputs[0].finish_reason == "length"
    out, _ = step(scheduler, runner)
    assert scheduled_counts(out) == {"b": 1, "c": 3}


# ---------------------------------------------------------------- preemption


def test_preemption_frees_blocks_and_resumes_with_the_same_tokens() -> None:
    # 4 blocks of 2: a and b (prompt 3) take 2 each; the next decode block preempts b (newest).
    scheduler, runner = setup(num_blocks=4, block_size=2)
    a, b = make_request("a", 3, max_tokens=4), make_request("b", [7, 8, 9], max_tokens=4)
    scheduler.add_request(a), scheduler.add_request(b)
    step(scheduler, runner)  # both prefill (positions 0-2), sample position 3
    out, _ = step(scheduler, runner)  # decode position 3 fits both second blocks
    assert scheduled_counts(out) == {"a": 1, "b": 1}
    out, _ = step(scheduler, runner)  # position 4 needs a 3rd block each: b is preempted
    assert out.preempted_request_ids == ["b"] and scheduled_counts(out) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b and b.output_token_ids == [103, 104]
    finals = {}
    while "b" not in finals:
        out, outputs = step(scheduler, runner)
        finals.update({o.request_id: o for o in outputs if o.is_finished})
        if "b" in scheduled_counts(out) and out.scheduled[0].start_position == 0:
            resumed = out.scheduled[0]
            assert resumed.token_ids == [7, 8, 9, 103, 104] and not resumed.is_new
    assert a.output_token_ids == b.output_token_ids == [103, 104, 105, 106]  # as if run alone
    assert b.num_preemptions == 1
    assert scheduler.block_manager.num_free_blocks == 4


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler, runner = setup(num_blocks=4, block_size=2)
    scheduler.add_request(make_request("a", 3, max_tokens=6))
    scheduler.add_request(make_request("b", [7, 8, 9], max_tokens=6))
    step(scheduler, runner), step(scheduler, runner)
    scheduler.add_request(make_request("c", 1, max_tokens=1))
    out, _ = step(scheduler, runner)
    assert out.preempted_request_ids == ["b"] and "c" not in scheduled_counts(out)


def test_priority_policy_orders_admission_and_preempts_the_least_important() -> None:
    scheduler, runner = setup(max_num_seqs=1, policy="priority")
    for rid, priority, arrival in (("low", 2, 0.0), ("high", 0, 1.0), ("mid", 1, 2.0), ("high2", 0, 3.0)):
        scheduler.add_request(make_request(rid, 2, arrival_time=arrival, priority=priority, max_tokens=1))
    order = [step(scheduler, runner)[0].scheduled[0].request_id for _ in range(4)]
    assert order == ["high", "high2", "mid", "low"]

    scheduler, runner = setup(num_blocks=4, block_size=2, policy=SchedulingPolicy.PRIORITY)
    scheduler.add_request(make_request("a", 3, arrival_time=0.0, priority=5, max_tokens=4))
    scheduler.add_request(make_request("b", [7, 8, 9], arrival_time=1.0, priority=0, max_tokens=4))
    step(scheduler, runner), step(scheduler, runner)
    out, _ = step(scheduler, runner)
    assert out.preempted_request_ids == ["a"] and scheduled_counts(out) == {"b": 1}


def test_priority_policy_preempts_the_least_important_even_if_already_scheduled_this_step() -> None:
    # vLLM v1: the victim is the least important of ALL running requests; one already scheduled this step is
    # unscheduled (its tokens return to the budget). Here "low" (admitted first) is scheduled before "high" runs
    # out of blocks: "low" must go, not "high".
    scheduler, runner = setup(num_blocks=4, block_size=2, policy="priority")
    low = make_request("low", [5, 6, 7], arrival_time=0.0, priority=1, max_tokens=6)
    high = make_request("high", [8, 9], arrival_time=1.0, priority=0, max_tokens=6)
    scheduler.add_request(low)
    step(scheduler, runner)  # low's prompt: 2 blocks
    scheduler.add_request(high)
    step(scheduler, runner)  # low's position 3, high's prompt: 1 block
    out, _ = step(scheduler, runner)  # low's position 4 takes the last block, high's position 2 needs one more
    assert out.preempted_request_ids == ["low"] and scheduled_counts(out) == {"high": 1}
    assert out.num_batched_tokens == 1 and low.status is RequestStatus.PREEMPTED and low.block_ids == []
    finals = drain(scheduler, runner)
    assert high.output_token_ids == [102 + i for i in range(6)] and low.output_token_ids == [103 + i for i in range(6)]
    assert finals["high"].finish_reason == finals["low"].finish_reason == "length"
    assert scheduler.block_manager.num_free_blocks == 4


def test_request_larger_than_the_pool_is_aborted_with_an_error() -> None:
    scheduler, runner = setup(num_blocks=2, block_size=2)
    scheduler.add_request(make_request("huge", 5))
    scheduler.add_request(make_request("ok", 2, max_tokens=1))
    out, outputs = step(scheduler, runner)
    assert scheduled_counts(out) == {"ok": 2}
    huge = next(o for o in outputs if o.request_id == "huge")
    assert huge.finish_reason == "abort" and "needs 3 KV blocks of 2 tokens" in huge.error
    # A request that grows past the pool is aborted too, instead of preempting itself forever.
    scheduler.add_request(make_request("grows", 3, max_tokens=5))
    finals = drain(scheduler, runner)
    assert finals["grows"].finish_reason == "abort" and "the pool has 2" in finals["grows"].error
    assert scheduler.block_manager.num_free_blocks == 2


def test_a_request_left_without_tokens_ends_alone_with_an_error_naming_its_masks() -> None:
    """The sampler's NO_TOKEN (every logit masked out) aborts that request only, with an error and the setting to
    blame (the server's 400); its blocks return to the pool and the request beside it runs to its end."""
    scheduler, _ = setup()
    bm = scheduler.block_manager
    runner = FakeRunner(bm, next_token=lambda rid, pos: NO_TOKEN if rid == "boxed" and pos >= 4 else 100 + pos)
    scheduler.add_request(make_request("boxed", 3, max_tokens=8, allowed_token_ids=[5], stop_token_ids=[5],
                                       min_tokens=3))
    scheduler.add_request(make_request("free", 3, max_tokens=6))
    finals = drain(scheduler, runner)
    boxed = finals["boxed"]
    assert boxed.finish_reason == "abort" and boxed.error_param == "allowed_token_ids"
    assert "no token can be generated at output token 1: allowed_token_ids, min_tokens" in boxed.error
    assert NO_TOKEN not in boxed.new_token_ids
    assert finals["free"].finish_reason == "length" and finals["free"].error is None
    assert bm.num_free_blocks == bm.num_blocks


# ---------------------------------------------------------------- prefix caching


def test_prefix_cache_hit_starts_after_the_cached_blocks_and_shares_them() -> None:
    scheduler, runner = setup(block_size=4)
    a = make_request("a", list(range(1, 11)), max_tokens=5)
    scheduler.add_request(a)
    step(scheduler, runner)
    b = make_request("b", list(range(1, 9)) + [77, 78, 79], max_tokens=2)
    scheduler.add_request(b)
    out, _ = step(scheduler, runner)
    s = out.scheduled[1]
    assert s.start_position == 8 and s.token_ids == [77, 78, 79]
    assert b.num_cached_prefix_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert [scheduler.block_manager.ref_counts[i] for i in a.block_ids[:2]] == [2, 2]


def test_same_prefix_in_the_same_step_waits_to_share_it() -> None:
    # n > 1 fan-out: children of one prompt arrive together; only one computes the shared blocks.
    scheduler, runner = setup(block_size=4)
    children = [make_request(f"r-{i}", list(range(1, 10)), max_tokens=3) for i in range(3)]
    for child in children:
        scheduler.add_request(child)
    out, _ = step(scheduler, runner)
    assert scheduled_counts(out) == {"r-0": 9}
    out, _ = step(scheduler, runner)
    assert scheduled_counts(out) == {"r-0": 1, "r-1": 1, "r-2": 1}
    assert all(s.start_position == 8 for s in out.scheduled[1:])
    assert children[1].block_ids[:2] == children[2].block_ids[:2] == children[0].block_ids[:2]
    assert all(c.output_token_ids[0] == 109 for c in children)


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    scheduler, runner = setup(num_blocks=6, block_size=2)
    a, b = make_request("a", 5, max_tokens=4), make_request("b", [9, 9, 9, 9, 9], max_tokens=4)
    scheduler.add_request(a), scheduler.add_request(b)
    preempted = False
    while not preempted:
        out, _ = step(scheduler, runner)
        preempted = out.preempted_request_ids == ["b"]
    while b.status is not RequestStatus.RUNNING:
        out, _ = step(scheduler, runner)
    assert out.scheduled[-1].request_id == "b" and out.scheduled[-1].start_position > 0  # not from scratch


# ---------------------------------------------------------------- stopping, aborting, finishing


@pytest.mark.parametrize(
    ("params", "tokens", "expected"),
    [
        ({}, [5, EOS, 6], ([5, EOS], "stop", None)),
        ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 6], ([5, EOS, 6], "length", None)),
        ({"stop_token_ids": [6]}, [5, 6, 7], ([5, 6], "stop", 6)),
        ({"max_tokens": 2}, [5, 5, 5], ([5, 5], "length", None)),
        ({"max_tokens": 2}, [5, EOS], ([5, EOS], "stop", None)),  # a stop token wins over length
        ({"min_tokens": 3, "stop_token_ids": [6]}, [EOS, 6, 6, 5], ([EOS, 6, 6], "stop", 6)),
        ({"max_tokens": None}, [5] * 20, ([5] * 5, "length", None)),  # max_model_len = 8
    ],
)
def test_stop_conditions(params: dict, tokens: list[int], expected: tuple) -> None:
    bm = BlockManager(16, 4)
    scheduler = Scheduler(4, 64, bm, max_model_len=8)
    runner = FakeRunner(bm, next_token=lambda rid, pos: tokens[pos - 3])
    r = make_request("a", 3, **params)
    scheduler.add_request(r)
    final = drain(scheduler, runner)["a"]
    assert (r.output_token_ids, final.finish_reason, final.stop_reason) == expected
    assert final.new_token_ids == [expected[0][-1]] and r.finish_time is not None
    assert bm.num_free_blocks == 16


def test_logprobs_and_first_token_time_are_recorded() -> None:
    scheduler, _ = setup()
    r = make_request("a", 3, logprobs=1)
    scheduler.add_request(r)
    out = scheduler.schedule()
    lp = {7: Logprob(-0.5, 1), 8: Logprob(-1.0, 2)}
    (o,) = scheduler.update_from_output(out, ModelRunnerOutput({"a": [7]}, {"a": [lp]}))
    assert o.new_logprobs == [lp] and r.first_token_time >= r.arrival_time


def test_missing_sampled_token_raises() -> None:
    scheduler, _ = setup()
    scheduler.add_request(make_request("a", 3))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        scheduler.update_from_output(out, ModelRunnerOutput({}))


def test_duplicate_request_id_is_an_internal_error() -> None:
    # LLMEngine.add_request refuses duplicate ids with a ValueError; reaching the scheduler with one is a bug.
    scheduler, _ = setup()
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(AssertionError, match="'a' is already in flight"):
        scheduler.add_request(make_request("a", 3))


def test_abort_frees_blocks_at_the_next_schedule() -> None:
    scheduler, runner = setup(num_blocks=8, max_num_seqs=1)
    scheduler.add_request(make_request("run", 6, max_tokens=50))
    scheduler.add_request(make_request("wait", 6))
    step(scheduler, runner)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == 6
    scheduler.abort_request("run"), scheduler.abort_request("wait"), scheduler.abort_request("unknown")
    assert bm.num_free_blocks == 6  # nothing freed while a step may still be running
    out, outputs = step(scheduler, runner)
    assert out.scheduled == [] and out.finished_request_ids == ["run"]  # "wait" never reached the runner
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [("run", "abort"), ("wait", "abort")]
    assert bm.num_free_blocks == 8 and not scheduler.has_unfinished_requests()


def test_pending_abort_of_an_unknown_or_finished_id_spares_a_new_request_with_that_id() -> None:
    scheduler, runner = setup()
    scheduler.abort_request("a")  # unknown now: ignored, even once "a" is added before the next schedule()
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    assert drain(scheduler, runner)["a"].finish_reason == "length"
    scheduler.abort_request("a")  # finished: ignored too
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    assert drain(scheduler, runner)["a"].finish_reason == "length"
    scheduler.add_request(make_request("b", 3, max_tokens=2))
    scheduler.abort_request("b")  # an abort after the add still applies
    assert drain(scheduler, runner)["b"].finish_reason == "abort"


def test_finish_requests_frees_now_and_tells_the_runner_next_step() -> None:
    scheduler, runner = setup()
    r = make_request("a", 6, max_tokens=50)
    scheduler.add_request(r)
    step(scheduler, runner)
    scheduler.finish_requests(["a", "gone"], RequestStatus.FINISHED_STOPPED)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.block_ids == []
    assert scheduler.block_manager.num_free_blocks == 64 and scheduler.get_num_unfinished() == 0
    out, outputs = step(scheduler, runner)
    assert out.finished_request_ids == ["a"] and outputs == []


# ---------------------------------------------------------------- property test


def hashed_token(request_id: str, position: int) -> int:
    """Deterministic fake model: EOS (0) now and then, else 1..49."""
    return zlib.crc32(f"{request_id}/{position}".encode()) % 50


def alone(prompt_len: int, request_id: str, max_tokens: int, ignore_eos: bool) -> tuple[list[int], str]:
    """Tokens and finish reason of a request running alone."""
    out: list[int] = []
    while True:
        out.append(hashed_token(request_id, prompt_len + len(out)))
        if out[-1] == EOS and not ignore_eos:
            return out, "stop"
        if len(out) == max_tokens:
            return out, "length"


@dataclass
class Spec:
    arrival_step: int
    prefix: int  # which shared prefix the prompt starts with
    suffix: list[int]
    max_tokens: int
    ignore_eos: bool
    priority: int
    abort_step: int | None
    prompt: list[int] = field(default_factory=list)


PREFIXES = [[], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9, 9, 9]]

spec_strategy = st.builds(
    Spec,
    arrival_step=st.integers(0, 12),
    prefix=st.integers(0, len(PREFIXES) - 1),
    suffix=st.lists(st.integers(1, 49), min_size=1, max_size=6),
    max_tokens=st.integers(1, 8),
    ignore_eos=st.booleans(),
    priority=st.integers(0, 2),
    abort_step=st.none() | st.integers(0, 30),
)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(spec_strategy, min_size=1, max_size=8),
    num_blocks=st.integers(3, 16),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 12),
    threshold=st.none() | st.integers(1, 5),
    policy=st.sampled_from(list(SchedulingPolicy)),
    enable_prefix_caching=st.booleans(),
)
def test_random_workloads_drain_cleanly_with_outputs_as_if_alone(
    specs, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, threshold, policy, enable_prefix_caching
) -> None:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, bm, threshold, policy)
    runner = FakeRunner(bm, next_token=hashed_token)
    requests: dict[str, Request] = {}
    finals: dict[str, EngineCoreOutput] = {}
    for i, spec in enumerate(specs):
        spec.prompt = PREFIXES[spec.prefix] + spec.suffix
    for t in range(3000):
        for i, spec in enumerate(specs):
            rid = f"r{i}"
            if spec.arrival_step == t:
                params = {"max_tokens": spec.max_tokens, "ignore_eos": spec.ignore_eos}
                requests[rid] = make_request(
                    rid, spec.prompt, arrival_time=t + i / 100, priority=spec.priority, **params
                )
                scheduler.add_request(requests[rid])
            if spec.abort_step == t and rid in requests:
                scheduler.abort_request(rid)
        if t > max(s.arrival_step for s in specs) and not scheduler.has_unfinished_requests():
            break
        out, outputs = step(scheduler, runner)
        if policy is SchedulingPolicy.PRIORITY:  # the least important go first
            for victim in out.preempted_request_ids:
                key = (requests[victim].priority, requests[victim].arrival_time)
                assert all((r.priority, r.arrival_time) <= key for r in scheduler.running)
        live = [r for r in requests.values() if not r.is_finished]
        assert sum(bm.ref_counts) == sum(len(r.block_ids) for r in live)
        assert bm.num_free_blocks == bm.ref_counts.count(0)
        for o in outputs:
            if o.is_finished:
                assert o.request_id not in finals, "finished twice"
                finals[o.request_id] = o
    else:
        raise AssertionError("did not drain")
    assert bm.num_free_blocks == num_blocks and sum(bm.ref_counts) == 0
    assert sorted(finals) == sorted(requests) and all(r.is_finished for r in requests.values())
    for i, spec in enumerate(specs):
        r, final = requests[f"r{i}"], finals[f"r{i}"]
        expected, reason = alone(len(spec.prompt), r.request_id, spec.max_tokens, spec.ignore_eos)
        too_big = cdiv(len(spec.prompt) + len(expected) - 1, block_size) > num_blocks
        if final.finish_reason == "abort":
            assert r.output_token_ids == expected[: r.num_output_tokens]
            assert final.error is None or too_big
            assert spec.abort_step is not None or too_big
        else:
            assert (r.output_token_ids, final.finish_reason) == (expected, reason)


# ---------------------------------------------------------------- prompt logprobs


class PromptLogprobRunner(FakeRunner):
    """FakeRunner that also scores prompt tokens: token t's logprob is -t (so a wrong position shows)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(out)
        result.prompt_logprobs = {}
        for s in out.scheduled:
            if s.sampling_params.prompt_logprobs is not None:
                end = min(s.start_position + len(s.token_ids), len(s.prompt_token_ids) - 1)
                next_ids = s.prompt_token_ids[s.start_position + 1 : end + 1]
                if next_ids:  # as ModelRunner: only chunks that score a prompt token
                    result.prompt_logprobs[s.request_id] = [{t: Logprob(-float(t))} for t in next_ids]
        return result


def test_prompt_logprobs_gather_over_chunks_skip_the_prefix_cache_and_come_with_the_first_token() -> None:
    bm = BlockManager(64, 4)
    scheduler, runner = Scheduler(8, 4, bm), PromptLogprobRunner(bm)  # 4-token chunks
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    scheduler.add_request(make_request("warm", prompt, max_tokens=1))
    drain(scheduler, runner)  # its full blocks are cached now
    scheduler.add_request(make_request("r", prompt, max_tokens=2, prompt_logprobs=1))
    outputs: list[EngineCoreOutput] = []
    starts = []
    while scheduler.has_unfinished_requests():
        out, new = step(scheduler, runner)
        starts += [s.start_position for s in out.scheduled]
        outputs += new
    assert starts[0] == 0  # no prefix-cache hit
    first, second = outputs
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
    assert first.prompt_logprobs[1:] == [{t: Logprob(-float(t))} for t in prompt[1:]]
    assert second.prompt_logprobs is None


def test_prompt_logprobs_recomputed_after_a_preemption_keep_one_entry_per_token() -> None:
    r = make_request("r", 10, prompt_logprobs=1)  # prompt tokens 1..10

    def chunk(start: int, end: int) -> list[dict[int, Logprob]]:  # what the runner returns for positions [start, end)
        return [{t: Logprob(-float(t))} for t in range(start + 2, min(end, 9) + 2)]

    r.add_prompt_logprobs(0, chunk(0, 4))
    r.add_prompt_logprobs(4, chunk(4, 8))
    r.add_prompt_logprobs(0, chunk(0, 6))  # preempted, recomputed: nothing new
    r.add_prompt_logprobs(6, chunk(6, 10))  # tokens 8, 9 known, 10 new
    assert r.prompt_logprobs[0] is None
    assert r.prompt_logprobs[1:] == [{t: Logprob(-float(t))} for t in range(2, 11)]


def test_reset_prefix_cache_preempts_the_running_requests_only_when_asked() -> None:
    """vLLM v1 ``Scheduler.reset_prefix_cache(reset_running_requests)``: "If reset_running_requests is True, all the
    running requests will be preempted and moved to the waiting queue. Otherwise, this method will only reset the
    KV prefix cache when there is no running requests taking KV cache" (``while self.running: request =
    self.running.pop(); self._preempt_request(...)``, so they come back in FIFO order)."""
    scheduler, runner = setup(block_size=4)
    a, b = make_request("a", list(range(1, 11)), max_tokens=4), make_request("b", [7, 8, 9, 10, 11], max_tokens=4)
    scheduler.add_request(a), scheduler.add_request(b)
    step(scheduler, runner)
    assert scheduler.reset_prefix_cache() is False and scheduler.block_manager.num_cached_blocks == 3
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert scheduler.block_manager.num_cached_blocks == 0 and not scheduler.running
    assert list(scheduler.waiting) == [a, b] and a.status is b.status is RequestStatus.PREEMPTED
    out, _ = step(scheduler, runner)
    assert out.preempted_request_ids == ["b", "a"]  # reported once, in the next step
    assert [(s.request_id, s.start_position) for s in out.scheduled] == [("a", 0), ("b", 0)]
    drain(scheduler, runner)
    assert a.output_token_ids == [110, 111, 112, 113] and b.output_token_ids == [105, 106, 107, 108]  # as alone
    assert scheduler.reset_prefix_cache() is True  # nothing holds blocks any more


# ---------------------------------------------------------------- mutation-testing round 2 (vLLM v1 semantics)


def test_no_admission_in_a_step_that_preempted_even_for_a_more_important_request() -> None:
    """vLLM v1 ``Scheduler.schedule``: the waiting queue is read only ``if not preempted_reqs``. Under the priority
    policy the preempted "b" goes behind the more important "c", which would fit the block "b" freed: "c" still
    waits for the next step."""
    scheduler, runner = setup(num_blocks=4, block_size=2, policy="priority")
    scheduler.add_request(make_request("a", 3, arrival_time=0.0, priority=0, max_tokens=6))
    scheduler.add_request(make_request("b", [7, 8, 9], arrival_time=1.0, priority=1, max_tokens=6))
    step(scheduler, runner), step(scheduler, runner)
    scheduler.add_request(make_request("c", 1, arrival_time=2.0, priority=0, max_tokens=1))
    out, _ = step(scheduler, runner)  # "a" needs a 3rd block: "b" goes, one block is left
    assert out.preempted_request_ids == ["b"] and scheduled_counts(out) == {"a": 1}
    assert scheduler.block_manager.num_free_blocks == 1 and [r.request_id for r in scheduler.waiting] == ["c", "b"]
    out, _ = step(scheduler, runner)
    assert "c" in scheduled_counts(out)


@pytest.mark.parametrize(("num_blocks", "budget"), [(5, 3), (5, 4), (6, 3)])
def test_a_priority_preemption_of_an_earlier_scheduled_request_leaves_no_other_unscheduled(num_blocks, budget) -> None:
    """vLLM v1: unscheduling a victim scheduled earlier in the step moves the loop back one request (``req_index -= 1``)
    and returns its tokens to the budget, so each running request is scheduled unless the budget is spent."""
    scheduler, runner = setup(num_blocks=num_blocks, block_size=2, max_num_batched_tokens=budget, policy="priority")
    requests = [make_request("low", [5, 6, 7], arrival_time=0.0, priority=1, max_tokens=6),
                make_request("high", [8, 9], arrival_time=1.0, priority=0, max_tokens=6),
                make_request("other", [4], arrival_time=2.0, priority=0, max_tokens=6)]
    num_preempted = 0
    for t in range(100):
        if t < len(requests):
            scheduler.add_request(requests[t])
        elif not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler, runner)
        num_preempted += len(out.preempted_request_ids)
        left_out = [r.request_id for r in scheduler.running if r.request_id not in scheduled_counts(out)]
        assert not left_out or out.num_batched_tokens == budget, (t, left_out, scheduled_counts(out))
    assert num_preempted > 0 and all(r.is_finished for r in requests)
    assert [r.output_token_ids for r in requests] == [[103 + i for i in range(6)], [102 + i for i in range(6)],
                                                      [101 + i for i in range(6)]]  # as if alone (position_token)


def test_fcfs_admits_in_arrival_order_past_a_full_pool_and_postponed_prefixes() -> None:
    """FCFS (vLLM v1: a waiting request that does not fit stays at the head, ``break``): a request is not admitted
    before one that arrived earlier and waits for blocks; requests postponed for a prefix another request computes
    this step keep their order and their place ahead of those not yet looked at."""
    for case in ("pool", "prefix"):
        if case == "pool":  # "big" needs 3 of the 2 free blocks; "small" behind it would fit
            scheduler, runner = setup(num_blocks=4, block_size=2)
            prompts = {"a": 3, "big": [9] * 5, "small": [4]}
        else:  # "b" and "c" wait for "a"'s first blocks; "d" is admitted beside "a"; "e" finds no slot
            scheduler, runner = setup(max_num_seqs=2)
            prefix = list(range(1, 9))
            prompts = {"a": prefix + [50], "b": prefix + [51], "c": prefix + [52], "d": [60] * 9, "e": [61] * 9}
        for i, (rid, prompt) in enumerate(prompts.items()):
            scheduler.add_request(make_request(rid, prompt, arrival_time=float(i), max_tokens=2))
        admitted: list[str] = []
        for _ in range(100):
            if not scheduler.has_unfinished_requests():
                break
            out, _ = step(scheduler, runner)
            admitted += [s.request_id for s in out.scheduled if s.request_id not in admitted]
        if case == "prefix":  # "d" may pass "b" and "c" (they share "a"'s blocks next step), but none passes "b"
            assert admitted[:2] == ["a", "d"]
            admitted.remove("d"), prompts.pop("d")
        assert admitted == list(prompts), case


def test_twice_pending_abort_of_an_unknown_id_spares_a_new_request_with_that_id() -> None:
    scheduler, runner = setup()
    scheduler.abort_request("a"), scheduler.abort_request("a")  # both before the add: neither reaches the new "a"
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    assert drain(scheduler, runner)["a"].finish_reason == "length"


def test_first_scheduled_and_first_token_times_survive_later_steps_and_preemption() -> None:
    """vLLM v1 ``RequestStateStats``: the first SCHEDULED event (preemptions ignored) and the first token set the
    queue and prefill times; later steps and a readmission keep them."""
    scheduler, runner = setup(num_blocks=4, block_size=2)
    a, b = make_request("a", 3, max_tokens=4), make_request("b", [7, 8, 9], max_tokens=4)
    scheduler.add_request(a), scheduler.add_request(b)
    step(scheduler, runner)
    first = {r.request_id: (r.first_scheduled_time, r.first_token_time) for r in (a, b)}
    assert all(None not in times for times in first.values())
    drain(scheduler, runner)
    assert b.num_preemptions == 1  # "b" was readmitted
    assert {r.request_id: (r.first_scheduled_time, r.first_token_time) for r in (a, b)} == first


def test_a_stop_token_id_is_flagged_for_the_detokenizer_and_a_length_finish_is_not() -> None:
    """The finishing EOS or stop token id is marked ``is_stop_token`` (vLLM's detokenizer leaves a stop-terminated
    request's last id out of the text unless include_stop_str_in_output); a token ending on max_tokens is text."""
    scheduler, runner = setup()
    scheduler.add_request(make_request("stop", 3, stop_token_ids=[105], max_tokens=10))  # 103, 104, 105
    scheduler.add_request(make_request("length", 3, max_tokens=3))
    finals = drain(scheduler, runner)
    assert (finals["stop"].finish_reason, finals["stop"].stop_reason, finals["stop"].is_stop_token) == ("stop", 105, True)
    assert (finals["length"].finish_reason, finals["length"].is_stop_token) == ("length", False)


def test_a_priority_victim_scheduled_earlier_in_the_step_gives_its_tokens_to_the_requests_after() -> None:
    """vLLM v1 ``Scheduler.schedule``: unscheduling a victim gives ``token_budget += num_scheduled_tokens[victim]``,
    so a prefill chunk later in the same step is as long as the budget left after the requests still scheduled."""
    scheduler, runner = setup(num_blocks=5, block_size=2, max_num_batched_tokens=3, policy="priority")
    requests = [make_request("low", [5, 6], arrival_time=0.0, priority=1, max_tokens=6),
                make_request("high", [8, 9], arrival_time=1.0, priority=0, max_tokens=6),
                make_request("chunked", [20, 21, 22, 23], arrival_time=2.0, priority=0, max_tokens=4)]
    counts = []
    for request in requests:
        scheduler.add_request(request)
        counts.append(scheduled_counts(step(scheduler, runner)[0]))
    assert counts == [{"low": 2}, {"low": 1, "high": 2}, {"low": 1, "high": 1, "chunked": 1}]
    assert scheduler.block_manager.num_free_blocks == 0
    out, _ = step(scheduler, runner)  # "low" is scheduled, then "high" needs a block: "low" goes
    left = requests[2].num_tokens - 1  # "chunked" still has 3 prompt tokens to compute
    assert out.preempted_request_ids == ["low"]
    assert scheduled_counts(out) == {"high": 1, "chunked": min(left, 3 - 1)} and out.num_batched_tokens == 3
    finals = drain(scheduler, runner)
    assert {rid: o.finish_reason for rid, o in finals.items()} == dict.fromkeys(("low", "high", "chunked"), "length")
    assert requests[2].output_token_ids == [104 + i for i in range(4)]  # as if alone (position_token)
