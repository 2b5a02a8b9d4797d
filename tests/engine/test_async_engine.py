"""AsyncLLMEngine without a model: a failing step fails and aborts the requests in flight but
not later ones; a stream closed before (or without) being read aborts its request."""

from __future__ import annotations

import asyncio

import pytest

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.outputs import CompletionOutput, RequestOutput


class _StubEngine:
    """Stands in for LLMEngine: every request finishes after one step; ``fail_steps`` steps raise first."""

    def __init__(self, fail_steps: int = 0) -> None:
        self.unfinished: set[str] = set()
        self.aborted: list[str] = []
        self.fail_steps = fail_steps

    def prepare_request(self, request_id, prompt, sampling_params, prompt_token_ids=None, priority=0) -> str:
        return request_id

    def add_prepared(self, request_id: str) -> None:
        self.unfinished.add(request_id)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.aborted += ids
        self.unfinished -= set(ids)

    def forget_aborted(self, request_id: str) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def step(self) -> list[RequestOutput]:
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("step failed")
        done, self.unfinished = sorted(self.unfinished), set()
        return [RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [5], None, None, "length")], True) for rid in done]


async def _collect(engine: AsyncLLMEngine, request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate("hi", None, request_id)]


def test_a_failed_step_aborts_its_requests_and_the_next_request_is_served():
    async def scenario() -> tuple[_StubEngine, list[RequestOutput]]:
        stub = _StubEngine(fail_steps=1)
        engine = AsyncLLMEngine(stub, step_in_thread=False)
        with pytest.raises(RuntimeError, match="step failed"):
            await _collect(engine, "a")
        assert engine.is_failed and "a" in stub.aborted
        outputs = await _collect(engine, "b")  # the loop restarts with the next request
        await engine.shutdown()
        return stub, outputs

    stub, outputs = asyncio.run(scenario())
    assert [o.request_id for o in outputs] == ["b"] and outputs[0].finished
    assert "b" not in stub.aborted


def test_closing_a_stream_before_its_last_output_aborts_the_request():
    async def scenario() -> _StubEngine:
        stub = _StubEngine()
        engine = AsyncLLMEngine(stub, step_in_thread=False)
        never_read = await engine.add_request("unread", "hi", None)
        await never_read.aclose()
        await never_read.aclose()  # idempotent
        finished = await engine.add_request("read", "hi", None)
        assert [o.finished async for o in finished] == [True]
        await finished.aclose()
        await engine.shutdown()
        return stub

    stub = asyncio.run(scenario())
    assert stub.aborted == ["unread"]


def test_vllm_prompt_dicts_reach_the_engine_as_llm_generate_takes_them(tiny_model_dir):
    """vLLM's ``AsyncLLM.generate`` and ``LLMEngine.add_request`` take ``TextPrompt`` / ``TokensPrompt`` dicts:
    ``{"prompt": text}`` streamed a KeyError and a TokensPrompt's ``prompt`` (its text) was dropped; both now give
    ``LLM.generate``'s output for the same dict."""
    from kvgen.engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt": "Hello there"}, {"prompt_token_ids": [5, 6, 7], "prompt": "its text"}]
    expected = llm.generate(prompts, params, use_tqdm=False)

    async def scenario() -> list[RequestOutput]:
        engine = AsyncLLMEngine(llm.llm_engine, step_in_thread=False)
        finals = [[out async for out in engine.generate(p, params, f"r{i}")][-1] for i, p in enumerate(prompts)]
        await engine.shutdown()
        return finals

    finals = asyncio.run(scenario())
    assert [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in finals] == [
        (o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in expected]
    llm.llm_engine.add_request("sync", {"prompt": "Hello there"}, params)
    done = [o for _ in range(10) for o in llm.llm_engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_shutdown_is_a_plain_call_as_vllm_and_can_be_awaited():
    """vLLM's ``AsyncLLM.shutdown()`` is a plain method: called without ``await`` it stops the engine. kvgen's was
    ``async def``, so such a call only warned "never awaited" and left the step loop running. Both forms stop it;
    ``is_running`` / ``errored`` are vLLM's names for the loop's state."""
    import warnings

    async def scenario() -> None:
        engine = AsyncLLMEngine(_StubEngine(), step_in_thread=False)
        await _collect(engine, "a")
        task = engine._loop_task
        assert engine.is_running and not engine.errored and task is not None and not task.done()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.shutdown()  # not awaited, as vLLM callers write it
            await asyncio.sleep(0)
        assert task.cancelled()
        await engine.shutdown()  # nothing left to stop: still awaitable
        await _collect(engine, "b")
        task = engine._loop_task
        await engine.shutdown()
        assert task is not None and task.cancelled()
        failing = AsyncLLMEngine(_StubEngine(fail_steps=1), step_in_thread=False)
        with pytest.raises(RuntimeError, match="step failed"):
            await _collect(failing, "c")
        assert failing.errored and not failing.is_running

    asyncio.run(scenario())


def test_vllm_health_and_tokenizer_names(tiny_model_dir):
    """vLLM's ``AsyncLLM`` has ``check_health()`` (raises ``dead_error`` once the engine died), ``is_stopped`` (its
    ``errored``), ``dead_error`` and ``get_tokenizer()``; kvgen's engine had none of them (AttributeError). They now
    report the step loop's state, the failure being the step's own exception, and the tokenizer is ``LLM``'s."""
    from kvgen.engine import LLM

    llm = LLM(str(tiny_model_dir), num_blocks=64)

    async def scenario() -> None:
        healthy = AsyncLLMEngine(llm.llm_engine, step_in_thread=False)
        await healthy.check_health()
        assert not healthy.is_stopped and healthy.get_tokenizer() is llm.get_tokenizer()
        failing = AsyncLLMEngine(_StubEngine(fail_steps=1), step_in_thread=False)
        with pytest.raises(RuntimeError, match="step failed"):
            await _collect(failing, "a")
        assert failing.is_stopped == failing.errored is True
        with pytest.raises(RuntimeError, match="step failed"):
            await failing.check_health()
        assert str(failing.dead_error) == "step failed"
        await _collect(failing, "b")  # the loop restarts with the next request: healthy again
        await failing.check_health()
        assert not failing.is_stopped
        await failing.shutdown()

    asyncio.run(scenario())


def test_a_cancelled_requests_id_can_be_reused_at_once(tiny_model_dir):
    """vLLM's ``AsyncLLM`` forgets a request as soon as its ``generate()`` is left early (``OutputProcessor
    .abort_requests``), so the same id may be submitted again right away. kvgen kept the id in flight until the
    next step applied the abort, and the resubmission raised "request_id must be unique"; the new request now runs
    (n=1 and n>1 alike), gives the output it gives alone, and no block stays held."""
    from kvgen.engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), num_blocks=64)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    cases = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
             SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)]
    expected = [[c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs] for params in cases]

    async def scenario() -> list[list[list[int]]]:
        engine = AsyncLLMEngine(llm.llm_engine)
        finals = []
        for params in cases:
            first = engine.generate(prompt, params, "same-id")
            async for _ in first:
                break  # the caller leaves after the first output
            await first.aclose()
            outputs = [out async for out in engine.generate(prompt, params, "same-id")]
            finals.append([c.token_ids for c in outputs[-1].outputs])
        await engine.shutdown()
        return finals

    assert asyncio.run(scenario()) == expected
    stats = llm.llm_engine.get_stats()
    assert not llm.llm_engine.has_unfinished_requests() and stats.num_free_blocks == stats.num_blocks


def test_reset_prefix_cache_runs_between_steps_as_vllm(tiny_model_dir):
    """vLLM's ``AsyncLLM.reset_prefix_cache(reset_running_requests=False) -> bool`` (awaited, the engine core's
    answer); kvgen's engine had none (AttributeError). A stream whose request it preempts ends as it would alone."""
    from kvgen.engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), num_blocks=64, block_size=4)
    prompt, params = {"prompt_token_ids": list(range(5, 19))}, SamplingParams(temperature=0.0, max_tokens=8,
                                                                              ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    async def scenario() -> tuple[bool, bool, list[int], bool]:
        engine = AsyncLLMEngine(llm.llm_engine, step_in_thread=False)
        stream = engine.generate(prompt, params, "r")
        await anext(stream)  # the request is running: it holds blocks
        refused = await engine.reset_prefix_cache()
        forced = await engine.reset_prefix_cache(reset_running_requests=True)
        outputs = [out async for out in stream]
        is_reset = await engine.reset_prefix_cache()  # the request is done: nothing holds blocks
        await engine.shutdown()
        return refused, forced, outputs[-1].outputs[0].token_ids, is_reset

    assert asyncio.run(scenario()) == (False, True, alone, True)


def test_a_slow_grammar_compiles_while_other_requests_step_and_the_loop_runs(tiny_model_dir, monkeypatch):
    """A structured-output grammar is built in a worker thread outside the step lock, as vLLM compiles grammars
    asynchronously: a 2 MB regex held the event loop (and every stream) for 2 s. Here the compile waits until another
    request has finished; before, the compile ran on the loop under the lock, so that request could not step and the
    wait ran out first."""
    import threading

    from kvgen.engine import LLM, SamplingParams
    from kvgen.engine.structured_outputs import GrammarCompiler, StructuredOutputsParams

    llm = LLM(str(tiny_model_dir), num_blocks=64)
    other_done, events = threading.Event(), []
    matcher = GrammarCompiler.matcher

    def slow_matcher(self, params):
        events.append("compile started")
        other_done.wait(timeout=10)
        events.append("compile ended")
        return matcher(self, params)

    monkeypatch.setattr(GrammarCompiler, "matcher", slow_matcher)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=4,
                                 structured_outputs=StructuredOutputsParams(regex="[0-9]+"))

    async def scenario() -> list[int]:
        engine = AsyncLLMEngine(llm.llm_engine)

        async def other() -> None:
            while "compile started" not in events:
                await asyncio.sleep(0.01)
            async for output in engine.generate([5, 6, 7], plain, "plain"):
                if output.finished:
                    events.append("other finished")
                    other_done.set()

        async def constrained_request() -> list[int]:
            outputs = [out async for out in engine.generate([5, 6, 7], constrained, "constrained")]
            return outputs[-1].outputs[0].token_ids

        _, ids = await asyncio.gather(other(), constrained_request())
        await engine.shutdown()
        return ids

    ids = asyncio.run(scenario())
    assert events == ["compile started", "other finished", "compile ended"]
    assert ids == llm.generate([{"prompt_token_ids": [5, 6, 7]}], constrained, use_tqdm=False)[0].outputs[0].token_ids


def test_abort_all_during_a_grammar_compile_stops_that_request_too(tiny_model_dir, monkeypatch):
    """A request still being prepared (its grammar compiling in a worker thread) when the shutdown's ``abort_all``
    runs is not added afterwards: it ran on to its last token after the abort."""
    import threading

    from kvgen.engine import LLM, SamplingParams
    from kvgen.engine.async_engine import EngineStoppedError
    from kvgen.engine.structured_outputs import GrammarCompiler, StructuredOutputsParams

    llm = LLM(str(tiny_model_dir), num_blocks=64)
    started, release = threading.Event(), threading.Event()
    matcher = GrammarCompiler.matcher

    def held_matcher(self, params):
        started.set()
        release.wait(timeout=10)
        return matcher(self, params)

    monkeypatch.setattr(GrammarCompiler, "matcher", held_matcher)
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))

    async def scenario() -> None:
        engine = AsyncLLMEngine(llm.llm_engine)
        task = asyncio.create_task(engine.add_request("held", [5, 6, 7], params))
        while not started.is_set():
            await asyncio.sleep(0.01)
        engine.abort_all()
        release.set()
        with pytest.raises(EngineStoppedError, match="'held' not added"):
            await task
        await engine.shutdown()

    asyncio.run(scenario())
    assert not llm.llm_engine.has_unfinished_requests()


def test_concurrent_first_structured_requests_build_the_grammar_tokenizer_once(tiny_model_dir, monkeypatch):
    """``prepare_request`` runs in worker threads; the lazily built compiler and llguidance tokenizer (~0.25 s and its
    memory for a 49k vocabulary) were built once per concurrent first request."""
    import threading
    import time

    import llguidance

    from kvgen.engine import LLM, SamplingParams
    from kvgen.engine.structured_outputs import StructuredOutputsParams

    llm = LLM(str(tiny_model_dir), num_blocks=64)
    builds, real = [], llguidance.LLTokenizer

    def slow_tokenizer(*args, **kwargs):
        builds.append(1)
        time.sleep(0.2)  # the build's time, so the threads overlap
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", slow_tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    threads = [threading.Thread(target=llm.llm_engine.prepare_request, args=(f"r{i}", [5, 6, 7], params))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
