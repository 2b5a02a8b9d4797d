"""Strings, conversations and small trained vocabularies shared by the tokenizer tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import GPT2TokenizerFast

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



def ref_decode(ref, ids: list[int], skip: bool) -> str:
    # transformers' GGUF loader sets clean_up_tokenization_spaces=True (" ," -> ","); the
    # file (and llama.cpp) does no clean-up, so compare with it off.
    return ref.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def train_byte_level(vocab_size: int = 700) -> BackendTokenizer:
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


def save_gpt2_dir(trained: BackendTokenizer, directory: Path, legacy: bool, **config: object) -> Path:
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


# A BERT-style vocabulary: specials, Chinese characters, English words and ## pieces, punctuation.
WORDPIECE_VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + list("你好世界中文我们是的天气很不错吗，。！？、")
    + ["hello", "world", "the", "weather", "is", "fine", "cafe", "naive", "resume", "it", "don", "we", "go"]
    + ["Hello", "World", "The", "café", "naïve", "Résumé", "HELLO"]
    + list("abcdefghijklmnopqrstuvwxyz.,!?'-()")
    + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    + ["##ing", "##ed", "##ly", "##llo", "##orld", "##é", "##ï"]
)

# Mixed Chinese / English text: upper case, accents, punctuation, specials, characters not in the vocabulary.
WORDPIECE_STRINGS = [
    "",
    "你好，世界！",
    "Hello World. 你好世界",
    "HELLO 我们 Café naïve Résumé!",
    "it's fine, don't go? 天气很不错。",
    "the weather's fine (we go) - really",
    "[CLS] 你好 [SEP] hello [MASK] world [PAD]",
    "  spaces\tand\nnewlines   ",
    "ÅNGSTRÖM straße 日本語 한국어",
    "helloing worlded cafés naïvely",
]


def write_wordpiece_dir(directory: Path, vocab: list[str], **config: object) -> Path:
    """``vocab.txt`` and a ``tokenizer_config.json`` naming BertTokenizer (plus ``config``) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", **config}))
    return directory
