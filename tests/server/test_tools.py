"""Tool choice "auto" with the Hermes parser: the parser on strings, and a server started with
``--enable-auto-tool-choice --tool-call-parser hermes`` whose reply is forced into Hermes form by a regex."""

from __future__ import annotations

import json

import pytest

from kvgen.server.launch import ServerArgs
from kvgen.server.tool_parsers import TOOL_CALL_PARSERS

hermes_tool_calls = TOOL_CALL_PARSERS["hermes"].extract

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Rome?"}]


def test_hermes_blocks_become_calls_and_the_text_before_them_content():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}')  # the last one unterminated (cut by max_tokens)
    content, calls = hermes_tool_calls(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert hermes_tool_calls("no calls here") == ("no calls here", [])
    assert hermes_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None
    broken = "<tool_call>{not json}</tool_call>"
    assert hermes_tool_calls(broken) == (broken, [])  # not a call: the text stays the content


def test_llama3_json_replies_are_calls_when_they_are_json_objects():
    parse = TOOL_CALL_PARSERS["llama3_json"].extract
    content, calls = parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                           '{"name": "get_time", "arguments": {"tz": "CET"}}')
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]
    assert parse(' {"name": "f", "parameters": {}}\n')[1][0].function.arguments == "{}"
    for text in ("It is sunny.", '{"name": "f"', '{"nom": "f", "parameters": {}}', '{"name": "f", "parameters": 3}',
                 '{"name": "f", "parameters": {}} and more'):
        assert parse(text) == (text, []), text


def test_llama3_json_keeps_every_call_whatever_separates_them():
    """Calls separated by ", ", a newline or ";" without a space are all calls, as vLLM parses them; a ";" at the
    end closed the reply and the calls in between were dropped."""
    parse = TOOL_CALL_PARSERS["llama3_json"].extract
    a, b, c = ('{"name": "a", "parameters": {"x": 1}}', '{"name": "b", "parameters": {}}',
               '{"name": "c", "arguments": {"y": [1, {"z": "}{"}]}}')
    for text in (f"{a}, {b}, {c};", f"{a}\n{b}\n{c}", f"{a};{b};{c}", f"{a} ; {b}; {c}"):
        content, calls = parse(text)
        assert content is None and [call.function.name for call in calls] == ["a", "b", "c"], text
    for text in (f"{a}, and {b}", f"{a};;{b}", f"{a}; text"):
        assert parse(text) == (text, []), text


def test_mistral_calls_follow_the_marker():
    parse = TOOL_CALL_PARSERS["mistral"].extract
    content, calls = parse('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                           '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}]')
    assert content == "Sure. " and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]
    assert parse('[TOOL_CALLS] {"name": "f", "arguments": {}}')[0] is None
    for tail in ("</s>", " Done.", "\n"):  # text after the array is dropped (vLLM's [{...}] regex), the calls kept
        content, calls = parse('Hi[TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}]' + tail)
        assert content == "Hi" and [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"a": "]"}')]
    for text in ("no call", "[TOOL_CALLS] [{broken", '[TOOL_CALLS] [{"name": "f"}]'):
        assert parse(text) == (text, []), text


# Mistral 7B Instruct v0.3's chat template, its assistant tool-call turn (verbatim but for the loop's header and
# the end of turn)
MISTRAL_TOOL_CALLS_TEMPLATE = """{%- for message in messages %}{%- if message.tool_calls is defined %}
{{- "[TOOL_CALLS] [" }}
{%- for tool_call in message.tool_calls %}
    {%- set out = tool_call.function|tojson %}
    {{- out[:-1] }}
    {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
        {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
    {%- endif %}
    {{- ', "id": "' + tool_call.id + '"}' }}
    {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
{%- endfor %}{%- endif %}{%- endfor %}"""


def test_mistral_call_ids_go_back_through_mistral_templates():
    """Mistral's templates refuse a tool call whose id is not 9 letters or digits (vLLM's ``MistralToolCall`` ids):
    kvgen gave ``call_`` + 24 hex digits, so a client sending the calls back in the history got a 400."""
    from kvgen.tokenizer import Tokenizer
    from kvgen.tokenizer.special_tokens import SpecialTokenIds

    from helpers import train_tiny_tokenizer

    _, calls = TOOL_CALL_PARSERS["mistral"].extract('[TOOL_CALLS] [{"name": "f", "arguments": {}}, '
                                                    '{"name": "g", "arguments": {"a": 1}}]')
    tok = Tokenizer(train_tiny_tokenizer(), SpecialTokenIds(), MISTRAL_TOOL_CALLS_TEMPLATE, "tiny")
    turn = {"role": "assistant", "tool_calls": [c.model_dump() for c in calls]}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, turn])
    assert isinstance(text, str) and all(f'"id": "{c.id}"' in text for c in calls)
    assert len({c.id for c in calls}) == 2 and all(c.id.isalnum() and c.id.isascii() for c in calls)


def test_streamable_content_stops_where_a_call_may_start():
    hermes, llama, mistral = (TOOL_CALL_PARSERS[n] for n in ("hermes", "llama3_json", "mistral"))
    assert hermes.num_streamable("Hello <tool") == len("Hello ") and hermes.num_streamable("Hi <b>") == len("Hi <b>")
    assert hermes.num_streamable("A<tool_call>{...") == 1 and mistral.num_streamable("ok [TOOL_") == 3
    assert llama.num_streamable("  ") == 0 and llama.num_streamable(' {"na') == 0 and llama.num_streamable("<|py") == 0
    assert llama.num_streamable("The weather") == len("The weather")


@pytest.mark.parametrize("parser,is_kept", [("hermes", True), ("mistral", True), ("llama3_json", False)])
def test_marker_parsers_keep_special_tokens_in_the_text(parser, is_kept):
    """Mistral's [TOOL_CALLS] (and Hermes 2 Pro's <tool_call>) are special tokens: skipped from the text, the parser
    never saw a call. vLLM's adjust_request turns skip_special_tokens off when tools may be called."""
    from kvgen.server.protocol import ChatCompletionRequest
    from kvgen.server.tools import tool_plan

    for choice, expected in (("auto", not is_kept), ("required", not is_kept), ("none", True)):
        req = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER], tool_choice=choice)
        tool_plan(req, parser)
        assert req.skip_special_tokens is expected, choice
    req = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER], tool_choice="required")
    tool_plan(req, None)  # without --enable-auto-tool-choice: as asked
    assert req.skip_special_tokens is True


def test_required_calls_resolve_each_tools_own_defs(tiny_model_dir):
    """tool_choice "required" nests every tool's parameters in one array schema, where their "#/$defs/..." references
    (as pydantic writes them) pointed at that array's root and every such request was a 400. Here two tools define
    "Unit" differently: each call's arguments take its own tool's units."""
    from kvgen.engine import LLM, SamplingParams
    from kvgen.loader import load_model
    from kvgen.server.protocol import ChatCompletionRequest
    from kvgen.server.tools import tool_calls, tool_plan

    def tool(name: str, units: list[str]) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "$defs": {"Unit": {"enum": units}}, "type": "object", "additionalProperties": False, "required": ["unit"],
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}}}}

    units = {"temperature": ["C", "F"], "wind": ["kmh", "knots"]}
    req = ChatCompletionRequest(messages=MESSAGES, tools=[tool(n, u) for n, u in units.items()], tool_choice="required",
                                parallel_tool_calls=False)
    plan = tool_plan(req)
    assert plan is not None
    llm = LLM(*load_model(str(tiny_model_dir)), num_blocks=64)
    sampling = SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=300, structured_outputs=plan.constraint)
    (out,) = llm.generate(["Weather in Rome?"], sampling, use_tqdm=False)
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        (call,) = tool_calls(plan, completion.text) or []
        assert json.loads(call.function.arguments)["unit"] in units[call.function.name]


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ServerArgs(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json, mistral"):
        ServerArgs(tool_call_parser="pythonic")


@pytest.fixture(scope="module")
def hermes_server(tiny_model_dir, tmp_path_factory, launch_server):
    live = launch_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "hermes.log", "--num-blocks", "256",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield live
    assert live.stop() == 0, live.log()[-3000:]


def test_auto_tool_choice_parses_hermes_calls_streamed_or_not(hermes_server):
    from openai import OpenAI

    forced = {"structured_outputs": {"regex": r'Checking\.<tool_call>\{"name": "get_weather", "arguments": '
                                              r'\{"city": "(Rome|Paris)"\}\}</tool_call>'}}
    with OpenAI(base_url=hermes_server.v1, api_key="unused", max_retries=0, timeout=60) as client:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=1.0, seed=3,
                                           max_tokens=80, extra_body=forced)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Checking."
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Rome", "Paris")
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=1.0,
                                                     seed=3, max_tokens=80, extra_body=forced, stream=True))
        deltas = [x.delta for ch in chunks for x in ch.choices]
        assert "".join(d.content or "" for d in deltas) == "Checking."
        (streamed,) = [t for d in deltas if d.tool_calls for t in d.tool_calls]
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
        assert [x.finish_reason for ch in chunks for x in ch.choices if x.finish_reason] == ["tool_calls"]
        plain = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0,
                                               max_tokens=12)  # no call in the text: an ordinary reply
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
        # streamed, an ordinary reply comes as it is written (not held to the end)
        words = {"structured_outputs": {"regex": "(one two three four five six seven eight)"}}
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0,
                                                     max_tokens=40, stream=True, extra_body=words))
        pieces = [x.delta.content for ch in chunks for x in ch.choices if x.delta.content]
        assert "".join(pieces) == "one two three four five six seven eight" and len(pieces) > 3
