"""``use_beam_search`` (vLLM's extra of the completion and chat endpoints): each prompt's ``n`` best beams from the
engine's beam search (:mod:`kvgen.engine.beam_search`, ``n`` = beam width, with ``length_penalty``), answered, or
streamed as one piece per choice, when the search ends (as vLLM's ``beam_search``); a beam's final EOS is in its
token ids only with ``include_stop_str_in_output``. Settings beam search would silently ignore (stop strings,
penalties, structured outputs, ...) are refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from kvgen.engine.async_engine import EngineStoppedError, RequestStream
from kvgen.engine.beam_search import (
    BeamSearchParams,
    BeamSearchSequence,
    Candidates,
    beam_search_steps,
    candidates_of,
    num_candidates,
    token_logprobs,
)
from kvgen.engine.outputs import CompletionOutput, RequestOutput
from kvgen.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgen.server.errors import OpenAIError, bad_request
from kvgen.server.metrics import RequestTracker
from kvgen.server.protocol import SamplingFields
from kvgen.server.serving import Generation, ServerState, client_request_id, new_request_id, value_error

# request fields beam search does not use -> the values that mean "off"
_IGNORED_BY_BEAM_SEARCH: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ""), "stop_token_ids": (None, []), "logit_bias": (None, {}), "allowed_token_ids": (None,),
    "bad_words": (None, []), "structured_outputs": (None,), "min_tokens": (0,), "seed": (None,),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
}


def new_generation(state: ServerState, req: SamplingFields, prefix: str, raw: Request | None = None) -> Generation:
    """The engine requests of one HTTP request (its id from ``raw``'s X-Request-Id, see ``new_request_id``): a
    :class:`BeamGeneration` with ``use_beam_search``. Raises a 400 naming a field beam search would ignore."""
    request_id, is_client_id = new_request_id(prefix, raw), bool(client_request_id(raw))
    if not req.use_beam_search:
        return Generation(state, request_id, is_client_id)
    for name, off in _IGNORED_BY_BEAM_SEARCH.items():
        if getattr(req, name, None) not in off:
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        raise bad_request("response_format is not supported with use_beam_search", "response_format")
    return BeamGeneration(state, request_id, req.length_penalty, is_client_id)


class BeamGeneration(Generation):
    """Beam search for every prompt of one HTTP request; ``outputs`` yields each prompt's finished
    ``RequestOutput`` (``n`` completions, best first) once the search ends. Always ``close``."""

    def __init__(self, state: ServerState, request_id: str, length_penalty: float, is_client_id: bool = False) -> None:
        super().__init__(state, request_id, is_client_id)
        self.length_penalty = length_penalty
        self.prompts: list[list[int]] = []
        self.params = SamplingParams()  # the request's (n, max_tokens, logprobs, ...), set by start
        self.step_params = SamplingParams()  # each beam's one-token step request
        self.beam_params = BeamSearchParams()
        self.priority = 0

    async def start(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str, priority: int = 0
                    ) -> None:
        if params.structured_outputs is not None:
            raise bad_request("use_beam_search cannot follow a schema (tool_choice 'required' or a named tool)",
                              "tool_choice")
        if params.prompt_logprobs is not None:
            raise bad_request("echo with logprobs is not supported with use_beam_search", "echo")
        max_logprobs = self.state.engine.engine.max_logprobs
        if 2 * params.n > max_logprobs:
            raise bad_request(f"use_beam_search needs 2 * n <= {max_logprobs} (the server's max_logprobs), got "
                              f"n={params.n}", "n")
        try:
            self.beam_params = BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens or 1,
                                                ignore_eos=params.ignore_eos, temperature=params.temperature,
                                                length_penalty=self.length_penalty)
        except ValueError as e:
            raise value_error(e, "length_penalty") from None
        self.admit(len(prompts) * params.n)
        self.num_prompts = len(prompts)
        self.prompts, self.priority, self.params = prompts, priority, params
        num_logprobs = num_candidates(params.n, self.state.engine.engine.model.config.vocab_size)
        self.step_params = SamplingParams(logprobs=num_logprobs, max_tokens=1, temperature=params.temperature,
                                          output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        self.trackers = [RequestTracker(self.state.metrics, f"{self.request_id}-{i}") for i in range(len(prompts))]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        engine = self.state.engine.engine
        search = beam_search_steps(self.prompts, self.beam_params, engine.eos_token_ids, self.state.max_model_len)
        try:
            batch = next(search)
            while True:
                batch = search.send(await self._step(batch))
        except StopIteration as done:
            best: list[list[BeamSearchSequence]] = done.value
        for i, beams in enumerate(best):
            completions = [self._completion(j, beam, len(self.prompts[i])) for j, beam in enumerate(beams)]
            output = RequestOutput(self.request_id, None, self.prompts[i], completions, finished=True)
            self.trackers[i].on_output(output)
            yield i, output

    async def _step(self, batch: list[list[int]]) -> list[Candidates]:
        """Run every live beam one token as its own engine request; their candidates, in order."""
        self.streams = []
        for tokens in batch:
            engine_id = new_request_id(self.engine_request_id)
            try:
                stream = await self.state.engine.add_request(engine_id, {"prompt_token_ids": tokens},
                                                             self.step_params, self.priority)
            except ValueError as e:
                raise value_error(e, "prompt") from None
            except EngineStoppedError as e:  # the shutdown's abort_all came between two beam steps
                raise OpenAIError(503, f"the request was aborted by the server: {e}", None, "aborted") from None
            self.streams.append(stream)
        finals = await asyncio.gather(*(_last_output(s) for s in self.streams))
        for stream in self.streams:
            await stream.aclose()
        return [candidates_of(o) for o in finals]

    def _completion(self, index: int, beam: BeamSearchSequence, num_prompt_tokens: int) -> CompletionOutput:
        """One choice. A final EOS stays out of the text, and out of the token ids (so of the logprobs and usage)
        unless ``include_stop_str_in_output``, and is its ``stop_reason``, as vLLM's serving ``beam_search``;
        ``cum_logprob`` still counts it."""
        new_ids = beam.tokens[num_prompt_tokens:]
        num_text_ids = len(new_ids) - (beam.finish_reason == "stop")
        text = self.state.tokenizer.decode(new_ids[:num_text_ids], skip_special_tokens=self.params.skip_special_tokens)
        num_ids = len(new_ids) if self.params.include_stop_str_in_output else num_text_ids
        num_top = self.params.logprobs
        logprobs = None if num_top is None else token_logprobs(beam, num_prompt_tokens, num_top)[:num_ids]
        stop_reason = new_ids[-1] if beam.finish_reason == "stop" else None
        return CompletionOutput(index, text, new_ids[:num_ids], beam.cum_logprob, logprobs, beam.finish_reason,
                                stop_reason)

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self.state.metrics.num_in_server -= self._num_admitted
        for stream in self.streams:  # the step in flight, if the client left
            await stream.aclose()
        for tracker in self.trackers:
            tracker.finish(is_aborted=tracker.first_token is None)


async def _last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None and last.finished  # a stream ends with its finished output
    return last
