"""LLMEngine / LLM / AsyncLLMEngine on the default model (slow) and on the tiny random Llama directory
(fast subset): equivalence with generate(), sampling settings, errors that leave other requests alone,
aborts, streaming."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
import torch

from kvgen.engine import LLM, AsyncLLMEngine, EngineArgs, LLMEngine, SamplingParams
from kvgen.engine.sampling_params import RequestOutputKind
from kvgen.generation import GenerationConfig, generate

from helpers import top_of

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PREAMBLE = "You are a helpful assistant. Answer in one short sentence, and never use more words than needed. "
TEXTS = [
    "The capital of France is", "List three colours:", "def fibonacci(n):\n    ", "Hi",
    "In 1969, the first humans landed on the Moon. The mission was called", "2 + 2 =",
    "Translate to French: good morning", "import numpy as np\n\ndef softmax(x):", "Once upon a time, in a small village,",
    "The quick brown fox", "Water boils at", "My favourite book is", "SELECT * FROM users WHERE",
    "Q: What is the largest planet?\nA:", "Roses are red,", "The three laws of robotics are",
]


@pytest.fixture(scope="module", params=[pytest.param("default", marks=pytest.mark.slow), "tiny"])
def model_tok(request, tiny_model_dir):
    """(model, tokenizer): the default model in float32, or the tiny random Llama loaded from its directory."""
    if request.param == "default":
        return request.getfixturevalue("ours_default")
    from kvgen.loader import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def prompts(model_tok):
    """32 prompts of 1 to ~60 tokens; a third share a 20-token preamble (prefix-cache hits)."""
    _, tok = model_tok
    chat = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True) for t in TEXTS[:6]]
    texts = [tok.encode(t) for t in TEXTS] + [tok.encode(PREAMBLE + t) for t in TEXTS[:10]] + chat
    return texts[:32]


@pytest.fixture(scope="module")
def reference(model_tok, prompts):
    """generate() on each prompt alone: greedy, MAX_TOKENS new tokens (EOS included when hit)."""
    model, _ = model_tok
    config = GenerationConfig(max_new_tokens=MAX_TOKENS)
    return [generate(model, torch.tensor([p]), None, config).new_token_ids[0] for p in prompts]


def _llm(model_tok, **engine_args) -> LLM:
    model, tok = model_tok
    # 16-token blocks (vLLM's GPU size): the 20-token preamble fills a block (prefix-cache hits) and small pools preempt
    return LLM(model, tok, **{"num_blocks": 256, "block_size": 16, **engine_args})


@pytest.mark.parametrize(
    "engine_args,subset",
    [
        ({}, slice(None)),  # a pool that holds everything
        ({"num_blocks": 24}, slice(None)),  # forces preemption (recompute)
        ({"max_num_batched_tokens": 20}, slice(16, 32, 2)),  # chunked prefill of the longer prompts
    ],
    ids=["large_pool", "tiny_pool_preempts", "chunked_prefill"],
)
def test_greedy_batch_is_token_identical_to_generate_alone(model_tok, prompts, reference, engine_args, subset):
    llm = _llm(model_tok, **engine_args)
    prompts, reference = prompts[subset], reference[subset]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [o.prompt_token_ids for o in outputs] == prompts
    if engine_args.get("num_blocks") == 24:
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    elif engine_args.get("max_num_batched_tokens"):
        assert max(len(p) for p in prompts) > 20  # some prompt really was split
    else:
        assert sum(o.num_cached_tokens for o in outputs) > 0  # the shared preamble was reused
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_detokenize_false_gives_the_token_ids_without_text(model_tok, prompts, reference):
    llm = _llm(model_tok)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:6]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[:6]
    assert all(o.outputs[0].text == "" for o in outputs)
    assert any(o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:6]], GREEDY,
                                                       use_tqdm=False))


def test_long_prefill_token_threshold_caps_each_prefill_chunk(model_tok, prompts, reference):
    """vLLM's long_prefill_token_threshold: no request prefills more than 7 tokens in a step; tokens unchanged."""
    llm = _llm(model_tok, long_prefill_token_threshold=7)
    scheduler, chunks = llm.llm_engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend(len(r.token_ids) for r in out.scheduled)
        return out

    scheduler.schedule = recording
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[16:32:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[16:32:2]
    assert max(chunks) == 7 and max(len(p) for p in prompts[16:32:2]) > 7


@pytest.mark.parametrize(
    "engine_args", [{}, {"num_blocks": 12}, {"max_num_batched_tokens": 16}], ids=["large_pool", "tiny_pool_preempts", "chunked_prefill"]
)
def test_quantized_default_path_engine_is_token_identical_to_generate_alone(ours_default_auto, prompts, engine_args):
    """Batch invariance on the kernels: a request's greedy tokens do not depend on its neighbours,
    on chunked prefill or on preemption (per-row arithmetic never depends on the batch)."""
    model, tok = ours_default_auto
    prompts = prompts[::2]
    config = GenerationConfig(max_new_tokens=12)
    alone = [generate(model, torch.tensor([p]), None, config).new_token_ids[0] for p in prompts]
    llm = LLM(model, tok, **{"num_blocks": 256, "block_size": 16, **engine_args})  # 12 blocks of 16 preempt
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    if engine_args.get("num_blocks"):
        assert sum(o.metrics.num_preemptions for o in outputs) > 0


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_preempting_batch(model_tok, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = _llm(model_tok).generate(TEXTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12)
    busy_params = [SamplingParams(temperature=1.2, max_tokens=10), GREEDY, seeded] * 3 + [other_seed]
    busy_prompts = [TEXTS[1 + i] if p.seed is None else TEXTS[0] for i, p in enumerate(busy_params)]
    busy = _llm(model_tok, num_blocks=10).generate(busy_prompts, busy_params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in busy) > 0
    assert [o.outputs[0].token_ids for o, p in zip(busy, busy_params) if p is seeded] == [alone] * 3
    assert busy[-1].outputs[0].token_ids != alone


def test_stat_loggers_see_each_preemption_in_the_step_it_happens(model_tok):
    """vLLM's ``IterationStats.num_preempted_reqs``: a step's stats count the requests that step preempted (the
    metrics counter moves while the requests still run, and an aborted request's preemptions count too)."""
    llm = _llm(model_tok, num_blocks=4)  # 64 tokens: two requests fit, their decodes then preempt
    engine = llm.llm_engine
    preempted_per_step: list[int] = []
    recorded_per_step: list[int] = []
    schedule = engine.scheduler.schedule

    def schedule_and_count():
        out = schedule()
        preempted_per_step.append(len(out.preempted_request_ids))
        recorded_per_step.append(0)
        return out

    engine.scheduler.schedule = schedule_and_count
    engine.stat_loggers.append(lambda stats: recorded_per_step.__setitem__(-1, stats.num_preempted_reqs))
    prompts = [{"prompt_token_ids": [5 + i] * 8} for i in range(6)]  # 8 + 24 tokens: 2 blocks each, 6 requests
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert sum(preempted_per_step) > 0
    assert recorded_per_step == preempted_per_step


def test_stop_strings_stop_token_ids_min_tokens_and_ignore_eos(ours_default):
    llm = _llm(ours_default)  # the real model: its chat answer ends with EOS
    tok = llm.get_tokenizer()
    chat = {"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=True)}
    base, free = (o.outputs[0] for o in llm.generate([TEXTS[0], chat], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False))
    assert free.finish_reason == "stop" and free.token_ids[-1] in tok.eos_token_ids  # the chat answer ends with EOS
    word, stop_id, n = base.text.split()[1], base.token_ids[2], len(free.token_ids)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[word]),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=n + 4, min_tokens=n + 2),
        SamplingParams(temperature=0.0, max_tokens=n + 3, ignore_eos=True),
    ]
    by_stop, by_id, longer, ignoring = (o.outputs[0] for o in llm.generate([TEXTS[0], TEXTS[0], chat, chat], params, use_tqdm=False))
    assert by_stop.text == base.text[: base.text.index(word)] and by_stop.finish_reason == "stop" and by_stop.stop_reason == word
    assert by_id.token_ids == base.token_ids[:3] and by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert len(longer.token_ids) >= n + 2 and not any(t in tok.eos_token_ids for t in longer.token_ids[: n + 1])
    assert ignoring.token_ids[:n] == free.token_ids and len(ignoring.token_ids) == n + 3 and ignoring.finish_reason == "length"


def test_n_completions_share_the_prompt_and_match_their_seeds(model_tok):
    model, tok = model_tok
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)
    prompt = PREAMBLE + TEXTS[1]
    engine = LLMEngine(model, tok, EngineArgs(num_blocks=128, block_size=16))  # the prompt fills a 16-token block
    engine.add_request("p", prompt, params)
    engine.step()
    engine.step()  # the children after the first wait one step for its prompt blocks, then share them
    cached = [engine.scheduler.requests[f"{i}_p"].num_cached_prefix_tokens for i in (1, 2) if f"{i}_p" in engine.scheduler.requests]
    assert cached and all(c >= 16 for c in cached)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "p"
            final = out
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    singles = [SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6) for i in range(3)]
    separate = _llm(model_tok).generate([prompt] * 3, singles, use_tqdm=False)
    assert [c.token_ids for c in final.outputs] == [o.outputs[0].token_ids for o in separate]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1


def test_logprobs_are_log_softmax_of_raw_logits_with_top_alternatives(model_tok):
    model, tok = model_tok
    ids = tok.encode(TEXTS[4])
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=4, logprobs=3, repetition_penalty=1.3)
    out = _llm(model_tok).generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        with torch.inference_mode():
            seq = torch.tensor([ids + out.token_ids[:i]])
            raw = model.compute_logits(model(seq, torch.arange(seq.shape[1])[None], None, None))[0, -1]
        expected = torch.log_softmax(raw, -1)
        assert next(iter(lp)) == token  # vLLM's order: the sampled id first
        assert lp[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        assert lp[token].rank == 1 + int((expected > expected[token]).sum())
        assert lp[token].decoded_token == tok.decode([token])  # vLLM: each id decoded alone
        top = expected.topk(3)
        assert list(top_of(lp, 3)) == top.indices.tolist()
        assert list(top_of(lp, 3).values()) == pytest.approx(top.values.tolist(), abs=1e-4)
        assert all(lp[t].decoded_token == tok.decode([t]) for t in top.indices.tolist())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
    detokenize = dataclasses.replace(params, detokenize=False)
    quiet = _llm(model_tok).generate({"prompt_token_ids": ids}, detokenize, use_tqdm=False)[0].outputs[0]
    assert quiet.token_ids == out.token_ids and all(e.decoded_token is None for lp in quiet.logprobs for e in lp.values())


def test_prompt_logprobs_are_log_softmax_of_each_prompt_position(model_tok):
    """``prompt_logprobs``: None for the first prompt token, then each token's logprob under the raw logits of the
    position before it and the k best, the same with the prompt prefilled in chunks, after a prefix-cache hit
    was possible (it is skipped), for n = 2, and on the first DELTA output only."""
    model, tok = model_tok
    ids = tok.encode(PREAMBLE + TEXTS[4])
    with torch.inference_mode():
        raw = model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None], None, None))[0]  # [T, V]
    expected = torch.log_softmax(raw, -1)  # row i predicts token i + 1

    def check(prompt_logprobs) -> None:
        assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
        for i, lp in enumerate(prompt_logprobs[1:]):
            assert next(iter(lp)) == ids[i + 1]  # the prompt token's entry first
            assert lp[ids[i + 1]].logprob == pytest.approx(expected[i, ids[i + 1]].item(), abs=1e-4)
            assert lp[ids[i + 1]].rank == 1 + int((expected[i] > expected[i, ids[i + 1]]).sum())
            assert lp[ids[i + 1]].decoded_token == tok.decode([ids[i + 1]])
            top = expected[i].topk(2)
            assert list(top_of(lp, 2)) == top.indices.tolist()
            assert list(top_of(lp, 2).values()) == pytest.approx(top.values.tolist(), abs=1e-4)

    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    llm = _llm(model_tok, max_num_batched_tokens=8)  # the prompt is prefilled in 8-token chunks
    first = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    again = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]  # its blocks are cached now
    assert again.num_cached_tokens == 0
    check(again.prompt_logprobs)
    both = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2,
                                                                     prompt_logprobs=2), use_tqdm=False)[0]
    assert len(both.outputs) == 2
    check(both.prompt_logprobs)
    engine = LLMEngine(model, tok, EngineArgs(num_blocks=64))
    engine.add_request("d", prompt_token_ids=ids, sampling_params=dataclasses.replace(
        params, max_tokens=3, output_kind=RequestOutputKind.DELTA))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    check(outputs[0].prompt_logprobs)
    assert len(outputs) == 3 and all(o.prompt_logprobs is None for o in outputs[1:])
    lone = llm.generate({"prompt_token_ids": ids[:1]}, params, use_tqdm=False)[0]
    assert lone.prompt_logprobs == [None]  # one entry per prompt token, as vLLM (it was [])
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= max_logprobs \(20\), got 21"):
        engine.add_request("big", prompt_token_ids=ids, sampling_params=SamplingParams(prompt_logprobs=21))


def test_bad_requests_raise_naming_the_field_and_others_finish_normally(model_tok, reference, prompts):
    model, tok = model_tok
    engine = LLMEngine(model, tok, EngineArgs(num_blocks=64, max_model_len=64))
    engine.add_request("ok", prompt_token_ids=prompts[0], sampling_params=GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=r"max_tokens must be <= \d+ \(max_model_len 64"):
        engine.add_request("long", prompt_token_ids=[5] * 60, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len"):
        engine.add_request("longer", prompt_token_ids=[5] * 64, sampling_params=GREEDY)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        engine.add_request("bad", "hello", SamplingParams(top_p=1.5))
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt_token_ids must be in \[0, {vocab}\), got {vocab}"):
        engine.add_request("oov", prompt_token_ids=[1, vocab], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="request_id must be unique"):
        engine.add_request("ok", "again", GREEDY)
    with pytest.raises(ValueError, match=r"logprobs must be <= max_logprobs \(20\), got 21"):
        engine.add_request("lp", "hello", SamplingParams(logprobs=21))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["ok"]
    assert outputs[-1].outputs[0].token_ids == reference[0]
    llm = _llm(model_tok, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens must be <="):
        llm.generate([TEXTS[0], {"prompt_token_ids": [5] * 60}], GREEDY, use_tqdm=False)
    assert llm.generate(TEXTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference[0]
    with pytest.raises(ValueError, match="num_blocks=4 conflicts with kv_cache_memory=100"):
        EngineArgs(num_blocks=4, kv_cache_memory=100)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        EngineArgs(max_num_seqs=0)


def test_a_refused_n_request_leaves_nothing_behind(model_tok, prompts, reference):
    """Stop strings need a tokenizer: an ``n > 1`` request refused for that leaves no parent holding its id."""
    model, _ = model_tok
    engine = LLMEngine(model, None, EngineArgs(num_blocks=64))
    for _ in range(2):
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.add_request("p", prompt_token_ids=prompts[0], sampling_params=SamplingParams(n=2, stop=["x"]))
    assert not engine.has_unfinished_requests() and not engine._parents and not engine._child_to_parent
    engine.add_request("p", prompt_token_ids=prompts[0], sampling_params=dataclasses.replace(GREEDY, n=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [c.token_ids for c in outputs[-1].outputs] == [reference[0]] * 2


def test_a_step_that_fails_leaves_the_llm_usable(model_tok, prompts, reference, monkeypatch):
    """An exception inside a step (here the runner's) ends that generate() call, whose requests leave the engine:
    the next call gives the reference tokens (the requests stayed and failed every later step before)."""
    llm = _llm(model_tok)
    runner = llm.llm_engine.runner
    execute = runner.execute
    failures = [RuntimeError("boom")]

    def fail_once(*args, **kwargs):
        if failures:
            raise failures.pop()
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_once)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    aborted = llm.llm_engine.step()  # the abort reaches the scheduler with the next step
    assert [(o.request_id, o.outputs[0].finish_reason) for o in aborted] == [("0", "abort")]
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference[0]


def test_the_default_max_model_len_fits_the_kv_pool_and_an_explicit_one_must(model_tok):
    """A pool of 64 blocks of 4 tokens holds 256: the default max_model_len (the context window) shrinks to it, so a
    longer request is a ValueError at once (it was aborted inside a step); a larger explicit one is refused."""
    model, tok = model_tok
    engine = LLMEngine(model, tok, EngineArgs(num_blocks=64, block_size=4))
    assert engine.max_model_len == 256 < model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"prompt of 300 tokens leaves no room to generate within max_model_len \(256\)"):
        engine.add_request("long", prompt_token_ids=[5] * 300, sampling_params=GREEDY)
    with pytest.raises(ValueError, match=r"max_model_len \(512\) exceeds the KV cache pool of 256 tokens \(64 blocks of 4\)"):
        LLMEngine(model, tok, EngineArgs(num_blocks=64, block_size=4, max_model_len=512))


def test_a_pool_too_large_to_map_is_refused_naming_the_setting(model_tok):
    """A pool of more bytes than an address holds (lazy_zeros' mmap fails): the ValueError names the setting that
    sized it and its value (it named only the bytes and the tensor shape)."""
    model, tok = model_tok
    with pytest.raises(ValueError, match=r"^num_blocks=1000000000000000: the KV cache pool of 1000000000000000 blocks "
                                         r"of 16 tokens does not fit in memory \(cannot map"):
        LLMEngine(model, tok, EngineArgs(num_blocks=10**15, block_size=16))
    with pytest.raises(ValueError, match=r"^kv_cache_memory=100000000000000000000: the KV cache pool of \d+ blocks"):
        LLMEngine(model, tok, EngineArgs(kv_cache_memory=10**20, block_size=16))


def test_abort_frees_blocks_and_runner_state(model_tok, prompts):
    model, tok = model_tok
    engine = LLMEngine(model, tok, EngineArgs(num_blocks=64))
    engine.add_request("a", prompt_token_ids=prompts[4], sampling_params=SamplingParams(temperature=0.0, max_tokens=50))
    engine.add_request("b", prompt_token_ids=prompts[0], sampling_params=GREEDY)
    engine.step()
    engine.step()
    held_by_a = len(engine.scheduler.requests["a"].block_ids)
    free_before = engine.block_manager.num_free_blocks
    engine.abort_request("a")
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_free_blocks >= free_before + held_by_a - 1  # b may have grown by a block
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # an empty step tells the runner about the last finished request
    assert engine.block_manager.num_free_blocks == 64 and engine.runner.num_tracked_requests == 0


def test_async_engine_streams_growing_text_equal_to_llm_generate_and_cancel_aborts(model_tok):
    model, tok = model_tok
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = _llm(model_tok).generate(TEXTS[8], params, use_tqdm=False)[0].outputs[0]

    async def main():
        engine = AsyncLLMEngine(LLMEngine(model, tok, EngineArgs(num_blocks=64)))
        texts, last = [], None
        async for out in engine.generate(TEXTS[8], params, "s"):
            texts.append(out.outputs[0].text)
            last = out

        async def consume_two():
            seen = 0
            async for _ in engine.generate(TEXTS[0], SamplingParams(temperature=0.0, max_tokens=200), "c"):
                seen += 1
                if seen == 2:
                    break

        await consume_two()
        for _ in range(100):  # the abort lands at the next step
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        await engine.shutdown()
        return texts, last, engine.engine

    texts, last, engine = asyncio.run(main())
    assert len(texts) > 2 and all(b.startswith(a) for a, b in itertools.pairwise(texts)) and len(texts[-1]) > len(texts[0])
    assert last.finished and last.outputs[0].text == expected.text and last.outputs[0].token_ids == expected.token_ids
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_llm_chat_renders_each_conversation_with_the_chat_template(model_tok):
    """vLLM's ``LLM.chat``: one conversation or a list of them give the outputs of ``generate`` on the template's
    token ids; a bad conversation or an LLM without a tokenizer is refused."""
    model, tok = model_tok
    llm = _llm(model_tok)
    conversations = [[{"role": "user", "content": t}] for t in TEXTS[:3]]
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations]
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.chat(conversations, GREEDY, use_tqdm=False)] == expected
    (one,) = llm.chat(conversations[1], GREEDY, use_tqdm=False)
    assert one.outputs[0].token_ids == expected[1] and one.prompt_token_ids == ids[1]
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty list of conversations"):
        llm.chat([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        LLM(model, None, num_blocks=16).chat(conversations[0], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_text_of_token_prompts_and_chat(model_tok):
    """vLLM: a ``TokensPrompt``'s optional ``"prompt"`` is its ids' text, returned as ``RequestOutput.prompt`` (the
    ids are what runs), and ``LLM.chat``'s outputs carry the rendered template as their ``prompt``."""
    _, tok = model_tok
    llm = _llm(model_tok)
    ids = tok.encode("Hello there")
    (out,) = llm.generate({"prompt_token_ids": ids, "prompt": "shown text"}, GREEDY, use_tqdm=False)
    assert out.prompt == "shown text" and out.prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].prompt is None
    conversation = [{"role": "user", "content": "Say hi."}]
    (chat,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert chat.prompt == tok.apply_chat_template(conversation, add_generation_prompt=True)
    assert chat.prompt_token_ids == tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    with pytest.raises(ValueError, match="prompt must be their text"):
        llm.generate({"prompt_token_ids": ids, "prompt": [1, 2]}, GREEDY, use_tqdm=False)


def test_allowed_token_ids_and_bad_words_on_the_tiny_model(tiny_model_dir):
    from kvgen.loader import load_model

    llm = LLM(*load_model(str(tiny_model_dir)), num_blocks=64)
    tok = llm.get_tokenizer()
    plain = llm.generate("Hello there", GREEDY, use_tqdm=False)[0].outputs[0]
    allowed = [5, 17, 42, 99]
    out = llm.generate("Hello there", SamplingParams(temperature=1.0, seed=3, max_tokens=20, allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 20 and set(out.token_ids) <= set(allowed)
    word = tok.decode(plain.token_ids[:2]).strip()  # the greedy reply's first word(s)
    banned = llm.generate("Hello there", dataclasses.replace(GREEDY, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    sequences = llm.llm_engine._bad_words_token_ids([word])
    assert sequences and banned.token_ids != plain.token_ids
    for ids in sequences:
        assert all(banned.token_ids[i : i + len(ids)] != ids for i in range(len(banned.token_ids)))
    with pytest.raises(ValueError, match=r"allowed_token_ids must be token ids in \[0, 384\), got 384"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[1, 384]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids in \[0, 384\), got 10000"):
        llm.generate("Hi", SamplingParams(logit_bias={1: 2.0, 10000: 5.0}), use_tqdm=False)  # vLLM refuses it too


def test_scheduling_policy_priority_runs_the_lowest_priority_first(tiny_model_dir):
    """EngineArgs.scheduling_policy reaches the scheduler: with one running sequence, a later request of priority -1
    finishes before earlier ones of priority 5 and 0 (vLLM's order: lower first); under "fcfs" (the default) a
    priority other than 0 is refused naming the field, and an unknown policy too."""
    from kvgen.loader import load_model

    model, tok = load_model(tiny_model_dir)
    engine = LLMEngine(model, tok, EngineArgs(scheduling_policy="priority", max_num_seqs=1, num_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for request_id, priority in (("five", 5), ("zero", 0), ("minus_one", -1)):
        engine.add_request(request_id, [5, 6, 7], params, priority=priority)
    finished = [out.request_id for _ in range(40) for out in engine.step() if out.finished]
    assert finished == ["minus_one", "zero", "five"]
    fcfs = LLMEngine(model, tok, EngineArgs(num_blocks=64))
    with pytest.raises(ValueError, match="^priority must be 0 unless scheduling_policy is 'priority'"):
        fcfs.add_request("a", [5, 6, 7], params, priority=2)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineArgs(scheduling_policy="lifo")


def test_llm_generate_takes_one_priority_per_prompt(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_blocks=64, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=False, priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]  # in input order, whatever ran first
    with pytest.raises(ValueError, match=r"priority must give one int per prompt \(2\), got 1"):
        llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be 0 unless"):
        LLM(str(tiny_model_dir), num_blocks=64).generate([5, 6, 7], params, use_tqdm=False, priority=[4])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(model_tok, prompts):
    """vLLM's left truncation: the tokens of the prompt's last k alone; -1 keeps up to max_model_len."""
    long_prompt, k = next(p for p in prompts if len(p) > 12), 8
    llm = _llm(model_tok)
    out = llm.generate([long_prompt], dataclasses.replace(GREEDY, truncate_prompt_tokens=k), use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-k:]
    alone = llm.generate([long_prompt[-k:]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate([long_prompt], dataclasses.replace(GREEDY, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == long_prompt


def test_truncate_prompt_tokens_above_max_model_len_is_refused_as_vllm(tiny_model_dir):
    """vLLM's ``_validate_truncation_size``: ``truncate_prompt_tokens > max_model_len`` is a ValueError, whatever the
    prompt's length (kvgen served a short prompt and refused a long one for another reason)."""
    llm = LLM(str(tiny_model_dir), num_blocks=64, block_size=16, max_model_len=64)
    for k in (65, 10**6):
        with pytest.raises(ValueError, match=rf"truncate_prompt_tokens must be -1 or <= max_model_len \(64\), got {k}"):
            llm.generate([[5, 6, 7]], dataclasses.replace(GREEDY, truncate_prompt_tokens=k), use_tqdm=False)
    out = llm.generate([list(range(3, 103))], dataclasses.replace(GREEDY, truncate_prompt_tokens=60, max_tokens=None),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(43, 103)) and len(out.outputs[0].token_ids) <= 4


def test_llm_arguments_of_another_kind_are_value_errors(tiny_model_dir):
    """The offline API's arguments checked before any request: params of another kind (a dict, a GenerationConfig,
    None for beam search), a priority that is not a list, bytes as prompts (read as token ids before)."""
    from kvgen.generation import GenerationConfig

    llm = LLM(str(tiny_model_dir), num_blocks=64)
    for call, match in [
        (lambda: llm.generate(["hi"], {"temperature": 0}), "sampling_params must be one SamplingParams .*got dict"),
        (lambda: llm.generate(["hi"], GenerationConfig()), "sampling_params must be .*got GenerationConfig"),
        (lambda: llm.generate(["hi"], GREEDY, priority=0), "priority must be a list of ints, one per prompt, got 0"),
        (lambda: llm.generate(b"abc"), "prompts must be a string, a list of token ids .*got b'abc'"),
        (lambda: llm.beam_search(["hi"], None), "params must be a BeamSearchParams, got NoneType"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("n", [1, 2])
def test_llm_generate_returns_whole_outputs_whatever_the_output_kind(model_tok, prompts, n):
    """vLLM's ``LLM.generate`` runs every request FINAL_ONLY: a DELTA or CUMULATIVE request's output holds all its
    text, ids, logprobs and prompt logprobs, not only its last step's; the caller's params are left as given."""
    llm = _llm(model_tok)
    base = dict(temperature=0.0, max_tokens=6, ignore_eos=True, n=n, logprobs=0, prompt_logprobs=0)
    (whole,) = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(**base), use_tqdm=False)
    assert all(len(c.token_ids) == 6 for c in whole.outputs)
    for kind in RequestOutputKind:
        params = SamplingParams(**base, output_kind=kind)
        (out,) = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
        assert params.output_kind is kind
        assert [(c.index, c.text, c.token_ids, c.logprobs) for c in out.outputs] == \
            [(c.index, c.text, c.token_ids, c.logprobs) for c in whole.outputs]
        assert out.prompt_logprobs == whole.prompt_logprobs and out.finished


def test_logprobs_minus_one_is_the_whole_vocabulary(model_tok):
    """vLLM: ``logprobs=-1`` / ``prompt_logprobs=-1`` return every token's logprob, on an engine whose
    ``max_logprobs`` is -1 (the vocabulary size); under the default ``max_logprobs`` (20) they are refused."""
    model, tok = model_tok
    vocab = model.config.vocab_size
    llm = _llm(model_tok, max_logprobs=-1)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    assert params.logprobs == -1 and params.prompt_logprobs == -1
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    assert [len(lp) for lp in out.outputs[0].logprobs] == [vocab, vocab]
    assert out.prompt_logprobs[0] is None and [len(lp) for lp in out.prompt_logprobs[1:]] == [vocab] * 2
    assert sorted(lp.rank for lp in out.prompt_logprobs[1].values()) == list(range(1, vocab + 1))
    assert out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].rank == 1  # greedy: the best of them all
    with pytest.raises(ValueError, match=r"logprobs must be <= max_logprobs \(20\), got -1"):
        _llm(model_tok).generate([5, 6, 7], SamplingParams(logprobs=-1), use_tqdm=False)
    for name in ("logprobs", "prompt_logprobs"):  # past the vocabulary: a clear error, not a failed step
        with pytest.raises(ValueError, match=rf"^{name} must be <= the vocabulary size \({vocab}\), got {vocab + 1}"):
            llm.generate([5, 6, 7], SamplingParams(**{name: vocab + 1}), use_tqdm=False)
    assert llm.generate([5, 6, 7], SamplingParams(max_tokens=1), use_tqdm=False)[0].finished  # still serving
    with pytest.raises(ValueError, match="logprobs must be"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-2)


def test_llm_chat_takes_continue_final_message_and_chat_template_kwargs(model_tok):
    """vLLM's ``LLM.chat(..., continue_final_message=True, chat_template_kwargs={...})``: the prompt ends inside the
    last message (no new turn), and the extra variables reach the template."""
    _, tok = model_tok
    llm = _llm(model_tok)
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    kwargs = {"enable_thinking": False}
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True,
                      chat_template_kwargs=kwargs)
    assert out.prompt.endswith("The colour is")
    assert out.prompt_token_ids == tok.apply_chat_template(conversation, tokenize=True, continue_final_message=True,
                                                           chat_template_kwargs=kwargs)


def test_llm_chat_hands_messages_over_as_vllm(tiny_model_dir):
    """vLLM's ``LLM.chat`` joins a content list's text parts with newlines and parses tool-call arguments from their
    JSON text; kvgen gave the template the raw list (rendered as a Python list by a string template) and the JSON
    text (quoted a second time by ``arguments | tojson``)."""
    from transformers import AutoTokenizer

    from kvgen.loader import load_model

    model, tok = load_model(str(tiny_model_dir))
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% for c in m.tool_calls or [] %}"
                "<call>{{ c.function.arguments | tojson }}</call>{% endfor %}\n{% endfor %}[assistant]")
    ref = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ref.chat_template = template
    call = {"id": "call_1", "type": "function", "function": {"name": "paint", "arguments": '{"colour": "red"}'}}
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Paint it"}, {"type": "text", "text": "red."}]},
        {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "user", "content": "Again."}]
    as_vllm = [{"role": "user", "content": "Paint it\nred."},
               {"role": "assistant", "content": "", "tool_calls": [
                   {**call, "function": {"name": "paint", "arguments": {"colour": "red"}}}]},
               conversation[2]]
    (out,) = LLM(model, tok, num_blocks=64).chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == ref.apply_chat_template(as_vllm, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == ref.apply_chat_template(as_vllm, add_generation_prompt=True, tokenize=True)
    assert '<call>{"colour": "red"}</call>' in out.prompt and conversation[1]["tool_calls"][0] is call  # not modified


def test_completion_output_finished_is_a_method_as_vllm(model_tok):
    """vLLM's ``CompletionOutput.finished()`` is a method (``RequestOutput.finished`` an attribute)."""
    model, tok = model_tok
    engine = LLMEngine(model, tok, EngineArgs(num_blocks=64))
    engine.add_request("r", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].finished() for o in outputs] == [False, False, True] == [o.finished for o in outputs]


def test_reset_prefix_cache_with_running_requests_preempts_them_and_outputs_stay_as_alone(model_tok, prompts,
                                                                                          reference):
    """vLLM v1 ``LLMEngine.reset_prefix_cache(reset_running_requests=False) -> bool``: refused (False) while running
    requests hold KV blocks; with ``reset_running_requests=True`` the scheduler preempts every running request
    ("while self.running: ... self._preempt_request(request, timestamp)") and the reset succeeds. kvgen had no such
    method. The preempted requests are recomputed and end with the tokens ``generate()`` gives them alone."""
    model, tok = model_tok
    engine = LLMEngine(model, tok, EngineArgs(num_blocks=64, block_size=16))
    chosen = [16, 17, 18]  # preamble prompts: at least one full, prefix-cached block
    for i in chosen:
        engine.add_request(str(i), prompt_token_ids=prompts[i], sampling_params=GREEDY)
    engine.step()
    engine.step()
    assert engine.block_manager.num_cached_blocks > 0
    assert engine.reset_prefix_cache() is False and engine.block_manager.num_cached_blocks > 0
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert engine.block_manager.num_cached_blocks == 0 and engine.get_stats().num_waiting_reqs == len(chosen)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert {r: finals[r].outputs[0].token_ids for r in finals} == {str(i): reference[i] for i in chosen}
    assert engine.reset_prefix_cache() is True


def test_get_tokenizer_is_the_engines_tokenizer_as_vllm(model_tok):
    """vLLM v1's ``LLMEngine.get_tokenizer()`` (``return self.renderer.get_tokenizer()``) was missing on kvgen's
    engine (AttributeError; only the ``tokenizer`` attribute). It is the tokenizer ``LLM.get_tokenizer()`` gives,
    None for an engine of token ids only."""
    model, tok = model_tok
    llm = LLM(model, tok, num_blocks=16)
    assert llm.llm_engine.get_tokenizer() is tok is llm.get_tokenizer()
    assert LLMEngine(model, None, EngineArgs(num_blocks=16)).get_tokenizer() is None
