"""kvgen.tokenizer.gguf_vocab: backends rebuilt from GGUF metadata against transformers' converters."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import finish_gguf
from tokenizer_cases import HARD_STRINGS, TRAIN_TEXT
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models
from transformers import LlamaTokenizerFast
from transformers.convert_slow_tokenizer import (
    GPT2Converter,
    Qwen2Converter,
    TikTokenConverter,
)

from kvgen.errors import ModelFormatError
from kvgen.tokenizer import GGUF_PRE_TOKENIZERS, ByteLevelVariant, Tokenizer


def test_unsupported_tokenizer_model_raises(meta: dict) -> None:
    with pytest.raises(ModelFormatError, match="unsupported GGUF tokenizer model tokenizer.ggml.model='bert'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.model": "bert"})


def test_unsupported_pre_tokenizer_and_missing_fields_raise(meta: dict) -> None:
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.pre='mystery'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ModelFormatError, match="GGUF metadata has no tokenizer.ggml.merges"):
        Tokenizer.from_gguf({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    merges = list(meta["tokenizer.ggml.merges"])
    merges[7] = "a b c"
    with pytest.raises(ModelFormatError, match=r"tokenizer.ggml.merges\[7\] must be two tokens and a space, got 'a b c'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.merges": merges})
    num_tokens = len(meta["tokenizer.ggml.tokens"])
    with pytest.raises(ModelFormatError, match=rf"tokenizer.ggml.eos_token_id must be in \[0, {num_tokens}\)"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.eos_token_id": num_tokens})


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


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smaug-bpe"])  # smaug-bpe: SmolLM3's, Llama 3's rules
def test_variants_match_transformers_converters(trained: BackendTokenizer, pre: str) -> None:
    ours = Tokenizer.from_gguf(_synthetic_meta(trained, pre))
    reference = _reference_backend(GGUF_PRE_TOKENIZERS[pre], trained)
    for text in HARD_STRINGS + TRAIN_TEXT:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False)


# ---------------------------------------------------------------- GPT-4o / o200k ("gpt-4o": gpt-oss, Phi-4)

# tiktoken's o200k_base pattern as the Split of gpt-oss's tokenizer.json holds it (written out here, not imported)
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|"
    r"\s*[\r\n]+|"
    r"\s+(?!\S)|"
    r"\s+"
)
O200K_STRINGS = [
    "they're here, DON'T stop; she'LL say we've I'm don't",  # contractions stay on their word
    "HelloWorld getHTTPResponseCode XMLHttpRequest iPhone McDonald's ÉcoleNormale",  # CamelCase splits
    "1234567 12 345 6789012 3.14159 1,000,000",  # digits in threes
    "wait...!!! ?! --> ==> a/b//c path/to/file.txt)\r\n",  # punctuation runs
    "line1\n\nline2\r\n\tindent\n   \n  trailing  ",  # newlines and spaces
    "Straße ÅNGSTRÖM Ελληνικά ΑΒΓδε Привет мир नमस्ते 中文字符 日本語テキスト",  # letters of other scripts, marks
]


def _o200k_trained() -> BackendTokenizer:
    """A byte-level BPE trained on whole lines (no pre-split), so its tokens cross the o200k pieces' boundaries and
    any other split of the same text encodes differently."""
    from tokenizers import decoders, pre_tokenizers, trainers

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator((O200K_STRINGS + TRAIN_TEXT) * 4, trainer)
    return backend


def test_gpt4o_vocabulary_splits_as_o200k_and_matches_transformers() -> None:
    """``tokenizer.ggml.pre = "gpt-4o"`` (llama.cpp's GPT4O, gpt-oss's files): pieces as the o200k pattern cuts them
    (CamelCase, contractions kept, digits in threes), and ids equal the backend transformers builds for such a
    tokenizer.json (TikTokenConverter: that Split, then ByteLevel without its regex) on tricky strings; the Llama 3
    rules cut some of them otherwise, so another variant would not pass."""
    trained = _o200k_trained()
    meta = _synthetic_meta(trained, "gpt-4o")
    ours = Tokenizer.from_gguf(meta)
    vocab = trained.get_vocab(with_added_tokens=False)
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]

    class _O200k(TikTokenConverter):
        def tokenizer(self) -> BackendTokenizer:  # TikTokenConverter's, from these merges instead of a tiktoken file
            backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False))
            backend.model.ignore_merges = True  # a whole piece in the vocabulary is one token (tiktoken's shortcut)
            return backend

    reference = _O200k(pattern=O200K_PATTERN, additional_special_tokens=[]).converted()
    reference.add_special_tokens([t for t in trained.get_added_tokens_decoder().values()])
    for text in O200K_STRINGS + HARD_STRINGS + TRAIN_TEXT:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False)

    def pieces(pre: str, text: str) -> list[str]:
        from kvgen.tokenizer.gguf_vocab import gguf_backend

        pre_tokenizer = gguf_backend(meta | {"tokenizer.ggml.pre": pre}).pre_tokenizer
        assert pre_tokenizer is not None
        return [p for p, _ in pre_tokenizer.pre_tokenize_str(text)]

    assert pieces("gpt-4o", "getHTTPResponseCode they're 1234567") == [
        "get", "HTTPResponse", "Code", "Ġthey're", "Ġ", "123", "456", "7"]
    assert pieces("llama-bpe", "getHTTPResponseCode they're") == ["getHTTPResponseCode", "Ġthey", "'re"]
    llama3 = Tokenizer.from_gguf(meta | {"tokenizer.ggml.pre": "llama-bpe"})
    differ = [t for t in O200K_STRINGS
              if llama3.encode(t, add_special_tokens=False) != ours.encode(t, add_special_tokens=False)]
    assert len(differ) >= 3, differ
    assert all(GGUF_PRE_TOKENIZERS[name] is ByteLevelVariant.GPT4O for name in ("gpt-4o", "llama4"))


# ---------------------------------------------------------------- SentencePiece BPE ("llama")


def _sentencepiece_meta() -> dict:
    """An SPM-style GGUF vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then "▁"-pieces of a BPE trained on
    TRAIN_TEXT, each scored by its rank (earlier pieces merge first), as llama.cpp's "llama" model stores them."""
    from tokenizers import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(TRAIN_TEXT, vocab_size=400, min_frequency=1, show_progress=False)
    head = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    pieces = [t for t in (trained.id_to_token(i) for i in range(trained.get_vocab_size())) if t not in head]
    tokens = [*head, *pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }


def test_sentencepiece_vocabularies_match_transformers_gguf_converter() -> None:
    from transformers.integrations.ggml import GGUFLlamaConverter

    meta = _sentencepiece_meta()
    ours = Tokenizer.from_gguf(meta)
    fields = {k.removeprefix("tokenizer.ggml."): v for k, v in meta.items()}
    reference = GGUFLlamaConverter({**fields, "unk_token_id": 0}).converted()
    for text in HARD_STRINGS + TRAIN_TEXT + ["  two spaces", "\ttab\nnewline", "<s> literal"]:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False), text
    ids = ours.encode("Hello 🦙")  # BOS first; the emoji (not in the training text) falls back to its UTF-8 bytes
    assert ids[0] == 1 and {meta["tokenizer.ggml.tokens"].index(f"<0x{b:02X}>") for b in "🦙".encode()} <= set(ids)
    assert ours.decode(ids, skip_special_tokens=True) == "Hello 🦙"
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores has 3 entries"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.scores": [0.0] * 3})


def test_gemma_style_sentencepiece_vocabulary_has_no_prefix_space() -> None:
    """A Gemma 3 GGUF vocabulary (llama.cpp's converter: SentencePiece "llama" model, add_space_prefix false, turn
    markers as control tokens) builds on the SentencePiece path: no "▁" is prepended, spaces inside the text become
    "▁", the turn markers stay single special tokens, and decode gives the text back."""
    meta = _sentencepiece_meta()
    tokens = [*meta["tokenizer.ggml.tokens"], "<start_of_turn>", "<end_of_turn>"]
    meta |= {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [*meta["tokenizer.ggml.scores"], 0.0, 0.0],
             "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], 3, 3],
             "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}
    ours = Tokenizer.from_gguf(meta)
    with_prefix = Tokenizer.from_gguf(meta | {"tokenizer.ggml.add_space_prefix": True})
    text = "<start_of_turn>user\nThe quick brown fox<end_of_turn>"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids[0] == tokens.index("<start_of_turn>") and ids[-1] == tokens.index("<end_of_turn>")
    assert ours.decode(ids) == text
    plain = ours.encode("quick fox", add_special_tokens=False)
    assert not tokens[plain[0]].startswith("▁") and any(tokens[i].startswith("▁") for i in plain[1:])
    assert tokens[with_prefix.encode("quick fox", add_special_tokens=False)[0]].startswith("▁")


def _write_vocab_gguf(path: Path, meta: dict) -> Path:
    """A GGUF file holding ``meta``'s tokenizer fields, llama's shape keys and no tensors: enough for transformers'
    GGUF tokenizer and llama.cpp's ``vocab_only`` load."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    finish_gguf(w)
    return path


UNK_TEXTS = ["a<unk>b", "<unk>", " <unk> the fox", "Hello<unk>\n<unk>"]


def test_unknown_token_is_special_as_in_transformers_gguf_tokenizer(tmp_path: Path) -> None:
    """The UNKNOWN-typed "<unk>" of a SentencePiece GGUF is a special token: its text in a prompt is its id, and
    ``skip_special_tokens`` drops it, as transformers' tokenizer for the same file (and llama.cpp) do."""
    meta = _sentencepiece_meta()
    path = _write_vocab_gguf(tmp_path / "spm.gguf", meta)
    ref = LlamaTokenizerFast.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer.from_gguf(meta)
    for text in UNK_TEXTS:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    ids = [0, *ours.encode("The quick fox", add_special_tokens=False), 0]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), skip
    assert ref.unk_token_id == 0 and 0 in ours.all_special_ids


def test_unknown_token_is_special_as_in_llama_cpp(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    meta = _sentencepiece_meta()
    path = _write_vocab_gguf(tmp_path / "spm.gguf", meta)
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf(meta)
    for text in UNK_TEXTS:
        assert ours.encode(text, add_special_tokens=False) == ref.tokenize(text.encode(), add_bos=False, special=True)
    ids = [0, *ours.encode("The quick fox", add_special_tokens=False), 0]
    # llama.cpp keeps the prefix space of "▁The" after a hidden token, transformers' decoder (kvgen's) strips it
    assert ours.decode(ids, skip_special_tokens=True) == ref.detokenize(ids, special=False).decode().removeprefix(" ")
    assert ours.decode(ids) == ref.detokenize(ids, special=True).decode()


def _without_add_bos_token(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k != "tokenizer.ggml.add_bos_token"}


def test_sentencepiece_file_without_add_bos_token_gets_bos_as_transformers(tmp_path: Path) -> None:
    """A SentencePiece GGUF without ``tokenizer.ggml.add_bos_token`` (Llama 2 files converted before the key existed)
    prepends BOS, as transformers' tokenizer for that file does (and llama.cpp: its SPM default); one saying false
    gets none."""
    meta = _without_add_bos_token(_sentencepiece_meta())
    path = _write_vocab_gguf(tmp_path / "spm.gguf", meta)
    ref = LlamaTokenizerFast.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer.from_gguf(meta)
    for text in ["", "Hello world", *TRAIN_TEXT]:
        assert ours.encode(text) == ref.encode(text), text
    assert ours.add_bos_token
    assert not Tokenizer.from_gguf(meta | {"tokenizer.ggml.add_bos_token": False}).add_bos_token


def test_llama3_file_without_add_bos_token_gets_bos_as_transformers(tmp_path: Path, trained: BackendTokenizer) -> None:
    """The same for a byte-level GGUF with a Llama 3 pre-tokenizer ("llama-bpe"); other pre-tokenizers add none
    (llama.cpp's defaults, checked against it below)."""
    meta = _without_add_bos_token(_synthetic_meta(trained, "llama-bpe")) | {"tokenizer.ggml.bos_token_id": 1}
    path = _write_vocab_gguf(tmp_path / "bpe.gguf", meta)
    ref = LlamaTokenizerFast.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer.from_gguf(meta)
    for text in ["", "Hello world", *TRAIN_TEXT]:
        assert ours.encode(text)[:1] == ref.encode(text)[:1] == [1], text
    assert not Tokenizer.from_gguf(meta | {"tokenizer.ggml.pre": "gpt-2"}).add_bos_token


@pytest.mark.parametrize("pre", ["spm", "llama-bpe", "gpt-2", "smollm"])
def test_bos_without_add_bos_token_follows_llama_cpp(tmp_path: Path, trained: BackendTokenizer, pre: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    if pre == "spm":
        meta = _without_add_bos_token(_sentencepiece_meta())
    else:
        meta = _without_add_bos_token(_synthetic_meta(trained, pre)) | {"tokenizer.ggml.bos_token_id": 1}
    ref = llama_cpp.Llama(str(_write_vocab_gguf(tmp_path / "v.gguf", meta)), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf(meta)
    for text in ["", "Hello world", *TRAIN_TEXT]:
        assert ours.encode(text) == ref.tokenize(text.encode(), add_bos=True, special=True), text


def test_added_tokens_with_latin1_text_decode_as_llama_cpp(tmp_path: Path, trained: BackendTokenizer) -> None:
    """A byte-level GGUF stores added tokens as plain text (llama.cpp's converter pre-normalizes them): a USER_DEFINED
    "café" or "ñandú" and a CONTROL "<|é|>" decode to that text, as llama.cpp prints them, not through the byte-level
    decoder (which read "é" as the lone byte 0xE9: "caf\ufffd"); they are matched in text as before."""
    llama_cpp = pytest.importorskip("llama_cpp")
    meta = _synthetic_meta(trained, "smollm")
    added = {"café": 4, "ñandú": 4, "<|é|>": 3}
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *added]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *added.values()]
    ref = llama_cpp.Llama(str(_write_vocab_gguf(tmp_path / "v.gguf", meta)), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf(meta)
    for text in ["café", "un café<|é|>ñandúx", "The café<|im_end|>\ncafé 😀<|é|>"]:
        ids = ref.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == ref.detokenize(ids, special=True).decode(), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.detokenize(ids, special=False).decode(), text


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_unused_tokens_decode_to_nothing_as_llama_cpp(tmp_path: Path, trained: BackendTokenizer, model: str) -> None:
    """The UNUSED "[PAD{i}]" rows llama.cpp's converter pads a vocabulary with (Qwen2.5's 271) decode to nothing, as
    llama.cpp prints them (and as transformers skips ids past a tokenizer's vocabulary); kvgen printed "[PAD628]"."""
    llama_cpp = pytest.importorskip("llama_cpp")
    meta = _synthetic_meta(trained, "smollm") if model == "gpt2" else _sentencepiece_meta()
    num_tokens = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], f"[PAD{num_tokens}]", f"[PAD{num_tokens + 1}]"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 5, 5]
    if model == "llama":
        meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], 0.0, 0.0]
    ref = llama_cpp.Llama(str(_write_vocab_gguf(tmp_path / "v.gguf", meta)), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf(meta)
    words = ours.encode("The quick café", add_special_tokens=False)
    ids = [*words[:1], num_tokens, *words[1:], num_tokens + 1, num_tokens]
    for skip in (False, True):
        # llama.cpp's token_to_piece keeps the "▁" of a SentencePiece text's first piece; its decode strips it, as kvgen
        expected = ref.detokenize(ids, special=not skip).decode().removeprefix(" ")
        assert ours.decode(ids, skip_special_tokens=skip) == expected == "The quick café"
    assert ours.decode([num_tokens]) == ref.detokenize([num_tokens], special=True).decode() == ""


@pytest.mark.parametrize("pre", ["deepseek-r1-qwen", "falcon3", "pixtral", "phi-2", "mpt", "olmo", "jais", "gigachat",
                                 "command-r", "codeshell", "exaone"])
def test_llama_cpps_other_pre_tokenizer_names_encode_as_llama_cpp(tmp_path: Path, trained: BackendTokenizer,
                                                                   pre: str) -> None:
    """llama.cpp gives these names the split rules of a group kvgen has (``llama-vocab.cpp``: LLAMA3 with BOS by
    default, QWEN2, GPT2, the digit-first STARCODER/SMOLLM/COMMAND_R/CODESHELL/EXAONE); they were refused as unknown
    (DeepSeek-R1-Distill-Qwen's GGUF files among them). Encoded as llama.cpp does on the same file, BOS included when
    the file has no add_bos_token."""
    llama_cpp = pytest.importorskip("llama_cpp")
    meta = _without_add_bos_token(_synthetic_meta(trained, pre)) | {"tokenizer.ggml.bos_token_id": 1}
    ref = llama_cpp.Llama(str(_write_vocab_gguf(tmp_path / "v.gguf", meta)), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf(meta)
    # llama.cpp does not NFC-normalize Qwen2's text (transformers does, and kvgen with it): no combining marks here
    for text in [t for t in HARD_STRINGS + TRAIN_TEXT if unicodedata.normalize("NFC", t) == t]:
        assert ours.encode(text) == ref.tokenize(text.encode(), add_bos=True, special=True), (pre, text)
