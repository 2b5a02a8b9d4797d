"""kvgen.tokenizer against transformers' tokenizers on the same files.

The reference for every id, string and chat prompt is ``transformers`` (AutoTokenizer on
the default GGUF file, on HF directories, or its slow->fast converters), never a literal.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import regex
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GPT2TokenizerFast, LlamaTokenizerFast
from transformers.convert_slow_tokenizer import (
    GPT2Converter,
    Qwen2Converter,
    TikTokenConverter,
    bytes_to_unicode,
)
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

from kvgen import default_model
from kvgen.default_model import INSTALL_HINT, find_default_gguf
from kvgen.errors import ModelFormatError, ModelNotFoundError
from kvgen.tokenizer import (
    GGUF_PRE_TOKENIZERS,
    ByteLevelVariant,
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    build_byte_level_bpe,
)
from kvgen.weights.gguf_file import gguf_metadata, open_gguf

HARD_STRINGS = [
    "",
    " ",
    "Hello, world!",
    "Hello , world ! I 'm here",
    "naïve café résumé Ångström Straße",
    "中文字符测试，日本語のテキスト、한국어 문장",
    "עברית ומילים بالعربية مع أرقام ١٢٣",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ❤️",
    "   leading and   runs of    spaces   ",
    "\ttabs\tand\t\ttabs \t mixed",
    "windows\r\nline\r\nendings\r\n",
    "\n\n\nnewlines\n \n",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))",
    "numbers 0 12 345 6789 3.14159 -42 1e-5 1,000,000 x2y3",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "inline<|im_end|>special<|endoftext|>tokens <|im_start|>",
    "<not_special> <|im_start <|im_end|",
    "I'm we'll they've it's DON'T She'S",
    "zero\u200bwidth\u00a0nbsp e\u0301 combining",
    "a\x00b control \x07 chars \x7f",
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color. 🎨"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write 中文 and\ttabs\n  please."},
    ],
}

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. I'm sure it's 12345 times.",
    "def add(a, b):\n    return a + b\n\n\tprint(add(10, 20))",
    "naïve café résumé 中文字符测试 日本語 😀👍🏽 \r\n windows",
    "We'll see THE ISSUE they've had: 3.14159, 1,000,000 and 2024-05-01.",
]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return find_default_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def meta(gguf_path: Path) -> dict:
    return gguf_metadata(open_gguf(gguf_path))


@pytest.fixture(scope="session")
def ours(meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf(meta)


@pytest.fixture(scope="session")
def ref(gguf_path: Path) -> LlamaTokenizerFast:
    """transformers' tokenizer for the default GGUF.

    AutoTokenizer resolves this file to LlamaTokenizerFast (asserted below); naming the class
    skips AutoTokenizer's extra parse of the whole GGUF, about half of the load time.
    """
    return LlamaTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def ref_smollm(ref: LlamaTokenizerFast) -> BackendTokenizer:
    """transformers' tokenizer with SmolLM2's own tokenizer.json pre-tokenizer, Digits -> ByteLevel.

    transformers' GGUF loader drops the digit split that ``tokenizer.ggml.pre = "smollm"`` asks
    for; ASCII digits never merge in this vocabulary, but other numerals ("١٢٣") do.
    """
    backend = BackendTokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


def test_reference_is_the_class_autotokenizer_picks(meta: dict) -> None:
    assert TOKENIZER_MAPPING_NAMES[meta["general.architecture"]][1] == LlamaTokenizerFast.__name__


def _ref_decode(ref, ids: list[int], skip: bool) -> str:
    # transformers' GGUF loader sets clean_up_tokenization_spaces=True (" ," -> ","); the
    # file (and llama.cpp) does no clean-up, so compare with it off.
    return ref.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _train_byte_level(vocab_size: int = 700) -> BackendTokenizer:
    """A small byte-level BPE trained with the GPT-2 pre-tokenizer, 3 special tokens first."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAIN_TEXT * 4, trainer)
    return backend


@pytest.fixture(scope="session")
def trained() -> BackendTokenizer:
    return _train_byte_level()


def _save_gpt2_dir(trained: BackendTokenizer, directory: Path, legacy: bool, **config: object) -> Path:
    fast = GPT2TokenizerFast(
        tokenizer_object=trained, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ bos_token + m['role'] + '\n' + m['content'] + eos_token }}{% endfor %}"
    )
    fast.save_pretrained(directory, legacy_format=legacy)
    if config:
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return directory


# ---------------------------------------------------------------- GGUF: ids and decoding


def _has_non_ascii_numerals(text: str) -> bool:
    return any(c not in "0123456789" for c in regex.findall(r"\p{N}", text))


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_encode_matches_transformers(ours: Tokenizer, ref, ref_smollm: BackendTokenizer, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == ref_smollm.encode(text, add_special_tokens=False).ids
    if not _has_non_ascii_numerals(text):
        assert ids == ref.encode(text, add_special_tokens=False)


def test_non_ascii_numerals_follow_the_file_not_transformers(
    ours: Tokenizer, ref, ref_smollm: BackendTokenizer
) -> None:
    text = "أرقام ١٢٣ and ⅷ ٤٥"
    assert _has_non_ascii_numerals(text)
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == ref_smollm.encode(text, add_special_tokens=False).ids
    assert ids != ref.encode(text, add_special_tokens=False)  # transformers' GGUF loader lacks the digit split
    assert ours.decode(ids) == ref.decode(ref.encode(text, add_special_tokens=False)) == text


def test_add_special_tokens_follows_the_file(ours: Tokenizer, ref, meta: dict) -> None:
    assert ours.add_bos_token == meta["tokenizer.ggml.add_bos_token"]
    text = "Hello there"
    if meta["tokenizer.ggml.add_bos_token"]:
        assert ours.encode(text) == [ours.bos_token_id] + ours.encode(text, add_special_tokens=False)
    else:
        assert ours.encode(text) == ours.encode(text, add_special_tokens=False)
        # Known transformers difference: its GGUF loader prepends BOS although the file says not to.
        assert ref.encode(text)[0] == ref.bos_token_id
        assert ref.encode(text)[1:] == ours.encode(text)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("text", HARD_STRINGS)
def test_decode_matches_transformers(ours: Tokenizer, ref, text: str, skip: bool) -> None:
    ids = ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=skip) == _ref_decode(ref, ids, skip)
    if not skip:
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_special_ids_follow_the_file(ours: Tokenizer, ref, meta: dict) -> None:
    assert ours.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert ours.eos_token_id == meta["tokenizer.ggml.eos_token_id"]
    assert ours.eos_token_ids == [meta["tokenizer.ggml.eos_token_id"]]
    assert ours.pad_token_id == meta["tokenizer.ggml.padding_token_id"]
    control = [i for i, kind in enumerate(meta["tokenizer.ggml.token_type"]) if kind == 3]
    assert ours.all_special_ids == control
    assert ours.all_special_ids == sorted(i for i, t in ref.added_tokens_decoder.items() if t.special)


def test_vocab_matches_transformers(ours: Tokenizer, ref, meta: dict) -> None:
    assert ours.vocab_size == len(ref) == len(meta["tokenizer.ggml.tokens"])
    for i in (0, 1, 2, 100, 1000, ours.vocab_size - 1):
        assert ours.id_to_token(i) == ref.convert_ids_to_tokens(i)
        assert ours.token_to_id(ours.id_to_token(i)) == i
    assert ours.token_to_id("not a token at all") is None


# ---------------------------------------------------------------- GGUF: chat template


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(ours: Tokenizer, ref, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)


def test_chat_template_without_template_raises(meta: dict) -> None:
    bare = Tokenizer.from_gguf({k: v for k, v in meta.items() if k != "tokenizer.chat_template"})
    assert bare.chat_template is None
    with pytest.raises(ModelFormatError, match="has no chat template"):
        bare.apply_chat_template(CONVERSATIONS["single"])


def test_chat_template_errors_are_chat_template_errors(meta: dict, ours: Tokenizer) -> None:
    strict = Tokenizer.from_gguf({**meta, "tokenizer.chat_template": "{{ raise_exception('roles must alternate') }}"})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.apply_chat_template(CONVERSATIONS["single"])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be a dict with a string 'role'"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}, {"content": "no role"}])
    broken = Tokenizer.from_gguf({**meta, "tokenizer.chat_template": "{% for m in messages %}"})
    with pytest.raises(ModelFormatError, match="chat template does not compile"):
        broken.apply_chat_template(CONVERSATIONS["single"])


# ---------------------------------------------------------------- GGUF: bad metadata


def test_unsupported_tokenizer_model_raises(meta: dict) -> None:
    with pytest.raises(ModelFormatError, match="unsupported GGUF tokenizer model tokenizer.ggml.model='llama'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.model": "llama"})


def test_unsupported_pre_tokenizer_and_missing_fields_raise(meta: dict) -> None:
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.pre='mystery'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ModelFormatError, match="GGUF metadata has no tokenizer.ggml.merges"):
        Tokenizer.from_gguf({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    num_tokens = len(meta["tokenizer.ggml.tokens"])
    with pytest.raises(ModelFormatError, match=rf"tokenizer.ggml.eos_token_id must be in \[0, {num_tokens}\)"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.eos_token_id": num_tokens})


def test_decode_rejects_out_of_range_ids(ours: Tokenizer) -> None:
    with pytest.raises(ValueError, match=rf"token id must be in \[0, {ours.vocab_size}\), got {ours.vocab_size}"):
        ours.decode([1, ours.vocab_size])
    with pytest.raises(ValueError, match=r"got -1"):
        IncrementalDetokenizer(ours).add(-1)


# ---------------------------------------------------------------- byte-level variants


def _synthetic_meta(trained: BackendTokenizer, pre: str) -> dict:
    model = json.loads(trained.to_str())["model"]
    tokens = [trained.id_to_token(i) for i in range(trained.get_vocab_size())]
    specials = {t.content for t in trained.get_added_tokens_decoder().values()}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
        "tokenizer.ggml.merges": [" ".join(m) for m in model["merges"]],
        "tokenizer.ggml.eos_token_id": trained.token_to_id("<|im_end|>"),
    }


def test_user_defined_tokens_are_matched_and_kept_by_decode(trained: BackendTokenizer) -> None:
    meta = _synthetic_meta(trained, "gpt2")
    tokens, plain = meta["tokenizer.ggml.tokens"], Tokenizer.from_gguf(meta)
    candidates = [(i, c) for i, t in enumerate(tokens) if len(t) > 3 and t.isascii() and t.isalpha() for c in "aeiost"]
    # A token that plain BPE does not produce inside "{c}{token}{c}": glued to letters that merge first.
    user_id, c = next((i, c) for i, c in candidates if i not in plain.encode(f"{c}{tokens[i]}{c}"))
    text = f"{c}{tokens[user_id]}{c}<|im_end|>"
    meta["tokenizer.ggml.token_type"][user_id] = 4  # USER_DEFINED: matched whole, printed by decode
    ours = Tokenizer.from_gguf(meta)
    ids = ours.encode(text, add_special_tokens=False)
    assert user_id in ids and user_id not in ours.all_special_ids
    assert ours.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")


def _reference_backend(variant: ByteLevelVariant, trained: BackendTokenizer) -> BackendTokenizer:
    """The backend transformers' slow->fast converter builds for this variant."""
    vocab = trained.get_vocab(with_added_tokens=False)
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    stub = SimpleNamespace(add_prefix_space=False, add_bos_token=False)
    if variant is ByteLevelVariant.GPT2:
        backend = GPT2Converter(stub).converted(vocab=vocab, merges=merges)
    elif variant is ByteLevelVariant.QWEN2:
        backend = Qwen2Converter(stub).converted(vocab=vocab, merges=merges)
    else:

        class _Llama3(TikTokenConverter):
            def tokenizer(self) -> BackendTokenizer:
                backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False))
                backend.model.ignore_merges = True
                return backend

        backend = _Llama3(additional_special_tokens=[]).converted()
    backend.add_special_tokens([t for t in trained.get_added_tokens_decoder().values()])
    return backend


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_variants_match_transformers_converters(trained: BackendTokenizer, pre: str) -> None:
    ours = Tokenizer.from_gguf(_synthetic_meta(trained, pre))
    reference = _reference_backend(GGUF_PRE_TOKENIZERS[pre], trained)
    for text in HARD_STRINGS + TRAIN_TEXT:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False)


def _llama_cpp_digit_split(text: str) -> list[str]:
    """llama.cpp's SMOLLM pre-tokenizer: "\\p{N}" isolates each digit, then the GPT-2 regex per piece."""
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    # llama.cpp keeps the text between matches as pieces of its own.
    return [w for p in pieces for w in regex.split(f"({gpt2})", p) if w]


def test_digit_variant_splits_like_llama_cpp() -> None:
    pre_tokenizer = build_byte_level_bpe({}, [], GGUF_PRE_TOKENIZERS["smollm"]).pre_tokenizer
    byte_chars = bytes_to_unicode()
    for text in HARD_STRINGS + TRAIN_TEXT:
        expected = ["".join(byte_chars[b] for b in w.encode()) for w in _llama_cpp_digit_split(text)]
        words = [w for w, _ in pre_tokenizer.pre_tokenize_str(text)]
        assert words == expected, text


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("legacy", [False, True], ids=["tokenizer_json", "vocab_merges"])
def test_gpt2_directory_matches_transformers(trained: BackendTokenizer, tmp_path: Path, legacy: bool) -> None:
    directory = _save_gpt2_dir(trained, tmp_path, legacy)
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
    directory = _save_gpt2_dir(trained, tmp_path, legacy=True, add_bos_token=True)
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


# ---------------------------------------------------------------- incremental detokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_stream_never_splits_a_character(ours: Tokenizer, ref) -> None:
    text = "👨‍👩‍👧‍👦 中文字符 🇫🇷 naïve ok! 日本語"
    ids = ours.encode(text, add_special_tokens=False)
    assert any("\ufffd" in ref.decode([i]) for i in ids)  # some tokens hold half a character
    detok = IncrementalDetokenizer(ours)
    pieces = _stream(detok, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == detok.text == _ref_decode(ref, ids, skip=True) == text
    assert detok.token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_stream_after_prompt_matches_decode(ours: Tokenizer, ref, skip: bool) -> None:
    prompt = ours.apply_chat_template(CONVERSATIONS["system"], add_generation_prompt=True, tokenize=True)
    ids = ours.encode("  Hello there! 你好 🌍\n\tcode<|im_end|>\n<|im_start|>x", add_special_tokens=False)
    pieces = _stream(IncrementalDetokenizer(ours, prompt, skip_special_tokens=skip), ids)
    assert "".join(pieces) == _ref_decode(ref, ids, skip)
    chunked = IncrementalDetokenizer(ours, prompt, skip_special_tokens=skip)
    assert chunked.add(ids[:7]) + chunked.add(ids[7:]) + chunked.flush() == "".join(pieces)


def test_stream_of_random_ids_matches_decode(ours: Tokenizer, ref) -> None:
    """Arbitrary ids (stray UTF-8 bytes, specials, prompts ending mid-character) still add up."""
    rng = random.Random(0)
    byte_ids = [i for i in range(ours.vocab_size) if len(ref.convert_ids_to_tokens(i)) == 1][:256]
    for _ in range(60):
        ids = [rng.choice(byte_ids) if rng.random() < 0.4 else rng.randrange(ours.vocab_size) for _ in range(40)]
        prompt = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(8))]
        skip = rng.random() < 0.5
        pieces = _stream(IncrementalDetokenizer(ours, prompt, skip_special_tokens=skip), ids)
        assert "".join(pieces) == _ref_decode(ref, ids, skip)


def test_flush_emits_an_unfinished_character(ours: Tokenizer, ref) -> None:
    partial = ours.encode("ok 👨", add_special_tokens=False)[:-1]  # the emoji spans several tokens
    assert ref.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(ours)
    streamed = detok.add(partial)
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert streamed + tail == detok.text == _ref_decode(ref, partial, skip=True)


def test_stream_decodes_a_bounded_window(ours: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    windows: list[int] = []
    original = IncrementalDetokenizer._decode

    def recording(self: IncrementalDetokenizer, start: int, end: int) -> str:
        windows.append(end - start)
        return original(self, start, end)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode", recording)
    ids = ours.encode(" ".join(HARD_STRINGS) * 5, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, list(range(100)))
    assert "".join(_stream(detok, ids)) == ours.decode(ids, skip_special_tokens=True)
    assert len(ids) > 500 and max(windows) <= 12


# ---------------------------------------------------------------- default model locator


def test_find_default_gguf_finds_the_file(gguf_path: Path) -> None:
    assert gguf_path.is_file() and gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_find_default_gguf_missing_gives_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setattr(default_model.site, "getsitepackages", list)
    monkeypatch.setattr(default_model.site, "getusersitepackages", lambda: str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=INSTALL_HINT):
        find_default_gguf()
