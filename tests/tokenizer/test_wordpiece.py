"""kvgen.tokenizer.wordpiece: BERT-style vocab.txt tokenizers against transformers' BertTokenizer.

Every expected id and string comes from ``transformers.BertTokenizer`` (the slow, Python
reference) on the same vocab.txt and options, and from ``BertTokenizerFast`` as AutoTokenizer
builds it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizer_cases import WORDPIECE_STRINGS, WORDPIECE_VOCAB, write_wordpiece_dir
from transformers import AutoTokenizer, BertTokenizer, BertTokenizerFast

from kvgen.tokenizer import Tokenizer
from kvgen.tokenizer.wordpiece import StreamingCleanUp, clean_up_tokenization

CONFIGS: dict[str, dict[str, Any]] = {
    "lower": {"do_lower_case": True},
    "cased": {"do_lower_case": False},
    "no_chinese_split": {"do_lower_case": True, "tokenize_chinese_chars": False},
    "keep_accents": {"do_lower_case": True, "strip_accents": False},
    "strip_accents_cased": {"do_lower_case": False, "strip_accents": True},
    "no_clean_up": {"do_lower_case": True, "clean_up_tokenization_spaces": False},
}


def _pair(tmp_path: Path, config: dict[str, Any]) -> tuple[Tokenizer, BertTokenizer]:
    directory = write_wordpiece_dir(tmp_path / "tok", WORDPIECE_VOCAB, **config)
    return Tokenizer.from_pretrained(directory), BertTokenizer(vocab_file=str(directory / "vocab.txt"), **config)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_encode_matches_bert_tokenizer(tmp_path: Path, name: str) -> None:
    ours, ref = _pair(tmp_path, CONFIGS[name])
    for text in WORDPIECE_STRINGS:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text) == ref.encode(text), text
    assert ours.encode("你好")[0] == ref.cls_token_id and ours.encode("你好")[-1] == ref.sep_token_id


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_matches_bert_tokenizer(tmp_path: Path, name: str) -> None:
    ours, ref = _pair(tmp_path, CONFIGS[name])
    rng = random.Random(0)
    encoded = [ref.encode(text) for text in WORDPIECE_STRINGS]
    # Arbitrary ids too: "##" pieces first, "'" between words, specials in the middle.
    arbitrary = [[rng.randrange(len(WORDPIECE_VOCAB)) for _ in range(rng.randrange(1, 30))] for _ in range(100)]
    for ids in encoded + arbitrary:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids


def test_matches_bert_tokenizer_fast_from_auto_tokenizer(tmp_path: Path) -> None:
    directory = write_wordpiece_dir(tmp_path, WORDPIECE_VOCAB, do_lower_case=True)
    ours, ref = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    assert isinstance(ref, BertTokenizerFast)
    for text in WORDPIECE_STRINGS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(ref)
    assert ours.all_special_ids == sorted(ref.all_special_ids)


def test_a_vocab_with_duplicate_lines_decodes_every_id_as_transformers(tmp_path: Path) -> None:
    """vocab.txt repeating a token: the later line's id wins (encode) and every line's id decodes, as transformers'
    tokenizers do; kvgen counted distinct tokens and refused the last ids ("token id must be in [0, n)")."""
    vocab = [*WORDPIECE_VOCAB, WORDPIECE_VOCAB[-1], WORDPIECE_VOCAB[-2]]
    directory = write_wordpiece_dir(tmp_path, vocab, do_lower_case=True)
    ours, fast = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    slow = BertTokenizer(vocab_file=str(directory / "vocab.txt"), do_lower_case=True)
    assert ours.vocab_size == len(vocab)
    for text in WORDPIECE_STRINGS:
        assert ours.encode(text) == fast.encode(text) == slow.encode(text), text
    every_id = list(range(len(vocab)))
    for skip in (False, True):
        assert ours.decode(every_id, skip_special_tokens=skip) == fast.decode(every_id, skip_special_tokens=skip)


def test_vocab_lines_keep_their_trailing_whitespace_as_transformers(tmp_path: Path) -> None:
    """vocab.txt lines are tokens as transformers' load_vocab reads them (only the line break removed; "\\r" and
    "\\r\\n" end a line): kvgen read it with tokenizers' WordPiece.read_file, which trims trailing whitespace, so
    "hello " took the id of "hello" and the "\\u3000" line became an empty token."""
    vocab = [*WORDPIECE_VOCAB[:40], "hello ", "\u3000", "world\t", *WORDPIECE_VOCAB[40:]]
    directory = write_wordpiece_dir(tmp_path, vocab, do_lower_case=True)
    text = "\n".join(vocab[:20]) + "\r" + "\r\n".join(vocab[20:]) + "\n"  # a lone "\r" and "\r\n" line breaks too
    (directory / "vocab.txt").write_bytes(text.encode("utf-8"))
    ours = Tokenizer.from_pretrained(directory)
    every_id = list(range(len(vocab)))
    for ref in (AutoTokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory, use_fast=False)):
        assert ours.vocab_size == len(ref)
        for text in WORDPIECE_STRINGS:
            assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(every_id) == ref.decode(every_id)


def test_special_ids_stop_generation_at_sep(tmp_path: Path) -> None:
    ours, ref = _pair(tmp_path, CONFIGS["lower"])
    assert ref.bos_token_id is None and ref.eos_token_id is None  # BertTokenizer has neither
    assert ours.bos_token_id is None and not ours.add_bos_token
    assert ours.eos_token_ids == [ref.sep_token_id]  # kvgen's choice: generation stops at [SEP]
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.token_to_id("[UNK]") == ref.unk_token_id
    assert ours.id_to_token(ref.mask_token_id) == "[MASK]"


def test_clean_up_matches_transformers() -> None:
    text = "a . b ? c ! d , it ' s we ' re I 'm you 've can n't x 's o ' ' ' ja"
    assert clean_up_tokenization(text) == BertTokenizer.clean_up_tokenization(text)


def test_streaming_clean_up_equals_clean_up_of_the_whole_text() -> None:
    rng = random.Random(0)
    alphabet = [" ", "'", ".", "n", "t", "s", "m", "v", "e", "r", "a", ",", "?", "!"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(min(6, len(text) + 1))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = StreamingCleanUp()
        assert "".join(stream.feed(p) for p in pieces) + stream.flush() == clean_up_tokenization(text), pieces
