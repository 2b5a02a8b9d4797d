"""``LLM``: offline batch generation on the engine (vLLM's ``LLM.generate``, ``LLM.chat`` and ``LLM.beam_search``)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvgen.chat_template import ContentFormat, read_chat_template, template_messages
from kvgen.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search_steps,
    candidates_of,
    num_candidates,
)
from kvgen.engine.engine_args import EngineArgs
from kvgen.engine.generation_defaults import as_sampling_params, default_sampling_params
from kvgen.engine.llm_engine import LLMEngine, split_prompt
from kvgen.engine.outputs import RequestOutput
from kvgen.engine.pooling import EmbeddingRequestOutput, PoolingParams
from kvgen.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgen.loader import load_model, resolve_model_path
from kvgen.models import CausalLM
from kvgen.tokenizer import Tokenizer

PromptInput = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}
Conversation = list[dict[str, Any]]  # OpenAI-style messages: {"role": ..., "content": ...}


class LLM:
    """An engine plus a loop that runs it until every prompt of a call has finished.

    ``model``: ``"default"``, a .gguf file, a Hugging Face directory, or an already
    built model (then pass ``tokenizer``; None means token-id prompts only).
    ``tokenizer``: a ``Tokenizer`` or a Hugging Face directory holding one, or the repo id of one in the local Hugging
    Face cache (vLLM's ``tokenizer``), used instead of the model's own; None: the model's own.
    ``engine_args`` are further ``EngineArgs`` fields (``num_blocks``, ``max_num_seqs``, ...).
    Raises ``ValueError`` for bad engine settings or a tokenizer of another type, ``ModelNotFoundError`` /
    ``ModelFormatError`` for a tokenizer directory that is missing or holds no tokenizer.
    """

    def __init__(self, model: str | CausalLM = "default", tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
                 **engine_args: Any) -> None:
        if isinstance(tokenizer, (str, os.PathLike)):  # vLLM's tokenizer path (loaded first: it fails fast)
            from kvgen.loader import cached_snapshot

            is_local = os.path.exists(os.path.expanduser(tokenizer))  # else a repo id in the Hugging Face cache
            tokenizer = Tokenizer.from_pretrained(tokenizer if is_local else cached_snapshot(str(tokenizer)) or tokenizer)
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise ValueError(f"tokenizer must be a kvgen Tokenizer, a Hugging Face directory or None, got "
                             f"{type(tokenizer).__name__}")
        if isinstance(model, CausalLM):
            args = EngineArgs(**engine_args)
            self.llm_engine, model_path = LLMEngine(model, tokenizer, args), None
        else:
            args = EngineArgs(model=str(model), **engine_args)
            if tokenizer is None:
                self.llm_engine = LLMEngine.from_engine_args(args)
            else:  # the given tokenizer replaces the model's own (it was ignored before)
                self.llm_engine = LLMEngine(load_model(args.model, args.dtype, args.quantization)[0], tokenizer, args)
            model_path = resolve_model_path(args.model)
        self._default_sampling = default_sampling_params(model_path, args.generation_config,
                                                         args.override_generation_config)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` run without ``sampling_params``: ``SamplingParams()`` with the model's
        generation-config defaults (``EngineArgs.generation_config``, ``override_generation_config``) over it."""
        return as_sampling_params(self._default_sampling)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """:meth:`LLMEngine.reset_prefix_cache`: True once no prefix-cached block is left to reuse (vLLM's
        ``LLM.reset_prefix_cache``)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished ``RequestOutput`` per prompt, in input order.

        ``prompts``: a string, a list of token ids, a list of either, or dicts with
        ``prompt`` or ``prompt_token_ids``. ``sampling_params``: one for all prompts or one
        per prompt (default :meth:`get_default_sampling_params`; each runs with ``output_kind`` FINAL_ONLY, as vLLM's,
        so every output is whole). ``priority``: one per prompt (lower first;
        needs ``scheduling_policy="priority"``). ``use_tqdm``: show a progress bar; a callable (vLLM's) makes it, called
        as ``tqdm`` is. Raises ``ValueError`` (naming the field) for
        an invalid prompt or settings; then no prompt of the call is left in the engine.
        """
        items = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params if sampling_params is not None else self.get_default_sampling_params(),
                                 len(items))
        # only the final output is kept: as vLLM, each request runs FINAL_ONLY (a DELTA request's last output would
        # hold only its last token); copies, so the caller's SamplingParams stay as given
        final = {id(p): p if p.output_kind is RequestOutputKind.FINAL_ONLY
                 else dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]  # one copy per distinct params object
        if priority is not None and not isinstance(priority, Sequence):
            raise ValueError(f"priority must be a list of ints, one per prompt, got {priority!r}")
        priorities = [0] * len(items) if priority is None else list(priority)
        if len(priorities) != len(items):
            raise ValueError(f"priority must give one int per prompt ({len(items)}), got {len(priorities)}")
        request_ids: list[str] = []
        try:
            for item, p, prio in zip(items, params, priorities):
                request_id = str(next(self._counter))
                text, ids = split_prompt(item)
                self.llm_engine.add_request(request_id, text, p, prompt_token_ids=ids, priority=prio)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of message dicts) or to each of a list of them, rendered by
        the model's chat template (with ``tools`` if given; ``continue_final_message``: the reply continues the last
        message; ``chat_template_kwargs``: extra template variables such as ``enable_thinking``), its messages as
        vLLM hands them over (:func:`kvgen.chat_template.template_messages`: text parts joined with newlines, or
        given as a list of text parts to a template that loops over them, as ``chat_template_content_format`` says:
        "auto" detects it, "string" or "openai" forces it; tool-call arguments parsed from JSON text); one finished
        ``RequestOutput`` per conversation. ``chat_template``: a Jinja template (or a file holding one) used instead of
        the model's for this call. Raises ``ValueError`` without a tokenizer, for malformed messages, an
        unknown content format, a template that does not compile, or as ``generate``. Source: vLLM ``LLM.chat``."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer (its chat template); this LLM has none")
        if chat_template is not None:  # this call's template, on a copy: the model's stays as it is
            if not isinstance(chat_template, str):
                raise ValueError(f"chat_template must be a Jinja template or a file path, got {chat_template!r}")
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = read_chat_template(chat_template)
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError(f"messages must be a conversation or a non-empty list of conversations, got {messages!r}")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                             f"{chat_template_content_format!r}")
        content_format = cast("ContentFormat", chat_template_content_format) if chat_template_content_format != "auto" \
            else tokenizer.chat_template_content_format(tools)
        conversations = cast("list[Conversation]", [messages] if isinstance(messages[0], dict) else list(messages))
        texts = [cast(str, tokenizer.apply_chat_template(
            template_messages(c, content_format), add_generation_prompt=add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs)) for c in conversations]
        # rendered once; the text is each output's prompt, as vLLM's (its ids as apply_chat_template(tokenize=True))
        prompts: list[PromptInput] = [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False), "prompt": t}
                                      for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | Callable[..., Any] = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (prompts as ``generate`` takes them), in input order: the hidden states after the
        final norm pooled by ``EngineArgs.pooling_type`` (:mod:`kvgen.engine.pooling`); ``pooling_params``: one for
        all prompts or one per prompt (``dimensions``, ``normalize``; default: every value, unit norm). Raises
        ``ValueError`` for an invalid prompt, one over ``max_model_len``, ``dimensions`` over the hidden size or a
        params list of another length. Source: vLLM ``LLM.embed``."""
        items = _as_prompt_list(prompts)
        params = list(pooling_params) if isinstance(pooling_params, Sequence) else [pooling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"pooling_params must be one PoolingParams or one per prompt ({len(items)}), got "
                             f"{len(params)}")
        bar = None
        if use_tqdm:
            bar = _progress_bar(use_tqdm, len(items), "Embedded prompts")
        outputs = []
        try:
            for item, p in zip(items, params):
                text, ids = split_prompt(item)
                outputs.append(self.llm_engine.embed(str(next(self._counter)), text, p, prompt_token_ids=ids))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return outputs

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    use_tqdm: bool | Callable[..., Any] = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (:mod:`kvgen.engine.beam_search`); per prompt the best
        ``params.beam_width`` sequences, best first, each with ``text`` = the decoded prompt and output (as vLLM).
        Raises ``ValueError`` for a prompt that leaves no room for a token within ``max_model_len``, or
        ``2 * beam_width`` above ``max_logprobs``. Source: vLLM ``LLM.beam_search``."""
        engine, tokenizer = self.llm_engine, self.get_tokenizer()
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if 2 * params.beam_width > engine.max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} needs 2 * beam_width <= max_logprobs "
                             f"({engine.engine_args.max_logprobs}); raise max_logprobs")
        token_lists = []
        for item in _as_prompt_list(prompts):
            text, ids = split_prompt(item)
            if ids is None:
                if tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; this LLM has none (pass token ids)")
                ids = tokenizer.encode(text or "")
            if not ids or len(ids) >= engine.max_model_len:
                raise ValueError(f"a beam search prompt must hold 1 to {engine.max_model_len - 1} tokens "
                                 f"(max_model_len - 1), got {len(ids)}")
            token_lists.append(list(ids))
        step_params = SamplingParams(logprobs=num_candidates(params.beam_width, engine.model.config.vocab_size),
                                     max_tokens=1, temperature=params.temperature, detokenize=False)
        search = beam_search_steps(token_lists, params, engine.eos_token_ids, engine.max_model_len)
        try:
            batch = next(search)
            while True:
                outputs = self.generate([{"prompt_token_ids": t} for t in batch], step_params, use_tqdm=use_tqdm)
                batch = search.send([candidates_of(o) for o in outputs])
        except StopIteration as done:
            best = done.value
        for beams in best:
            for beam in beams:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        return [BeamSearchOutput(beams) for beams in best]

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            bar = _progress_bar(use_tqdm, len(request_ids), "Processed prompts")
        try:
            while len(finished) < len(request_ids) and self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # a failed step (or Ctrl-C): this call's requests leave, so the engine stays usable
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int, desc: str) -> Any:
    """A tqdm bar of ``total`` prompts; ``use_tqdm`` a callable makes it (vLLM's ``tqdm_func``), else ``tqdm.auto``."""
    from tqdm.auto import tqdm

    return (use_tqdm if callable(use_tqdm) else tqdm)(total=total, desc=desc, dynamic_ncols=True)


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts must be a string, a list of token ids or a list of prompts, got {prompts!r}")
    items: list[Any] = list(prompts)
    if not items:  # no prompts, nothing to run (as vLLM, whose generate([]) returns []), not one empty prompt
        return []
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt of token ids
    return items


def _as_params_list(params: SamplingParams | Sequence[SamplingParams], num_prompts: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of them, got {type(params).__name__}")
    if len(params) != num_prompts:
        raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({num_prompts}), got {len(params)}")
    return list(params)
