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
