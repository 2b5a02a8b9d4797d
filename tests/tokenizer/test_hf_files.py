"""kvgen.tokenizer.hf_files: tokenizers of Hugging Face directories against transformers' AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_cases import CONVERSATIONS, HARD_STRINGS, save_gpt2_dir
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoTokenizer

from kvgen.errors import ModelFormatError, ModelNotFoundError
from kvgen.tokenizer import Tokenizer


@pytest.mark.parametrize("legacy", [False, True], ids=["tokenizer_json", "vocab_merges"])
def test_gpt2_directory_matches_transformers(trained: BackendTokenizer, tmp_path: Path, legacy: bool) -> None:
    directory = save_gpt2_dir(trained, tmp_path, legacy)
    assert (directory / "tokenizer.json").exists() != legacy
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    for text in HARD_STRINGS:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.encode(text) == ref.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.pad_token_id == ref.eos_token_id  # no pad token: falls back to EOS
    messages = CONVERSATIONS["multi_turn"]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False)


def test_gpt2_directory_add_bos_token_and_config_template(trained: BackendTokenizer, tmp_path: Path) -> None:
    directory = save_gpt2_dir(trained, tmp_path, legacy=True, add_bos_token=True)
    template = (directory / "chat_template.jinja").read_text()
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.add_bos_token
    for text in HARD_STRINGS:
        assert ours.encode(text) == ref.encode(text)
    messages = CONVERSATIONS["system"]
    assert ours.apply_chat_template(messages, tokenize=True) == ref.apply_chat_template(messages, tokenize=True)


def test_saved_gguf_tokenizer_directory_matches_transformers(ref, tmp_path: Path) -> None:
    ref.save_pretrained(tmp_path)
    ours, reloaded = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in HARD_STRINGS:
        assert ours.encode(text) == reloaded.encode(text)
    assert ours.add_bos_token  # transformers saved its BOS-adding post-processor
    messages = CONVERSATIONS["system"]
    expected = reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected


def test_bad_directories_raise(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="tokenizer directory not found: .*missing"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(ModelFormatError, match=f"{tmp_path} has no tokenizer.json and no vocab.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="cannot read .*tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
