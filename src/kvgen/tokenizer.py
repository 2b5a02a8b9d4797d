"""Text <-> token ids: one ``Tokenizer`` over the Hugging Face ``tokenizers`` library.

Builds byte-level BPE tokenizers from GGUF metadata (llama.cpp's "gpt2" tokenizer
model) or from a Hugging Face directory, renders chat templates with jinja2 as
``transformers`` does, and detokenizes a stream of ids incrementally as vLLM does.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as BackendTokenizer

from kvgen.chat_template import ChatTemplateError, check_messages, compile_chat_template
from kvgen.errors import ModelFormatError, ModelNotFoundError


class GGUFTokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class ByteLevelVariant(enum.Enum):
    """How a byte-level BPE normalizes and splits text before merging."""

    GPT2 = "gpt2"  # GPT-2 regex
    DIGITS = "digits"  # every digit alone, then the GPT-2 regex (SmolLM, StarCoder)
    LLAMA3 = "llama3"  # Llama 3 regex; a word that is in the vocabulary skips merging
    QWEN2 = "qwen2"  # NFC, then the Qwen2 regex


# ``tokenizer.ggml.pre`` -> variant; names and groups as in llama.cpp's llama-vocab.cpp.
GGUF_PRE_TOKENIZERS: dict[str, ByteLevelVariant] = {
    "default": ByteLevelVariant.GPT2,
    "gpt2": ByteLevelVariant.GPT2,
    "gpt-2": ByteLevelVariant.GPT2,
    "smollm": ByteLevelVariant.DIGITS,
    "starcoder": ByteLevelVariant.DIGITS,
    "refact": ByteLevelVariant.DIGITS,
    "llama-bpe": ByteLevelVariant.LLAMA3,
    "llama3": ByteLevelVariant.LLAMA3,
    "llama-v3": ByteLevelVariant.LLAMA3,
    "qwen2": ByteLevelVariant.QWEN2,
}

# Split patterns of the models' own tokenizer.json files (Meta Llama 3, Qwen2).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Prompt tokens decoded before the first new one (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET), for spacing that depends on context.
DETOKENIZE_CONTEXT_TOKENS = 5


def _gpt2_byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_PRE_TOKENIZERS = {
    ByteLevelVariant.GPT2: _gpt2_byte_level,
    ByteLevelVariant.DIGITS: lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_byte_level()]
    ),
    ByteLevelVariant.LLAMA3: lambda: _split_then_byte_level(LLAMA3_PATTERN),
    ByteLevelVariant.QWEN2: lambda: _split_then_byte_level(QWEN2_PATTERN),
}


def build_byte_level_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], variant: ByteLevelVariant
) -> BackendTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` (no prefix space, no post-processor).

    Source: the tokenizer.json files of GPT-2, SmolLM2, Llama 3 and Qwen2, as transformers'
    GPT2Converter, TikTokenConverter (``ignore_merges``) and Qwen2Converter (NFC) build them.
    """
    model = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=variant is ByteLevelVariant.LLAMA3)
    backend = BackendTokenizer(model)
    if variant is ByteLevelVariant.QWEN2:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _PRE_TOKENIZERS[variant]()
    backend.decoder = decoders.ByteLevel()
    return backend


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids of the tokens with a role; ``eos_token_ids[0]`` is the primary EOS."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    unk_token_id: int | None = None


def _check_token_ids(token_ids: Iterable[int], vocab_size: int) -> None:
    for i in token_ids:
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id must be in [0, {vocab_size}), got {i}")


def _add_bos_eos(backend: BackendTokenizer, bos: int | None, eos: int | None, add_bos: bool, add_eos: bool) -> None:
    """Install a post-processor adding BOS and/or EOS when ``encode(add_special_tokens=True)``."""
    if add_bos and bos is None:
        raise ModelFormatError("tokenizer asks to add a BOS token but has no bos token id")
    if add_eos and eos is None:
        raise ModelFormatError("tokenizer asks to add an EOS token but has no eos token id")
    bos_ids = [bos] if add_bos else []
    eos_ids = [eos] if add_eos else []
    if not bos_ids and not eos_ids:
        return
    name = backend.id_to_token
    single = [name(i) for i in bos_ids] + ["$A"] + [name(i) for i in eos_ids]
    special = [(name(i), i) for i in dict.fromkeys(bos_ids + eos_ids)]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)


# ---------------------------------------------------------------- GGUF


def _gguf_require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"GGUF metadata has no {key}")
    return meta[key]


def _gguf_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ")) for m in merges]
    for i, pair in enumerate(pairs):
        if len(pair) != 2:
            raise ModelFormatError(f"tokenizer.ggml.merges[{i}] must be two tokens and a space, got {merges[i]!r}")
    return pairs  # type: ignore[return-value]


def _gguf_vocab(meta: dict[str, Any]) -> tuple[list[str], list[int]]:
    tokens: list[str] = _gguf_require(meta, "tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [GGUFTokenType.NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise ModelFormatError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    if len(set(tokens)) != len(tokens):
        raise ModelFormatError(f"tokenizer.ggml.tokens has {len(tokens) - len(set(tokens))} duplicate tokens")
    return tokens, token_types


def _gguf_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """CONTROL tokens become special added tokens; USER_DEFINED ones added tokens kept by decode (as llama.cpp)."""
    model = _gguf_require(meta, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelFormatError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; kvgen reads 'gpt2' (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ModelFormatError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {sorted(GGUF_PRE_TOKENIZERS)}"
        )
    tokens, token_types = _gguf_vocab(meta)
    merges = _gguf_merges(_gguf_require(meta, "tokenizer.ggml.merges"))
    backend = build_byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges, GGUF_PRE_TOKENIZERS[pre])
    typed = list(zip(tokens, token_types))
    control = [AddedToken(t, special=True, normalized=False) for t, k in typed if k == GGUFTokenType.CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in typed if k == GGUFTokenType.USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    return backend


def _gguf_special_ids(meta: dict[str, Any], vocab_size: int) -> SpecialTokenIds:
    keys = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id", "unknown_token_id")
    ids = {k: meta.get(f"tokenizer.ggml.{k}") for k in keys}
    for key, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise ModelFormatError(f"tokenizer.ggml.{key} must be in [0, {vocab_size}), got {token_id}")
    eos = (ids["eos_token_id"], ids["eot_token_id"], ids["eom_token_id"])
    eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    return SpecialTokenIds(ids["bos_token_id"], eos_ids, ids["padding_token_id"], ids["unknown_token_id"])


# ---------------------------------------------------------------- Hugging Face directory


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from None


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json, overridden by special_tokens_map.json as in transformers."""
    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (directory / name).is_file():
            config.update(_read_json(directory / name))
    return config


def _hf_added_tokens(config: dict[str, Any]) -> list[AddedToken]:
    """``added_tokens_decoder`` entries, then the named special tokens."""
    added = []
    for _, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
        fields = {k: entry[k] for k in ("special", "normalized", "lstrip", "rstrip", "single_word") if k in entry}
        added.append(AddedToken(entry["content"], **fields))
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    strings = [_token_content(config.get(n)) for n in names]
    strings += [_token_content(t) for t in config.get("additional_special_tokens", [])]
    return added + [AddedToken(s, special=True, normalized=False) for s in strings if s]


def _gpt2_files_backend(directory: Path, config: dict[str, Any]) -> BackendTokenizer:
    """GPT-2 style ``vocab.json`` + ``merges.txt``, as transformers' GPT2Converter builds it."""
    try:
        vocab, merges = models.BPE.read_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
    except Exception as e:  # tokenizers raises plain Exception for unreadable files
        raise ModelFormatError(f"cannot read vocab.json/merges.txt in {directory}: {e}") from None
    backend = build_byte_level_bpe(vocab, merges, ByteLevelVariant.GPT2)
    if config.get("add_prefix_space"):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    if (directory / "added_tokens.json").is_file():
        backend.add_tokens(list(_read_json(directory / "added_tokens.json")))
    for token in _hf_added_tokens(config):
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    bos, eos = (backend.token_to_id(_token_content(config.get(k)) or "") for k in ("bos_token", "eos_token"))
    _add_bos_eos(backend, bos, eos, bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
    return backend


def _hf_backend(directory: Path, config: dict[str, Any]) -> BackendTokenizer:
    if (directory / "tokenizer.json").is_file():
        try:
            return BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise ModelFormatError(f"cannot read {directory / 'tokenizer.json'}: {e}") from None
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        return _gpt2_files_backend(directory, config)
    raise ModelFormatError(f"{directory} has no tokenizer.json and no vocab.json + merges.txt")


def _hf_special_ids(directory: Path, config: dict[str, Any], backend: BackendTokenizer) -> SpecialTokenIds:
    def lookup(key: str) -> int | None:
        content = _token_content(config.get(key))
        return backend.token_to_id(content) if content else None

    eos = [lookup("eos_token")]
    if (directory / "generation_config.json").is_file():
        extra = _read_json(directory / "generation_config.json").get("eos_token_id")
        eos += extra if isinstance(extra, list) else [extra]
    eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    return SpecialTokenIds(lookup("bos_token"), eos_ids, lookup("pad_token"), lookup("unk_token"))


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else tokenizer_config's (the "default" one of a list)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template


# ---------------------------------------------------------------- Tokenizer


class Tokenizer:
    """Encode, decode and chat-format text for one model; build with ``from_gguf`` or ``from_pretrained``.

    Token ids agree with transformers' fast tokenizer on the same files.
    """

    def __init__(
        self, backend: BackendTokenizer, special: SpecialTokenIds, chat_template: str | None, name: str
    ) -> None:
        self._backend = backend
        self._special = special
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.name = name
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        bos = special.bos_token_id
        self._add_bos_token = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (``gguf_metadata(open_gguf(path))``).

        Reads ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE); adds BOS/EOS only where
        ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say so. Raises ``ModelFormatError``
        for another tokenizer model or pre-tokenizer, or malformed tokenizer fields.
        """
        backend = _gguf_backend(meta)
        special = _gguf_special_ids(meta, backend.get_vocab_size(with_added_tokens=True))
        eos = special.eos_token_ids[0] if special.eos_token_ids else None
        add_bos, add_eos = (bool(meta.get(f"tokenizer.ggml.add_{k}_token", False)) for k in ("bos", "eos"))
        _add_bos_eos(backend, special.bos_token_id, eos, add_bos, add_eos)
        return cls(backend, special, meta.get("tokenizer.chat_template"), meta.get("general.name", "GGUF model"))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Build from a Hugging Face directory: ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``,
        with ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja`` and
        ``generation_config.json`` (extra EOS ids) when present.

        Raises ``ModelNotFoundError`` if ``directory`` does not exist, ``ModelFormatError`` if it
        holds no readable tokenizer.
        """
        path = Path(directory)
        if not path.exists():
            raise ModelNotFoundError(f"tokenizer directory not found: {path}")
        if not path.is_dir():
            raise ModelFormatError(f"tokenizer path is not a directory: {path}")
        config = _hf_config(path)
        backend = _hf_backend(path, config)
        return cls(backend, _hf_special_ids(path, config, backend), _hf_chat_template(path, config), str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it ("<|im_end|>") become their ids.

        ``add_special_tokens`` adds BOS/EOS only where the model's files ask for them.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (a list, or a 1-D tensor/array); invalid UTF-8 becomes "\\ufffd",
        spaces are not cleaned up. Raises ``ValueError`` for an id outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in token_ids]
        _check_token_ids(ids, self._vocab_size)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary string of ``token_id`` (byte-level form, "Ġthe"). Raises ``ValueError`` if out of range."""
        _check_token_ids([token_id], self._vocab_size)
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or ``None`` if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template, as transformers' ``apply_chat_template``.

        Returns the prompt, or its ids when ``tokenize`` (no BOS added: the template carries
        the special tokens). Raises ``ModelFormatError`` if the model has no template and
        ``ChatTemplateError`` if the template rejects the messages.
        """
        if self._chat_template is None:
            raise ModelFormatError(f"{self.name} has no chat template")
        check_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self._chat_template)
        special = self._special
        named = {"bos_token": special.bos_token_id, "eos_token": self.eos_token_id}
        named |= {"unk_token": special.unk_token_id, "pad_token": special.pad_token_id}
        strings = {k: self._backend.id_to_token(i) for k, i in named.items() if i is not None}
        try:
            text = self._compiled_template.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **strings
            )
        except (jinja2.TemplateError, TypeError) as e:
            raise ChatTemplateError(f"chat template of {self.name} failed on these messages: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be larger)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._special.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id."""
        return self._special.eos_token_ids[0] if self._special.eos_token_ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (EOS, end-of-turn, generation_config extras)."""
        return list(self._special.eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, falling back to EOS."""
        pad = self._special.pad_token_id
        return pad if pad is not None else self.eos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every added token marked special (those ``skip_special_tokens`` drops), sorted."""
        return sorted(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` prepends BOS."""
        return self._add_bos_token


class IncrementalDetokenizer:
    """Turn a stream of generated ids into text, one finalized piece at a time.

    Decodes a short window (the last emitted tokens plus the new ones) and emits the
    difference, holding text back while it ends in "\\ufffd" (an unfinished UTF-8
    character): O(1) per token. ``"".join(add outputs) + flush()`` equals
    ``tokenizer.decode(token_ids, skip_special_tokens)``.
    Source: vLLM ``detokenize_incrementally`` (prefix_offset / read_offset).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        context = list(prompt_token_ids or [])[-DETOKENIZE_CONTEXT_TOKENS:]
        _check_token_ids(context, tokenizer.vocab_size)
        self._backend = tokenizer._backend
        self._vocab_size = tokenizer.vocab_size
        self._skip_special_tokens = skip_special_tokens
        self._ids = context  # prompt context, then generated ids
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, len(context))
        self._pieces: list[str] = []

    def _decode(self, start: int, end: int) -> str:
        return self._backend.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _emit(self, text: str) -> str:
        """Record ``text`` as final and slide the window past it."""
        self._pieces.append(text)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return text

    def add(self, token_id: int | list[int]) -> str:
        """Append generated id(s); return the text they finalize ("" while a character is unfinished).

        Raises ``ValueError`` for an id outside the vocabulary.
        """
        new_ids = [int(i) for i in token_id] if isinstance(token_id, (list, tuple)) else [int(token_id)]
        _check_token_ids(new_ids, self._vocab_size)
        out = []
        for i in new_ids:
            self._ids.append(i)
            text = self._decode(self._prefix_offset, len(self._ids))
            if len(text) > len(self._prefix_text) and not text.endswith("\ufffd"):
                out.append(self._emit(text[len(self._prefix_text) :]))
        return "".join(out)

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character decodes to "\\ufffd")."""
        text = self._decode(self._prefix_offset, len(self._ids))[len(self._prefix_text) :]
        return self._emit(text) if text else ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        """The generated ids added so far (without the prompt)."""
        return self._ids[self._num_context :]
