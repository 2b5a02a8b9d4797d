"""The official ``openai`` client against a live ``kvgen serve`` (tiny random model): shapes,
streaming, n, stop strings, seeds, logprobs, logit_bias, usage counts, /v1/models."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

import kvgen

MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "max_tokens": 12}


def _chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def _stream_chat(client, **kwargs):
    """(concatenated content per choice, every chunk) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **kwargs))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


def test_chat_completion_has_openai_shape_and_usage_from_our_tokenizer(client, tiny_tokenizer):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny" and r.created > 0
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(_chat_ids(tiny_tokenizer, MESSAGES))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == GREEDY["max_tokens"]
    assert r.choices[0].message.content  # 12 random tokens are never all special


def test_a_reply_has_openais_null_refusal_and_no_tool_calls_without_calls(server):
    """OpenAI's message requires ``refusal`` (null) and its choice ``logprobs`` requires ``content`` and ``refusal``;
    ``tool_calls`` is an array when present, and a reply without calls has none (OpenAI, vLLM). kvgen left ``refusal``
    out of both and sent ``"tool_calls": null``, which OpenAI's schema refuses."""
    body = {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 1, **GREEDY}
    choice = httpx.post(server.v1 + "/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["message"]["refusal"] is None and "tool_calls" not in choice["message"]
    assert choice["logprobs"]["refusal"] is None and len(choice["logprobs"]["content"]) > 0
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"] is not None]
    assert len(logprobs) > 1 and all(lp["refusal"] is None and lp["content"] for lp in logprobs)


def test_openai_fields_that_change_nothing_here_are_accepted_and_others_refused(client):
    """store, metadata, service_tier, reasoning_effort, prediction ... are OpenAI's and agent frameworks send them: the
    same reply as without them (they were 400s); an unknown field is still a 400, as OpenAI's."""
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    sent = client.chat.completions.create(
        model="tiny", messages=MESSAGES, store=False, metadata={"k": "v"}, service_tier="auto", prompt_cache_key="c",
        safety_identifier="u1", reasoning_effort="low", verbosity="low", modalities=["text"],
        prediction={"type": "content", "content": "x"}, **GREEDY)
    assert sent.choices[0].message.content == plain.choices[0].message.content
    for extra, param in (({"modalities": ["audio"]}, "modalities"), ({"extra_body": {"colour": 1}}, "colour")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY, **extra)
        assert e.value.param.startswith(param), e.value.body


def test_null_n_stream_logprobs_echo_are_their_defaults_and_metadata_has_openais_limits(server):
    """OpenAI's schemas let n, stream, logprobs (chat) and echo (completions) be null, their defaults, as vLLM's
    Optional fields (they were 400s); chat metadata keys are at most 64 characters and values 512, as OpenAI's."""
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    plain = httpx.post(server.v1 + "/chat/completions", json=chat, timeout=60).json()
    nulls = httpx.post(server.v1 + "/chat/completions", json=chat | {"n": None, "stream": None, "logprobs": None},
                       timeout=60)
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    text = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(server.v1 + "/completions", json=text, timeout=60).json()
    nulls = httpx.post(server.v1 + "/completions", json=text | {"n": None, "stream": None, "echo": None}, timeout=60)
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
        r = httpx.post(server.v1 + "/chat/completions", json=chat | {"metadata": metadata}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("metadata"), r.text
    ok = httpx.post(server.v1 + "/chat/completions", json=chat | {"metadata": {"k" * 64: "v" * 512}}, timeout=60)
    assert ok.status_code == 200, ok.text
    echo = httpx.post(server.v1 + "/chat/completions", json=chat | {"echo": None}, timeout=60)  # chat has no echo
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo", echo.text


def test_streamed_chat_equals_non_streamed_and_follows_the_chunk_protocol(client):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    texts, chunks = _stream_chat(client, messages=MESSAGES, stream_options={"include_usage": True}, **GREEDY)
    assert texts == {0: full.choices[0].message.content}
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: whatever the prefix cache held
    assert chunks[-1].choices == [] and [getattr(chunks[-1].usage, k) for k in counts] == [
        getattr(full.usage, k) for k in counts]
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_stream_ends_with_done_and_has_no_usage_unless_asked(server):
    body = {"model": "tiny", "messages": MESSAGES, "stream": True, **GREEDY}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and '"usage"' not in "".join(lines)


def test_continuous_usage_stats_give_every_chunk_its_choices_running_usage(client, tiny_tokenizer):
    """vLLM's ``stream_options.continuous_usage_stats``: each choice chunk's usage is its prompt's tokens and its
    choice's tokens so far (0 on the opening chunk); the last chunk is the request's usage; off without include_usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = {"messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 5}
    _, chunks = _stream_chat(client, stream_options=options, **kwargs)
    num_prompt = len(_chat_ids(tiny_tokenizer, MESSAGES))
    seen = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        u = chunk.usage
        assert u.prompt_tokens == num_prompt and u.total_tokens == num_prompt + u.completion_tokens
        assert u.completion_tokens >= seen[choice.index]  # running, per choice
        seen[choice.index] = u.completion_tokens
    assert seen == {0: 5, 1: 5} and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    _, plain = _stream_chat(client, stream_options={"continuous_usage_stats": True}, **kwargs)
    assert all(c.usage is None for c in plain)
    prompts = ["The capital of France is", "Hello"]
    stream = client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=4, stream=True,
                                       stream_options=options)
    last = {c.choices[0].index: c.usage for c in stream if c.choices}
    assert [(u.prompt_tokens, u.completion_tokens) for _, u in sorted(last.items())] == [
        (len(tiny_tokenizer.encode(p)), 4) for p in prompts]


def test_n_2_gives_two_different_seeded_reproducible_choices(client):
    kwargs = {"messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    a = client.chat.completions.create(model="tiny", **kwargs)
    b = client.chat.completions.create(model="tiny", **kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    streamed, _ = _stream_chat(client, **kwargs)
    assert streamed == {c.index: c.message.content for c in a.choices}
    assert [c.finish_reason for c in a.choices] == ["length", "length"] and a.usage.completion_tokens == 16


def test_seed_reproducibility_and_different_seeds_differ(client):
    def run(seed: int) -> str:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=10)
        return r.choices[0].message.content

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_stop_string_cuts_text_and_never_leaks_into_the_stream(client):
    sampled = {"messages": MESSAGES, "temperature": 1.0, "seed": 11, "max_tokens": 24}
    text = client.chat.completions.create(model="tiny", **sampled).choices[0].message.content
    start = next(i for i in range(len(text) // 3, len(text) - 3) if not any(ch.isspace() for ch in text[i : i + 3]))
    stop = text[start : start + 3]  # a stop string that spans token boundaries, about a third in
    expected = text[: text.index(stop)]
    r = client.chat.completions.create(model="tiny", stop=[stop, "\x00zz"], **sampled)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop  # vLLM's extension: the stop string that ended it
    texts, chunks = _stream_chat(client, stop=stop, **sampled)
    assert texts == {0: expected}
    assert [c.choices[0].stop_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [stop]
    assert not any(stop in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_logprobs_are_sorted_and_the_greedy_token_is_the_top_one(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
    _, chunks = _stream_chat(client, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_completion_logprobs_match_transformers(client, tiny_tokenizer, tiny_model_dir):
    """Legacy ``logprobs: k``: each greedy token's text, logprob and k best alternatives (plus the chosen one), and
    text offsets, against transformers' log-softmax on the same weights; streamed chunks carry the same entries."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt, k, n = "The capital of France is", 2, 6
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=n, logprobs=k,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([tiny_tokenizer.encode(prompt)])  # [1, T]
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    new_ids = out.sequences[0, ids.shape[1]:].tolist()
    want = [torch.log_softmax(step[0].double(), -1) for step in out.logits]  # [V] per step
    assert lp.tokens == [tiny_tokenizer.decode([t]) for t in new_ids]
    assert lp.token_logprobs == pytest.approx([float(w[t]) for w, t in zip(want, new_ids)], abs=1e-4)
    for top, w, t in zip(lp.top_logprobs, want, new_ids):
        best = w.topk(k)
        expected = {tiny_tokenizer.decode([int(i)]): float(v) for v, i in zip(best.values, best.indices)}
        expected.setdefault(tiny_tokenizer.decode([t]), float(w[t]))
        assert top.keys() == expected.keys() and list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    stream = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=n, logprobs=k,
                                       stream=True, extra_body={"ignore_eos": True})
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_completion_echo_returns_the_prompt_and_its_logprobs(client, tiny_tokenizer, tiny_model_dir):
    """``echo`` with ``logprobs: 1`` and ``max_tokens: 1`` (what evaluation harnesses send for log-likelihoods): the
    prompt's text and tokens come first, its first token without a logprob, the others with transformers'
    log-softmax of the position before; streamed, the same pieces; without logprobs, only the text."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is"
    ids = tiny_tokenizer.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=1, logprobs=1, echo=True)
    choice, lp = r.choices[0], r.choices[0].logprobs
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)  # [T, V]: row i predicts i + 1
    new_id = int(want[-1].argmax())
    assert choice.text == prompt + tiny_tokenizer.decode([new_id]) and r.usage.completion_tokens == 1
    assert lp.tokens == [tiny_tokenizer.decode([t]) for t in ids + [new_id]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([float(want[i, t]) for i, t in enumerate(ids[1:] + [new_id])], abs=1e-4)
    for top, w, t in zip(lp.top_logprobs[1:], want, ids[1:] + [new_id]):
        best = int(w.argmax())
        assert top.keys() == {tiny_tokenizer.decode([best]), tiny_tokenizer.decode([t])}
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids) + 1)]
    stream = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=1, logprobs=1, echo=True,
                                       stream=True)
    pieces = [c.choices[0] for c in stream if c.choices and c.choices[0].logprobs]
    assert "".join(p.text for p in pieces) == choice.text
    assert [t for p in pieces for t in p.logprobs.tokens] == lp.tokens
    assert [o for p in pieces for o in p.logprobs.text_offset] == lp.text_offset
    two = client.completions.create(model="tiny", prompt=prompt, temperature=1.0, seed=5, n=2, max_tokens=2, logprobs=1,
                                    echo=True, stream=True)
    firsts: dict[int, object] = {}
    for c in two:
        for choice in c.choices:
            if choice.logprobs is not None:
                firsts.setdefault(choice.index, choice)
    assert sorted(firsts) == [0, 1]
    for choice in firsts.values():  # each choice opens with the prompt and its logprobs
        assert choice.text.startswith(prompt) and choice.logprobs.tokens[: len(ids)] == lp.tokens[: len(ids)]
        assert choice.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-5)
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=3, echo=True)
    plain = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=3)
    assert by_ids.choices[0].text == tiny_tokenizer.decode(ids) + plain.choices[0].text
    assert by_ids.choices[0].logprobs is None


def test_completion_echo_with_max_tokens_0_returns_the_prompt_alone(client, tiny_tokenizer):
    """``echo`` with ``max_tokens: 0`` (OpenAI's and vLLM's "echo without generation"): the prompt's text and, with
    ``logprobs``, its tokens' logprobs, the same as before the generated token of ``max_tokens: 1``; no completion
    tokens, finished by length; streamed, the same. kvgen refused max_tokens 0."""
    prompt = "The capital of France is"
    num_ids = len(tiny_tokenizer.encode(prompt))
    one = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=1, logprobs=1, echo=True)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    choice, want = r.choices[0], one.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    assert choice.logprobs.tokens == want.tokens[:num_ids] and choice.logprobs.text_offset == want.text_offset[:num_ids]
    assert choice.logprobs.token_logprobs == pytest.approx(want.token_logprobs[:num_ids], abs=1e-5)
    stream = client.completions.create(model="tiny", prompt=[prompt, "Hi"], max_tokens=0, echo=True, n=2, stream=True,
                                       stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    for c in stream:
        for piece in c.choices:
            texts[piece.index] = texts.get(piece.index, "") + piece.text
        usage = c.usage
    assert texts == {0: prompt, 1: prompt, 2: "Hi", 3: "Hi"} and usage is not None and usage.completion_tokens == 0


def test_logit_bias_forces_a_token(client, tiny_tokenizer):
    token_id = tiny_tokenizer.encode(" blue")[0]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=4,
                                       logit_bias={str(token_id): 100})
    assert r.choices[0].message.content == tiny_tokenizer.decode([token_id] * 4)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour", "count"],
          "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}}}


def test_response_format_json_schema_and_json_object(client):
    """OpenAI's response_format on chat: the content parses and matches the schema (sampled, n=2, streamed too)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=5, n=2, max_tokens=100,
                                       response_format=fmt)
    streamed, _ = _stream_chat(client, messages=MESSAGES, temperature=1.0, seed=5, n=2, max_tokens=100,
                               response_format=fmt)
    for choice in r.choices:
        value = json.loads(choice.message.content)
        assert choice.finish_reason == "stop" and set(value) == {"colour", "count"}
        assert value["colour"] in ("red", "green", "blue") and 1 <= value["count"] <= 9
    assert streamed == {c.index: c.message.content for c in r.choices}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=200,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may write a long object; what it wrote is still a JSON object's start
        assert r.choices[0].message.content.startswith("{")


def test_vllm_structured_outputs_on_completions(client):
    r = client.completions.create(model="tiny", prompt="Pick one:", temperature=1.0, seed=2, n=3, max_tokens=20,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert all(c.text in ("yes", "no", "maybe") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model="tiny", prompt="Code:", temperature=1.0, seed=2, max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", r.choices[0].text) and r.usage.completion_tokens <= 4


def test_max_completion_tokens_and_vllm_extras(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.8, top_p=0.9, seed=3,
                                       max_completion_tokens=5, presence_penalty=0.5, frequency_penalty=0.5,
                                       user="u1", extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1,
                                                              "min_tokens": 5, "ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_completions_text_list_and_token_prompts(client, tiny_tokenizer):
    prompt = "The capital of France is"
    one = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6)
    assert one.object == "text_completion" and one.id.startswith("cmpl-")
    assert one.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt))
    by_ids = client.completions.create(model="tiny", prompt=tiny_tokenizer.encode(prompt), temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(model="tiny", prompt=[prompt, "Hello"], n=2, temperature=0, max_tokens=6)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text  # greedy: n copies
    assert many.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt)) + len(tiny_tokenizer.encode("Hello"))
    stream = client.completions.create(model="tiny", prompt=[prompt, "Hello"], temperature=0, max_tokens=6, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: one.choices[0].text, 1: many.choices[2].text}


def test_models_tokenize_detokenize_health_and_page(server, client, tiny_tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].object == "model"
    card = client.models.retrieve("tiny")
    assert (card.id, card.object, card.model_extra) == ("tiny", "model", models.data[0].model_extra)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and "org/other-model" in e.value.body["message"]
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == tiny_tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == _chat_ids(tiny_tokenizer, MESSAGES)
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hello world"}
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ping").json() == httpx.post(server.url + "/ping").json() == {"status": "ok"}
    schema = httpx.get(server.url + "/openapi.json").json()
    operations = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(operations) == len(set(operations))  # FastAPI warns (and clients mis-generate) on a duplicate
    assert not [op for path in schema["paths"].values() for op in path.values() if "422" in op["responses"]]  # 400s
    assert httpx.get(server.url + "/openapi.json").json() == schema  # built once
    assert httpx.get(server.url + "/version").json() == {"version": kvgen.__version__}
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "/static/chat.js" in page.text
    assert "/v1/chat/completions" in httpx.get(server.url + "/static/chat.js").text


def test_metrics_count_tokens_and_log_one_line_per_request(server, client):
    before = server.metrics()
    r = client.completions.create(model="tiny", prompt="Hello there", temperature=0, max_tokens=7,
                                  extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["kvgen:generation_tokens_total"] - before.get("kvgen:generation_tokens_total", 0) == 7
    assert after["kvgen:prompt_tokens_total"] - before.get("kvgen:prompt_tokens_total", 0) == r.usage.prompt_tokens
    for name in ("kvgen:time_to_first_token_seconds_count", "kvgen:e2e_request_latency_seconds_count"):
        assert after[name] - before.get(name, 0) == 1
    assert after["kvgen:inter_token_latency_seconds_count"] - before.get("kvgen:inter_token_latency_seconds_count", 0) == 6
    assert 0 <= after["kvgen:prefix_cache_hit_rate"] <= 1 and "process_resident_memory_bytes" in after
    assert f"request {r.id}: prompt_tokens={r.usage.prompt_tokens} completion_tokens=7" in server.log()


def test_prefix_cache_hits_show_in_metrics(server, client):
    prompt = "A shared preamble that is long enough to fill two KV blocks of sixteen tokens each, and then some more. " * 2
    client.completions.create(model="tiny", prompt=prompt + "First.", temperature=0, max_tokens=2)
    before = server.metrics()
    r = client.completions.create(model="tiny", prompt=prompt + "Second.", temperature=0, max_tokens=2)
    after = server.metrics()
    hits = after["kvgen:prefix_cache_hits_total"] - before["kvgen:prefix_cache_hits_total"]
    queries = after["kvgen:prefix_cache_queries_total"] - before["kvgen:prefix_cache_queries_total"]
    assert queries == r.usage.prompt_tokens and hits >= 32 and hits % 16 == 0  # whole blocks of the shared prefix
    assert after["kvgen:prefix_cache_hit_rate"] > 0
    # OpenAI's usage.prompt_tokens_details.cached_tokens: the same hits, in replies and in a stream's usage chunk
    assert r.usage.prompt_tokens_details.cached_tokens == hits
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt + "One."}],
                                          temperature=0, max_tokens=2)
    before_prompt = chat.usage.prompt_tokens_details.cached_tokens  # at most the template's opening, from other chats
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt + "Two."}],
                                           temperature=0, max_tokens=2, n=2, stream=True,
                                           stream_options={"include_usage": True})
    (final,) = [c for c in again if c.usage is not None]
    details = final.usage.prompt_tokens_details
    assert details.cached_tokens >= before_prompt + 32 and details.cached_tokens % 16 == 0  # counted once for n=2
    assert details.cached_tokens <= final.usage.prompt_tokens


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"], "properties": {"zone": {"enum": ["UTC"]}}}}}


def test_a_named_tool_choice_returns_a_call_with_schema_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice,
                                       temperature=1.0, seed=4, n=2, max_tokens=60)
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert c.message.content is None and c.finish_reason == "stop" and call.type == "function"
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice=choice,
                                                 temperature=1.0, seed=4, n=2, max_tokens=60, stream=True))
    for c in r.choices:  # the streamed arguments, concatenated, are the non-streamed ones
        deltas = [d.tool_calls[0] for ch in chunks for d in [x.delta for x in ch.choices if x.index == c.index]
                  if d.tool_calls]
        assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
        assert "".join(d.function.arguments or "" for d in deltas) == c.message.tool_calls[0].function.arguments


def test_required_tool_choice_returns_calls_of_the_given_tools(client):
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required",
              "temperature": 1.0, "seed": 9, "max_tokens": 120, "parallel_tool_calls": False}
    r = client.chat.completions.create(**kwargs)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    args = json.loads(call.function.arguments)
    assert args == ({"city": args.get("city")} if call.function.name == "get_weather" else {"zone": "UTC"})
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [t for ch in chunks for x in ch.choices if x.delta.tool_calls for t in x.delta.tool_calls]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [(call.function.name, call.function.arguments)]
    assert [x.finish_reason for ch in chunks for x in ch.choices if x.finish_reason] == ["tool_calls"]
    body = kwargs | {"stream": True, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with httpx.stream("POST", str(client.base_url) + "chat/completions", json=body, timeout=60) as raw:
        events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: {")]
    calls = [t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls", [])]
    assert len(calls) > 1 and all(None not in t.values() and None not in t["function"].values() for t in calls)  # no nulls
    cut = client.chat.completions.create(**kwargs | {"parallel_tool_calls": True, "max_tokens": 3})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("[")  # the unparsable start of the array comes back as text


def test_tool_choice_none_ignores_tools_and_a_tool_turn_is_accepted(client):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_vllm_extras_allowed_token_ids_bad_words_stop_token_ids(client, tiny_tokenizer):
    (x,), (y,) = (tiny_tokenizer.encode(c, add_special_tokens=False) for c in "xy")
    kwargs = {"model": "tiny", "prompt": "Hello", "temperature": 1.0, "seed": 5, "max_tokens": 20}

    def text(**extra) -> tuple[str, str]:
        r = client.completions.create(**kwargs, extra_body=extra)
        stop_reason = r.choices[0].stop_reason  # vLLM's: the stop token id that ended it, None for a length limit
        assert stop_reason == (y if r.choices[0].finish_reason == "stop" else None)
        streamed = [c.choices[0].stop_reason for c in client.completions.create(**kwargs, extra_body=extra, stream=True)
                    if c.choices and c.choices[0].finish_reason]
        assert streamed == [stop_reason]
        return r.choices[0].text, r.choices[0].finish_reason

    both, _ = text(allowed_token_ids=[x, y])
    assert set(both) == {"x", "y"} and len(both) == 20
    assert text(allowed_token_ids=[x, y], bad_words=["x"]) == ("y" * 20, "length")
    stopped, reason = text(allowed_token_ids=[x, y], stop_token_ids=[y])
    assert reason == "stop" and stopped == both[: both.index("y")]
    kept, _ = text(allowed_token_ids=[x, y], stop_token_ids=[y], include_stop_str_in_output=True)
    assert kept == both[: both.index("y") + 1]


def test_chat_continue_final_message_and_template_kwargs(client, tiny_tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "Red, green and"}]
    r = client.chat.completions.create(model="tiny", messages=messages, extra_body={
        "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}, **GREEDY)
    ids = tiny_tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    assert r.usage.prompt_tokens == len(ids) and tiny_tokenizer.decode(ids).endswith("Red, green and")
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"add_generation_prompt": False}, **GREEDY)
    assert plain.usage.prompt_tokens == len(tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=True))


def test_tokenize_takes_vllms_chat_fields_and_return_token_strs(server, tiny_model_dir):
    """vLLM's /tokenize: ``return_token_strs`` adds each id's vocabulary string (transformers'
    ``convert_ids_to_tokens``); ``messages`` render with ``continue_final_message`` (no generation prompt then)."""
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == ref.encode("hello world")
    assert body["token_strs"] == ref.convert_ids_to_tokens(body["tokens"])
    messages = MESSAGES + [{"role": "assistant", "content": "Red, gr"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "continue_final_message": True}, timeout=30)
    assert r.status_code == 200, r.text
    want = ref.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}),
    ("/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 2}),
    ("/v1/embeddings", {"model": "tiny", "input": "Hello"}),
    ("/tokenize", {"model": "tiny", "prompt": "Hello"}),
], ids=["completions", "chat", "responses", "embeddings", "tokenize"])
def test_prompts_are_tokenized_off_the_event_loop(tiny_model_dir, path, body):
    """A prompt is tokenized in a worker thread (vLLM's async tokenizer), so a huge one does not stall the server:
    here tokenization waits until a /health request, sent after it, has been answered. Tokenized on the event loop
    (before), /health could not be answered and the wait ran out."""
    import asyncio
    import threading

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server.app import build_app

    healthy = threading.Event()
    waits: list[bool] = []

    async def run() -> int:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_blocks=64))
        tokenizer = engine.engine.tokenizer
        tokenizer.encode = _waiting(tokenizer.encode, healthy, waits)
        tokenizer.apply_chat_template = _waiting(tokenizer.apply_chat_template, healthy, waits)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "tiny")),
                                         base_url="http://kvgen", timeout=60) as client:
                request = asyncio.create_task(client.post(path, json=body))
                await asyncio.sleep(0.05)  # the request is being tokenized
                assert (await client.get("/health")).status_code == 200
                healthy.set()
                return (await request).status_code
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == 200
    assert waits and all(waits)


def _waiting(fn, event, waits):
    """``fn`` that first waits for ``event`` (at most 5 s) and records whether it came."""
    def wrapped(*args, **kwargs):
        waits.append(event.wait(timeout=5))
        return fn(*args, **kwargs)
    return wrapped


def test_x_request_id_names_the_response_as_vllm(server):
    """vLLM's ``_base_request_id``: a client's (a gateway's) ``X-Request-Id`` header becomes the response id's tail,
    ``chatcmpl-<id>`` / ``cmpl-<id>``, streamed chunks too; the same id sent twice at once is two requests, both
    answered (the engine's ids stay unique). Without the header the id is random."""
    import concurrent.futures

    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    text = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}

    def post(path: str, body: dict, request_id: str | None) -> httpx.Response:
        headers = {"X-Request-Id": request_id} if request_id is not None else {}
        return httpx.post(server.v1 + path, json=body, headers=headers, timeout=60)

    assert post("/chat/completions", chat, "trace-7").json()["id"] == "chatcmpl-trace-7"
    assert post("/completions", text, "trace-8").json()["id"] == "cmpl-trace-8"
    streamed = post("/chat/completions", chat | {"stream": True}, "trace-9").text
    ids = {json.loads(line[6:])["id"] for line in streamed.splitlines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-trace-9"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: post("/completions", text | {"max_tokens": 8}, "same"), range(2)))
    assert [r.status_code for r in both] == [200, 200] and {r.json()["id"] for r in both} == {"cmpl-same"}
    plain = [post("/completions", text, None).json()["id"] for _ in range(2)]
    assert plain[0] != plain[1] and all(re.fullmatch("cmpl-[0-9a-f]{32}", i) for i in plain)
