"""``/v1/responses`` (OpenAI's Responses API) against a live ``kvgen serve`` on the tiny model, through the
official ``openai`` client: every reply is compared with the chat completion of the same conversation
(the reference the Responses path is built on), streamed events with the SDK's own accumulator."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

GREEDY_CHAT = {"temperature": 0, "max_completion_tokens": 12}
GREEDY = {"temperature": 0, "max_output_tokens": 12}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Rome", "Paris"]}}, "required": ["city"],
                  "additionalProperties": False}  # an enum: the random model's free strings never end
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, **{**GREEDY_CHAT, **kwargs})


def _events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw streamed response."""
    with httpx.stream("POST", server.v1 + "/responses", json={"model": "tiny", "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    out = []
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        out.append((event[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_a_response_is_the_chat_completion_of_its_input(client, tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    chat = _chat(client, messages)
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Name three colours.", **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny" and r.instructions == "Be brief."
    assert r.output_text == chat.choices[0].message.content and r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens == len(
        tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert item.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    # message items with an input_text part, and a developer message, are the same conversation
    parts = client.responses.create(model="tiny", input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}],
        **GREEDY)
    assert parts.output_text == r.output_text and parts.usage.input_tokens == r.usage.input_tokens


def test_several_input_text_parts_are_joined_as_chat_joins_text_parts(client, tiny_tokenizer):
    """A message's text parts reach the template as chat's do (vLLM's ``parse_chat_messages``, which the Responses API
    shares: joined with newlines for a template taking strings). kvgen joined them with nothing: "Name three" and
    "colours." were the prompt "Name threecolours."."""
    texts = ["Name three", "colours."]
    r = client.responses.create(model="tiny", input=[
        {"role": "user", "content": [{"type": "input_text", "text": t} for t in texts]}], **GREEDY)
    chat = _chat(client, [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens == len(tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "\n".join(texts)}], add_generation_prompt=True, tokenize=True))


def test_streamed_events_build_the_same_response(client, server):
    colour = {"type": "json_schema", "name": "colour", "schema": {
        "type": "object", "properties": {"colour": {"enum": ["red", "green", "light blue"]}}, "required": ["colour"],
        "additionalProperties": False}}  # a reply that ends before max_output_tokens: "response.completed"
    kwargs = {"input": "Name a colour.", "temperature": 0, "max_output_tokens": 200, "text": {"format": colour}}
    full = client.responses.create(model="tiny", **kwargs)
    assert full.status == "completed"
    with client.responses.stream(model="tiny", **kwargs) as stream:  # the SDK's accumulator checks the events
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == full.output_text and len(deltas) > 1
    assert (final.status, final.usage.input_tokens, final.usage.output_tokens) == (
        full.status, full.usage.input_tokens, full.usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: the prefix cache served it
    cut = {"input": "Name three colours.", "temperature": 0, "max_output_tokens": 5}
    events = _events(server, cut)
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[4:-4] == ["response.output_text.delta"] * (len(names) - 8)
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    done = client.responses.create(model="tiny", **cut).model_dump()
    last = events[-1][1]["response"]
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    Response.model_validate(last)  # the SDK's schema, validated (it only constructs): cache_write_tokens is required
    for _, data in events:
        TypeAdapter(ResponseStreamEvent).validate_python(data)
    assert events[0][1]["response"]["status"] == "in_progress" and last["status"] == "incomplete"
    assert last["output"][0]["content"] == done["output"][0]["content"]
    assert last["usage"]["output_tokens"] == done["usage"]["output_tokens"] == 5
    assert "".join(data["delta"] for _, data in events[4:-4]) == done["output"][0]["content"][0]["text"]


def test_a_completed_response_says_when_it_completed(client, server):
    """OpenAI's ``completed_at``: the Unix time a response completed, there with status "completed" only (its
    ``Response`` schema; the SDK's ``Response.completed_at``). kvgen's responses had none."""
    import time

    colour = {"type": "json_schema", "name": "colour", "schema": {
        "type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
        "additionalProperties": False}}  # a reply that ends before max_output_tokens
    kwargs = {"input": "Name a colour.", "temperature": 0, "max_output_tokens": 200, "text": {"format": colour}}
    done = client.responses.create(model="tiny", **kwargs)
    assert done.status == "completed" and done.created_at <= done.completed_at <= time.time()
    assert client.responses.retrieve(done.id).completed_at == done.completed_at
    cut = client.responses.create(model="tiny", input="Hi", **GREEDY | {"max_output_tokens": 2})
    assert cut.status == "incomplete" and cut.completed_at is None
    events = [data for _, data in _events(server, kwargs)]
    assert events[0]["response"]["completed_at"] is None and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["created_at"] <= events[-1]["response"]["completed_at"] <= time.time()


def _replay(events: list[tuple[str, dict]]) -> list[dict]:
    """The output items a client builds from stream events, as the ``openai`` SDK's accumulator does
    (``openai.lib.streaming.responses.ResponseStreamState.accumulate_event``): an item as ``output_item.added`` gives
    it, a part appended on each ``content_part.added``, text deltas added to ``content[content_index]``."""
    items: list[dict] = []
    for _, data in events:
        if data["type"] == "response.output_item.added":
            items.append(json.loads(json.dumps(data["item"])))
        elif data["type"] == "response.content_part.added":
            items[data["output_index"]]["content"].append(dict(data["part"]))
        elif data["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[data["output_index"]]["content"][data["content_index"]]["text"] += data["delta"]
    return items


def test_a_message_item_is_added_empty_and_its_part_by_content_part_added(server):
    """OpenAI (its documented ``response.output_item.added``) and vLLM add a message item with ``content: []``; the part
    comes with ``content_part.added``. The item came with its part already in it, so a client that appends the added
    part (the SDK's accumulator) held two parts: the replayed message differed from the final one."""
    events = _events(server, {"input": "Name three colours.", "temperature": 0, "max_output_tokens": 5})
    added = [data for _, data in events if data["type"] == "response.output_item.added"]
    assert [item["item"]["content"] for item in added] == [[]]
    final = events[-1][1]["response"]["output"]
    replayed = _replay(events)
    assert [item["content"] for item in replayed] == [item["content"] for item in final]
    assert len(final[0]["content"]) == 1 and final[0]["content"][0]["text"]


def test_a_stream_that_fails_ends_with_a_failed_response_of_openais_error_codes(tiny_model_dir, monkeypatch):
    """In process, the engine's stream failing after its first output: ``response.failed`` whose ``error.code`` is of
    OpenAI's enum (``server_error``), as the SDK's event types validate it. It was kvgen's "internal_error" (and
    "aborted" for an abort), codes OpenAI's schema refuses."""
    import asyncio

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server.app import build_app
    from kvgen.server.serving import Generation

    outputs = Generation.outputs

    async def failing(self):
        async for item in outputs(self):
            yield item
            raise RuntimeError("the engine failed")

    monkeypatch.setattr(Generation, "outputs", failing)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir)))
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 8, "stream": True}

    async def post() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "tiny")),
                                     base_url="http://kvgen") as client:
            r = await client.post("/v1/responses", json=body)
        await engine.shutdown()
        return r.text

    events = [json.loads(line[len("data: "):]) for line in asyncio.run(post()).splitlines() if line.startswith("data: ")]
    last = TypeAdapter(ResponseStreamEvent).validate_python(events[-1])
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error" and "RuntimeError" in last.response.error.message


def test_stored_responses_continue_read_and_delete(client, server):
    first = client.responses.create(model="tiny", instructions="Be brief.", input="Hello there.", **GREEDY)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="And then?", **GREEDY)
    # the instructions are not carried over (as OpenAI)
    chat = _chat(client, [{"role": "user", "content": "Hello there."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    for method, path in (("GET", first.id), ("DELETE", first.id)):
        r = httpx.request(method, f"{server.v1}/responses/{path}", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    unstored = client.responses.create(model="tiny", input="Hi", store=False, **GREEDY)
    assert httpx.get(f"{server.v1}/responses/{unstored.id}", timeout=10).status_code == 404
    for unknown in (first.id, ""):  # "" is no id either, not an absent one
        r = httpx.post(server.v1 + "/responses", json={"model": "tiny", "input": "x", "previous_response_id": unknown},
                       timeout=10)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_cancelling_a_response_is_a_400_as_none_runs_in_the_background(client, server):
    """``POST /v1/responses/{id}/cancel`` (the SDK's ``responses.cancel``): OpenAI cancels background responses only, and
    vLLM answers a stored one that is not "Cannot cancel a synchronous response." (400), an unknown id 404. kvgen had no
    such route: a bare 404 "Not Found" for any id."""
    import openai

    r = client.responses.create(model="tiny", input="Hi", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(r.id)
    assert client.responses.retrieve(r.id).status == r.status  # left as it was
    unknown = httpx.post(f"{server.v1}/responses/resp_unknown/cancel", timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


def test_function_calls_and_their_outputs(client, server):
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="tiny", input="Weather in Rome?", tools=[WEATHER], tool_choice=named,
                                temperature=0, max_output_tokens=200)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Rome", "Paris") and r.status == "completed"
    with client.responses.stream(model="tiny", input="Weather in Rome?", tools=[WEATHER], tool_choice=named,
                                 temperature=0, max_output_tokens=200) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert "".join(pieces) == streamed.output[0].arguments == call.arguments and len(pieces) > 1
    required = client.responses.create(model="tiny", input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_output_tokens=200)
    assert [item.type for item in required.output] == ["function_call"] and required.output[0].name == "get_weather"
    names = [name for name, _ in _events(server, {"input": "Weather in Rome?", "tools": [WEATHER],
                                                  "tool_choice": "required", "parallel_tool_calls": False,
                                                  "temperature": 0, "max_output_tokens": 200})]
    assert names[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]
    # the call and its output given back as input items are the chat conversation with a tool turn
    answer = client.responses.create(model="tiny", tools=[WEATHER], tool_choice="none", input=[
        {"role": "user", "content": "Weather in Rome?"}, *r.output,  # the SDK sends them as it parsed them
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], **GREEDY)
    chat = _chat(client, [{"role": "user", "content": "Weather in Rome?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": "get_weather", "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
                 tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}],
                 tool_choice="none")
    assert answer.output_text == chat.choices[0].message.content and answer.usage.input_tokens == chat.usage.prompt_tokens


def test_a_function_call_output_of_text_parts_is_the_tool_turn_of_those_parts(client, server):
    """OpenAI's ``function_call_output.output`` is text or a list of content parts (the SDK's ``FunctionCallOutput``);
    vLLM hands it on as the tool message's content. Text parts are the chat conversation whose tool turn has those
    parts; an image part is a 400 naming it. A list was refused: output had to be a string."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'}
    texts = ["sunny", "warm"]
    output = {"type": "function_call_output", "call_id": "call_1",
              "output": [{"type": "input_text", "text": t} for t in texts]}
    r = client.responses.create(model="tiny", input=[{"role": "user", "content": "Weather in Rome?"}, call, output],
                                **GREEDY)
    chat = _chat(client, [{"role": "user", "content": "Weather in Rome?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "call_1", "type": "function", "function": {"name": call["name"],
                                                                               "arguments": call["arguments"]}}]},
                          {"role": "tool", "tool_call_id": "call_1",
                           "content": [{"type": "text", "text": t} for t in texts]}])
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens
    image = output | {"output": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
    bad = httpx.post(server.v1 + "/responses", json={"model": "tiny", "input": [call, image], **GREEDY}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("input[1].output")


def test_text_format_and_logprobs(client):
    fmt = {"type": "json_schema", "name": "city", "schema": WEATHER_SCHEMA}
    r = client.responses.create(model="tiny", input="A city?", text={"format": fmt}, temperature=0, max_output_tokens=200)
    assert json.loads(r.output_text)["city"] in ("Rome", "Paris") and r.text.format.type == "json_schema"
    assert r.text.format.schema_ == WEATHER_SCHEMA and r.text.format.name == "city"  # echoed as sent
    r = client.responses.create(model="tiny", input="Name three colours.", include=["message.output_text.logprobs"],
                                top_logprobs=2, **GREEDY)
    chat = _chat(client, [{"role": "user", "content": "Name three colours."}], logprobs=True, top_logprobs=2)
    ours, theirs = r.output[0].content[0].logprobs, chat.choices[0].logprobs.content
    assert [(x.token, len(x.top_logprobs)) for x in ours] == [
        (x.token, len(x.top_logprobs)) for x in theirs] and len(ours) == r.usage.output_tokens
    # close, not equal: the chat request may find its prompt in the prefix cache the first request filled
    assert [x.logprob for x in ours] == pytest.approx([x.logprob for x in theirs], abs=1e-5)
    assert client.responses.create(model="tiny", input="Hi", **GREEDY).output[0].content[0].logprobs == []


def test_text_format_is_echoed_as_sent_without_null_fields(server):
    """OpenAI's text formats have no null fields: ``{"type": "text"}``, and a json_schema format's ``description`` is a
    string when there. kvgen echoed every field of its model, ``"description": null`` (refused by OpenAI's schema),
    ``"name": null`` and ``"schema": null`` in a text format among them."""
    fmt = {"type": "json_schema", "name": "city", "schema": WEATHER_SCHEMA}
    for sent, echoed in ((None, {"type": "text"}), ({"type": "json_object"}, {"type": "json_object"}), (fmt, fmt),
                         (fmt | {"strict": True, "description": "A city."}, fmt | {"strict": True, "description": "A city."})):
        body = {"model": "tiny", "input": "A city?", **GREEDY} | ({"text": {"format": sent}} if sent else {})
        r = httpx.post(server.v1 + "/responses", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["text"]["format"] == echoed
        assert httpx.get(server.v1 + f"/responses/{r.json()['id']}", timeout=60).json()["text"]["format"] == echoed


def test_tool_choice_left_out_is_echoed_as_auto(server):
    """OpenAI's default ``tool_choice`` is "auto", echoed so without tools too (the responses of its API reference:
    ``"tool_choice": "auto", "tools": []``), as vLLM echoes the request's field, "auto" by default. kvgen echoed "none"
    when no tools were given, in the response, its stream's events and its stored copy."""
    body = {"model": "tiny", "input": "Hi", **GREEDY}
    r = httpx.post(server.v1 + "/responses", json=body, timeout=60).json()
    events = [data for _, data in _events(server, {"input": "Hi", **GREEDY})]
    stored = httpx.get(server.v1 + f"/responses/{r['id']}", timeout=60).json()
    assert (r["tool_choice"], r["tools"]) == ("auto", []) == (stored["tool_choice"], stored["tools"])
    assert {e["response"]["tool_choice"] for e in events if "response" in e} == {"auto"}
    named = httpx.post(server.v1 + "/responses", json=body | {"tool_choice": "none"}, timeout=60).json()
    assert named["tool_choice"] == "none"  # one sent is echoed as sent


def test_output_text_logprobs_are_an_empty_array_unless_asked(server):
    """OpenAI's ``output_text`` requires ``logprobs``, an array (its examples: ``[]`` when not asked): a response, and
    each part of its stream, gave ``null``, which OpenAI's schema refuses."""
    body = {"input": "Hi", **GREEDY}
    r = httpx.post(server.v1 + "/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.json()["output"][0]["content"][0]["logprobs"] == []
    events = [data for _, data in _events(server, body)]
    parts = [e["part"] for e in events if "part" in e] + [e["item"]["content"][0] for e in events
                                                         if e["type"] == "response.output_item.done"]
    parts += events[-1]["response"]["output"][0]["content"]
    assert len(parts) == 4 and all(part["logprobs"] == [] for part in parts)


def test_null_stream_and_store_are_their_defaults(server):
    """OpenAI's ``stream`` and ``store`` may be null (its ``CreateResponse`` schema; vLLM's ``Optional[bool]``
    fields): not streamed, stored. Both were a 400 ("Input should be a valid boolean")."""
    body = {"model": "tiny", "input": "Hi", "stream": None, "store": None, **GREEDY}
    r = httpx.post(server.v1 + "/responses", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json") and r.json()["store"]
    assert httpx.get(server.v1 + f"/responses/{r.json()['id']}", timeout=60).json() == r.json()


def test_metadata_past_openais_limits_is_refused(server):
    """OpenAI's metadata: 16 pairs at most, keys of at most 64 characters, values of at most 512 (its ``Metadata``
    schema, the SDK's ``metadata`` docstring). The pair count was checked, the lengths were not: any key or value was
    accepted, echoed and stored."""
    at_limit = {"k" * 64: "v" * 512}
    r = httpx.post(server.v1 + "/responses", json={"model": "tiny", "input": "Hi", "metadata": at_limit, **GREEDY},
                   timeout=60)
    assert r.status_code == 200 and r.json()["metadata"] == at_limit
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
        r = httpx.post(server.v1 + "/responses", json={"model": "tiny", "input": "Hi", "metadata": metadata, **GREEDY},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("metadata")


def test_truncation_auto_drops_the_oldest_turns(server):
    long_turn = {"role": "user", "content": "word " * 1500}  # over the 2048-token context alone
    body = {"model": "tiny", "input": [long_turn, {"role": "user", "content": "Hi"}], **GREEDY}
    r = httpx.post(server.v1 + "/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(server.v1 + "/responses", json=body | {"truncation": "auto"}, timeout=60)
    assert r.status_code == 200 and r.json()["truncation"] == "auto" and r.json()["usage"]["input_tokens"] < 100


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "Hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "Hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools[0]"),
    ({"input": "Hi", "background": True}, 400, "background"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "Hi", "include": ["file_search_call.results"]}, 400, "include"),
    ({"input": "Hi", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": "Hi", "temperature": 3}, 400, "temperature"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0]"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"input": "Hi", "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     400, "text.format"),
    ({"input": "Hi", "model": "other"}, 404, "model"),
])
def test_bad_requests_are_openai_errors_naming_the_field(server, body, status, param):
    r = httpx.post(server.v1 + "/responses", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param) and error["message"]


def _truncated_chain(tiny_model_dir, num_links: int) -> tuple[Any, str, list[int], list[dict]]:
    """In process, on a 64-token context: ``num_links`` responses chained by previous_response_id under truncation
    "auto". Returns the server state, the last response's id, each request's input tokens and the last one's input
    items (oldest first)."""
    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server.app import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=64))
    app = build_app(engine, "tiny")

    async def chain() -> tuple[str, list[int], list[dict]]:
        previous, num_input_tokens = None, []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvgen") as client:
            for _ in range(num_links):
                body = {"model": "tiny", "input": "one two three four five six", "max_output_tokens": 2,
                        "truncation": "auto", "temperature": 0}
                r = await client.post("/v1/responses", json=body | ({"previous_response_id": previous} if previous else {}))
                assert r.status_code == 200, r.text
                previous, usage = r.json()["id"], r.json()["usage"]
                num_input_tokens.append(usage["input_tokens"])
            items = (await client.get(f"/v1/responses/{previous}/input_items", params={"order": "asc"})).json()
        await engine.shutdown()
        return previous, num_input_tokens, items["data"]

    return (app.state.kvgen, *asyncio.run(chain()))


def test_a_truncated_chain_stores_only_the_turns_its_prompt_kept(tiny_model_dir):
    """In process: under ``truncation: "auto"`` a response stores the turns its prompt kept. It stored the dropped
    ones too, so each link of a chain held (and re-tokenized per request) the whole conversation, growing without
    bound while every prompt fit: 24 stored messages here, 600 and 2.6 s a request after 300 links."""
    state, last_id, num_input_tokens, _ = _truncated_chain(tiny_model_dir, 12)
    stored = state.responses.get(last_id)
    assert max(num_input_tokens) <= 62 and num_input_tokens[-1] > num_input_tokens[0]  # truncated, and chained
    assert len(stored.messages) <= 8


def test_truncation_auto_keeps_the_most_turns_that_fit_in_few_renderings(tiny_model_dir, monkeypatch):
    """In process: truncation "auto" over 400 turns keeps the longest tail that fits, found in a few renderings of the
    conversation. It dropped one turn at a time, rendering the conversation once per dropped turn on the event loop
    (3.4 s for 1,000 short turns, every other stream stalled meanwhile)."""
    import asyncio

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server import responses
    from kvgen.server.app import build_app
    from kvgen.server.protocol import ChatCompletionRequest

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=256))
    app = build_app(engine, "tiny")
    state, num_renderings = app.state.kvgen, []
    render = responses.chat_prompt_ids
    monkeypatch.setattr(responses, "chat_prompt_ids", lambda *a, **k: num_renderings.append(1) or render(*a, **k))
    turns = [{"role": "user", "content": f"turn {i} " + "word " * (i % 5)} for i in range(400)]
    body = {"model": "tiny", "input": turns, "instructions": "Be brief.", "max_output_tokens": 4, "truncation": "auto"}

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvgen") as client:
            r = await client.post("/v1/responses", json=body)
        await engine.shutdown()
        return r

    r = asyncio.run(post())
    assert r.status_code == 200, r.text
    kept = state.responses.get(r.json()["id"]).messages[:-1]  # the kept turns, less the reply
    assert len(num_renderings) <= 12 and 1 < len(kept) < 400

    def num_tokens(messages: list) -> int:
        system = {"role": "system", "content": "Be brief."}
        return len(render(state, ChatCompletionRequest(messages=[system, *messages])))

    assert r.json()["usage"]["input_tokens"] == num_tokens(kept) <= 256 - 4
    assert num_tokens([turns[-len(kept) - 1], *kept]) > 256 - 4  # one turn more would not fit


def test_input_items_list_a_stored_responses_input_in_pages(client, server):
    """``GET /v1/responses/{id}/input_items`` (the SDK's ``responses.input_items.list``): OpenAI's ``ResponseItemList``
    of the items a response was generated from, each with an id (a string input is one user message), newest first
    unless ``order=asc``, ``limit`` (default 20) a page, ``after`` an item's id. kvgen had no such route: a bare 404."""
    from openai.types.responses import ResponseItemList

    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'}
    sent = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"}, call,
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "then?"}]}]
    r = client.responses.create(model="tiny", input=sent, **GREEDY)
    items = list(client.responses.input_items.list(r.id, order="asc", limit=2))  # the SDK follows has_more and after
    assert [(item.type, getattr(item, "role", None)) for item in items] == [
        ("message", "developer"), ("message", "user"), ("function_call", None), ("function_call_output", None),
        ("message", "assistant"), ("message", "user")]
    assert [item.content[0].text for item in (items[0], items[1], items[4])] == ["Be brief.", "Weather in Rome?", "Sunny."]
    assert [part.text for part in items[5].content] == ["And ", "then?"] and items[5].content[0].type == "input_text"
    assert (items[2].call_id, items[2].name, items[2].arguments) == ("call_1", "get_weather", call["arguments"])
    assert (items[3].call_id, items[3].output) == ("call_1", "sunny")
    assert len({item.id for item in items}) == 6 and items[1].id.startswith("msg_")
    pages = [httpx.get(f"{server.v1}/responses/{r.id}/input_items", params=params, timeout=10).json()
             for params in ({}, {"limit": 4}, {"limit": 4, "after": items[2].id}, {"order": "asc", "after": items[5].id})]
    for page in pages[:3]:
        ResponseItemList.model_validate(page)  # OpenAI's schema (the SDK's model, validated)
    assert [item["id"] for item in pages[0]["data"]] == [item.id for item in reversed(items)]  # desc, the default
    assert (pages[0]["first_id"], pages[0]["last_id"], pages[0]["has_more"]) == (items[5].id, items[0].id, False)
    assert [item["id"] for item in pages[1]["data"]] == [item.id for item in items[:1:-1]] and pages[1]["has_more"]
    assert [item["id"] for item in pages[2]["data"]] == [items[1].id, items[0].id] and not pages[2]["has_more"]
    assert pages[3]["data"] == [] and not pages[3]["has_more"] and pages[3]["object"] == "list"
    # a string input is one user message; a continuation lists the conversation it was generated from
    first = client.responses.create(model="tiny", input="Hello there.", **GREEDY)
    (hello,) = client.responses.input_items.list(first.id)
    assert (hello.type, hello.role, hello.content[0].text) == ("message", "user", "Hello there.")
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="And then?", **GREEDY)
    chain = list(client.responses.input_items.list(second.id, order="asc"))
    assert [item.id for item in chain] == [hello.id, first.output[0].id, chain[2].id]
    assert chain[1].content[0].text == first.output_text and chain[2].content[0].text == "And then?"


def test_input_items_of_an_unknown_or_unstored_response_or_bad_params_are_openai_errors(client, server):
    r = client.responses.create(model="tiny", input="Hi", **GREEDY)
    unstored = client.responses.create(model="tiny", input="Hi", store=False, **GREEDY)
    for response_id in ("resp_unknown", unstored.id):  # as GET /v1/responses/{id}
        got = httpx.get(f"{server.v1}/responses/{response_id}/input_items", timeout=10)
        assert got.status_code == 404 and got.json()["error"]["code"] == "not_found"
        assert got.json() == httpx.get(f"{server.v1}/responses/{response_id}", timeout=10).json()
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"),
                          ({"order": "newest"}, "order"), ({"after": "msg_unknown"}, "after"),
                          ({"include": "nope"}, "include"), ({"include[]": "nope"}, "include"),
                          ({"before": "msg_x"}, "before")):
        got = httpx.get(f"{server.v1}/responses/{r.id}/input_items", params=params, timeout=10)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, (params, got.text)
    # OpenAI's include values are accepted (kvgen's items have none of what they add), in the SDK's include[] form too
    (item,) = client.responses.input_items.list(r.id, include=["message.input_image.image_url"], limit=100)
    assert item.content[0].text == "Hi"


def test_duplicate_item_ids_are_refused_as_openai_refuses_them(client, server):
    """An id given twice, in one input or across the previous_response_id's conversation (its output items sent back
    with it), is OpenAI's 400 "Duplicate item found with id ..." (param input, its error quoted in
    openai/openai-agents-python#1789). kvgen took them, and input_items paging with after= then looped forever."""
    twice = [{"id": "msg_a", "role": "user", "content": "a"}, {"id": "msg_b", "role": "user", "content": "b"},
             {"id": "msg_a", "role": "user", "content": "c"}]
    got = httpx.post(f"{server.v1}/responses", json={"model": "tiny", "input": twice, **GREEDY}, timeout=30)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["message"] == ("Duplicate item found with id msg_a. Remove duplicate items from your "
                                              "input and try again.") and got.json()["error"]["param"] == "input"
    first = client.responses.create(model="tiny", input="Hi", **GREEDY)
    resent = [item.model_dump(exclude_none=True) for item in first.output]
    body = {"model": "tiny", "input": [*resent, {"role": "user", "content": "And?"}],
            "previous_response_id": first.id, **GREEDY}
    got = httpx.post(f"{server.v1}/responses", json=body, timeout=30)
    assert got.status_code == 400 and got.json()["error"]["param"] == "input", got.text
    later = client.responses.create(model="tiny", input="And?", previous_response_id=first.id, **GREEDY)
    ids = [item.id for item in client.responses.input_items.list(later.id, limit=100)]
    assert len(ids) == len(set(ids)) == 3  # Hi, the reply, And?


def test_input_items_of_a_truncated_chain_are_those_its_prompt_kept(tiny_model_dir):
    """In process: under ``truncation: "auto"`` the input items listed are those of the turns the prompt kept (the
    items it was generated from), as the stored conversation a continuation sees."""
    state, last_id, _, items = _truncated_chain(tiny_model_dir, 8)
    kept = state.responses.get(last_id).messages[:-1]  # the kept turns, less the reply
    assert 1 < len(items) < 15  # 8 inputs and 7 replies in all: some dropped
    assert [(item["role"], item["content"][0]["text"]) for item in items] == [(m.role, m.content) for m in kept]
