"""kvgen.tokenizer.hf_files: tokenizers of Hugging Face directories against transformers' AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_cases import (
    CONVERSATIONS,
    HARD_STRINGS,
    WORDPIECE_STRINGS,
    WORDPIECE_VOCAB,
    save_gpt2_dir,
    write_wordpiece_dir,
)
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers, processors
from transformers import AutoTokenizer, BertTokenizer

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


def test_vocab_merges_directory_ignores_add_eos_token(trained: BackendTokenizer, tmp_path: Path) -> None:
    """GPT2Tokenizer has ``add_bos_token`` but no ``add_eos_token``: transformers adds no EOS; kvgen added one."""
    directory = save_gpt2_dir(trained, tmp_path, legacy=True, add_bos_token=True, add_eos_token=True)
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    ids = ours.encode("Hello world")
    assert ids == ref.encode("Hello world")
    assert ids[0] == ref.bos_token_id and ids[-1] != ref.eos_token_id


@pytest.mark.parametrize("value", [True, False])
def test_add_prefix_space_of_the_config_overrides_tokenizer_json(
    trained: BackendTokenizer, tmp_path: Path, value: bool
) -> None:
    """transformers sets the ByteLevel pre-tokenizer's add_prefix_space from tokenizer_config.json; kvgen kept the
    tokenizer.json's, so "Hello" lacked (or had) the leading "Ġ" token."""
    directory = save_gpt2_dir(trained, tmp_path, legacy=False, add_prefix_space=value)
    if not value:  # the file says true, the config false
        path = directory / "tokenizer.json"
        data = json.loads(path.read_text())
        data["pre_tokenizer"]["add_prefix_space"] = True
        path.write_text(json.dumps(data))
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    for text in ["Hello world", "", " x", "\nline"]:
        assert ours.encode(text) == ref.encode(text), text
    assert ours.decode(ours.encode("Hello")) == ref.decode(ref.encode("Hello")) == (" Hello" if value else "Hello")




@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "Qwen2Tokenizer", "LlamaTokenizerFast"])
def test_a_config_without_add_prefix_space_sets_the_class_default(
    trained: BackendTokenizer, tmp_path: Path, tokenizer_class: str
) -> None:
    """Without add_prefix_space in tokenizer_config.json transformers sets its class default (false; None, the file's,
    for LlamaTokenizerFast) on a top-level ByteLevel; kvgen kept tokenizer.json's true, so "Hello" got a leading "Ġ"."""
    backend = BackendTokenizer.from_str(trained.to_str())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": tokenizer_class, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "unk_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in ["Hello world", "", " x", "\nline"]:
        assert ours.encode(text) == ref.encode(text), text


@pytest.mark.parametrize("tokenizer_class", ["LlamaTokenizerFast", "GPTNeoXTokenizerFast", "PreTrainedTokenizerFast"])
@pytest.mark.parametrize("flags", [{}, {"add_bos_token": False}, {"add_eos_token": True},
                                   {"add_bos_token": True, "add_eos_token": True}])
def test_llama_class_rebuilds_the_post_processor_from_add_bos_and_eos_token(
    trained: BackendTokenizer, tmp_path: Path, tokenizer_class: str, flags: dict
) -> None:
    """LlamaTokenizerFast (GPT-NeoX's, Gemma's ... too) replaces tokenizer.json's post-processor by one adding BOS/EOS
    as add_bos_token / add_eos_token say (Llama: BOS by default); kvgen kept the file's, whose BOS stayed where the
    config turns it off and no EOS came where it asks for one."""
    backend = BackendTokenizer.from_str(trained.to_str())
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": tokenizer_class, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "unk_token": "<|endoftext|>", **flags}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ref).__name__ == tokenizer_class
    for text in ["Hello world", "", "<|im_end|> x"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    assert ours.add_bos_token == (ref.encode("")[:1] == [ref.bos_token_id])



@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2"])
def test_a_directory_naming_no_class_takes_its_model_types_as_autotokenizer(
    trained: BackendTokenizer, tmp_path: Path, model_type: str
) -> None:
    """With no tokenizer_class anywhere, AutoTokenizer picks the class of config.json's model_type
    (LlamaTokenizerFast for llama/mistral, GemmaTokenizerFast for gemma2), which rebuilds the post-processor from
    add_bos_token / add_eos_token; kvgen kept tokenizer.json's (17 of 34 encodes differed on a Llama-2 layout)."""
    backend = BackendTokenizer.from_str(trained.to_str())
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
              "add_bos_token": False, "add_eos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours, ref = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in ["Hello world", "", "<|im_end|> x"]:
        assert ours.encode(text) == ref.encode(text), text


def test_config_tokens_join_a_tokenizer_json(trained: BackendTokenizer, tmp_path: Path) -> None:
    """transformers adds tokenizer_config.json's added_tokens_decoder and named special tokens to a tokenizer.json's;
    kvgen read them only beside vocab.json / vocab.txt, so "<tool>" and "<|call|>" were split into pieces, the in-vocab
    "print" named special was kept by skip_special_tokens, and the vocabulary was two ids short."""
    trained.save(str(tmp_path / "tokenizer.json"))
    size = trained.get_vocab_size()
    call = {"content": "<|call|>", "special": False, "normalized": False, "lstrip": False, "rstrip": False}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "additional_special_tokens": ["<tool>", "print"], "added_tokens_decoder": {str(size): call}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.vocab_size == len(ref) == size + 2
    for text in ["<tool> print <|call|>x", "printing <tool>print(<|call|> <|im_end|>"]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text



@pytest.mark.parametrize("legacy", [False, True], ids=["tokenizer_json", "vocab_merges"])
def test_special_tokens_given_as_added_token_dicts_keep_their_flags(
    trained: BackendTokenizer, tmp_path: Path, legacy: bool
) -> None:
    """A named special token written as an AddedToken dict keeps its lstrip / rstrip / single_word flags, as
    transformers' _from_pretrained reads it; kvgen added it as a plain string, so "a <mask>" kept the space before
    "<mask>" as a token of its own and "<tool>  b" the spaces after "<tool>"."""
    mask = {"content": "<mask>", "lstrip": True, "rstrip": False, "normalized": False, "single_word": False,
            "special": True, "__type": "AddedToken"}
    tool = {**mask, "content": "<tool>", "lstrip": False, "rstrip": True}
    directory = save_gpt2_dir(trained, tmp_path, legacy, mask_token=mask, additional_special_tokens=[tool])
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    for text in ["a <mask> b", "x  <mask><tool>  b <tool>\n<mask>"]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids), text


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
    with pytest.raises(ModelFormatError, match=f"{tmp_path} has no tokenizer.json and no vocab.json.*vocab.txt"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="cannot read .*tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


# ---------------------------------------------------------------- BERT-style vocab.txt


def test_vocab_txt_with_tokenizer_class_in_config_json(tmp_path: Path) -> None:
    """The uer/gpt2-chinese layout: tokenizer_class in config.json, tokenizer_config without it."""
    directory = write_wordpiece_dir(tmp_path, WORDPIECE_VOCAB)
    (directory / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "tokenizer_class": "BertTokenizer"}))
    ours, ref = Tokenizer.from_pretrained(directory), BertTokenizer(str(directory / "vocab.txt"), do_lower_case=False)
    for text in WORDPIECE_STRINGS:
        assert ours.encode(text) == ref.encode(text)


def test_special_tokens_map_overrides_the_defaults(tmp_path: Path) -> None:
    vocab = [*WORDPIECE_VOCAB, "<s>", "</s>", "<eos>"]
    directory = write_wordpiece_dir(tmp_path, vocab, cls_token="<s>", sep_token="</s>")
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eos>"}))
    ours = Tokenizer.from_pretrained(directory)
    ref = BertTokenizer(str(directory / "vocab.txt"), cls_token="<s>", sep_token="</s>", eos_token="<eos>")
    assert ours.encode("你好 world") == ref.encode("你好 world")
    assert ours.eos_token_ids == [ref.eos_token_id]  # a named eos_token wins over the sep token


def test_additional_special_tokens_of_the_map_join_the_configs(tmp_path: Path) -> None:
    """A legacy directory naming additional_special_tokens in both tokenizer_config.json and special_tokens_map.json:
    transformers keeps both lists (config's first); kvgen let the map's replace the config's, so "<eod>" was no
    special token (split inside text, kept by skip_special_tokens)."""
    vocab = [*WORDPIECE_VOCAB, "<eod>", "[unused0]"]
    directory = write_wordpiece_dir(tmp_path, vocab, do_lower_case=True, additional_special_tokens=["<eod>", "<new>"])
    (directory / "special_tokens_map.json").write_text(json.dumps({"additional_special_tokens": ["[unused0]", "<new>"]}))
    ours = Tokenizer.from_pretrained(directory)
    for ref in (AutoTokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory, use_fast=False)):
        assert ours.vocab_size == len(ref)
        assert ours.all_special_ids == sorted(ref.all_special_ids)
        for text in ("你好<eod>hello [unused0]<new>", "<eod>world"):
            ids = ref.encode(text)
            assert ours.encode(text) == ids, text
            assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_additional_special_tokens_null_is_none_and_a_string_is_refused(tmp_path: Path) -> None:
    """"additional_special_tokens": null means none in transformers (kvgen died with "'NoneType' object is not
    iterable"); a string is no list (kvgen made each of its characters a special token)."""
    directory = write_wordpiece_dir(tmp_path / "null", WORDPIECE_VOCAB, do_lower_case=True,
                                    additional_special_tokens=None)
    ours = Tokenizer.from_pretrained(directory)
    for ref in (AutoTokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory, use_fast=False)):
        assert ours.all_special_ids == sorted(ref.all_special_ids)
        for text in WORDPIECE_STRINGS:
            assert ours.encode(text) == ref.encode(text), text
    directory = write_wordpiece_dir(tmp_path / "str", WORDPIECE_VOCAB, additional_special_tokens="<eod>")
    with pytest.raises(ModelFormatError, match=r"additional_special_tokens .* must be a list of tokens, got str '<eod>'"):
        Tokenizer.from_pretrained(directory)


@pytest.mark.parametrize(
    ("decoder", "match"),
    [
        ([], r"added_tokens_decoder must map ids to tokens, got list"),
        ({"x": {"content": "<x>"}}, r"added_tokens_decoder: the id 'x' is not an integer"),
        ({"200": "<x>"}, r"added_tokens_decoder\['200'\] must be an object with a string content, got '<x>'"),
        ({"200": {"text": "<x>"}}, r"added_tokens_decoder\['200'\] must be an object with a string content"),
        ({"200": {"content": "<x>", "special": "yes"}}, r"added_tokens_decoder\['200'\] special must be true or false"),
    ],
)
def test_a_malformed_added_tokens_decoder_is_named(tmp_path: Path, decoder: object, match: str) -> None:
    """kvgen died with an AttributeError, ValueError (int('x')), KeyError or TypeError from deep in the loader."""
    directory = write_wordpiece_dir(tmp_path, WORDPIECE_VOCAB, added_tokens_decoder=decoder)
    with pytest.raises(ModelFormatError, match=match):
        Tokenizer.from_pretrained(directory)


@pytest.mark.parametrize(
    ("config", "vocab", "match"),
    [
        ({"tokenizer_class": "XLNetTokenizer"}, WORDPIECE_VOCAB, r"tokenizer_class='XLNetTokenizer'.*BertTokenizer"),
        ({"tokenizer_class": None}, WORDPIECE_VOCAB, r"only vocab.txt, with tokenizer_class=None"),
        ({}, [t for t in WORDPIECE_VOCAB if t != "[CLS]"], r"cls_token='\[CLS\]' is not in .*vocab.txt"),
        ({"unk_token": "<unk>"}, WORDPIECE_VOCAB, r"unk_token='<unk>' is not in"),
        ({"do_basic_tokenize": False}, WORDPIECE_VOCAB, r"do_basic_tokenize=false"),
        ({"strip_accents": "yes"}, WORDPIECE_VOCAB, r"strip_accents must be true, false or null, got 'yes'"),
        ({"strip_accents": 1}, WORDPIECE_VOCAB, r"strip_accents must be true, false or null, got 1"),
    ],
)
def test_unsupported_vocab_txt_directories_raise(tmp_path: Path, config: dict, vocab: list[str], match: str) -> None:
    directory = write_wordpiece_dir(tmp_path, vocab, **config)
    with pytest.raises(ModelFormatError, match=match):
        Tokenizer.from_pretrained(directory)


def test_continue_final_message_and_chat_template_kwargs_match_transformers(trained: BackendTokenizer, tmp_path: Path) -> None:
    directory = save_gpt2_dir(trained, tmp_path, legacy=False)
    template = "{% if enable_thinking %}<think>{% endif %}" + (directory / "chat_template.jinja").read_text()
    (directory / "chat_template.jinja").write_text(template)
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    messages = [*CONVERSATIONS["system"], {"role": "assistant", "content": "The answer is "}]
    expected = ref.apply_chat_template(messages, continue_final_message=True, tokenize=False, enable_thinking=True)
    got = ours.apply_chat_template(messages, continue_final_message=True, chat_template_kwargs={"enable_thinking": True})
    assert got == expected and got.startswith("<think>") and got.endswith("The answer is ")
    assert not ours.apply_chat_template(messages).startswith("<think>")
    with pytest.raises(ValueError, match="cannot both be true"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    for blank in ("", "  \n"):  # transformers would return the closed turn: nothing to continue
        with pytest.raises(ValueError, match="final message with text to continue"):
            ours.apply_chat_template([*messages[:-1], {"role": "assistant", "content": blank}], continue_final_message=True)


def test_continue_final_message_cuts_where_transformers_does(trained: BackendTokenizer, tmp_path: Path) -> None:
    """transformers continues the last text part of a list content (kvgen joined the parts, not in a prompt that
    renders them apart), and keeps a final message's trailing whitespace only when it has no leading whitespace."""
    directory = save_gpt2_dir(trained, tmp_path, legacy=False)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    user = {"role": "user", "content": "Hi"}
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    finals = ["  padded  \n", "padded  ", "  padded", parts]
    for content in finals:
        messages = [user, {"role": "assistant", "content": content}]
        expected = ref.apply_chat_template(messages, continue_final_message=True, tokenize=False)
        assert ours.apply_chat_template(messages, continue_final_message=True) == expected, content
    assert expected.endswith("[one][two")


@pytest.mark.parametrize("eos", [[[2]], "2", [2, None], -1])
def test_generation_config_eos_ids_of_the_wrong_type_are_named(trained: BackendTokenizer, tmp_path: Path,
                                                               eos: object) -> None:
    """``[[2]]`` escaped as TypeError (unhashable), ``"2"`` was read as the ids of its characters."""
    directory = save_gpt2_dir(trained, tmp_path, False)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id must be a token id or a list of them"):
        Tokenizer.from_pretrained(directory)


def test_generation_config_eos_ids_join_the_tokenizers(trained: BackendTokenizer, tmp_path: Path) -> None:
    directory = save_gpt2_dir(trained, tmp_path, False)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert Tokenizer.from_pretrained(directory).eos_token_ids[-2:] == [5, 7]


@pytest.mark.parametrize("legacy", [False, True], ids=["tokenizer_json", "vocab_merges"])
def test_clean_up_tokenization_spaces_of_the_config_applies_to_byte_level_decode(
    trained: BackendTokenizer, tmp_path: Path, legacy: bool
) -> None:
    """tokenizer_config.json's ``clean_up_tokenization_spaces: true`` (what transformers' GGUF loader saves) makes
    transformers' decode drop " ." and " 's"; kvgen read the flag for a vocab.txt only and kept the spaces."""
    from kvgen.engine.detokenizer import IncrementalDetokenizer

    directory = save_gpt2_dir(trained, tmp_path, legacy, clean_up_tokenization_spaces=True)
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    ids = ref.encode("Hello , world ! I 'm here . it 's", add_special_tokens=False)
    assert ref.decode(ids) == "Hello, world! I'm here. it's"
    assert ours.decode(ids) == ref.decode(ids)
    stream = IncrementalDetokenizer(ours)
    assert "".join(stream.add(i) for i in ids) + stream.flush() == ref.decode(ids)
    plain = Tokenizer.from_pretrained(save_gpt2_dir(trained, tmp_path / "plain", legacy))
    plain_ref = AutoTokenizer.from_pretrained(tmp_path / "plain")
    assert plain.decode(ids) == plain_ref.decode(ids) == "Hello , world ! I 'm here . it 's"


def test_named_tool_use_template_is_taken_with_tools_as_transformers(trained: BackendTokenizer, tmp_path: Path) -> None:
    """A list of named templates in tokenizer_config.json, or additional_chat_templates/NAME.jinja files: with tools
    transformers renders the "tool_use" one; kvgen kept only "default" and rendered it, the tools left out."""
    default = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tool_use = "TOOLS {{ tools | tojson }}\n" + default
    tool = {"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}
    messages = CONVERSATIONS["system"]
    listed = save_gpt2_dir(trained, tmp_path / "listed", legacy=False, chat_template=[
        {"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}])
    (listed / "chat_template.jinja").unlink()
    in_files = save_gpt2_dir(trained, tmp_path / "files", legacy=False)
    (in_files / "chat_template.jinja").write_text(default)
    (in_files / "additional_chat_templates").mkdir()
    (in_files / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    for directory in (listed, in_files):
        ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
        for tools in (None, [tool], []):
            expected = ref.apply_chat_template(messages, tools=tools, tokenize=False)
            assert ours.apply_chat_template(messages, tools=tools) == expected
        assert ours.apply_chat_template(messages, tools=[tool]).startswith("TOOLS [{")
        assert ours.chat_template == default
    only_tool_use = save_gpt2_dir(trained, tmp_path / "only", legacy=False, chat_template=[
        {"name": "tool_use", "template": tool_use}])
    (only_tool_use / "chat_template.jinja").unlink()
    ours, ref = Tokenizer.from_pretrained(only_tool_use), AutoTokenizer.from_pretrained(only_tool_use)
    assert ours.apply_chat_template(messages, tools=[tool]) == ref.apply_chat_template(messages, tools=[tool],
                                                                                         tokenize=False)
    with pytest.raises(ValueError, match="no default"):
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ModelFormatError, match=r"has no chat template \(only the named \['tool_use'\]\)"):
        ours.apply_chat_template(messages)
    ours.chat_template = default  # a given template replaces the named ones too
    assert ours.apply_chat_template(messages, tools=[tool]) == ours.apply_chat_template(messages)


def test_special_tokens_map_counts_only_for_a_legacy_config(trained: BackendTokenizer, tmp_path: Path) -> None:
    """transformers reads special_tokens_map.json only when tokenizer_config.json has no added_tokens_decoder; kvgen
    let the map win over every config, so its eos_token (stop id and template variable) was the map's."""
    directory = save_gpt2_dir(trained, tmp_path, legacy=False)
    (directory / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
                                                   "{{ eos_token }}")
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>",
                                                                   "eos_token": "<|endoftext|>"}))
    config_path = directory / "tokenizer_config.json"
    for is_legacy in (False, True):
        if is_legacy:
            config_path.write_text(json.dumps({k: v for k, v in json.loads(config_path.read_text()).items()
                                               if k != "added_tokens_decoder"}))
        ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
        assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
        messages = CONVERSATIONS["single"]
        assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False)
        assert (ref.eos_token == "<|endoftext|>") is is_legacy


def _added_tokens_dir(tmp_path: Path, added: dict[str, int], **config: object) -> Path:
    directory = write_wordpiece_dir(tmp_path, WORDPIECE_VOCAB, do_lower_case=True, **config)
    (directory / "added_tokens.json").write_text(json.dumps(added))
    return directory


def _assert_added_tokens_match(directory: Path, texts: list[str], ids: list[int]) -> None:
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.vocab_size == len(ref)
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_added_tokens_json_is_ignored_next_to_added_tokens_decoder(tmp_path: Path) -> None:
    """transformers reads added_tokens.json only for a legacy config (no added_tokens_decoder); kvgen added its tokens
    first, so a token of added_tokens_decoder got another id."""
    n = len(WORDPIECE_VOCAB)
    entry = {"special": True, "normalized": False, "lstrip": False, "rstrip": False, "single_word": False}
    directory = _added_tokens_dir(tmp_path, {"newtok": n, "<extra>": n + 1},
                                  added_tokens_decoder={str(n): {"content": "<extra>", **entry}})
    _assert_added_tokens_match(directory, ["<extra> hello newtok", "newtok"], [n, 30, 31])


def test_legacy_added_tokens_json_takes_its_ids_and_special_flags(tmp_path: Path) -> None:
    """A legacy added_tokens.json: ids from the file (kvgen took the key order), and a named special token special and
    not normalized (kvgen normalized it, so "<EXTRA>" matched it where BertTokenizerFast does not)."""
    n = len(WORDPIECE_VOCAB)
    directory = _added_tokens_dir(tmp_path, {"newtok": n + 1, "<extra>": n}, additional_special_tokens=["<extra>"])
    _assert_added_tokens_match(directory, ["<extra> hello newtok", "<EXTRA> NEWTOK"], [n, n + 1, 30])


def test_added_tokens_json_id_must_be_an_int(tmp_path: Path) -> None:
    directory = _added_tokens_dir(tmp_path, {"newtok": "12"})
    with pytest.raises(ModelFormatError, match="the id of 'newtok' must be an int, got '12'"):
        Tokenizer.from_pretrained(directory)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"vocab_size": 1' + "0" * 5000 + "}"],
                         ids=["nested_too_deep", "int_over_4300_digits"])
def test_json_python_cannot_parse_is_named(tmp_path: Path, text: str) -> None:
    """JSON nested past the recursion limit escaped as RecursionError, an integer of over 4300 digits as a ValueError
    naming no file; transformers' config reader fails on both too."""
    from transformers import AutoConfig

    from kvgen.tokenizer.hf_files import read_json

    (tmp_path / "config.json").write_text(text)
    with pytest.raises((RecursionError, ValueError)):
        AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ModelFormatError, match=f"cannot read {tmp_path / 'config.json'}: "):
        read_json(tmp_path / "config.json")
