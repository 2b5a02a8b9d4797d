"""Tool calls in chat completions (OpenAI ``tools`` / ``tool_choice``) through structured outputs.

A named ``tool_choice`` constrains the reply to a JSON object matching that function's ``parameters``;
``"required"`` constrains it to a JSON array of ``{"name", "parameters"}`` calls of the given tools (one
at most with ``parallel_tool_calls: false``). The reply then comes back as ``message.tool_calls``. As vLLM
without ``--enable-auto-tool-choice``, ``"auto"`` (the default when tools are given) is refused: telling
free text from a call needs a model-specific parser. ``"none"`` ignores the tools.
Source: OpenAI API reference (Chat Completions: tools, tool_choice, tool_calls); vLLM
``entrypoints/openai/serving_chat.py`` and ``protocol.py`` (``_get_json_schema_from_tool``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvgen.engine.sampling_params import StructuredOutputsParams
from kvgen.server.errors import bad_request
from kvgen.server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionCall,
    ToolCall,
)
from kvgen.server.tool_parsers import TOOL_CALL_PARSERS, new_call_id

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    """How a request calls tools: ``function`` is the named one, None for ``"required"``; ``parser`` (a
    ``TOOL_CALL_PARSERS`` name) for
    ``"auto"``, where the model decides and calls are parsed out of its text (no constraint)."""

    constraint: StructuredOutputsParams | None
    function: str | None
    parser: str | None = None


def tool_plan(req: ChatCompletionRequest, parser: str | None = None) -> ToolPlan | None:
    """The request's tool constraint, or None when it calls no tool; ``parser`` is the server's tool-call parser.
    Raises a 400 naming ``tool_choice`` for ``"auto"`` without a parser, an unknown function or a choice other than
    ``"none"`` without tools, and naming ``response_format`` beside a forced call. With a parser whose call marker may be a special
    token (hermes, mistral) and tools that may be called, sets ``req.skip_special_tokens`` false, as vLLM's
    ``ToolParser.adjust_request`` (the marker would otherwise never reach the parser)."""
    choice, tools = req.tool_choice, req.tools or []
    if parser is not None and tools and choice != "none" and TOOL_CALL_PARSERS[parser].is_keeping_special_tokens:
        req.skip_special_tokens = False
    if choice is None or choice == "auto":
        if not tools:
            if choice == "auto":  # as vLLM and OpenAI; only "none" goes without tools
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        if parser is not None:
            return ToolPlan(None, None, parser)
        raise bad_request('tool_choice "auto" (the default with tools) needs the server started with '
                          '--enable-auto-tool-choice --tool-call-parser NAME; or pass "required", a named function '
                          'or "none"', "tool_choice")
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs is not None:
        raise bad_request("response_format cannot be combined with a tool_choice that calls a tool", "response_format")
    if choice == "required":
        return ToolPlan(StructuredOutputsParams(json=_calls_schema(tools, req.parallel_tool_calls)), None)
    by_name = {t.function.name: t for t in tools}
    tool = by_name.get(choice.function.name)
    if tool is None:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                          f"{sorted(by_name)}", "tool_choice")
    return ToolPlan(StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT), tool.function.name)


def _calls_schema(tools: list[ChatTool], parallel: bool | None) -> dict[str, Any]:
    """JSON schema of a non-empty array of calls, each ``{"name": one tool, "parameters": its arguments}``. Each
    tool's parameters get an ``$id`` (unless they have one), so that their own references (``#/$defs/...``, as
    pydantic writes them) still resolve in them, not in this schema's root (vLLM moves ``$defs`` to the root)."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name},
                             "parameters": {"$id": f"urn:kvgen:tool:{i}", **(t.function.parameters or _ANY_OBJECT)}}}
             for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (OpenAI's JSON), None without tools or with ``"none"``."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def tool_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls in a forced reply: the named function with ``text`` as its arguments (as generated, even when cut
    by ``max_tokens``), or the parsed array of ``"required"`` (None when it does not parse: cut short). ``"auto"``
    replies go through their parser (:mod:`kvgen.server.tool_parsers`)."""
    if plan.function is not None:
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=plan.function, arguments=text))]
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])))
            for c in calls]  # any JSON the tool's schema allows (parsers' calls take objects only)
