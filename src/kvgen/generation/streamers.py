"""Streamers: receive token ids as ``generate()`` produces them.

Behaviour follows transformers' ``TextStreamer`` / ``TextIteratorStreamer``
(flush at word boundaries, at newlines and after CJK characters;
``skip_prompt``), one piece per ``put``. These rules hold back an incomplete character at the end of the text
(U+FFFD from a partial byte sequence) until it completes: a space, newline or CJK character after it would have
ended it, so only ``end()`` prints one.
"""

from __future__ import annotations

import queue
import sys
from typing import Any, TextIO

import torch


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


class TextStreamer:
    """Prints decoded text to ``file`` as tokens arrive (batch size 1).

    ``put(ids)`` takes ``[T]`` or ``[1, T]`` int64; ``end()`` flushes the rest.
    Raises ``ValueError`` for a batch of more than one row.
    Reference: transformers ``TextStreamer``.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, file: TextIO | None = None, **decode_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.file = file
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError(f"TextStreamer only supports batch size 1, got {value.shape[0]} rows")
        if value.dim() > 1:
            value = value[0]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(value.tolist())
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        if text.endswith("\n"):
            printable, self.token_cache, self.print_len = text[self.print_len :], [], 0
        elif text and _is_cjk(ord(text[-1])):
            printable = text[self.print_len :]
            self.print_len += len(printable)
        else:
            printable = text[self.print_len : text.rfind(" ") + 1]
            self.print_len += len(printable)
        self.on_finalized_text(printable)

    def end(self) -> None:
        printable = ""
        if self.token_cache:
            printable = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)[self.print_len :]
        self.token_cache, self.print_len = [], 0
        self.next_tokens_are_prompt = True
        self.on_finalized_text(printable, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        out = self.file or sys.stdout
        print(text, flush=True, end="" if not stream_end else "\n", file=out)


class TextIteratorStreamer(TextStreamer):
    """Like :class:`TextStreamer` but yields text pieces to an iterating consumer thread.

    ``timeout`` (seconds) bounds each wait; ``queue.Empty`` is raised past it.
    Reference: transformers ``TextIteratorStreamer``.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, timeout: float | None = None, **decode_kwargs: Any) -> None:
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: queue.Queue[str | None] = queue.Queue()
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(None, timeout=self.timeout)

    def __iter__(self) -> TextIteratorStreamer:
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is None:
            raise StopIteration
        return value
