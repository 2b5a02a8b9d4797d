"""The n-gram draft of prompt lookup decoding (``generate()``) and of n-gram speculative decoding (the engine).

Draft = the tokens that followed the first earlier occurrence of the sequence's longest suffix n-gram.
Source: transformers 4.55 ``PromptLookupCandidateGenerator.get_candidates`` (n from the largest size down,
first occurrence, draft cut before an EOS id); vLLM's ``prompt_lookup_min`` as the smallest n tried.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence


def find_draft(
    ids: Sequence[int], max_ngram_size: int, num_tokens: int, eos_token_ids: Sequence[int] = (), min_ngram_size: int = 1
) -> list[int]:
    """Up to ``num_tokens`` ids that followed the first earlier occurrence of the longest suffix n-gram of ``ids``
    (n = ``max_ngram_size`` down to ``min_ngram_size``), cut before any EOS id; [] when none is found.

    ``ids``: the whole sequence (prompt and output), ints (a 1-D tensor's ``tolist()``). The search is a
    byte-string search over the ids as 64-bit words (C speed: ~µs for thousands of tokens).
    """
    length = len(ids)
    if num_tokens < 1 or length < 2:
        return []
    words = array("q", ids).tobytes()  # 8 bytes per id
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        pattern = words[8 * (length - n) :]
        pos = words.find(pattern)
        while pos != -1:
            start = pos // 8
            if pos % 8 == 0:  # a whole-id match (a byte search can also match across id boundaries)
                begin, end = start + n, min(start + n + num_tokens, length)
                if begin < end:  # not the suffix itself
                    draft = list(ids[begin:end])
                    cut = next((i for i, t in enumerate(draft) if t in eos_token_ids), len(draft))
                    return draft[:cut]
                break  # the suffix itself is the last occurrence
            pos = words.find(pattern, pos + 1)
    return []
