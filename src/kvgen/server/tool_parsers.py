"""Tool-call parsers of ``kvgen serve --enable-auto-tool-choice --tool-call-parser NAME``: with tool_choice "auto"
the model decides, and its calls are found in the text it wrote, in the format its chat template taught it.

Each parser gives ``extract(text) -> (content, calls)`` for a finished reply (a reply that does not parse stays
text, with no calls) and ``num_streamable(text)``: how many leading characters are content whatever comes next, so
a streamed reply shows its text as it is written and holds back only what may start a call.
Source: vLLM ``entrypoints/openai/tool_parsers`` (``hermes``, ``llama3_json``, ``mistral``: formats and names).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: ServerArgs checks parser names without loading pydantic models
    from kvgen.server.protocol import ToolCall


def new_call_id() -> str:
    """A fresh tool-call id, ``call_`` + 24 hex digits (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def new_mistral_call_id() -> str:
    """A fresh Mistral tool-call id: 9 ASCII letters or digits, the only form Mistral's chat templates take back
    (they raise "Tool call IDs should be alphanumeric strings with length 9!"). Source: vLLM ``MistralToolCall``."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def parsed_call(name: Any, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A call with ``call_id`` (a fresh :func:`new_call_id` when None) from parsed JSON (arguments re-serialized,
    non-ASCII kept as vLLM does); ``TypeError`` / ``ValueError`` when it is not a name with object (or JSON-text)
    arguments."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"tool call name must be a string, got {name!r}")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise TypeError(f"tool call arguments must be an object, got {arguments!r}")
    from kvgen.server.protocol import FunctionCall, ToolCall

    return ToolCall(id=call_id or new_call_id(),
                    function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (it may become the marker)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


class MarkerParser:
    """Calls follow ``marker``; the text before it is the content. The marker may be a special token (Mistral's
    ``[TOOL_CALLS]``, Hermes 2 Pro's ``<tool_call>``), so requests that may call keep special tokens in the text."""

    marker = ""
    is_keeping_special_tokens = True

    def num_streamable(self, text: str) -> int:
        found = text.find(self.marker)
        return found if found >= 0 else len(text) - _held_back(text, self.marker)


class HermesParser(MarkerParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Hermes); an unterminated last
    block (cut by max_tokens) counts. Source: vLLM ``Hermes2ProToolParser``."""

    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        blocks = [closed or tail for closed, tail in self._BLOCK.findall(text)]  # "" for the unused group
        if not blocks:
            return text, []
        try:
            calls = [parsed_call(c["name"], c["arguments"]) for c in map(json.loads, blocks)]
        except (ValueError, KeyError, TypeError):
            return text, []
        return text[: text.find(self.marker)] or None, calls


class MistralParser(MarkerParser):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B Instruct v0.3 and later's JSON form);
    text after the array (``</s>`` kept by skip_special_tokens false, a remark) is dropped. Call ids are Mistral's
    (:func:`new_mistral_call_id`), so the calls can go back through a Mistral chat template.
    Source: vLLM ``MistralToolParser``."""

    marker = "[TOOL_CALLS]"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        found = text.find(self.marker)
        if found < 0:
            return text, []
        try:
            start = len(text) - len(text[found + len(self.marker) :].lstrip())
            payload = json.JSONDecoder().raw_decode(text, start)[0]  # text after the calls is dropped, as vLLM's regex
            payload = payload if isinstance(payload, list) else [payload]
            calls = [parsed_call(c["name"], c["arguments"], new_mistral_call_id()) for c in payload]
        except (ValueError, KeyError, TypeError):
            return text, []
        return text[:found] or None, calls


class Llama3JsonParser:
    """A reply that is one or more JSON objects ``{"name": ..., "parameters": {...}}`` (separated by ``;``, ``,`` or
    whitespace), after an optional ``<|python_tag|>`` (Llama 3.1 / 3.2's JSON tool calling); any other reply is
    content.
    Source: vLLM ``Llama3JsonToolParser``."""

    python_tag = "<|python_tag|>"
    is_keeping_special_tokens = False  # the JSON is the call; vLLM leaves skip_special_tokens as asked

    def num_streamable(self, text: str) -> int:
        start = text.lstrip()
        if not start or start[0] == "{" or start.startswith(self.python_tag) or self.python_tag.startswith(start):
            return 0  # a call may be starting
        return len(text)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.python_tag).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                calls.append(parsed_call(obj["name"], obj.get("arguments", obj.get("parameters"))))
                i = self._next_call(body, i)
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        return None, calls

    @staticmethod
    def _next_call(body: str, i: int) -> int:
        """Where the call after the one ending at ``i`` starts: past whitespace and one ``;`` or ``,`` (vLLM takes
        ``{...}; {...}``, ``{...}, {...}`` and ``{...}\n{...}`` alike); ``len(body)`` at the end, ``ValueError`` when
        anything else follows (the reply is then text)."""
        rest = body[i:].lstrip()
        rest = rest[1:].lstrip() if rest[:1] in (";", ",") else rest
        if rest and not rest.startswith("{"):
            raise ValueError(f"text after a tool call: {rest[:20]!r}")
        return len(body) - len(rest)


TOOL_CALL_PARSERS: dict[str, HermesParser | MistralParser | Llama3JsonParser] = {
    "hermes": HermesParser(), "llama3_json": Llama3JsonParser(), "mistral": MistralParser(),
}
