"""kvgen.sampling.stopping: criteria, finish reasons and the stop-string helpers."""

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast
from transformers.generation import stopping_criteria as hf

from kvgen.sampling.stopping import (
    EosTokenCriteria,
    MaxNewTokensCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    find_stop_string,
    partial_stop_suffix_len,
)

# A toy vocabulary whose tokens are their own text, so a stop string can span several tokens.
PIECES = ["<unk>", "abcdef", "st", "op", "s", "to", "p", "pped", "las", "topper", "a", "ab", "b", "\n", "\n\n", "x"]
ID = {p: i for i, p in enumerate(PIECES)}


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def ids_of(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def hf_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab=ID, unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # tokens concatenate without spaces, like `decode` above
    return PreTrainedTokenizerFast(tokenizer_object=backend)


# ------------------------------------------------------------------ criteria


def test_max_new_tokens_counts_after_the_prompt():
    criteria = MaxNewTokensCriteria(max_new_tokens=2, prompt_length=3)
    assert criteria(torch.zeros(2, 4, dtype=torch.long)).tolist() == [False, False]
    assert criteria(torch.zeros(2, 5, dtype=torch.long)).tolist() == [True, True]


def test_eos_with_several_ids_matches_transformers():
    ids = torch.tensor([[1, 2], [1, 5], [3, 7], [7, 2]])
    ours = EosTokenCriteria([5, 7])(ids, None)
    assert ours.tolist() == [False, True, True, False]
    assert torch.equal(ours, hf.EosTokenCriteria(eos_token_id=[5, 7])(ids, None))
    assert EosTokenCriteria(2)(ids).tolist() == [True, False, False, True]


@pytest.mark.parametrize(
    "pieces,expected",
    [
        (("st", "op"), (0, "stop")),
        (("las", "topper"), (2, "stop")),
        (("s", "to", "pped"), (0, "stop")),
        (("x", "\n", "\n"), (1, "\n\n")),
        (("a", "b", "x"), None),
        (("x", "st"), None),  # only a partial stop string so far
    ],
)
def test_stop_strings_span_token_boundaries(pieces, expected):
    criteria = StopStringCriteria(["stop", "\n\n"], decode, prompt_length=1)
    ids = torch.tensor([[ID["ab"], *ids_of(*pieces)]])  # the prompt "ab" is ignored
    assert criteria(ids).tolist() == [expected is not None]
    assert criteria.matches == [expected]


def test_stop_strings_in_the_prompt_are_ignored():
    criteria = StopStringCriteria("stop", decode, prompt_length=2)
    ids = torch.tensor([ids_of("st", "op", "x", "a"), ids_of("x", "a", "st", "op")])  # row 0's "stop" is prompt
    assert criteria(ids).tolist() == [False, True]
    assert criteria.matches == [None, (0, "stop")]


def test_stop_string_first_hit_matches_transformers():
    stops = ["stop", "\n\n", "aba"]
    theirs = hf.StopStringCriteria(tokenizer=hf_tokenizer(), stop_strings=stops)
    ours = StopStringCriteria(stops, decode, prompt_length=0)
    rng = random.Random(0)
    num_rows, num_steps = 300, 10
    ids = torch.tensor([[rng.randrange(2, len(PIECES)) for _ in range(num_steps)] for _ in range(num_rows)])
    first_ours, first_theirs = [None] * num_rows, [None] * num_rows
    for step in range(1, num_steps + 1):
        prefix = ids[:, :step]  # [B, step]: the criteria run after every new token
        for first, hits in ((first_ours, ours(prefix)), (first_theirs, theirs(prefix, None))):
            for row in hits.nonzero().flatten().tolist():
                first[row] = step if first[row] is None else first[row]
    assert first_ours == first_theirs
    assert sum(f is not None for f in first_ours) > num_rows // 4  # many rows actually stop


def test_max_time_uses_the_given_clock():
    now = [100.0]
    criteria = MaxTimeCriteria(2.0, clock=lambda: now[0])
    ids = torch.zeros(3, 1, dtype=torch.long)
    now[0] = 101.9
    assert criteria(ids).tolist() == [False] * 3
    now[0] = 102.1
    assert criteria(ids).tolist() == [True] * 3
    assert MaxTimeCriteria(60.0)(ids).tolist() == [False] * 3  # time.monotonic, started now
    assert MaxTimeCriteria(0.5, start_time=-1e9)(ids).tolist() == [True] * 3


def test_list_ors_criteria_and_names_finish_reasons():
    prompt = ids_of("x")
    rows = [("a", "b"), ("st", "op"), ("a", "x"), ("x", "a")]
    ids = torch.tensor([prompt + ids_of(*row) for row in rows])
    criteria = StoppingCriteriaList(
        [MaxNewTokensCriteria(2, prompt_length=1), StopStringCriteria(["stop"], decode, 1), EosTokenCriteria(ID["b"])]
    )
    is_done, reasons = criteria.check(ids)
    assert is_done.tolist() == [True] * 4
    assert criteria(ids).tolist() == [True] * 4
    assert reasons == ["stop", "stop_string", "length", "length"]  # EOS, then stop strings, then length
    is_done, reasons = criteria.check(ids[:, :2])
    assert is_done.tolist() == [False] * 4 and reasons == [None] * 4
    empty = StoppingCriteriaList()
    assert empty(ids).tolist() == [False] * 4 and empty.check(ids)[1] == [None] * 4


# ------------------------------------------------------------------ helpers


def test_find_stop_string_returns_the_earliest_match():
    assert find_stop_string("hello world. bye", ["bye", "."]) == (11, ".")
    assert find_stop_string("abcabc", ["bc", "abc"]) == (0, "abc")
    assert find_stop_string("xabcd", ["abcd", "ab", "abc"]) == (1, "ab")  # same start: the shortest completes first
    assert find_stop_string("nothing here", ["stop"]) is None
    assert find_stop_string("", ["stop"]) is None
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        find_stop_string("text", ["ok", ""])


def test_partial_stop_suffix_len_examples():
    assert partial_stop_suffix_len("hello wor", ["world"]) == 3
    assert partial_stop_suffix_len("hello world", ["world"]) == 0  # a full match is not a partial one
    assert partial_stop_suffix_len("foo\n", ["\n\n", "oo\nbar"]) == 3
    assert partial_stop_suffix_len("abc", ["x"]) == 0
    assert partial_stop_suffix_len("", ["stop"]) == 0
    assert partial_stop_suffix_len("s", ["stop"]) == 1


def brute_force_partial(text: str, stops: list[str]) -> int:
    return max(
        [k for k in range(1, len(text) + 1) for s in stops if k < len(s) and s.startswith(text[len(text) - k :])],
        default=0,
    )


def test_partial_stop_suffix_len_matches_brute_force():
    rng = random.Random(1)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 8)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        assert partial_stop_suffix_len(text, stops) == brute_force_partial(text, stops), (text, stops)


def test_streaming_with_hold_back_never_leaks_a_stop_string():
    rng = random.Random(2)
    stops = ["stop", "\n\n", "aba"]
    num_stopped = 0
    for _ in range(300):
        text, sent, match = "", "", None
        for piece in (rng.choice(PIECES[2:]) for _ in range(12)):
            text += piece
            match = find_stop_string(text, stops)
            if match is not None:
                assert match[0] >= len(sent)  # nothing already sent belongs to the stop string
                sent += text[len(sent) : match[0]]
                num_stopped += 1
                break
            visible = len(text) - partial_stop_suffix_len(text, stops)
            assert visible >= len(sent)  # held-back text is only ever released, never retracted
            sent += text[len(sent) : visible]
        else:
            sent += text[len(sent) :]  # end of stream: release what was held back
        assert sent == (text if match is None else text[: match[0]])
        assert find_stop_string(sent, stops) is None
    assert num_stopped > 50


# --------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: MaxNewTokensCriteria(0, 3), r"max_new_tokens must be an int >= 1, got 0"),
        (lambda: MaxNewTokensCriteria(5, -1), r"prompt_length must be an int >= 0, got -1"),
        (lambda: EosTokenCriteria([]), r"eos_token_id must name at least one id"),
        (lambda: StopStringCriteria([], decode, 0), r"stop_strings must be a non-empty list"),
        (lambda: StopStringCriteria(["ok", ""], decode, 0), r"stop_strings must be a non-empty list of non-empty"),
        (lambda: MaxTimeCriteria(0.0), r"max_time must be > 0 seconds, got 0\.0"),
    ],
)
def test_invalid_criteria_raise_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()
