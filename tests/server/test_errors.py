"""Bad input gets its status and an OpenAI error body naming the parameter; the official client
raises the same exception classes it raises against OpenAI. Never a 500, never a traceback."""

from __future__ import annotations

import gzip

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]

BAD_CHAT = [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4096}, "max_tokens"),  # prompt + max_tokens beyond the 2048-token context
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"not-an-id": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"seed": 2**64}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"extra_body": {"min_tokens": 10}, "max_tokens": 2}, "min_tokens"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"priority": 3}}, "priority"),  # the shared server schedules fcfs
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"choice": ["a"]}}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"extra_body": {"allowed_token_ids": [1, 100000]}}, "allowed_token_ids"),
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ({"extra_body": {"bad_words": [" "]}}, "bad_words"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids[0]"),
    ({"extra_body": {"continue_final_message": True, "add_generation_prompt": True}}, "continue_final_message"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto": no parser
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools (vLLM: "When using `tool_choice`, `tools` must be set.")
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"}, "tools[0].function.name"),
]


def _assert_error_body(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    return body["error"]


@pytest.mark.parametrize("extra,param", BAD_CHAT, ids=[p + str(i) for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_chat_parameters_are_400_naming_the_parameter(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, **{"max_tokens": 4, **extra})
    assert e.value.status_code == 400, e.value.body
    assert e.value.param == param or e.value.param.startswith(param + "."), e.value.body  # "logit_bias.5" names the key
    assert e.value.type == "invalid_request_error"


def test_a_union_field_names_the_branch_its_value_took(client):
    """``stop`` is a string or a list of at most 16: 17 strings are "a list too long" on ``stop``, not the string
    branch's "should be a valid string" on ``stop.str``."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stop=["x"] * 17)
    assert e.value.param == "stop", e.value.body
    assert "at most 16 items" in e.value.message and "valid string" not in e.value.message


def test_unknown_model_is_404_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert e.value.param == "model" and "gpt-4o" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=4)


@pytest.mark.parametrize(
    "extra,param",
    [({"logprobs": 6}, "logprobs"), ({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of"),
     ({"prompt": ""}, "prompt"), ({"prompt": [1, -5]}, "prompt"), ({"prompt": [[1, 2], [10**7]]}, "prompt"),
     ({"prompt": "x " * 3000}, "prompt"), ({"extra_body": {"priority": -1}}, "priority"),
     ({"extra_body": {"stop_token_ids": [10**7]}}, "stop_token_ids"), ({"logit_bias": {"1_0": 1}}, "logit_bias"),
     ({"logit_bias": {" 1": 1}}, "logit_bias"), ({"logit_bias": {"\u0661": 1}}, "logit_bias"),
     ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # beyond int()'s 4300 digits: it was a 500
     ({"extra_body": {"structured_outputs": {"regex": ""}}}, "structured_outputs"),
     ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs"),
     ({"extra_body": {"structured_outputs": {"grammar": ""}}}, "structured_outputs"),
     ({"max_tokens": 0}, "max_tokens")],  # 0 only with echo
)
def test_unsupported_or_bad_completion_fields_are_400(client, extra, param):
    kwargs = {"prompt": "Hello", "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", **kwargs)
    assert e.value.param == param or (param == "prompt" and e.value.param.startswith("prompt")), e.value.body


def test_a_logit_bias_key_of_many_digits_is_out_of_range_or_its_id(client):
    """A key of more than 4300 digits is a 400 saying it is out of the vocabulary (int() refused it: a 500); one of
    leading zeros names its id, as int() reads a short one ("007" is 7), so the biased reply is the same."""
    greedy = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(logit_bias={"9" * 5000: 1}, **greedy)
    assert e.value.param == "logit_bias" and "got one of 5000 digits" in e.value.message
    padded = client.completions.create(logit_bias={"0" * 5000 + "7": 100}, **greedy)
    short = client.completions.create(logit_bias={"007": 100}, **greedy)
    assert padded.choices[0].text == short.choices[0].text == client.completions.create(
        logit_bias={"7": 100}, **greedy).choices[0].text


@pytest.mark.parametrize(
    "body,param",
    [
        (b'{"model": "tiny", "messages": [', None),  # malformed JSON
        (b"[]", None),
        (b'{"model": "tiny"}', "messages"),
        (b'{"model": "tiny", "messages": []}', "messages"),
        (b'{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}', "tools[0].type"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', "max_tokens"),
    ],
)
def test_malformed_requests_are_400_with_an_openai_body(server, body, param):
    r = httpx.post(server.v1 + "/chat/completions", content=body, headers={"content-type": "application/json"})
    _assert_error_body(r, 400, param)


@pytest.mark.parametrize(("body", "message"), [
    (b"", "the request body is empty"), (b"[1, 2]", "the request body is not a JSON object"),
    (b'"Hi"', "the request body is not a JSON object")])
def test_a_body_that_is_no_json_object_is_said_as_such(server, body, message):
    """No body, or JSON that is no object, is a 400 saying so, as malformed JSON is (OpenAI: it could not parse the
    JSON body). It was pydantic's "Field required" or "Input should be a valid dictionary ..." naming nothing."""
    for path in ("/chat/completions", "/completions", "/responses", "/embeddings"):
        r = httpx.post(server.v1 + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        error = _assert_error_body(r, 400, None)
        assert error["message"].startswith(message) and error["code"] == "invalid_json", error


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_json_body_under_another_content_type_names_the_content_type(server, content_type):
    """FastAPI reads a body as JSON only under a JSON Content-Type: a JSON object sent as text/plain, as curl -d's
    form encoding or with none is a 400 naming the Content-Type to send; it said the body "is not a JSON object"."""
    import json

    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        error = _assert_error_body(httpx.post(server.url + path, content=body, headers=headers, timeout=30), 400, None)
        assert error["message"].startswith("the request body must be sent with Content-Type: application/json")
        assert (repr(content_type) if content_type else "no Content-Type") in error["message"], error


@pytest.mark.parametrize("body", [b'{"model": "tiny", "prompt": "hi",}', b'{"model": "tiny" "prompt": "hi"}', b"   ",
                                  b'{"model": "tiny", "prompt": "h\x01i"}', b'{"model": "tiny"} {}'])
def test_malformed_json_is_named_with_its_character(server, body):
    """A syntax error says what json.loads says and where (as vLLM's 400 carries FastAPI's ctx and loc); it was
    "malformed JSON body: JSON decode error", whatever and wherever the error."""
    import json

    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(body)
    r = httpx.post(server.v1 + "/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    error = _assert_error_body(r, 400, None)
    assert error["message"] == f"malformed JSON body: {e.value.msg} at character {e.value.pos}"
    assert error["code"] == "invalid_json"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_number_that_is_not_finite_is_named_as_such(server, literal):
    """Python's json reads NaN, Infinity and 1e400 (inf) as floats: each is a 400 saying the field must be a finite
    number; NaN was "Input should be less than or equal to 2" (a NaN fails every bound)."""
    cases = [("/v1/completions", "temperature", '{"prompt": "x", "max_tokens": 2, "temperature": %s}'),
             ("/v1/chat/completions", "presence_penalty",
              '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "presence_penalty": %s}'),
             ("/v1/completions", "logit_bias.5", '{"prompt": "x", "max_tokens": 2, "logit_bias": {"5": %s}}'),
             ("/v1/responses", "top_p", '{"input": "x", "top_p": %s}')]
    for path, field, body in cases:
        r = httpx.post(server.url + path, content=(body % literal).encode(), headers={"content-type": "application/json"},
                       timeout=30)
        assert _assert_error_body(r, 400, field)["message"] == f"{field}: Input should be a finite number"


_DEEP = b"[" * 10_000 + b"]" * 10_000


@pytest.mark.parametrize(("body", "headers", "cause"), [
    (b'{"model": "tiny", "prompt": "h\xffi"}', {}, "'utf-8' codec can't decode byte 0xff"),
    (b'{"model": "tiny", "prompt": "hi", "user": ' + _DEEP + b"}", {}, "maximum recursion depth exceeded"),
    (b'{"model": "tiny", "prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", {}, "Exceeds the limit (4300 digits)"),
    (gzip.compress(b'{"model": "tiny", "prompt": "hi"}'), {"content-encoding": "gzip"},
     "Content-Encoding 'gzip' is not supported"),
], ids=["utf8", "deep", "digits", "gzip"])
def test_a_body_json_cannot_read_is_400_naming_why(server, body, headers, cause):
    """Bytes that are no UTF-8 (a gzip body among them), 10,000 levels of nesting (RecursionError) and an integer of
    5,000 digits fail in json.loads, not as syntax: each is a 400 "malformed JSON body" naming the cause, as a syntax
    error is, and the server stays up. They were "There was an error parsing the body" with no code."""
    headers = {"content-type": "application/json"} | headers
    error = _assert_error_body(httpx.post(server.v1 + "/completions", content=body, headers=headers, timeout=30), 400,
                               None)
    assert error["message"].startswith("malformed JSON body: ") and cause in error["message"], error
    assert error["code"] == "invalid_json" and "set_int_max_str_digits" not in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_other_routes_answer_errors_as_openai_bodies(server):
    _assert_error_body(httpx.get(server.url + "/v1/nothing"), 404, None)
    _assert_error_body(httpx.get(server.v1 + "/chat/completions"), 405, None)
    _assert_error_body(httpx.post(server.url + "/detokenize", json={"tokens": [10**7]}), 400, "tokens")
    _assert_error_body(httpx.post(server.url + "/tokenize", json={"prompt": "a", "messages": MESSAGES}), 400, "prompt")
    _assert_error_body(httpx.post(server.url + "/tokenize", json={"model": "x", "prompt": "a"}), 404, "model")
    empty = _assert_error_body(httpx.post(server.url + "/tokenize", json={"messages": []}), 400, "messages")
    assert empty["message"].startswith("messages: List should have at least 1 item")


def test_a_wrong_method_is_405_saying_the_allowed_ones(server):
    """A 405 carries the Allow header (RFC 9110 15.5.6: MUST), as Starlette's own handler sends it for the same
    routes; the OpenAI error body dropped it."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    plain = FastAPI()  # the reference: FastAPI's own 405s for the same routes
    for path in ("/v1/chat/completions", "/v1/completions"):
        plain.post(path)(lambda: None)
    plain.get("/v1/models")(lambda: None)
    with TestClient(plain) as reference:
        for method, path in (("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("PUT", "/v1/completions")):
            r = httpx.request(method, server.url + path, timeout=30)
            _assert_error_body(r, 405, None)
            expected = reference.request(method, path)
            assert expected.status_code == 405 and r.headers["allow"] == expected.headers["allow"], r.headers


def test_server_still_answers_after_bad_requests(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_request_without_model_is_served_by_the_served_model(server, client):
    """vLLM and llama.cpp's server take a missing ``model`` as the served one: the same tokens as naming it."""
    for path, body in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "Hello"}),
                       ("responses", {"input": "Hello", "max_output_tokens": 4})):
        greedy = {"temperature": 0} | ({} if path == "responses" else {"max_tokens": 4})
        unnamed = httpx.post(f"{server.v1}/{path}", json=body | greedy, timeout=60)
        named = httpx.post(f"{server.v1}/{path}", json=body | greedy | {"model": "tiny"}, timeout=60)
        assert unnamed.status_code == named.status_code == 200, unnamed.text
        assert unnamed.json()["model"] == "tiny"
        pick = (lambda r: r["output"]) if path == "responses" else (lambda r: r["choices"])
        strip = {"id", "created", "created_at", "object"}  # ids differ; the generated content must not
        assert [{k: v for k, v in c.items() if k not in strip} for c in pick(unnamed.json())] == \
            [{k: v for k, v in c.items() if k not in strip} for c in pick(named.json())]


def test_truncate_prompt_tokens_keeps_the_last_tokens_before_the_length_check(server, client, tiny_tokenizer):
    """vLLM's extra: the prompt's last k tokens are what the model sees and usage counts, so a prompt longer than
    the context is served; k outside -1, 1.. is a 400 naming the field."""
    ids = tiny_tokenizer.encode("hello world " * 1500)  # beyond the 2048-token context
    assert len(ids) > 2048
    greedy = {"max_tokens": 4, "temperature": 0}
    cut = client.completions.create(model="tiny", prompt=ids, extra_body={"truncate_prompt_tokens": 10}, **greedy)
    alone = client.completions.create(model="tiny", prompt=ids[-10:], **greedy)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == alone.choices[0].text
    echoed = client.completions.create(model="tiny", prompt="hello world " * 1500, echo=True,
                                       extra_body={"truncate_prompt_tokens": 10}, **greedy)
    assert echoed.choices[0].text == tiny_tokenizer.decode(ids[-10:]) + alone.choices[0].text  # the kept tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world " * 1500}],
                                          extra_body={"truncate_prompt_tokens": 50}, **greedy)
    assert chat.usage.prompt_tokens == 50
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", extra_body={"truncate_prompt_tokens": -2}, **greedy)
    assert e.value.param == "truncate_prompt_tokens"


def test_settings_that_leave_no_token_are_400_and_harm_no_other_request(server, tiny_tokenizer):
    """allowed_token_ids [x] with x a stop id under min_tokens (or x a bad word) masks every token: that request
    alone is a 400 naming a setting, sampled or greedy, streamed or not; a stream running beside it ends normally
    and the server stays healthy."""
    import concurrent.futures

    (x,) = tiny_tokenizer.encode("x", add_special_tokens=False)
    boxed = [{"allowed_token_ids": [x], "stop_token_ids": [x], "min_tokens": 2},
             {"allowed_token_ids": [x], "bad_words": ["x"]}]

    def beside() -> str:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as r:
            return r.read().decode()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(beside)
        for extra in boxed:
            for temperature in (1.0, 0.0):
                body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": temperature} | extra
                r = httpx.post(server.v1 + "/completions", json=body, timeout=60)
                assert "no token can be generated" in _assert_error_body(r, 400, "allowed_token_ids")["message"]
        with httpx.stream("POST", server.v1 + "/completions", json=body | {"stream": True}, timeout=60) as r:
            events = r.read().decode()
        assert '"code":"invalid_value"' in events.replace(" ", "") and "no token can be generated" in events
        streamed = running.result()
    assert streamed.rstrip().endswith("data: [DONE]") and '"error"' not in streamed
    assert httpx.get(server.url + "/health").status_code == 200


LONE_SURROGATES = [  # (path, body, param): JSON may escape a lone surrogate, which is no Unicode text
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 16, "bad_words": ["\ud800"]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\udc00": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udc00b"}]}, "messages"),
    ("/v1/embeddings", {"input": "\ud800"}, "input"),
    ("/v1/responses", {"input": "x", "instructions": "\ud800"}, "instructions"),
    ("/v1/responses", {"input": "x", "previous_response_id": "\ud800"}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "metadata": {"a": "\ud800"}}, "metadata"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/detokenize", {"tokens": [1], "model": "\ud800"}, "model"),
]


@pytest.mark.parametrize("path,body,param", LONE_SURROGATES, ids=[p for _, _, p in LONE_SURROGATES])
def test_lone_surrogates_are_400_naming_the_field_and_take_no_admission(server, path, body, param):
    import json

    content = json.dumps({"model": "tiny", "max_tokens": 2} | body if path.startswith("/v1/c") else
                         {"model": "tiny"} | body).encode()  # ensure_ascii: "\ud800" stays an escape
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    error = _assert_error_body(r, 400, param)
    assert "lone surrogate U+D" in error["message"]
    assert server.metrics()["kvgen:num_requests_in_server"] == 0


def test_a_grammar_that_fails_mid_generation_is_400_with_its_first_line(server):
    """A regex past llguidance's limits (a{1000000}) compiles, then its matcher fails after a few tokens: a 400 naming
    structured_outputs, with llguidance's message and none of its parser-state dump."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 16, "structured_outputs": {"regex": "a{1000000}"}}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=120)
    error = _assert_error_body(r, 400, "structured_outputs")
    assert error["message"].startswith("structured_outputs: the grammar failed at output token")
    assert "\n" not in error["message"] and "<state>" not in error["message"]


def test_a_grammar_that_fails_mid_stream_ends_it_with_the_400s_body(server):
    """Streamed, the same failure ends the stream with an error event carrying the body of the unstreamed 400
    (invalid_request_error naming structured_outputs), then [DONE]; it was a server_error naming no field, its
    message prefixed "the request was aborted by the server"."""
    import json

    body = {"model": "tiny", "prompt": "x", "max_tokens": 16, "structured_outputs": {"regex": "a{1000000}"}}
    expected = _assert_error_body(httpx.post(server.v1 + "/completions", json=body, timeout=120), 400,
                                  "structured_outputs")
    with httpx.stream("POST", server.v1 + "/completions", json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    event = json.loads(data[-2])["error"]
    assert data[-1] == "[DONE]" and {**event, "message": ""} == {**expected, "message": ""}
    assert event["message"].startswith("structured_outputs: the grammar failed at output token")
