"""Loading a tokenizer from a Hugging Face directory.

Looks, in order, for ``tokenizer.json``; GPT-2's ``vocab.json`` + ``merges.txt``; a BERT-style
``vocab.txt`` whose ``tokenizer_class`` (tokenizer_config.json, else config.json) is
``BertTokenizer``. Reads ``tokenizer_config.json`` and ``special_tokens_map.json`` (special tokens,
BOS/EOS flags), ``added_tokens.json``, ``chat_template.jinja`` (and ``additional_chat_templates/``) and
``generation_config.json`` (extra EOS ids), as transformers' ``AutoTokenizer`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvgen.config import checked_token_ids
from kvgen.errors import ModelFormatError
from kvgen.tokenizer.byte_level import ByteLevelVariant, build_byte_level_bpe
from kvgen.tokenizer.special_tokens import SpecialTokenIds, add_bos_eos
from kvgen.tokenizer.wordpiece import (
    VOCAB_FILE,
    WORDPIECE_TOKENIZER_CLASSES,
    wordpiece_backend,
    wordpiece_config,
)

# Tokenizer classes (with or without "Fast") whose fast __init__ replaces tokenizer.json's post-processor by one adding
# BOS/EOS as add_bos_token / add_eos_token say, with these defaults (transformers' update_post_processor); the others
# keep the file's.
POST_PROCESSOR_DEFAULTS: dict[str, tuple[bool, bool]] = {
    "LlamaTokenizer": (True, False),
    "CodeLlamaTokenizer": (True, False),
    "GemmaTokenizer": (True, False),
    "CohereTokenizer": (True, False),
    "GPTNeoXTokenizer": (False, False),
}

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class HFTokenizerFiles:
    """What a Hugging Face directory says about its tokenizer."""

    backend: BackendTokenizer
    special: SpecialTokenIds
    chat_template: str | None
    clean_up_tokenization_spaces: bool  # decode removes spaces before punctuation (tokenizer_config.json's flag)
    named_chat_templates: dict[str, str] = field(default_factory=dict)  # the others by name: "tool_use", "rag"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; raises ``ModelFormatError`` if unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an int over 4300 digits
        raise ModelFormatError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    content = value.get("content") if isinstance(value, dict) else value
    return content if isinstance(content, str) else None


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json, overridden by special_tokens_map.json only when the config has no
    ``added_tokens_decoder`` (a legacy save), as in transformers: a config written since transformers 4.34 names
    the special tokens itself and transformers ignores the map. The map's ``additional_special_tokens`` join the
    config's (config's first) instead of replacing them, as transformers' ``_from_pretrained`` merges them."""
    config: dict[str, Any] = {}
    if (directory / "tokenizer_config.json").is_file():
        config.update(read_json(directory / "tokenizer_config.json"))
    if "added_tokens_decoder" not in config and (directory / "special_tokens_map.json").is_file():
        special_map = read_json(directory / "special_tokens_map.json")
        extra = special_map.get("additional_special_tokens")
        if isinstance(extra, list) and isinstance(config.get("additional_special_tokens"), list):
            merged = list(config["additional_special_tokens"])
            named = {token_content(t) for t in merged}
            special_map["additional_special_tokens"] = merged + [t for t in extra if token_content(t) not in named]
        config.update(special_map)
    return config


def _special_strings(config: dict[str, Any]) -> list[str]:
    """The named special tokens of the config (``unk_token`` ..., ``additional_special_tokens``: a list, or null for
    none as in transformers). Raises ``ModelFormatError`` for ``additional_special_tokens`` not a list."""
    extra = config.get("additional_special_tokens") or []
    if not isinstance(extra, list):
        raise ModelFormatError(f"additional_special_tokens of tokenizer_config.json / special_tokens_map.json must be "
                               f"a list of tokens, got {type(extra).__name__} {extra!r}")
    strings = [token_content(config.get(n)) for n in SPECIAL_TOKEN_KEYS]
    strings += [token_content(t) for t in extra]
    return [s for s in strings if s]


ADDED_TOKEN_FLAGS = ("special", "normalized", "lstrip", "rstrip", "single_word")


def _decoder_entries(config: dict[str, Any]) -> list[dict[str, Any]]:
    """``added_tokens_decoder`` ({"id": {"content": ..., flags}}) entries in id order. Raises ``ModelFormatError``
    for one that is not an object of that form (transformers fails there with an AttributeError or KeyError)."""
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ModelFormatError(f"tokenizer_config.json added_tokens_decoder must map ids to tokens, "
                               f"got {type(decoder).__name__}")
    for key, entry in decoder.items():
        if not key.isdecimal():
            raise ModelFormatError(f"tokenizer_config.json added_tokens_decoder: the id {key!r} is not an integer")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ModelFormatError(f"tokenizer_config.json added_tokens_decoder[{key!r}] must be an object with a "
                                   f"string content, got {entry!r}")
        if bad := [k for k in ADDED_TOKEN_FLAGS if k in entry and not isinstance(entry[k], bool)]:
            raise ModelFormatError(f"tokenizer_config.json added_tokens_decoder[{key!r}] {bad[0]} must be true or "
                                   f"false, got {entry[bad[0]]!r}")
    return [entry for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0]))]


def _added_tokens(config: dict[str, Any], present: set[str]) -> list[AddedToken]:
    """``added_tokens_decoder`` entries (special also where the config names them), then the named special tokens not
    among them nor ``present`` (the backend's added tokens), as transformers' ``PreTrainedTokenizerFast.__init__``
    adds them."""
    named = _special_strings(config)
    added = []
    for entry in _decoder_entries(config):
        fields = {k: entry[k] for k in ADDED_TOKEN_FLAGS if k in entry}
        added.append(AddedToken(entry["content"], **fields))
        added[-1].special = added[-1].special or entry["content"] in named  # its normalized default stays as built
    present = present | {t.content for t in added}
    for token in _named_tokens(config):
        if token.content not in present:
            added.append(token)
            present.add(token.content)
    return added


def _named_tokens(config: dict[str, Any]) -> list[AddedToken]:
    """The named special tokens (see ``_special_strings``) as added tokens: a string plain (not normalized), an
    AddedToken dict with its lstrip/rstrip/single_word/normalized flags, as transformers' ``_from_pretrained`` reads it
    (special either way). Raises ``ModelFormatError`` for a flag that is no bool."""
    values = [config.get(n) for n in SPECIAL_TOKEN_KEYS] + list(config.get("additional_special_tokens") or [])
    tokens = []
    for value in values:
        content = token_content(value)
        if not content:
            continue
        if not isinstance(value, dict):
            tokens.append(AddedToken(content, special=True, normalized=False))
            continue
        if bad := [k for k in ADDED_TOKEN_FLAGS if k in value and not isinstance(value[k], bool)]:
            raise ModelFormatError(f"tokenizer_config.json / special_tokens_map.json: the special token {content!r} "
                                   f"{bad[0]} must be true or false, got {value[bad[0]]!r}")
        tokens.append(AddedToken(content, **{k: value[k] for k in ADDED_TOKEN_FLAGS if k in value}))
        tokens[-1].special = True
    return tokens


def _legacy_added_tokens(path: Path, config: dict[str, Any]) -> list[AddedToken]:
    """``added_tokens.json`` ({token: id}) in id order; a named special token is special and not normalized, the
    others normalized, as transformers' legacy load. Raises ``ModelFormatError`` for an id that is not an int."""
    added = read_json(path)
    if bad := [t for t, i in added.items() if isinstance(i, bool) or not isinstance(i, int)]:
        raise ModelFormatError(f"{path}: the id of {bad[0]!r} must be an int, got {added[bad[0]]!r}")
    special = set(_special_strings(config))
    return [AddedToken(t, special=t in special, normalized=t not in special) for t in sorted(added, key=added.__getitem__)]


def _add_tokens(backend: BackendTokenizer, directory: Path, config: dict[str, Any]) -> None:
    """Tokens of ``added_tokens.json`` (read only without the config's ``added_tokens_decoder``, which supersedes it in
    transformers) and of the config (specials as special tokens)."""
    if "added_tokens_decoder" not in config and (directory / "added_tokens.json").is_file():
        backend.add_tokens(_legacy_added_tokens(directory / "added_tokens.json", config))
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token in _added_tokens(config, present):
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])


def _gpt2_files_backend(directory: Path, config: dict[str, Any]) -> BackendTokenizer:
    """GPT-2 style ``vocab.json`` + ``merges.txt``, as transformers' GPT2Converter builds it: BOS where
    ``add_bos_token``, never an EOS (GPT2Tokenizer has no ``add_eos_token``)."""
    try:
        vocab, merges = models.BPE.read_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception for unreadable files
        raise ModelFormatError(f"cannot read vocab.json/merges.txt in {directory}: {e}") from None
    backend = build_byte_level_bpe(vocab, merges, ByteLevelVariant.GPT2)
    if config.get("add_prefix_space"):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    _add_tokens(backend, directory, config)
    bos = backend.token_to_id(token_content(config.get("bos_token")) or "")
    add_bos_eos(backend, bos, None, bool(config.get("add_bos_token")), add_eos=False)
    return backend


def _tokenizer_class(directory: Path, config: dict[str, Any]) -> str | None:
    """``tokenizer_class`` of tokenizer_config.json, else of config.json (as AutoTokenizer reads it)."""
    name = config.get("tokenizer_class")
    if name is None and (directory / "config.json").is_file():
        name = read_json(directory / "config.json").get("tokenizer_class")
    return name if isinstance(name, str) else None


# AutoTokenizer's class for a directory that names none, by config.json's model_type (transformers 4.55
# TOKENIZER_MAPPING_NAMES), for the model types kvgen loads whose class changes how tokenizer.json is read
_MODEL_TYPE_CLASSES = {"llama": "LlamaTokenizer", "mistral": "LlamaTokenizer", "mixtral": "LlamaTokenizer",
                       "phi3": "LlamaTokenizer", "ernie4_5": "LlamaTokenizer", "gemma2": "GemmaTokenizer",
                       "gemma3": "GemmaTokenizer", "gemma3_text": "GemmaTokenizer"}


def _fast_class_base(directory: Path, config: dict[str, Any]) -> str:
    """The tokenizer class AutoTokenizer builds, without "Fast": the named one (:func:`_tokenizer_class`), else the
    one of config.json's ``model_type`` (``_MODEL_TYPE_CLASSES``); "" when neither says."""
    name = _tokenizer_class(directory, config)
    if name is None and (directory / "config.json").is_file():
        name = _MODEL_TYPE_CLASSES.get(str(read_json(directory / "config.json").get("model_type")))
    return (name or "").removesuffix("Fast")


def _wordpiece_files(directory: Path, config: dict[str, Any]) -> HFTokenizerFiles:
    """``vocab.txt`` + a BertTokenizer config. EOS is the sep token (see ``Tokenizer.from_pretrained``)."""
    name = _tokenizer_class(directory, config)
    if name not in WORDPIECE_TOKENIZER_CLASSES:
        raise ModelFormatError(
            f"{directory} has only {VOCAB_FILE}, with tokenizer_class={name!r}; kvgen reads a {VOCAB_FILE} "
            f"for {' or '.join(WORDPIECE_TOKENIZER_CLASSES)} only"
        )
    config = wordpiece_config(config)
    tokens = {k: token_content(config.get(k)) or "" for k in ("unk_token", "cls_token", "sep_token")}
    backend = wordpiece_backend(directory / VOCAB_FILE, config, tokens)
    _add_tokens(backend, directory, config)
    if token_content(config.get("eos_token")) is None:
        config = {**config, "eos_token": config["sep_token"]}
    special = _special_ids(directory, config, backend)
    return _files(backend, special, directory, config, bool(config["clean_up_tokenization_spaces"]))


def _backend_file(directory: Path) -> BackendTokenizer:
    try:
        return BackendTokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception on bad JSON
        raise ModelFormatError(f"cannot read {directory / 'tokenizer.json'}: {e}") from None


# Tokenizer classes whose fast __init__ passes add_prefix_space=None: without the config's, tokenizer.json's stays.
KEEP_PREFIX_SPACE_CLASSES = ("LlamaTokenizer", "T5Tokenizer")


def _set_add_prefix_space(backend: BackendTokenizer, directory: Path, config: dict[str, Any]) -> None:
    """A ``add_prefix_space`` true/false in the config overrides a top-level ByteLevel pre-tokenizer's, as
    transformers' ``PreTrainedTokenizerFast.__init__`` does (GPT-2, RoBERTa, BLOOM directories); a config without the
    key sets false there (its default), except for ``KEEP_PREFIX_SPACE_CLASSES``."""
    keep = _fast_class_base(directory, config) in KEEP_PREFIX_SPACE_CLASSES
    value = config.get("add_prefix_space", None if keep else False)
    if isinstance(value, bool) and isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        backend.pre_tokenizer.add_prefix_space = value


def _rebuild_post_processor(backend: BackendTokenizer, directory: Path, config: dict[str, Any]) -> None:
    """For a ``POST_PROCESSOR_DEFAULTS`` class, a post-processor adding BOS and EOS as ``add_bos_token`` and
    ``add_eos_token`` say (nothing when neither), as transformers' ``LlamaTokenizerFast.update_post_processor``
    replaces tokenizer.json's. Raises ``ModelFormatError`` when asked to add a BOS or EOS the vocabulary lacks."""
    name = _fast_class_base(directory, config)
    if name not in POST_PROCESSOR_DEFAULTS:
        return
    add_bos, add_eos = (bool(config.get(k, d)) for k, d in zip(("add_bos_token", "add_eos_token"),
                                                              POST_PROCESSOR_DEFAULTS[name]))
    bos, eos = (backend.token_to_id(token_content(config.get(k)) or "") for k in ("bos_token", "eos_token"))
    backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    add_bos_eos(backend, bos, eos, add_bos, add_eos)


def _special_ids(directory: Path, config: dict[str, Any], backend: BackendTokenizer) -> SpecialTokenIds:
    def lookup(key: str) -> int | None:
        content = token_content(config.get(key))
        return backend.token_to_id(content) if content else None

    eos = [lookup("eos_token")]
    if (directory / "generation_config.json").is_file():
        extra = read_json(directory / "generation_config.json").get("eos_token_id")
        if extra is not None:
            eos += checked_token_ids(f"{directory / 'generation_config.json'} eos_token_id", extra, single=True,
                                     allow_empty=True)
    eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    return SpecialTokenIds(lookup("bos_token"), eos_ids, lookup("pad_token"), lookup("unk_token"))


def _chat_templates(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """The chat templates by name, "default" the model's own, as transformers reads them: ``chat_template.jinja``
    ("default") and ``additional_chat_templates/NAME.jinja`` when there are any, else tokenizer_config's
    ``chat_template`` (one template, or a list of ``{"name": ..., "template": ...}``)."""
    paths = {p.name.removesuffix(".jinja"): p for p in sorted((directory / "additional_chat_templates").glob("*.jinja"))}
    if (directory / "chat_template.jinja").is_file():
        paths["default"] = directory / "chat_template.jinja"
    if paths:
        return {name: path.read_text(encoding="utf-8") for name, path in paths.items()}
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {"default": template} if isinstance(template, str) else {}


def _files(backend: BackendTokenizer, special: SpecialTokenIds, directory: Path, config: dict[str, Any],
           clean_up: bool) -> HFTokenizerFiles:
    templates = _chat_templates(directory, config)
    return HFTokenizerFiles(backend, special, templates.pop("default", None), clean_up, templates)


def load_hf_tokenizer_files(directory: Path) -> HFTokenizerFiles:
    """The tokenizer of an existing HF directory.

    Raises ``ModelFormatError`` naming the directory and the files looked for when it holds
    none of them, a ``vocab.txt`` for a tokenizer class other than BertTokenizer, or an
    unreadable file.
    """
    config = _tokenizer_config(directory)
    if (directory / "tokenizer.json").is_file():
        backend = _backend_file(directory)
        _add_tokens(backend, directory, config)
        _set_add_prefix_space(backend, directory, config)
        _rebuild_post_processor(backend, directory, config)
    elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        backend = _gpt2_files_backend(directory, config)
    elif (directory / VOCAB_FILE).is_file():
        return _wordpiece_files(directory, config)
    else:
        raise ModelFormatError(
            f"{directory} has no tokenizer.json and no vocab.json + merges.txt (nor a {VOCAB_FILE} for BertTokenizer)"
        )
    special = _special_ids(directory, config, backend)
    # transformers' PreTrainedTokenizerBase reads the flag from the config, default false (BertTokenizer's is true).
    clean_up = bool(config.get("clean_up_tokenization_spaces", False))
    return _files(backend, special, directory, config, clean_up)
