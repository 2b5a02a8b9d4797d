"""Reasoning parsers (``kvgen serve --reasoning-parser``): the split of a reply into reasoning and content (vLLM's
deepseek_r1 and qwen3 rules), the same whether streamed piece by piece or whole, and a live server returning
``reasoning`` in chat completions (``message.reasoning``, ``delta.reasoning``) and reasoning items in responses."""

from __future__ import annotations

import json

import httpx
import pytest

from kvgen.server.launch import ServerArgs
from kvgen.server.reasoning_parsers import new_splitter, num_reasoning_tokens

CASES = {  # reply -> (deepseek_r1, qwen3) as (reasoning, content)
    "<think>Let me see.</think>The answer is 4.": (("Let me see.", "The answer is 4."),) * 2,
    "The answer is 4.": (("The answer is 4.", ""), (None, "The answer is 4.")),
    "Let me see.</think>Four": (("Let me see.", "Four"), (None, "Let me see.</think>Four")),
    "\n<think>a</think>\n\nb": (("a", "\n\nb"),) * 2,
    "<think>cut short by max_tokens": (("cut short by max_tokens", ""),) * 2,
    "<thi": (("<thi", ""), (None, "<thi")),
    "<think></think>x": (("", "x"),) * 2,
    "": (("", ""), (None, "")),
    "<think>": (("", ""),) * 2,  # stopped right after opening (max_tokens 1): no "<think>" left in either field
    " \n<think>": (("", ""),) * 2,
}


@pytest.mark.parametrize("reply", list(CASES))
@pytest.mark.parametrize("index,parser", [(0, "deepseek_r1"), (1, "qwen3")])
def test_replies_split_as_vllm_and_the_same_streamed(reply, index, parser):
    assert new_splitter(parser).split(reply) == CASES[reply][index]
    for size in (1, 2, 3, 5):  # pieces as a stream brings them
        splitter, reasoning, content = new_splitter(parser), "", ""
        for i in range(0, len(reply), size):
            r, c = splitter.feed(reply[i : i + size])
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert ((reasoning + r) if splitter.has_reasoning else None, content + c) == CASES[reply][index]


QWEN3_PROMPTS = {  # the end of the rendered prompt -> whether a qwen3 reply starts inside its reasoning
    "<|im_start|>assistant\n<think>\n": True,  # Qwen3-Thinking-2507 / Qwen3.5 open it in the prompt
    "<|im_start|>assistant\n<think>\n\n</think>\n\n": False,  # enable_thinking false closes it
    "<|im_start|>assistant\n": False,  # Qwen3's first template: the model writes <think> itself
    "": False,
}


@pytest.mark.parametrize("tail", list(QWEN3_PROMPTS))
def test_qwen3_replies_start_inside_a_reasoning_the_prompt_opened(tail):
    """vLLM (PR 34779) splits ``reasoning</think>content`` when the template wrote ``<think>``: kvgen returned the
    whole reply, ``</think>`` included, as content. Streamed at every split point, the same fields."""
    is_open = QWEN3_PROMPTS[tail]
    reply = "Two and two.</think>\n\nFour."
    expected = ("Two and two.", "\n\nFour.") if is_open else (None, reply)
    assert new_splitter("qwen3", tail).split(reply) == expected
    assert new_splitter("qwen3", tail).split("<think>a</think>b") == ("a", "b")  # a <think> written is dropped
    assert new_splitter("deepseek_r1", tail).split(reply) == ("Two and two.", "\n\nFour.")
    for cut in range(1, len(reply)):
        splitter = new_splitter("qwen3", tail)
        (r1, c1), (r2, c2), (r3, c3) = splitter.feed(reply[:cut]), splitter.feed(reply[cut:]), splitter.finish()
        assert ((r1 + r2 + r3) if splitter.has_reasoning else None, c1 + c2 + c3) == expected, cut


def test_num_reasoning_tokens_counts_through_the_closing_marker():
    """OpenAI's ``reasoning_tokens``: through ``</think>`` when it is one token; every token of a reply that never
    closed its reasoning; re-encoded when the marker came in pieces; 0 without reasoning."""
    from tokenizers import AddedToken

    from kvgen.tokenizer import Tokenizer
    from kvgen.tokenizer.special_tokens import SpecialTokenIds

    from helpers import train_tiny_tokenizer

    pieces = Tokenizer(train_tiny_tokenizer(), SpecialTokenIds(), None, "tiny")
    backend = train_tiny_tokenizer()
    backend.add_special_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)])
    marked = Tokenizer(backend, SpecialTokenIds(), None, "tiny")
    reply = "<think>Adding is four.</think>The answer is 4."
    for tok in (pieces, marked):
        ids = tok.encode(reply, add_special_tokens=False)
        thought = tok.encode("<think>Adding is four.</think>", add_special_tokens=False)
        assert ids[: len(thought)] == thought  # the split lies on a token boundary here
        assert num_reasoning_tokens(tok, ids, "Adding is four.") == len(thought)
        assert num_reasoning_tokens(tok, ids, None) == 0
        unclosed = tok.encode("<think>Adding is", add_special_tokens=False)
        assert num_reasoning_tokens(tok, unclosed, "Adding is") == len(unclosed)
    assert len(marked.encode("</think>", add_special_tokens=False)) == 1 < len(pieces.encode("</think>"))


def test_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerArgs(reasoning_parser="o1")


@pytest.fixture(scope="module")
def r1_server(tiny_model_dir, tmp_path_factory, launch_server):
    live = launch_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "r1.log", "--num-blocks", "256",
                         "--reasoning-parser", "deepseek_r1")
    yield live
    assert live.stop() == 0, live.log()[-3000:]


MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
FORCED = {"structured_outputs": {"regex": r"<think>(Two plus two|Adding) is four\.</think>The answer is (4|four)\."}}


def test_chat_completions_return_the_reasoning_apart(r1_server):
    from openai import OpenAI

    with OpenAI(base_url=r1_server.v1, api_key="unused", max_retries=0, timeout=60) as client:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=200,
                                           extra_body=FORCED)
        message = r.choices[0].message
        assert message.reasoning.endswith(" is four.") and message.content.startswith("The answer is ")
        assert r.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=200,
                                                     extra_body=FORCED, stream=True))
        deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
        assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
        assert "".join(d.content or "" for d in deltas) == message.content
        # the assistant turn given back with its reasoning is accepted
        again = client.chat.completions.create(model="tiny", temperature=0, max_tokens=4, messages=[
            *MESSAGES, message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}])
        assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 4


def test_responses_put_the_reasoning_in_a_reasoning_item(r1_server):
    """Without a closing </think> the whole reply is deepseek_r1 reasoning: a reasoning item, then an empty message,
    the same streamed (reasoning_text events) as answered at once, and as chat completions give it."""
    from openai import OpenAI

    body = {"input": "What is 2 + 2?", "temperature": 0, "max_output_tokens": 12}
    with OpenAI(base_url=r1_server.v1, api_key="unused", max_retries=0, timeout=60) as client:
        r = client.responses.create(model="tiny", **body)
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.choices[0].message.reasoning
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12  # never closed: all of it
    assert message.type == "message" and r.output_text == ""
    assert chat.choices[0].message.content is None  # vLLM's parsers: ``content or None``
    with httpx.stream("POST", r1_server.v1 + "/responses", json={"model": "tiny", "stream": True, **body},
                      timeout=60) as stream:
        events = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message"]
    assert events[-1]["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 12}


def test_a_streamed_reasoning_item_has_its_part_added_and_done(r1_server):
    """A reasoning item streams as vLLM's: added without content, ``content_part.added`` (a ``reasoning_text`` part),
    the deltas, ``reasoning_text.done``, ``content_part.done``, ``output_item.done``. The item came with its part
    already in it and no part events, unlike the message after it."""
    body = {"model": "tiny", "input": "What is 2 + 2?", "temperature": 0, "max_output_tokens": 12, "stream": True}
    with httpx.stream("POST", r1_server.v1 + "/responses", json=body, timeout=60) as stream:
        events = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]
    reasoning = [e for e in events if e.get("output_index") == 0]
    kinds = [e["type"] for e in reasoning]
    num_deltas = kinds.count("response.reasoning_text.delta")
    assert num_deltas > 0 and kinds == ["response.output_item.added", "response.content_part.added",
                                        *["response.reasoning_text.delta"] * num_deltas, "response.reasoning_text.done",
                                        "response.content_part.done", "response.output_item.done"]
    assert reasoning[0]["item"]["type"] == "reasoning" and reasoning[0]["item"]["content"] == []
    text = "".join(e["delta"] for e in reasoning[2:-3])
    assert reasoning[1]["part"] == {"type": "reasoning_text", "text": ""}
    assert reasoning[-2]["part"] == {"type": "reasoning_text", "text": text} == reasoning[-1]["item"]["content"][0]
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "reasoning_text", "text": text}]


def test_qwen3_server_reads_the_reasoning_its_template_opened(tiny_model_dir, tmp_path, launch_server):
    """A template that writes ``<think>\\n`` after the assistant header (Qwen3.5's): the reply's text up to
    ``</think>`` is reasoning in chat completions, streamed or not, and in /v1/responses (a reasoning item)."""
    from openai import OpenAI

    from helpers import CHATML_TEMPLATE

    template = tmp_path / "thinking.jinja"
    template.write_text(CHATML_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"))
    live = launch_server(tiny_model_dir, tmp_path / "qwen3.log", "--num-blocks", "256", "--reasoning-parser", "qwen3",
                         "--chat-template", str(template))
    forced = {"structured_outputs": {"regex": r"Two and two\.</think>Four\."}}
    try:
        with OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60) as client:
            message = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40,
                                                     extra_body=forced).choices[0].message
            assert (message.reasoning, message.content) == ("Two and two.", "Four.")
            deltas = [choice.delta for chunk in client.chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=0, max_tokens=40, extra_body=forced, stream=True)
                for choice in chunk.choices]
            assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Two and two."
            assert "".join(d.content or "" for d in deltas) == "Four."
            r = client.responses.create(model="tiny", input="What is 2 + 2?", temperature=0, max_output_tokens=8)
            assert r.output[0].type == "reasoning" and r.output[0].content[0].text  # no </think>: all reasoning
    finally:
        assert live.stop() == 0, live.log()[-3000:]
