"""Text <-> token ids: one ``Tokenizer`` over the Hugging Face ``tokenizers`` library.

``tokenizer`` holds the ``Tokenizer`` class; ``gguf_vocab`` rebuilds a backend from GGUF
metadata, ``hf_files`` from a Hugging Face directory (``byte_level`` and ``wordpiece`` build
the backends), ``special_tokens`` the ids with a role. Incremental detokenization lives in
:mod:`kvgen.engine.detokenizer`.
"""

from kvgen.chat_template import ChatTemplateError
from kvgen.tokenizer.byte_level import ByteLevelVariant, build_byte_level_bpe
from kvgen.tokenizer.gguf_vocab import GGUF_PRE_TOKENIZERS, GGUFTokenType
from kvgen.tokenizer.special_tokens import SpecialTokenIds, check_token_ids
from kvgen.tokenizer.tokenizer import Tokenizer

__all__ = [
    "GGUF_PRE_TOKENIZERS",
    "ByteLevelVariant",
    "ChatTemplateError",
    "GGUFTokenType",
    "SpecialTokenIds",
    "Tokenizer",
    "build_byte_level_bpe",
    "check_token_ids",
]
