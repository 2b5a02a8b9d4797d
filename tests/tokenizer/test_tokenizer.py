"""kvgen.tokenizer.tokenizer: ``Tokenizer`` on the default GGUF against transformers' tokenizer.

The reference for every id, string and chat prompt is ``transformers``, never a literal.
"""

from __future__ import annotations

import copy

import pytest
import regex
from tokenizer_cases import CONVERSATIONS, HARD_STRINGS, ref_decode
from tokenizers import Tokenizer as BackendTokenizer
from transformers import LlamaTokenizerFast
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

from kvgen.errors import ModelFormatError
from kvgen.tokenizer import ChatTemplateError, Tokenizer


def test_reference_is_the_class_autotokenizer_picks(meta: dict) -> None:
    assert TOKENIZER_MAPPING_NAMES[meta["general.architecture"]][1] == LlamaTokenizerFast.__name__


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
    assert ours.decode(ids, skip_special_tokens=skip) == ref_decode(ref, ids, skip)
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


# ---------------------------------------------------------------- chat template


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(ours: Tokenizer, ref, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)


def test_chat_template_kwargs_and_documents_match_transformers(meta: dict, ref) -> None:
    """transformers renders ``documents``, and its kwargs win over the special-token variables and set tools,
    documents and add_generation_prompt; kvgen rendered documents as None and failed on these kwargs ("got multiple
    values for keyword argument 'bos_token'")."""
    template = ("{{ bos_token }}|{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}|"
                "{{ tools | tojson }}|{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    ours = Tokenizer.from_gguf({**meta, "tokenizer.chat_template": template})
    ref = copy.deepcopy(ref)
    ref.chat_template = template
    messages = CONVERSATIONS["system"]
    documents = [{"title": "Colors", "text": "Red is warm."}]
    tool = {"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}
    assert ours.apply_chat_template(messages, documents=documents) == ref.apply_chat_template(
        messages, documents=documents, tokenize=False)
    kwargs = {"bos_token": "<s>", "documents": documents, "tools": [tool], "add_generation_prompt": True}
    text = ours.apply_chat_template(messages, chat_template_kwargs=kwargs)
    assert text == ref.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text.startswith("<s>|[Colors") and "assistant:" in text
    with pytest.raises(ValueError, match="documents must be a list of dicts"):
        ours.apply_chat_template(messages, documents=["Red is warm."])
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set 'messages'"):
        ours.apply_chat_template(messages, chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict, got list"):
        ours.apply_chat_template(messages, chat_template_kwargs=[("enable_thinking", True)])  # type: ignore[arg-type]


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


# ---------------------------------------------------------------- bad input


def test_decode_rejects_out_of_range_ids(ours: Tokenizer) -> None:
    with pytest.raises(ValueError, match=rf"token id must be in \[0, {ours.vocab_size}\), got {ours.vocab_size}"):
        ours.decode([1, ours.vocab_size])
    with pytest.raises(ValueError, match=r"got -1"):
        ours.id_to_token(-1)


def test_decode_takes_integer_ids_only_and_encode_refuses_lone_surrogates(ours: Tokenizer, ref) -> None:
    """What transformers' decode takes (an int, a list, an int tensor or array) gives its text; a str was read as its
    digits and floats or bools were truncated before."""
    import numpy as np
    import torch

    ids = ours.encode("Hello world")
    for given in (ids, tuple(ids), torch.tensor(ids), torch.tensor([ids]), np.array(ids)):
        assert ours.decode(given) == ref.decode(ids)
    assert ours.decode(ids[0]) == ref.decode(ids[0])
    for bad, message in [("123", "got str"), ([1.5], "got 1.5"), ([True], "got True"), (None, "got NoneType"),
                         (torch.tensor([1.0]), "a tensor of torch.float32"), ([float("nan")], "got nan")]:
        with pytest.raises(ValueError, match=f"token ids must be .*{message}"):
            ours.decode(bad)
    with pytest.raises(ValueError, match="token ids must be ints, got 1.5"):
        ours.id_to_token(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lone surrogate"):
        ours.encode("a\ud800b")


def test_flags_that_are_no_bools_are_named(ours: Tokenizer, ref) -> None:
    """transformers refuses them too, with the tokenizers binding's TypeError from deep in the call; kvgen's encode
    named a lone surrogate that the text does not hold."""
    for call in (lambda t: t.encode("hi", add_special_tokens="no"), lambda t: t.decode([1, 2], skip_special_tokens=1)):
        with pytest.raises(TypeError, match="cannot be converted to 'PyBool'"):
            call(ref)
    with pytest.raises(ValueError, match="add_special_tokens must be a bool, got 'no'"):
        ours.encode("hi", add_special_tokens="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skip_special_tokens must be a bool, got 1"):
        ours.decode([1, 2], skip_special_tokens=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clean_up_tokenization_spaces must be a bool, got 'yes'"):
        ours.decode([1, 2], clean_up_tokenization_spaces="yes")  # type: ignore[arg-type]
    import numpy as np  # numpy bools are bools to transformers and to kvgen

    ids = ours.encode("hi there")
    assert ours.encode("hi there", add_special_tokens=np.False_) == ours.encode("hi there", add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=np.True_, clean_up_tokenization_spaces=np.False_) == ref.decode(
        ids, skip_special_tokens=np.True_, clean_up_tokenization_spaces=np.False_)


def test_a_long_text_is_encoded_with_the_gil_released(ours: Tokenizer, ref) -> None:
    """``tokenizers``' ``encode`` holds the GIL for the whole call, so a multi-megabyte prompt froze the server's event
    loop even from a worker thread; from ``GIL_FREE_ENCODE_CHARS`` on, kvgen encodes through ``encode_batch``, which
    releases it. Evidence: the main thread keeps running during the encode (it records times inside it; with the GIL
    held it could only at the call's edges), and the ids are transformers'; the lone-surrogate check still holds."""
    import random
    import threading
    import time

    from kvgen.tokenizer.tokenizer import GIL_FREE_ENCODE_CHARS

    rng = random.Random(0)
    text = " ".join("".join(rng.choice("abcdefghéü中") for _ in range(8)) for _ in range(150_000))
    span: list[float] = []
    ids: list[int] = []

    def encode() -> None:
        span.append(time.perf_counter())
        ids.extend(ours.encode(text, add_special_tokens=False))
        span.append(time.perf_counter())

    worker = threading.Thread(target=encode)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.0005)
    worker.join()
    # held, the main thread could run only at the call's edges (a GIL switch before or after it): a tick or two
    assert sum(span[0] < t < span[1] for t in ticks) >= 10
    assert ids == ref.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="lone surrogate"):
        ours.encode("a\ud800b" * GIL_FREE_ENCODE_CHARS)


@pytest.mark.parametrize("clean_up", [None, False, True])
def test_decode_takes_clean_up_tokenization_spaces_as_transformers(ours: Tokenizer, ref, clean_up: bool | None) -> None:
    """``decode(ids, clean_up_tokenization_spaces=...)`` overrides the tokenizer's flag (None: keep it), as
    transformers' ``decode``; it was a TypeError before (so a streamer's decode_kwargs could not carry it)."""
    ids = ref.encode("Hello , world . I 'm here ?", add_special_tokens=False)
    ref_flag = ref.clean_up_tokenization_spaces
    ref.clean_up_tokenization_spaces = ours.clean_up_tokenization_spaces  # transformers' GGUF loader sets True
    try:
        assert ours.decode(ids, clean_up_tokenization_spaces=clean_up) == ref.decode(
            ids, clean_up_tokenization_spaces=clean_up)
    finally:
        ref.clean_up_tokenization_spaces = ref_flag
