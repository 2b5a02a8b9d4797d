"""kvgen.generation.streamers against transformers' ``TextStreamer`` / ``TextIteratorStreamer`` (4.55).

The same ``put`` calls go to kvgen's streamer over kvgen's tokenizer and to transformers' over transformers'
tokenizer of the same tiny HF directory; the printed or yielded pieces must agree.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.generation import streamers as hf_streamers

from kvgen.generation.generate import generate
from kvgen.generation.streamers import TextIteratorStreamer, TextStreamer
from kvgen.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir: Path) -> tuple[Tokenizer, Any]:
    """(kvgen's, transformers') tokenizer of the tiny directory."""
    return Tokenizer.from_pretrained(tiny_model_dir), transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _puts(ref: Any, prompt: str, pieces: list[str]) -> list[torch.Tensor]:
    """The prompt as [1, T], then each piece's ids as [1, k] (several tokens in one put, as drafting strategies)."""
    calls = [torch.tensor([ref.encode(prompt, add_special_tokens=False)])]  # [1, T]
    calls += [torch.tensor([ref.encode(p, add_special_tokens=False)]) for p in pieces]  # [1, k] each
    return calls


def _feed(streamer: Any, calls: list[torch.Tensor]) -> None:
    for value in calls:
        streamer.put(value)
    streamer.end()


def _iterated(streamer: Any, calls: list[torch.Tensor]) -> list[str]:
    """The pieces an iterator streamer yields for ``calls`` (all put before iterating)."""
    _feed(streamer, calls)
    return list(streamer)


def _printed(streamer: Any, calls: list[torch.Tensor]) -> str:
    """What a printing streamer writes to stdout for ``calls``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _feed(streamer, calls)
    return out.getvalue()


def test_decode_kwargs_clean_up_tokenization_spaces_as_transformers(tokenizers: tuple[Tokenizer, Any]) -> None:
    """``clean_up_tokenization_spaces`` in decode_kwargs reaches the tokenizer (it was a TypeError at the first put)."""
    ours, ref = tokenizers
    calls = _puts(ref, "Say it", [" again", " ,", " world", " .", " I", " 'm", "\n", "done", " ?"])
    for clean_up in (True, False):
        for skip_prompt in (True, False):
            kwargs = {"skip_prompt": skip_prompt, "skip_special_tokens": True, "clean_up_tokenization_spaces": clean_up}
            want = _iterated(hf_streamers.TextIteratorStreamer(ref, **kwargs), calls)
            assert _iterated(TextIteratorStreamer(ours, **kwargs), calls) == want
            assert _printed(TextStreamer(ours, **kwargs), calls) == _printed(hf_streamers.TextStreamer(ref, **kwargs), calls)


@pytest.mark.parametrize("text", [" one two 😀 three\nfour 👍🏽 five", "日本 語 中文字 🎉 end", "naïve 👨‍👩‍👧 café"])
def test_split_characters_stream_as_transformers(tokenizers: tuple[Tokenizer, Any], text: str) -> None:
    """Tokens put one at a time, a character's bytes split across them: the same pieces as transformers, one per
    put, none with a U+FFFD. Text ending in an incomplete character held back the words before it too (and put no
    piece) before."""
    ours, ref = tokenizers
    ids = ref.encode(text, add_special_tokens=False)
    assert any("\ufffd" in ref.decode(ids[:i]) for i in range(1, len(ids))), "no character split across tokens"
    calls = [torch.tensor([ids[:1]])] + [torch.tensor(ids[i : i + 1]) for i in range(1, len(ids))]  # [1, 1], [1]...
    want = _iterated(hf_streamers.TextIteratorStreamer(ref, skip_prompt=False), calls)
    got = _iterated(TextIteratorStreamer(ours, skip_prompt=False), calls)
    assert got == want
    assert "\ufffd" not in "".join(got)


# ---------------------------------------------------------------- generate(streamer=...) end to end


class _Recorder:
    """A streamer that keeps every ``put`` value's shape and ids, and ``"end"``."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], list[int]] | str] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append((tuple(value.shape), value.flatten().tolist()))

    def end(self) -> None:
        self.calls.append("end")


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[Any, Any]:
    """(kvgen's, transformers') model of the tiny directory, float32 and the same weights."""
    from kvgen.loader import load_model

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    return load_model(str(tiny_model_dir), dtype="float32")[0], ref.eval()


def _streamed(model: Any, ref_model: bool, ids: torch.Tensor, streamer: Any, settings: dict[str, Any],
              tokenizer: Any) -> torch.Tensor:
    """``sequences`` [1, T'] of one greedy ``generate`` with ``streamer``: transformers' when ``ref_model``."""
    if ref_model:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, tokenizer=tokenizer,
                                  pad_token_id=0, **settings)
    return generate(model, ids, streamer=streamer, tokenizer=tokenizer, pad_token_id=0, **settings).sequences


@pytest.mark.parametrize("settings", [
    {"max_new_tokens": 30},
    {"max_new_tokens": 30, "stop_strings": ["&"]},
    {"max_new_tokens": 12, "penalty_alpha": 0.6, "top_k": 4},
    {"max_new_tokens": 30, "prompt_lookup_num_tokens": 3},
    {"max_new_tokens": 30, "prompt_lookup_num_tokens": 3, "stop_strings": ["NN"]},
], ids=["greedy", "greedy-stop_strings", "contrastive", "prompt_lookup", "prompt_lookup-stop_strings"])
def test_generate_puts_and_streams_as_transformers(models: tuple[Any, Any], tokenizers: tuple[Tokenizer, Any],
                                                   settings: dict[str, Any]) -> None:
    """The put calls (the prompt [1, T], then [N] per step, or one [1, k] per prompt lookup step: transformers'
    ``streamer.put(valid_tokens)``), and the text pieces, equal transformers'. Prompt lookup put its accepted
    tokens one [1] at a time before, which flushed and yielded differently."""
    (ours, ref), (tok, ref_tok) = models, tokenizers
    ids = torch.tensor([ref_tok.encode("naïve café 3.14159, 1,000", add_special_tokens=False)])  # [1, T]
    settings = {"do_sample": False, **settings}
    want, got = _Recorder(), _Recorder()
    assert _streamed(ours, False, ids, got, settings, tok).tolist() == _streamed(
        ref, True, ids, want, settings, ref_tok).tolist()
    assert got.calls == want.calls
    if "prompt_lookup_num_tokens" in settings:
        assert any(c != "end" and c[0][-1] > 1 for c in want.calls[1:]), "no step put several tokens"
    ours_text = TextIteratorStreamer(tok, skip_prompt=True)
    ref_text = hf_streamers.TextIteratorStreamer(ref_tok, skip_prompt=True)
    _streamed(ours, False, ids, ours_text, settings, tok)
    _streamed(ref, True, ids, ref_text, settings, ref_tok)
    assert list(ours_text) == list(ref_text)
