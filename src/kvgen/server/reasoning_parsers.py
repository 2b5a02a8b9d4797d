"""Reasoning parsers (``kvgen serve --reasoning-parser``): a reply's chain of thought, written between
``<think>`` and ``</think>``, goes to ``message.reasoning`` (streamed as ``delta.reasoning``), the rest to
``content`` (and to the tool-call parser).

``deepseek_r1``: the reply starts inside the reasoning (the chat template opens ``<think>``; a ``<think>``
the model writes itself is dropped) and everything up to ``</think>`` is reasoning, all of it when the reply
never closes it. ``qwen3``: the reply is reasoning when it opens with ``<think>`` (Qwen3's first templates) or
when the prompt ends inside an open ``<think>`` (Qwen3-Thinking-2507 and Qwen3.5 templates write it there);
otherwise (thinking disabled by the template, ``enable_thinking: false``) it is all content. Streaming holds
back only what may still become a marker, so the streamed pieces join to the non-streamed fields.
Source: vLLM ``reasoning/deepseek_r1_reasoning_parser.py`` and ``qwen3_reasoning_parser.py``; the field name
``reasoning`` as vLLM's chat completions (it replaced ``reasoning_content``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.tokenizer import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (0 when none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """Splits one reply, as it streams, into reasoning and content: ``feed(delta)`` returns the (reasoning,
    content) text that is certain so far, ``finish()`` what was held back at the end."""

    starts_inside: bool  # deepseek_r1: True; qwen3: only after an opening <think>
    has_reasoning: bool = False  # the reply entered its reasoning
    _phase: str = ""  # "" while the reply may still open with <think>, then "reasoning", then "content"
    _pending: str = ""  # text held back: a possible start of <think> or of </think>

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._pending = self._pending + delta, ""
        if not self._phase:
            stripped = text.lstrip()
            if THINK_START.startswith(stripped):  # nothing but a possible start of <think> yet
                self._pending = text
                return "", ""
            opens = stripped.startswith(THINK_START)
            if opens:
                text = stripped[len(THINK_START):]
            self._phase = "reasoning" if opens or self.starts_inside else "content"
            self.has_reasoning = self._phase == "reasoning"
        if self._phase == "content":
            return "", text
        end = text.find(THINK_END)
        if end < 0:
            keep = _partial_suffix(text, THINK_END)
            self._pending = text[len(text) - keep:]
            return text[: len(text) - keep], ""
        self._phase = "content"
        return text[:end], text[end + len(THINK_END):]

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if not self._phase and rest.lstrip() == THINK_START:  # stopped right after opening: empty reasoning
            rest, self._phase = "", "reasoning"
        if self._phase == "reasoning" or (not self._phase and self.starts_inside):
            self.has_reasoning = True
            return rest, ""
        return "", rest

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; reasoning None when the reply has none."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return (reasoning + more_reasoning if self.has_reasoning else None), content + more_content


REASONING_PARSERS: dict[str, bool] = {"deepseek_r1": True, "qwen3": False}  # name -> starts_inside


def new_splitter(name: str, prompt_tail: str = "") -> ReasoningSplitter:
    """A fresh splitter for one reply; ``prompt_tail``, the end of the prompt's text, tells whether the template
    opened the reasoning (its last ``<think>`` not closed). Raises ``KeyError`` for an unknown parser (checked at
    startup). Source: vLLM PR 34779 (Qwen3.5: ``<think>`` in the prompt, only ``</think>`` generated)."""
    is_open = prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)
    return ReasoningSplitter(REASONING_PARSERS[name] or is_open)


def num_reasoning_tokens(tokenizer: Tokenizer, token_ids: list[int], reasoning: str | None) -> int:
    """How many of a reply's ``token_ids`` are its reasoning (OpenAI's ``reasoning_tokens``): the fewest whose text
    holds the closing ``</think>`` (whole or in pieces), all of them when the reply never closed its reasoning; 0
    without reasoning."""
    if reasoning is None:
        return 0
    if THINK_END not in tokenizer.decode(token_ids):
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # a longer prefix's text holds the marker once a shorter one's does
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_END in tokenizer.decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
