"""``kvgen chat``: an interactive conversation with the model's chat template, its KV cache kept across turns."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvgen.cli import _load_assistant, _load_for_chat
from kvgen.cli_flags import (
    CHAT_DEFAULTS,
    CliError,
    flag_values,
    generation_config_from_args,
    with_model_defaults,
)


def _chat_prompt(messages: list[dict[str, str]], tokenizer: Any, max_prompt_tokens: int) -> list[int] | None:
    """The conversation's prompt ids; while it is longer than ``max_prompt_tokens``, the oldest exchange after the
    system message is dropped from ``messages`` (as llama.cpp's chat shifts its context). None (said on stderr, the
    conversation left whole) when the last message does not fit even alone."""
    def prompt(turns: list[dict[str, str]]) -> list[int]:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)

    first = 1 if messages[0]["role"] == "system" else 0
    if len(ids := prompt(messages)) > max_prompt_tokens and len(alone := prompt(messages[:first] + messages[-1:])) > \
            max_prompt_tokens:
        print(f"kvgen chat: the message makes a prompt of {len(alone)} tokens, over the {max_prompt_tokens} the "
              f"context window leaves beside max_new_tokens; not sent", file=sys.stderr)
        return None
    while len(ids) > max_prompt_tokens:
        del messages[first : first + 2]  # the oldest user message and its reply
        print("kvgen chat: dropped the oldest exchange to fit the context window", file=sys.stderr)
        ids = prompt(messages)
    return ids


def _max_prompt_tokens(context: int, max_new_tokens: int) -> int:
    """The prompt tokens a reply of ``max_new_tokens`` leaves in a ``context``-token window; ``CliError`` when none
    (every message would be refused, as kvgen generate refuses such a setting)."""
    if (room := context - max_new_tokens) < 1:
        raise CliError(f"kvgen chat: error: max_new_tokens={max_new_tokens} leaves no room for a message in the "
                       f"context window of {context} tokens")
    return room


def run_chat(args: argparse.Namespace) -> int:
    """``kvgen chat``: reads messages from stdin until ``/exit`` or end of input; returns the exit code. Raises
    ``CliError`` (and the loader's errors) for bad settings or a closed standard input, before the first message."""
    import torch

    from kvgen.generation import Strategy, generate
    from kvgen.generation.config import is_unset_max_new_tokens
    from kvgen.generation.conversation import ConversationCache
    from kvgen.generation.generate import NOT_STREAMABLE
    from kvgen.generation.streamers import TextStreamer
    from kvgen.tokenizer.tokenizer import lone_surrogate

    def check(cfg: Any) -> Any:
        if cfg.num_return_sequences != 1:
            raise CliError(f"kvgen chat: error: num_return_sequences must be 1 in chat, got {cfg.num_return_sequences}")
        if cfg.strategy in NOT_STREAMABLE:  # chat streams its reply
            raise CliError(f"kvgen chat: error: {cfg.strategy.value} cannot stream, use kvgen generate for it")
        if cfg.max_length is not None and is_unset_max_new_tokens(cfg.max_new_tokens):  # it would decide the length
            raise CliError(f"kvgen chat: error: max_length={cfg.max_length} counts the whole conversation, which grows "
                           f"each turn; give the reply length with --max-new-tokens")
        return cfg

    if sys.stdin is None:  # started with its standard input closed (`<&-`): input() would raise RuntimeError
        raise CliError("kvgen chat: error: standard input is closed, there is nothing to read messages from")
    if sys.stdout is None:  # started with its standard output closed (`>&-`): input() would raise RuntimeError
        raise CliError("kvgen chat: error: standard output is closed, there is nowhere to write the replies")
    if args.system is not None and lone_surrogate(args.system) is not None:  # refused by the first message's template
        raise CliError("kvgen chat: error: --system is not valid UTF-8 text")
    if hasattr(sys.stdin, "reconfigure"):  # a UTF-8 locale reads stdin strictly: one bad byte ended the chat
        sys.stdin.reconfigure(errors="surrogateescape")  # such a line is now found below and skipped
    cfg, flags = check(generation_config_from_args(args, CHAT_DEFAULTS)), flag_values(args)
    model, tokenizer, _ = _load_for_chat(args)
    cfg = check(with_model_defaults(cfg, model.generation_defaults, flags))  # as kvgen generate
    if tokenizer.chat_template is None:
        raise CliError(f"model {args.model} has no chat template")
    max_prompt_tokens = _max_prompt_tokens(model.config.max_position_embeddings, cfg.max_new_tokens)
    assistant = _load_assistant(args)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    # contrastive search scores candidates against every token's hidden state: it prefills the whole conversation
    history = (ConversationCache(model, args.kv_cache_dtype)
               if cfg.use_cache and cfg.strategy is not Strategy.CONTRASTIVE_SEARCH else None)
    print("kvgen chat: type a message; /exit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        if lone_surrogate(line) is not None:  # bytes Python could not decode as UTF-8 (surrogateescape)
            print("kvgen chat: the line is not valid UTF-8 text; not sent", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        ids = _chat_prompt(messages, tokenizer, max_prompt_tokens)
        if ids is None:
            messages.pop()
            continue
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        try:
            out = generate(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), cfg,
                           tokenizer=tokenizer, streamer=streamer,
                           assistant_model=assistant, past_key_values=history.reuse(ids) if history else None, **flags)
        except KeyboardInterrupt:  # Ctrl-C stops the reply, as in llama.cpp's chat; at the prompt it leaves
            print(flush=True)
            print("kvgen chat: reply interrupted; the message is dropped", file=sys.stderr, flush=True)
            messages.pop()
            continue
        if history:
            history.record(ids, out.new_token_ids[0])
        messages.append({"role": "assistant", "content": tokenizer.decode(out.new_token_ids[0], skip_special_tokens=True)})
