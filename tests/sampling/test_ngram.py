import random

import torch

from kvgen.sampling.ngram import find_draft


def _unfold_draft(ids: list[int], max_n: int, num_tokens: int, eos: list[int], min_n: int = 1) -> list[int]:
    """transformers' PromptLookupCandidateGenerator search (unfold + all), the spec find_draft follows."""
    t = torch.tensor(ids)
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        windows = t.unfold(0, n, 1)  # [S - n + 1, n]
        for start in (windows == t[-n:]).all(dim=1).nonzero().flatten().tolist():
            begin, end = start + n, min(start + n + num_tokens, len(ids))
            if begin < end:
                draft = ids[begin:end]
                cut = next((i for i, x in enumerate(draft) if x in eos), len(draft))
                return draft[:cut]
    return []


def test_find_draft_takes_the_first_match_of_the_longest_ngram_and_cuts_at_eos():
    ids = [1, 2, 3, 9, 4, 1, 2, 7, 1, 2]
    assert find_draft(ids, 2, 3, []) == [3, 9, 4]  # [1, 2] first occurs at 0
    assert find_draft(ids, 2, 3, [9]) == [3]
    assert find_draft(ids, 2, 10, []) == [3, 9, 4, 1, 2, 7, 1, 2]  # up to the end of the sequence
    assert find_draft([4, 5, 6], 2, 3, []) == []
    assert find_draft([8, 5, 6, 8], 3, 2, []) == [5, 6]  # falls back to the 1-gram [8]
    assert find_draft([8, 5, 6, 8], 3, 2, [], min_ngram_size=2) == []  # vLLM's prompt_lookup_min
    assert find_draft(ids, 2, 0, []) == [] and find_draft([7], 2, 3, []) == []


def test_find_draft_matches_whole_ids_only():
    # 256 = bytes 00 01 00.., 1 = 01 00 ..: a byte search finds [1, 0] inside [256] shifted by one byte
    assert find_draft([256, 0, 0, 5, 1], 1, 2, []) == [] and find_draft([1, 256, 0, 1], 1, 2, []) == [256, 0]
    assert find_draft([2**40 + 3, 9, 3], 1, 1, []) == []


def test_find_draft_equals_the_unfold_search_on_random_sequences():
    rng = random.Random(0)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 300, 70000])
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        max_n, k, min_n = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 2)
        eos = [rng.randrange(vocab)] if trial % 3 == 0 else []
        assert find_draft(ids, max_n, k, eos, min_n) == _unfold_draft(ids, max_n, k, eos, min_n), (ids, max_n, k, eos)
