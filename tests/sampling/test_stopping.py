"""kvgen.sampling.stopping: criteria, finish reasons and the stop-string helpers."""

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast
from transformers.generation import stopping_criteria as hf

from kvgen.sampling.stopping import (
    PRIORITY,
    FinishReason,
    StopChecker,
    StopStrings,
    TokenStops,
    find_stop_string,
    partial_stop_suffix_len,
    reason_of,
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


def _checker(**kwargs) -> StopChecker:
    tokens = kwargs.pop("tokens", TokenStops())
    return StopChecker(tokens, **kwargs)


def _reasons(checker: StopChecker, ids: torch.Tensor) -> list[str | None]:
    return [r.value if (r := reason_of(c)) is not None else None for c in checker.check(ids).tolist()]


def test_max_new_tokens_counts_after_the_prompt():
    checker = _checker(tokens=TokenStops(max_new_tokens=2), prompt_length=3)
    assert _reasons(checker, torch.zeros(2, 4, dtype=torch.long)) == [None, None]
    assert _reasons(checker, torch.zeros(2, 5, dtype=torch.long)) == ["length", "length"]


def test_eos_with_several_ids_matches_transformers():
    ids = torch.tensor([[1, 2], [1, 5], [3, 7], [7, 2]])
    ours = _checker(tokens=TokenStops(eos_token_ids=(5, 7)), prompt_length=1).check(ids) > 0
    assert ours.tolist() == [False, True, True, False]
    assert torch.equal(ours, hf.EosTokenCriteria(eos_token_id=[5, 7])(ids, None))
    assert _reasons(_checker(tokens=TokenStops(eos_token_ids=(2,)), prompt_length=1), ids) == ["stop", None, None, "stop"]


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
    stops = StopStrings(("stop", "\n\n"))
    checker = _checker(prompt_length=1, stop_strings=stops, decode=decode)
    ids = torch.tensor([[ID["ab"], *ids_of(*pieces)]])  # the prompt "ab" is ignored
    assert _reasons(checker, ids) == ["stop_string" if expected else None]
    assert find_stop_string(decode(ids_of(*pieces)), stops.stops) == expected


def test_stop_strings_in_the_prompt_are_ignored():
    checker = _checker(prompt_length=2, stop_strings=StopStrings(("stop",)), decode=decode)
    ids = torch.tensor([ids_of("st", "op", "x", "a"), ids_of("x", "a", "st", "op")])  # row 0's "stop" is prompt
    assert _reasons(checker, ids) == [None, "stop_string"]


def test_stop_string_first_hit_matches_transformers():
    stops = ["stop", "\n\n", "aba"]
    theirs = hf.StopStringCriteria(tokenizer=hf_tokenizer(), stop_strings=stops)
    ours = _checker(prompt_length=0, stop_strings=StopStrings(tuple(stops)), decode=decode)
    rng = random.Random(0)
    num_rows, num_steps = 300, 10
    ids = torch.tensor([[rng.randrange(2, len(PIECES)) for _ in range(num_steps)] for _ in range(num_rows)])
    first_ours, first_theirs = [None] * num_rows, [None] * num_rows
    for step in range(1, num_steps + 1):
        prefix = ids[:, :step]  # [B, step]: the checks run after every new token
        for first, hits in ((first_ours, ours.check(prefix) > 0), (first_theirs, theirs(prefix, None))):
            for row in hits.nonzero().flatten().tolist():
                first[row] = step if first[row] is None else first[row]
    assert first_ours == first_theirs
    assert sum(f is not None for f in first_ours) > num_rows // 4  # many rows actually stop


def test_stop_strings_hit_where_they_overlap_the_last_token_as_transformers():
    """A row that runs on past a match (the beams of group and constrained beam search) is hit at every step
    exactly where transformers' criterion hits it: the match must end in the last token's text."""
    stops = ["stop", "\n\n", "aba"]
    theirs = hf.StopStringCriteria(tokenizer=hf_tokenizer(), stop_strings=stops)
    ours = _checker(prompt_length=0, stop_strings=StopStrings(tuple(stops)), decode=decode)
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(2, len(PIECES)) for _ in range(10)] for _ in range(300)])
    hits = []
    for step in range(1, 11):
        mine = (ours.check(ids[:, :step]) > 0).tolist()
        assert mine == theirs(ids[:, :step], None).tolist()
        hits.append(mine)
    assert any(hits[t][r] and not hits[t + 1][r] for t in range(9) for r in range(300))  # runs past a match


def test_stop_strings_may_begin_in_the_prompt_as_transformers():
    """transformers' criterion reads the prompt's tail too: after a 3-token prompt, every step hits where it hits,
    including stop strings that begin in the prompt and end in the first new token."""
    stops = ["stop", "\n\n", "aba"]
    theirs = hf.StopStringCriteria(tokenizer=hf_tokenizer(), stop_strings=stops)
    ours = _checker(prompt_length=3, stop_strings=StopStrings(tuple(stops)), decode=decode)
    rng = random.Random(2)
    ids = torch.tensor([[rng.randrange(2, len(PIECES)) for _ in range(8)] for _ in range(300)])
    for step in range(4, 9):
        assert (ours.check(ids[:, :step]) > 0).tolist() == theirs(ids[:, :step], None).tolist()
    first_hits = (ours.check(ids[:, :4]) > 0).tolist()
    new_text_only = [find_stop_string(decode(ids[r, 3:4].tolist()), stops) for r in range(300)]
    assert any(hit and alone is None for hit, alone in zip(first_hits, new_text_only))  # some begin in the prompt


def test_max_time_uses_the_given_clock():
    now = [100.0]
    checker = _checker(prompt_length=0, max_time=2.0, clock=lambda: now[0])
    ids = torch.zeros(3, 1, dtype=torch.long)
    now[0] = 101.9
    assert _reasons(checker, ids) == [None] * 3
    now[0] = 102.1
    assert _reasons(checker, ids) == ["time"] * 3
    assert _reasons(_checker(prompt_length=0, max_time=60.0), ids) == [None] * 3  # time.monotonic, started now
    assert _reasons(_checker(prompt_length=0, max_time=0.5, start_time=1.0, clock=lambda: 2.0), ids) == ["time"] * 3


def test_priority_eos_then_stop_strings_then_time_then_length():
    prompt = ids_of("x")
    rows = [("a", "b"), ("st", "op"), ("a", "x"), ("x", "a")]
    ids = torch.tensor([prompt + ids_of(*row) for row in rows])
    checker = _checker(tokens=TokenStops(eos_token_ids=(ID["b"],), max_new_tokens=2), prompt_length=1,
                       stop_strings=StopStrings(("stop",)), decode=decode)
    assert _reasons(checker, ids) == ["stop", "stop_string", "length", "length"]
    assert _reasons(checker, ids[:, :2]) == [None] * 4
    assert PRIORITY == (FinishReason.STOP, FinishReason.STOP_STRING, FinishReason.TIME, FinishReason.LENGTH)


def test_token_stops_for_the_engine():
    stops = TokenStops(eos_token_ids=(0,), stop_token_ids=(7,), min_new_tokens=2, max_new_tokens=5, max_total_tokens=9)
    assert stops.check(0, 1, 4) is None  # EOS before min_tokens does not stop
    assert stops.check(7, 1, 4) is None
    assert stops.check(0, 2, 5) == (FinishReason.STOP, None)
    assert stops.check(7, 2, 5) == (FinishReason.STOP, 7)  # the stop token id is the stop_reason
    assert stops.check(7, 5, 8) == (FinishReason.STOP, 7)  # a stop token wins over length
    assert stops.check(3, 5, 8) == (FinishReason.LENGTH, None)
    assert stops.check(3, 3, 9) == (FinishReason.LENGTH, None)  # max_model_len reached
    assert stops.check(3, 3, 8) is None


def test_finish_reasons_map_to_openai():
    assert {r: r.to_openai() for r in FinishReason} == {
        FinishReason.STOP: "stop", FinishReason.STOP_STRING: "stop", FinishReason.TIME: "length",
        FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
    }


def test_stop_strings_match_new_text_and_hold_back():
    stops = StopStrings(("world", "\n\n"))
    assert stops.match_new("hello world", 6) == (6, "world")
    assert StopStrings(("world",), include_in_output=True).match_new("hello world!", 9) == (11, "world")
    assert stops.num_streamable("hello wor") == 6
    assert stops.match_new("hello", 0) is None
    # vLLM's window: each stop string must end past old_len (text before it may be min_tokens text, never searched)
    assert StopStrings(("e", "zzzzz")).match_new("hello wor", 5) is None
    assert StopStrings(("l", "lo w")).match_new("hello wor", 5) == (3, "lo w")


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
        (lambda: StopStrings(()), r"stop_strings must be a non-empty list"),
        (lambda: StopStrings(("ok", "")), r"stop_strings must be a non-empty list of non-empty"),
        (lambda: StopChecker(TokenStops(), -1), r"prompt_length must be an int >= 0, got -1"),
        (lambda: StopChecker(TokenStops(), 0, StopStrings(("x",))), r"stop_strings need a decode function"),
    ],
)
def test_invalid_settings_raise_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()
