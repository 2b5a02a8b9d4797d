"""``Tokenizer``: encode, decode and chat-format text for one model over the ``tokenizers`` library.

Built from GGUF metadata (:mod:`kvgen.tokenizer.gguf_vocab`) or a Hugging Face directory
(:mod:`kvgen.tokenizer.hf_files`); chat templates render with jinja2 as transformers does.
Incremental detokenization lives with its user, :mod:`kvgen.engine.detokenizer`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from kvgen.chat_template import (
    ChatTemplateError,
    ContentFormat,
    check_documents,
    check_messages,
    compile_chat_template,
    detect_content_format,
)
from kvgen.errors import ModelFormatError, ModelNotFoundError
from kvgen.fields import as_bool
from kvgen.gguf_keys import check_gguf_value_types
from kvgen.tokenizer.gguf_vocab import gguf_adds_bos_by_default, gguf_backend, gguf_raw_token_texts, gguf_special_ids
from kvgen.tokenizer.hf_files import load_hf_tokenizer_files
from kvgen.tokenizer.special_tokens import SpecialTokenIds, add_bos_eos, check_token_ids, integer_ids
from kvgen.tokenizer.wordpiece import clean_up_tokenization


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """The code point of the first lone UTF-16 surrogate (U+D800-U+DFFF) in ``text``, or None. Python keeps one from
    a JSON escape ("\\ud800") or from bytes read with ``surrogateescape``; it is no Unicode text, and neither UTF-8
    nor the tokenizer can encode it."""
    found = _SURROGATE.search(text)
    return None if found is None else ord(found.group())


# Texts from this many characters on are encoded without the GIL (Tokenizer.encode): ~1 ms of encoding; below, the
# plain call is cheaper than encode_batch's thread-pool hand-off.
GIL_FREE_ENCODE_CHARS = 4096

class Tokenizer:
    """Encode, decode and chat-format text for one model; build with ``from_gguf`` or ``from_pretrained``.

    Token ids agree with transformers' fast tokenizer on the same files. ``backend`` is the
    ``tokenizers.Tokenizer`` that encodes and decodes; ``clean_up_tokenization_spaces`` makes
    ``decode`` drop the spaces before punctuation ("a ." -> "a.") as transformers' clean-up does.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        special: SpecialTokenIds,
        chat_template: str | None,
        name: str,
        clean_up_tokenization_spaces: bool = False,
        named_chat_templates: dict[str, str] | None = None,
        *,
        raw_token_texts: dict[int, str] | None = None,
    ) -> None:
        self._backend = backend
        self._raw_token_texts = dict(raw_token_texts or {})  # added tokens decoded as their text, not by the decoder
        self._special_added_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special and
                                   i in self._raw_token_texts}
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._special = special
        self._chat_template = chat_template
        self._named_chat_templates = dict(named_chat_templates or {})  # "tool_use", "rag", ... besides the default
        self._compiled_templates: dict[str, jinja2.Template] = {}  # by source
        self.name = name
        self._vocab_size = _num_ids(backend)
        bos = special.bos_token_id
        self._add_bos_token = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (``gguf_metadata(open_gguf(path))``).

        Reads ``tokenizer.ggml.model`` "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE); adds BOS/EOS only where
        ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say so, or, without ``add_bos_token``, where llama.cpp
        adds BOS (:func:`~kvgen.tokenizer.gguf_vocab.gguf_adds_bos_by_default`). Raises ``ModelFormatError``
        for another tokenizer model or pre-tokenizer, or malformed tokenizer fields (a value of the wrong type:
        :func:`kvgen.gguf_keys.check_gguf_value_types`).
        """
        check_gguf_value_types(meta)
        backend = gguf_backend(meta)
        special = gguf_special_ids(meta, backend.get_vocab_size(with_added_tokens=True))
        eos = special.eos_token_ids[0] if special.eos_token_ids else None
        bos_by_default = special.bos_token_id is not None and gguf_adds_bos_by_default(meta)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bos_by_default))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        add_bos_eos(backend, special.bos_token_id, eos, add_bos, add_eos)
        return cls(backend, special, meta.get("tokenizer.chat_template"), meta.get("general.name", "GGUF model"),
                   raw_token_texts=gguf_raw_token_texts(meta, backend))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Build from a Hugging Face directory: ``tokenizer.json``, ``vocab.json`` + ``merges.txt``,
        or a ``BertTokenizer`` ``vocab.txt``, with ``tokenizer_config.json``, ``special_tokens_map.json``,
        ``chat_template.jinja`` and ``generation_config.json`` (extra EOS ids) when present.

        A ``BertTokenizer`` has no BOS or EOS, and ``encode`` wraps text in ``[CLS] ... [SEP]``
        as transformers does; kvgen takes the sep token as EOS (unless the config names an
        ``eos_token``), so generation on a GPT-2 + BertTokenizer checkpoint stops at ``[SEP]``,
        and pad is ``[PAD]``. Decoding matches ``BertTokenizer.decode`` (``##`` pieces merged,
        clean-up of spaces as ``clean_up_tokenization_spaces`` says, default true). Other
        directories clean up where tokenizer_config.json sets ``clean_up_tokenization_spaces``
        (default false), as transformers' ``decode`` does.

        Raises ``ModelNotFoundError`` if ``directory`` does not exist, ``ModelFormatError`` if it
        holds no readable tokenizer (the message names the files looked for) or a ``vocab.txt``
        for a tokenizer class other than BertTokenizer.
        """
        path = Path(directory)
        if not path.exists():
            raise ModelNotFoundError(f"tokenizer directory not found: {path}")
        if not path.is_dir():
            raise ModelFormatError(f"tokenizer path is not a directory: {path}")
        files = load_hf_tokenizer_files(path)
        return cls(files.backend, files.special, files.chat_template, str(path), files.clean_up_tokenization_spaces,
                   files.named_chat_templates)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it ("<|im_end|>") become their ids.

        ``add_special_tokens`` adds BOS/EOS only where the model's files ask for them. A text of
        ``GIL_FREE_ENCODE_CHARS`` characters or more is encoded with the Python lock released (``encode_batch``, the
        same ids), so another thread (the server's event loop) runs meanwhile: ``tokenizers``' ``encode`` holds it.
        Raises ``ValueError`` for text that is not a str or holds a lone surrogate (no Unicode text), or an
        ``add_special_tokens`` that is no bool.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        add_special_tokens = as_bool("add_special_tokens", add_special_tokens)
        try:
            if len(text) >= GIL_FREE_ENCODE_CHARS:
                return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the tokenizers binding cannot convert a str with a lone surrogate
            raise ValueError(f"text holds the lone surrogate U+{lone_surrogate(text) or 0xD800:04X}, which is not "
                             "Unicode text") from None

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of ``token_ids`` (a list, or a 1-D tensor/array); invalid UTF-8 becomes "\\ufffd",
        spaces cleaned up where ``clean_up_tokenization_spaces`` says (None: the tokenizer's own flag, as
        transformers' ``decode``). Raises ``ValueError`` for
        anything but integer ids (a str, floats, bools), for an id outside ``[0, vocab_size)`` and for flags that are
        no bools (``clean_up_tokenization_spaces`` may be None).
        """
        skip_special_tokens = as_bool("skip_special_tokens", skip_special_tokens)
        if clean_up_tokenization_spaces is not None:
            clean_up_tokenization_spaces = as_bool("clean_up_tokenization_spaces", clean_up_tokenization_spaces)
        ids = integer_ids(token_ids)
        check_token_ids(ids, self._vocab_size)
        text = self.decode_without_clean_up(ids, skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def decode_without_clean_up(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """``decode`` of ids known to be in range, spaces never cleaned up.

        The incremental detokenizer's hot path; it cleans up the stream itself
        (:class:`~kvgen.tokenizer.wordpiece.StreamingCleanUp`). Ids of ``raw_token_texts`` (a GGUF's, see
        :func:`~kvgen.tokenizer.gguf_vocab.gguf_raw_token_texts`) come out as their text there (nothing: as if absent),
        the runs of ids between them through the backend's decoder.
        """
        raw = self._raw_token_texts
        if not raw or raw.keys().isdisjoint(token_ids):
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for token_id in token_ids:
            text = raw.get(token_id)
            if text is None:
                run.append(token_id)
            elif text:  # an added token of a byte-level vocabulary, printed as its text
                parts.append(self._backend.decode(run, skip_special_tokens=skip_special_tokens))
                parts.append("" if skip_special_tokens and token_id in self._special_added_ids else text)
                run = []
        parts.append(self._backend.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def backend_json(self) -> str:
        """The ``tokenizers`` JSON of the encoder/decoder (``Tokenizer.to_str()``), as llguidance reads it."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary string of ``token_id`` (byte-level form, "Ġthe"). Raises ``ValueError`` if out of range."""
        check_token_ids(integer_ids([token_id]), self._vocab_size)
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
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (its "tool_use" one, when it has named templates and
        ``tools`` are given), as transformers' ``apply_chat_template``.

        ``continue_final_message``: the prompt ends inside the last message (its end-of-turn cut off), so the model
        continues it; ``documents``: the template's ``documents`` (RAG), dicts; ``chat_template_kwargs``: extra
        template variables (e.g. ``enable_thinking``), transformers' ``**kwargs``: they win over the special-token
        variables (``bos_token`` ...), and ``tools``, ``documents``, ``add_generation_prompt`` and
        ``continue_final_message`` among them set those arguments (as vLLM's request ``chat_template_kwargs``).
        Returns the prompt, or its ids when ``tokenize`` (no BOS added: the template carries
        the special tokens). Raises ``ModelFormatError`` if the model has no template,
        ``ChatTemplateError`` if the template rejects the messages, ``ValueError`` for
        ``continue_final_message`` with ``add_generation_prompt``, a final message the template does not show,
        documents that are not dicts, ``chat_template_kwargs`` not a dict or setting ``messages``.
        """
        check_messages(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        variables = dict(chat_template_kwargs or {})
        if "messages" in variables:
            raise ValueError("chat_template_kwargs cannot set 'messages'; pass the conversation as messages")
        tools = variables.pop("tools", tools)
        documents = check_documents(variables.pop("documents", documents))
        add_generation_prompt = bool(variables.pop("add_generation_prompt", add_generation_prompt))
        continue_final_message = bool(variables.pop("continue_final_message", continue_final_message))
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        template = self._template_for(tools)
        special = self._special
        named = {"bos_token": special.bos_token_id, "eos_token": self.eos_token_id}
        named |= {"unk_token": special.unk_token_id, "pad_token": special.pad_token_id}
        strings = {k: self._backend.id_to_token(i) for k, i in named.items() if i is not None}
        try:  # the caller's variables win over the special tokens, as transformers' kwargs
            text = template.render(
                **{**strings, **variables}, messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # noqa: BLE001 -- a template is a program: range(10**8) is an OverflowError, x / 0 ...
            raise ChatTemplateError(f"chat template of {self.name} failed on these messages: "
                                    f"{type(e).__name__ + ': ' if not isinstance(e, jinja2.TemplateError) else ''}{e}"
                                    ) from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1])
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_for(self, tools: list[dict[str, Any]] | None) -> jinja2.Template:
        """The compiled template of a call: the model's "tool_use" one when there are tools (an empty list too) and
        it has one, else its default, as transformers' ``get_chat_template``. Raises ``ModelFormatError`` without."""
        source = self._template_source(tools)
        if source is None:
            named = f" (only the named {sorted(self._named_chat_templates)})" if self._named_chat_templates else ""
            raise ModelFormatError(f"{self.name} has no chat template{named}")
        if source not in self._compiled_templates:
            self._compiled_templates[source] = compile_chat_template(source)
        return self._compiled_templates[source]

    def _template_source(self, tools: list[dict[str, Any]] | None) -> str | None:
        source = self._named_chat_templates.get("tool_use") if tools is not None else None
        return source or self._chat_template

    def chat_template_content_format(self, tools: list[dict[str, Any]] | None = None) -> ContentFormat:
        """How the template ``apply_chat_template`` renders with these ``tools`` takes a message's content: "openai"
        (a list of text parts) when it loops over it, else "string" (also without a template); see
        :func:`kvgen.chat_template.detect_content_format`. Source: vLLM ``_resolve_chat_template_content_format``."""
        source = self._template_source(tools)
        return detect_content_format(source) if source is not None else "string"

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
        """The Jinja chat template (the default one of a model with named ones, such as "tool_use", which
        ``apply_chat_template`` takes when given tools); assigning one replaces the model's, named ones too (as
        transformers' ``tokenizer.chat_template = ...``), compiled at once: ``ModelFormatError`` (a ``ValueError``)
        when it does not compile."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str) -> None:
        self._compiled_templates = {source: compile_chat_template(source)}
        self._chat_template = source
        self._named_chat_templates = {}

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` prepends BOS."""
        return self._add_bos_token


def _cut_after_final_message(text: str, final: dict[str, Any]) -> str:
    """``text`` up to the end of the final message's content (its last text part), as transformers'
    ``continue_final_message``: its last occurrence, with its trailing whitespace where the template kept it and the
    content has no leading whitespace. Raises ``ValueError`` for an empty (or blank) content, or when the rendered prompt
    does not contain it."""
    content = final.get("content")
    if isinstance(content, list):  # text parts: transformers continues the last one
        texts = [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
        content = texts[-1] if texts else ""
    content = content or ""
    if not content.strip():  # transformers keeps the whole prompt, end of turn included: nothing is continued
        raise ValueError("continue_final_message needs a final message with text to continue, got an empty one")
    start = text.rfind(content.strip())
    if start < 0:
        raise ValueError("continue_final_message: the final message's content does not appear in the rendered prompt")
    kept = content.lstrip()  # compared with the whole content, as transformers does
    return text[: start + (len(kept) if text[start : start + len(kept)] == content else len(content.strip()))]


def _num_ids(backend: BackendTokenizer) -> int:
    """1 + the highest token id. The backend's size counts distinct tokens, fewer when a vocabulary repeats a token
    (a BERT ``vocab.txt`` with duplicate lines: the later line's id wins and the earlier id is a gap that decodes to
    nothing, as transformers' tokenizers decode it)."""
    size = backend.get_vocab_size(with_added_tokens=True)
    if backend.id_to_token(size) is None:  # ids 0 .. size - 1: the usual case, without building the vocabulary
        return size
    return max(backend.get_vocab(with_added_tokens=True).values()) + 1
