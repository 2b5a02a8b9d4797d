"""``LLM``'s vLLM-compatible surface on the tiny random Llama directory: constructor arguments and ``generate``'s."""

from __future__ import annotations

import json
import shutil

import pytest

from kvgen.engine import LLM, SamplingParams
from kvgen.errors import ModelNotFoundError
from kvgen.tokenizer import Tokenizer

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
