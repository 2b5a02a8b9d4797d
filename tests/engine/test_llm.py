"""``LLM``'s vLLM-compatible surface on the tiny random Llama directory: constructor arguments and ``generate``'s."""

from __future__ import annotations

import json
import shutil

import pytest

from kvgen.engine import LLM, SamplingParams
from kvgen.errors import ModelNotFoundError
from kvgen.tokenizer import Tokenizer

from helpers import PARTS_TEMPLATE, SMOLVLM_TEMPLATE

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def test_llm_uses_the_tokenizer_it_is_given_as_vllm(tiny_model_dir, tmp_path):
    """vLLM's ``LLM(model=..., tokenizer=PATH)`` loads the tokenizer from PATH instead of the model's; kvgen ignored
    ``tokenizer`` when ``model`` was a path (a Tokenizer object or a path, even a missing one)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "[{{ messages[0]['content'] }}]"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(str(tiny_model_dir), tokenizer=str(tmp_path), num_blocks=64)
    (out,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert out.prompt == "[hi]" == Tokenizer.from_pretrained(tmp_path).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    assert LLM(str(tiny_model_dir), tokenizer=tok, num_blocks=64).get_tokenizer() is tok
    with pytest.raises(ModelNotFoundError, match="tokenizer directory not found"):
        LLM(str(tiny_model_dir), tokenizer=str(tmp_path / "missing"), num_blocks=64)


def test_a_tokenizer_of_another_type_is_named(tiny_model_dir):
    """``LLM(PATH, tokenizer=5)`` died with "'int' object has no attribute 'eos_token_ids'" from the engine."""
    with pytest.raises(ValueError, match="tokenizer must be a kvgen Tokenizer, a Hugging Face directory or None, got "
                                         "int"):
        LLM(str(tiny_model_dir), tokenizer=5, num_blocks=64)


CALL = {"id": "call_123456789", "type": "function", "function": {"name": "paint", "arguments": '{"colour": "red"}'}}
PARTS_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Paint it"}, {"type": "text", "text": " red."}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_123456789", "content": [{"type": "text", "text": "done"},
                                                                  {"type": "text", "text": "ok"}]},
    {"role": "user", "content": "Again."},
]
AS_VLLM_OPENAI = [  # vLLM's parse_chat_messages, "openai" format: parts as dicts, a tool's texts joined
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "Paint it"}, {"type": "text", "text": " red."}]},
    {"role": "assistant", "content": [], "tool_calls": [{**CALL, "function": {"name": "paint",
                                                                               "arguments": {"colour": "red"}}}]},
    {"role": "tool", "tool_call_id": "call_123456789", "content": "done\nok"},
    {"role": "user", "content": [{"type": "text", "text": "Again."}]},
]


@pytest.mark.parametrize("template,turns", [(SMOLVLM_TEMPLATE, [0, 1, 4]), (PARTS_TEMPLATE, [0, 1, 2, 3, 4])],
                         ids=["smolvlm", "llama3.2-vision"])  # SmolVLM's reads content[0]: no content-less turns
def test_llm_chat_gives_a_template_that_loops_over_content_the_parts_as_vllm(tiny_model_dir, template, turns):
    """vLLM detects a template that loops over ``message['content']`` (its "openai" content format) and hands it each
    content as a list of text parts (a string as one part, None as none); kvgen joined the parts into one string, so
    SmolVLM's template rendered every message empty and Llama 3.2 Vision's put newlines between the parts."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ref.chat_template = template
    llm = LLM(str(tiny_model_dir), tokenizer=tok, num_blocks=64)
    conversation, as_vllm = [PARTS_CONVERSATION[i] for i in turns], [AS_VLLM_OPENAI[i] for i in turns]
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == ref.apply_chat_template(as_vllm, add_generation_prompt=True, tokenize=False)
    assert "Again." in out.prompt and PARTS_CONVERSATION[2]["content"] is None  # not modified
    as_vllm_string = [{**m, "content": "\n".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
                       else m["content"]} for m in as_vllm]  # vLLM's chat_template_content_format="string"
    (forced,) = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_content_format="string")
    assert forced.prompt == ref.apply_chat_template(as_vllm_string, add_generation_prompt=True, tokenize=False)
    with pytest.raises(ValueError, match="chat_template_content_format must be 'auto', 'string' or 'openai', got 'json'"):
        llm.chat(PARTS_CONVERSATION, GREEDY, use_tqdm=False, chat_template_content_format="json")


def test_llm_chat_gives_a_string_template_empty_text_for_no_content_as_vllm(tiny_model_dir):
    """vLLM hands a string template "" for a None content or an empty list of parts; kvgen kept None (``'[' +
    content`` failed) and the empty list (rendered as "[]")."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ref.chat_template = "{% for m in messages %}{{ '[' + m['content'] + ']' }}{% endfor %}"
    conversation = [{"role": "user", "content": []}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_123456789", "content": "done"}]
    (out,) = LLM(str(tiny_model_dir), tokenizer=tok, num_blocks=64).chat(conversation, GREEDY, use_tqdm=False)
    as_vllm = [{"role": "user", "content": ""}, {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "paint", "arguments": {"colour": "red"}}}]}, conversation[2]]
    assert out.prompt == ref.apply_chat_template(as_vllm, tokenize=False) == "[][][done]"


def test_use_tqdm_a_callable_makes_the_progress_bar_as_vllm(tiny_model_dir):
    """vLLM's ``use_tqdm`` may be a callable (``tqdm_func = use_tqdm if callable(use_tqdm) else tqdm``): it makes the
    bar of generate (and embed); kvgen used tqdm.auto whatever was passed."""
    from tqdm import tqdm

    made: list[tuple[int, str]] = []

    def make_bar(**kwargs):
        made.append((kwargs["total"], kwargs["desc"]))
        return tqdm(disable=True, **kwargs)

    llm = LLM(str(tiny_model_dir), num_blocks=64)
    outs = llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=make_bar)
    llm.embed([[5, 6, 7]], use_tqdm=make_bar)
    assert len(outs) == 2 and made == [(2, "Processed prompts"), (1, "Embedded prompts")]


def test_an_empty_prompt_list_gives_no_outputs_as_vllm(tiny_model_dir):
    """vLLM's ``LLM.generate([])`` adds no request and returns ``[]`` (its ``_validate_and_add_requests`` loops over
    zero prompts); kvgen raised. ``[[]]`` is still one empty prompt, refused naming the field."""
    llm = LLM(str(tiny_model_dir), num_blocks=64)
    assert llm.generate([], GREEDY, use_tqdm=False) == [] == llm.generate([], [], use_tqdm=False)
    assert llm.embed([], use_tqdm=False) == []
    with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty list of ints, got \\[\\]"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_reset_prefix_cache_forgets_the_cached_prompt_blocks_as_vllm(tiny_model_dir):
    """vLLM's ``LLM.reset_prefix_cache(reset_running_requests=False) -> bool`` (``llm_engine.reset_prefix_cache``):
    True once the prefix cache is empty, so the next request hits nothing; kvgen had no such method
    (AttributeError). The hit is the engine's own count, ``RequestOutput.num_cached_tokens``."""
    llm = LLM(str(tiny_model_dir), num_blocks=64, block_size=4)
    prompt = {"prompt_token_ids": list(range(5, 19))}  # 14 tokens: 3 full blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 12
    assert llm.reset_prefix_cache() is True
    after = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
    with pytest.raises(ValueError, match="reset_running_requests must be a bool, got 'yes'"):
        llm.reset_prefix_cache("yes")


def test_llm_chat_takes_a_chat_template_for_the_call_as_vllm(tiny_model_dir):
    """vLLM's ``LLM.chat(..., chat_template=None, ...)``: "The template to use for structuring the chat. If not
    provided, the model's default chat template will be used." kvgen's ``chat`` had no such argument (TypeError).
    The rendering is transformers' ``apply_chat_template(chat_template=...)``; the model's own template stays."""
    from transformers import AutoTokenizer

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}" \
               "<assistant>{% endif %}"
    messages = [{"role": "user", "content": "hi"}]
    llm = LLM(str(tiny_model_dir), num_blocks=64)
    own = llm.get_tokenizer().chat_template
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    assert out.prompt == AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True) == "<user>hi<assistant>"
    assert llm.get_tokenizer().chat_template == own and llm.chat(messages, GREEDY, use_tqdm=False)[0].prompt != out.prompt
    with pytest.raises(ValueError, match="chat_template must be a Jinja template or a file path, got 5"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template=5)
    with pytest.raises(ValueError):  # does not compile
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template="{% for %}")
