"""kvgen.sampling.ops against transformers' logits processors, per-row equivalence, purity and sampling."""

import math

import pytest
import torch
from helpers import assert_same, random_ids, random_logits
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from kvgen.sampling import ops

INF = float("inf")

# (B, V, scale, num_inf, integer-valued so that ties occur)
LOGIT_CASES = [
    (1, 5, 1.0, 0, False),
    (4, 50, 3.0, 5, False),
    (8, 1000, 1.0, 100, False),
    (3, 7, 30.0, 2, False),  # peaked: most probabilities underflow
    (2, 64, 0.01, 0, False),  # nearly uniform
    (5, 40, 1.0, 4, True),  # many ties
]


def all_cases():
    ids = [f"B{c[0]}V{c[1]}s{c[2]}inf{c[3]}{'ties' if c[4] else ''}" for c in LOGIT_CASES]
    return [pytest.param((i, *c), id=name) for i, (c, name) in enumerate(zip(LOGIT_CASES, ids))]


# ------------------------------------------------------------ vs transformers

WARPER_CASES = [
    # (our op, HF factory, values)
    (ops.apply_top_k, lambda v, k: TopKLogitsWarper(top_k=v, min_tokens_to_keep=k), [1, 3, 50, 2000]),
    (ops.apply_top_p, lambda v, k: TopPLogitsWarper(top_p=v, min_tokens_to_keep=k), [1e-6, 0.1, 0.5, 0.9, 0.999999]),
    (ops.apply_min_p, lambda v, k: MinPLogitsWarper(min_p=v, min_tokens_to_keep=k), [0.0, 0.05, 0.5, 1.0]),
    (ops.apply_typical_p, lambda v, k: TypicalLogitsWarper(mass=v, min_tokens_to_keep=k), [0.01, 0.5, 0.95, 0.999]),
    (ops.apply_epsilon_cutoff, lambda v, k: EpsilonLogitsWarper(v, min_tokens_to_keep=k), [1e-4, 0.03, 0.5, 0.999]),
    (ops.apply_eta_cutoff, lambda v, k: EtaLogitsWarper(v, min_tokens_to_keep=k), [1e-4, 0.03, 0.5, 0.999]),
]


@pytest.mark.parametrize("op,hf,values", WARPER_CASES, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("case", all_cases())
@pytest.mark.parametrize("min_tokens_to_keep", [1, 3])
def test_warpers_match_transformers(op, hf, values, case, min_tokens_to_keep):
    seed, *shape = case
    logits = random_logits(seed, *shape)
    ids = random_ids(seed, logits.shape[0], 3, logits.shape[1])
    for value in values:
        expected = hf(value, min_tokens_to_keep)(ids, logits.clone())
        assert_same(op(logits, value, min_tokens_to_keep), expected)


def _llm_like_logits(seed: int, B: int, V: int) -> torch.Tensor:
    """Rows shaped like a language model's: a few dozen strong ids over a long Gaussian tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 2  # [B, V]
    head = torch.randint(0, V, (B, 40), generator=g)  # [B, 40]
    return x.scatter_add(1, head, 12 + 4 * torch.rand(B, 40, generator=g))


TOP_P_ROWS = {
    "llm_like": lambda: _llm_like_logits(0, 16, 49_152),
    "llm_like_top_k": lambda: ops.apply_top_k(_llm_like_logits(1, 8, 49_152), 50),
    "llm_like_fp16_ties": lambda: _llm_like_logits(2, 8, 4_000).half().float(),
    "integer_ties": lambda: random_logits(3, 8, 2_000, ties=True) * 3,
    "flat": lambda: random_logits(4, 4, 2_000, scale=0.05),
    "minus_inf": lambda: random_logits(5, 8, 3_000, scale=4.0, num_inf=2_900),
}


@pytest.mark.parametrize("rows", list(TOP_P_ROWS), ids=str)
@pytest.mark.parametrize("min_tokens_to_keep", [1, 4])
def test_top_p_on_vocab_sized_rows_matches_transformers(rows, min_tokens_to_keep, monkeypatch):
    """apply_top_p decides most rows from their largest logits and sorts the rest: every row equals HF's full
    sort, ties and float noise at the threshold included; LLM-like rows never need the sort."""
    logits, sorted_rows, by_sort = TOP_P_ROWS[rows](), {}, ops._top_p_by_sort
    for p in (0.05, 0.5, 0.8, 0.9, 0.95, 0.999):

        def counted_sort(x: torch.Tensor, *args, p: float = p) -> torch.Tensor:
            sorted_rows[p] = sorted_rows.get(p, 0) + x.shape[0]
            return by_sort(x, *args)

        monkeypatch.setattr(ops, "_top_p_by_sort", counted_sort)
        expected = TopPLogitsWarper(top_p=p, min_tokens_to_keep=min_tokens_to_keep)(None, logits.clone())
        assert_same(ops.apply_top_p(logits, p, min_tokens_to_keep), expected)
    if rows in ("llm_like", "llm_like_top_k"):
        assert not any(sorted_rows.get(p) for p in (0.05, 0.5, 0.8, 0.9, 0.95))
    if rows == "flat":
        assert sorted_rows.get(0.95)  # thousands of ids kept: decided by the sort
    per_row = torch.tensor([1.0, 0.9, 0.5, 1.0] * (logits.shape[0] // 4), dtype=torch.float64)  # disabled rows mixed in
    expected = torch.cat([TopPLogitsWarper(top_p=float(v), min_tokens_to_keep=min_tokens_to_keep)(None, row[None])
                          if v < 1 else row[None] for v, row in zip(per_row, logits.clone())])
    assert_same(ops.apply_top_p(logits, per_row, min_tokens_to_keep), expected)


def test_top_p_candidates_defer_a_cut_within_float_noise_or_between_ties():
    """A cut within _TOP_P_MARGIN of 1 - top_p, or between two equal logits, is left to the full sort."""
    x = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)] + [-INF] * 97])  # [1, 100]
    threshold = torch.tensor([[0.2]])  # 1 - top_p: cuts exactly at the third id's cumulative 0.2
    _, certain = ops._top_p_from_candidates(x, threshold, 1, 8)
    assert not bool(certain[0])
    _, certain = ops._top_p_from_candidates(x, torch.tensor([[0.1]]), 1, 8)
    assert bool(certain[0])
    tied = torch.tensor([[2.0, 1.0, 1.0] + [-5.0] * 97])
    _, certain = ops._top_p_from_candidates(tied, torch.tensor([[0.3]]), 1, 8)  # cut between the two 1.0s
    assert not bool(certain[0])
    _, certain = ops._top_p_from_candidates(tied, torch.tensor([[0.5]]), 1, 8)  # cut between 2.0 and 1.0
    assert bool(certain[0])


def test_top_p_at_exactly_a_cumulative_probability_matches_transformers():
    """1 - top_p set to exactly one of HF's float32 cumulative probabilities, at each of the top ranks: the token
    there is removed (HF's ``<=``), the candidates defer each such row to the full sort (its float64 sums round
    above or below HF's float32 ones at V = 300), with min_tokens_to_keep 1 and 2."""
    logits = _llm_like_logits(6, 8, 300)  # [8, V]
    cumulative = logits.sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)  # [8, V], HF's ascending cumulative
    for rank in range(1, 12):  # the boundary just below the rank-th largest logit
        for row in range(logits.shape[0]):
            top_p = 1 - float(cumulative[row, -rank - 1])
            for keep in (1, 2):
                expected = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=keep)(None, logits[row : row + 1].clone())
                assert_same(ops.apply_top_p(logits[row : row + 1], top_p, keep), expected)


def test_cutoffs_exactly_at_their_threshold_match_transformers():
    """Probabilities that are exact in float32 put a token exactly on each cutoff: top_p removes a cumulative
    probability equal to 1 - top_p, typical_p counts only cumulative mass below typical_p, epsilon_cutoff keeps a
    probability equal to epsilon (HF's ``<=``, ``<``, ``<``)."""
    uniform = torch.zeros(2, 8)  # [2, 8]: probabilities 1/8, cumulative 1/8, 2/8, ...
    for top_p in (0.25, 0.5, 0.75):
        assert_same(ops.apply_top_p(uniform, top_p), TopPLogitsWarper(top_p=top_p)(None, uniform.clone()))
    halving = torch.tensor([[2.0, 1.0, 0.0, 0.0]]) * math.log(2)  # [1, 4]: probabilities 1/2, 1/4, 1/8, 1/8
    for epsilon in (0.125, 0.25):
        assert_same(ops.apply_epsilon_cutoff(halving, epsilon), EpsilonLogitsWarper(epsilon)(None, halving.clone()))
    for mass in (0.25, 0.75, 0.875):
        assert_same(ops.apply_typical_p(halving, mass), TypicalLogitsWarper(mass)(None, halving.clone()))


@pytest.mark.parametrize("case", all_cases())
@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.3, 100.0])
def test_temperature_matches_transformers(case, temperature):
    seed, *shape = case
    logits = random_logits(seed, *shape)
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    assert_same(ops.apply_temperature(logits, temperature), expected)


@pytest.mark.parametrize("case", all_cases())
@pytest.mark.parametrize("penalty", [0.5, 1.2, 3.0])
def test_repetition_penalty_matches_transformers(case, penalty):
    seed, *shape = case
    logits = random_logits(seed, *shape)
    ids = random_ids(seed + 1, logits.shape[0], 12, logits.shape[1])  # duplicates included
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert_same(ops.apply_repetition_penalty(logits, ids, penalty), expected)


@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len", [1, 2, 3, 9, 30])
def test_no_repeat_ngram_matches_transformers(ngram_size, seq_len):
    logits = random_logits(seq_len, 6, 10, num_inf=1)
    ids = random_ids(ngram_size * 100 + seq_len, 6, seq_len, 4)  # 4 ids, so n-grams repeat
    expected = NoRepeatNGramLogitsProcessor(ngram_size)(ids, logits.clone())
    assert_same(ops.apply_no_repeat_ngram(logits, ids, ngram_size), expected)


@pytest.mark.parametrize("seq_len", [4, 5, 6, 10])
@pytest.mark.parametrize("eos", [3, [3, 7, 9]])
def test_min_tokens_matches_transformers(seq_len, eos):
    logits = random_logits(seq_len, 3, 12, num_inf=2)
    ids = random_ids(seq_len, 3, seq_len, 12)
    expected = MinNewTokensLengthLogitsProcessor(4, 3, eos)(ids, logits.clone())
    eos_list = [eos] if isinstance(eos, int) else eos
    assert_same(ops.apply_min_tokens(logits, seq_len - 4, 3, eos_list), expected)


def biased_history(seed: int, B: int, T: int, V: int) -> torch.Tensor:
    """Random history whose rows end with prefixes of the test sequences below."""
    ids = random_ids(seed, B, T, V)
    ids[0, -1] = 4  # completes (4, 5)
    ids[1, -2:] = torch.tensor([1, 2])[-min(T, 2) :]  # completes (1, 2, 3)
    ids[2, -1] = 2  # ends like (1, 2, 3) without its first id
    return ids


@pytest.mark.parametrize("T", [1, 2, 5])
def test_sequence_bias_matches_transformers(T):
    logits = random_logits(T, 4, 20, num_inf=2)
    ids = biased_history(T, 4, T, 20)
    sequence_bias = {(7,): 2.5, (4, 5): -1.5, (1, 2, 3): 4.0, (9, 9, 9, 9, 9, 9): 9.0, (0,): -INF}
    expected = SequenceBiasLogitsProcessor(sequence_bias)(ids, logits.clone())
    assert_same(ops.apply_sequence_bias(logits, ids, sequence_bias), expected)
    as_list = [[list(k), v] for k, v in sequence_bias.items()]
    assert_same(ops.apply_sequence_bias(logits, ids, as_list), expected)


def test_sequence_bias_adds_every_matching_sequence_on_a_shared_last_id():
    """Sequences ending in the same id add up, a single-id bias included (HF accumulates ``bias[:, last] +=``)."""
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(4))  # [3, V]
    history = torch.tensor([[1, 6, 5], [2, 3, 5], [5, 6, 4]])  # [3, T]: both, one, none of the prefixes end a row
    bias = {(7,): 1.0, (5, 7): 2.0, (6, 5, 7): -0.5}
    expected = SequenceBiasLogitsProcessor([[list(k), v] for k, v in bias.items()])(history, logits.clone())
    assert_same(ops.apply_sequence_bias(logits, history, bias), expected)


@pytest.mark.parametrize("T", [1, 3, 6])
def test_bad_words_match_transformers(T):
    logits = random_logits(T, 4, 20, num_inf=3)
    ids = biased_history(T + 10, 4, T, 20)
    bad_words_ids = [[7], [4, 5], [1, 2, 3], [11, 12, 13, 14, 15, 16, 17]]
    expected = NoBadWordsLogitsProcessor(bad_words_ids)(ids, logits.clone())
    assert_same(ops.apply_bad_words(logits, ids, bad_words_ids), expected)


def test_suppress_tokens_match_transformers():
    logits = random_logits(0, 4, 30, num_inf=3)
    suppress = [0, 5, 29, 31]  # 31 is outside the vocabulary and ignored, as in HF
    expected = SuppressTokensLogitsProcessor(suppress)(None, logits.clone())
    assert_same(ops.apply_suppress_tokens(logits, suppress), expected)


def test_top_p_threshold_rounds_like_transformers_at_the_boundary():
    # A token whose cumulative probability lies between float32(1 - 0.9) and 1 - float32(0.9):
    # HF keeps it because it rounds the float64 threshold once; a float32 1 - p would drop it.
    low = torch.tensor(1 - 0.9, dtype=torch.float32).item()
    high = (1 - torch.tensor(0.9, dtype=torch.float32)).item()
    for step in range(-3000, 3000):
        logits = torch.tensor([[0.0, math.log(9) + step * 1e-8]])
        smallest = torch.softmax(logits, dim=-1).min().item()
        if low < smallest <= high:
            break
    else:
        pytest.fail("no boundary case found")
    expected = TopPLogitsWarper(0.9)(None, logits.clone())
    assert torch.isfinite(expected).all()
    assert_same(ops.apply_top_p(logits, 0.9), expected)
    assert_same(ops.apply_top_p(logits, torch.tensor([0.9], dtype=torch.float64)), expected)


# --------------------------------------------------------- OpenAI penalties


def openai_penalty(logits: list[float], output_ids: list[int], presence: float, frequency: float) -> list[float]:
    counts = {t: output_ids.count(t) for t in output_ids if t >= 0}
    return [
        mu - counts.get(j, 0) * frequency - float(counts.get(j, 0) > 0) * presence for j, mu in enumerate(logits)
    ]


def test_presence_frequency_match_openai_formula():
    logits = random_logits(3, 4, 16, num_inf=2)
    out_ids = random_ids(4, 4, 9, 16)
    out_ids[1, :3] = -1  # left padding of a shorter row
    presence = torch.tensor([0.0, 0.5, -1.0, 2.0])
    frequency = torch.tensor([0.0, 0.3, 1.5, -2.0])
    actual = ops.apply_presence_frequency_penalty(logits, out_ids, presence, frequency)
    for row in range(4):
        expected = openai_penalty(
            logits[row].tolist(), out_ids[row].tolist(), presence[row].item(), frequency[row].item()
        )
        torch.testing.assert_close(actual[row], torch.tensor(expected))
    assert_same(actual[0], logits[0])  # (0, 0) disables
    counts = torch.zeros(4, 17).scatter_add_(1, torch.where(out_ids >= 0, out_ids, 16), torch.ones(4, 9))[:, :16]
    over_vocab = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()  # [B, V] formula
    assert_same(actual, over_vocab)  # touching only the generated ids changes no bit
    mask = out_ids >= 0
    padded_zero = out_ids.clamp(min=0)  # pads now read as id 0, masked out instead
    assert_same(ops.apply_presence_frequency_penalty(logits, padded_zero, presence, frequency, mask), actual)


# ------------------------------------------------------- per-row parameters

PER_ROW_CASES = [
    (ops.apply_temperature, [0.5, 1.0, 2.0, 0.1, 1.0, 7.0]),
    (ops.apply_top_k, [0, 1, 5, 0, 100, 3]),
    (ops.apply_top_p, [1.0, 0.3, 0.9, 1.0, 0.05, 0.999]),
    (ops.apply_min_p, [0.0, 0.1, 0.5, 1.0, 0.0, 0.02]),
    (ops.apply_typical_p, [1.0, 0.2, 0.9, 0.5, 1.0, 0.99]),
    (ops.apply_epsilon_cutoff, [0.0, 1e-3, 0.1, 0.0, 0.5, 3e-4]),
    (ops.apply_eta_cutoff, [0.0, 1e-3, 0.1, 0.0, 0.5, 3e-4]),
]


def scalar_of(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long if isinstance(values[0], int) else torch.float64)


@pytest.mark.parametrize("op,values", PER_ROW_CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_per_row_params_equal_scalar_op_per_row(op, values):
    logits = random_logits(11, 6, 300, scale=2.0, num_inf=20)
    logits[3] = logits[3] * 40  # a peaked row, where underflowed probabilities meet disabled params
    batched = op(logits, scalar_of(values))
    for row, value in enumerate(values):
        assert_same(batched[row : row + 1], op(logits[row : row + 1], value))


@pytest.mark.parametrize("op,values", PER_ROW_CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_disabled_rows_are_unchanged(op, values):
    logits = random_logits(12, 6, 300, scale=40.0, num_inf=20)  # tiny probabilities everywhere
    disabled = {ops.apply_temperature: 1.0, ops.apply_top_k: 0, ops.apply_top_p: 1.0, ops.apply_typical_p: 1.0}
    value = disabled.get(op, 0.0)
    assert_same(op(logits, value), logits)
    assert_same(op(logits, scalar_of([value] * 6)), logits)


def test_per_row_penalties_equal_scalar_per_row():
    logits = random_logits(13, 4, 50, num_inf=3)
    ids = random_ids(14, 4, 20, 50)
    ids[2, :5] = -1  # ragged row, left-padded
    penalties = [1.0, 1.3, 0.7, 2.0]
    batched = ops.apply_repetition_penalty(logits, ids, torch.tensor(penalties))
    for row, p in enumerate(penalties):
        real = ids[row : row + 1, 5:] if row == 2 else ids[row : row + 1]
        assert_same(batched[row : row + 1], ops.apply_repetition_penalty(logits[row : row + 1], real, p))
    sizes = [0, 1, 2, 3]
    small_ids = torch.where(ids >= 0, ids % 4, -1)  # few ids, so n-grams repeat; padding kept
    batched = ops.apply_no_repeat_ngram(logits, small_ids, torch.tensor(sizes))
    for row, n in enumerate(sizes):
        real = small_ids[row : row + 1] if row != 2 else small_ids[row : row + 1, 5:]
        assert_same(batched[row : row + 1], ops.apply_no_repeat_ngram(logits[row : row + 1], real, n))
    batched = ops.apply_min_tokens(logits, torch.tensor([0, 3, 5, 9]), torch.tensor([4, 4, 0, 10]), [1, 2])
    for row, (n, m) in enumerate([(0, 4), (3, 4), (5, 0), (9, 10)]):
        assert_same(batched[row : row + 1], ops.apply_min_tokens(logits[row : row + 1], n, m, [1, 2]))


# ------------------------------------------------------------------- purity

PURE_CALLS = [
    lambda x, ids: ops.apply_temperature(x, 0.7),
    lambda x, ids: ops.apply_top_k(x, torch.tensor([2, 0, 5])),
    lambda x, ids: ops.apply_top_p(x, 0.8),
    lambda x, ids: ops.apply_min_p(x, 0.2),
    lambda x, ids: ops.apply_typical_p(x, 0.7),
    lambda x, ids: ops.apply_epsilon_cutoff(x, 0.05),
    lambda x, ids: ops.apply_eta_cutoff(x, 0.05),
    lambda x, ids: ops.apply_repetition_penalty(x, ids, 1.5),
    lambda x, ids: ops.apply_presence_frequency_penalty(x, ids, 0.5, 0.5),
    lambda x, ids: ops.apply_no_repeat_ngram(x, ids, 2),
    lambda x, ids: ops.apply_min_tokens(x, 0, 2, [1]),
    lambda x, ids: ops.apply_sequence_bias(x, ids, {(1,): 1.0, (2, 3): -2.0}),
    lambda x, ids: ops.apply_bad_words(x, ids, [[1], [2, 3]]),
    lambda x, ids: ops.apply_suppress_tokens(x, [0, 4]),
    lambda x, ids: ops.sample(x, torch.Generator().manual_seed(0)),
    lambda x, ids: ops.greedy(x),
    lambda x, ids: ops.compute_logprobs(x),
]


@pytest.mark.parametrize("call", PURE_CALLS)
def test_ops_never_modify_inputs(call):
    logits = random_logits(5, 3, 10, num_inf=2)
    ids = random_ids(6, 3, 8, 10)
    logits_before, ids_before = logits.clone(), ids.clone()
    out = call(logits, ids)
    assert torch.equal(logits, logits_before) and torch.equal(ids, ids_before)
    assert out.data_ptr() != logits.data_ptr()


# --------------------------------------------------------------- validation

NO_IDS = torch.zeros(2, 1, dtype=torch.long)

INVALID_CALLS = [
    (lambda x: ops.apply_top_p(x, 1.5), r"top_p must be in \(0, 1\], got 1\.5$"),
    (lambda x: ops.apply_top_p(x, 0.0), r"top_p must be in \(0, 1\], got 0\.0"),
    (lambda x: ops.apply_top_p(x, torch.tensor([0.5, 1.5])), r"top_p must be in \(0, 1\], got 1\.5 \(row 1\)"),
    (lambda x: ops.apply_top_k(x, -1), r"top_k must be an int in \[0, 2147483647\] .*got -1"),
    (lambda x: ops.apply_top_k(x, 2.5), r"top_k must be an int in .*, got 2\.5"),
    (lambda x: ops.apply_top_k(x, torch.tensor([1.0, 2.0])), r"top_k must hold integers"),
    (lambda x: ops.apply_temperature(x, 0.0), r"temperature must be a finite number > 0 .*got 0\.0"),
    (lambda x: ops.apply_temperature(x, -1.0), r"temperature must be a finite number > 0 .*got -1\.0"),
    (lambda x: ops.apply_temperature(x, float("nan")), r"temperature must be a finite number > 0 .*got nan"),
    (lambda x: ops.apply_repetition_penalty(x, NO_IDS, 0.0), r"repetition_penalty must be in \[1e-06, 1000000\], got 0\.0"),
    (lambda x: ops.apply_min_p(x, 1.5), r"min_p must be in \[0, 1\], got 1\.5"),
    (lambda x: ops.apply_typical_p(x, 0.0), r"typical_p must be in \(0, 1\], got 0\.0"),
    (lambda x: ops.apply_typical_p(x, 1.2), r"typical_p must be in \(0, 1\], got 1\.2"),
    (lambda x: ops.apply_epsilon_cutoff(x, 1.0), r"epsilon_cutoff must be in \[0, 1\), got 1\.0"),
    (lambda x: ops.apply_eta_cutoff(x, -0.1), r"eta_cutoff must be in \[0, 1\), got -0\.1"),
    (lambda x: ops.apply_no_repeat_ngram(x, NO_IDS, -1), r"no_repeat_ngram_size must be an int in \[0, 2147483647\] .*got -1"),
    (
        lambda x: ops.apply_presence_frequency_penalty(x, NO_IDS, 2.5, 0.0),
        r"presence_penalty must be in \[-2, 2\], got 2\.5",
    ),
    (lambda x: ops.apply_top_k(x, 2, min_tokens_to_keep=0), r"min_tokens_to_keep must be an int in \[1, 2147483647\], got 0"),
    (lambda x: ops.apply_top_p(x, torch.full((3,), 0.5)), r"top_p must be a scalar or a \[B=2\] tensor, got shape"),
    (lambda x: ops.apply_repetition_penalty(x, torch.tensor([[5, 8]]), 1.2), r"token_ids must be \[B=2, T\]"),
    (lambda x: ops.apply_repetition_penalty(x, torch.tensor([[5], [8]]), 1.2), r"token_ids must be < vocab size 8"),
    (lambda x: ops.apply_sequence_bias(x, NO_IDS, {(9,): 1.0}), r"ids must be < vocab size 8, got \[9\]"),
    (lambda x: ops.apply_sequence_bias(x, NO_IDS, {(): 1.0}), r"sequence_bias keys must be non-empty"),
    (lambda x: ops.apply_bad_words(x, NO_IDS, []), r"bad_words_ids must be a non-empty list"),
    (lambda x: ops.apply_temperature(x[0], 0.5), r"logits must be \[B, V\], got shape \[8\]"),
    (lambda x: ops.sample(x, [torch.Generator()]), r"one entry per row \(2\), got 1"),
    (lambda x: ops.top_logprobs(x, 9), r"num must be an int in \[0, 8\], got 9"),
]


@pytest.mark.parametrize("call,message", INVALID_CALLS)
def test_invalid_parameters_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(random_logits(0, 2, 8))


# ------------------------------------------------------------------ choice


def test_greedy_breaks_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, -INF], [2.0, 2.0, 2.0, 2.0], [-INF, -INF, 0.0, 0.0]])
    assert ops.greedy(logits).tolist() == [1, 0, 2]


def test_same_seed_same_tokens_and_matches_hf_global_draw():
    logits = random_logits(21, 16, 100, scale=2.0, num_inf=10)
    first = ops.sample(logits, torch.Generator().manual_seed(1234))
    assert torch.equal(first, ops.sample(logits, torch.Generator().manual_seed(1234)))
    assert not torch.equal(first, ops.sample(logits, torch.Generator().manual_seed(4321)))
    with torch.random.fork_rng():  # HF's _sample: softmax then multinomial on the global generator
        torch.manual_seed(1234)
        expected = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1)
    assert torch.equal(first, expected)


def test_per_row_generator_gives_same_tokens_whatever_the_batch():
    target = random_logits(31, 1, 50, scale=1.5)
    alone_gen = torch.Generator().manual_seed(77)
    alone = [ops.sample(target, [alone_gen]).item() for _ in range(40)]
    batch_gen = torch.Generator().manual_seed(77)
    others = [torch.Generator().manual_seed(s) for s in (1, 2)]
    in_batch = []
    for step in range(40):
        neighbours = random_logits(100 + step, 2, 50, scale=3.0)  # different neighbours at each step
        batch = torch.cat([neighbours[:1], target, neighbours[1:]])  # target in the middle
        in_batch.append(ops.sample(batch, [others[0], batch_gen, others[1]])[1].item())
    assert in_batch == alone
    assert len(set(alone)) > 5  # the draws are actually random


def test_sample_never_draws_minus_inf():
    logits = random_logits(41, 64, 20, num_inf=15)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = ops.sample(logits, gen)
        assert torch.isfinite(logits.gather(1, tokens.unsqueeze(1))).all()


STAT_FILTERS = [
    lambda x: ops.apply_top_k(x, 5),
    lambda x: ops.apply_top_p(x, 0.7),
    lambda x: ops.apply_min_p(x, 0.2),
    lambda x: ops.apply_top_p(ops.apply_top_k(ops.apply_temperature(x, 0.8), 8), 0.9),
]


@pytest.mark.parametrize("warp", STAT_FILTERS)
def test_sampled_frequencies_match_processed_distribution(warp):
    logits = random_logits(51, 1, 20, scale=1.5)
    processed = warp(logits)  # [1, V]
    probs = torch.softmax(processed, dim=-1)[0]  # [V]
    num_draws = 40_000
    tokens = ops.sample(processed.expand(num_draws, -1), torch.Generator().manual_seed(9))  # [N]
    freqs = torch.bincount(tokens, minlength=20).double() / num_draws
    assert torch.isfinite(processed[0, tokens]).all()  # excluded ids never drawn
    assert freqs[torch.isneginf(processed[0])].sum() == 0
    assert (freqs - probs.double()).abs().max() < 0.01


def test_inverse_cdf_draws_the_distribution_and_never_an_excluded_id():
    """sample_inverse_cdf: empirical frequencies over 200k seeded draws within 0.003 of softmax (a vocabulary that
    is not a whole number of blocks, -inf ids at both ends and in the middle never drawn); an id shifted by one
    would be off by more than 0.003 at the peaks."""
    logits = random_logits(71, 1, 700, scale=1.5)
    logits[0, :3] = logits[0, 300:350] = logits[0, -3:] = -INF
    probs = torch.softmax(logits, dim=-1)  # [1, V]
    draws = ops.choose_tokens(logits.expand(200_000, -1), True, torch.Generator().manual_seed(3), draw="inverse_cdf")
    freqs = torch.bincount(draws[:, 0], minlength=700).double() / draws.shape[0]
    assert freqs[torch.isneginf(logits[0])].sum() == 0
    assert (freqs - probs[0].double()).abs().max() < 0.003


def test_inverse_cdf_with_a_generator_per_row_is_batch_invariant():
    target = random_logits(72, 1, 600, scale=1.5)
    alone_gen, batch_gen = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    alone = [ops.choose_tokens(target, True, [alone_gen], draw="inverse_cdf").item() for _ in range(30)]
    in_batch = []
    for step in range(30):
        batch = torch.cat([random_logits(200 + step, 1, 600, scale=3.0), target])
        in_batch.append(ops.choose_tokens(batch, True, [None, batch_gen], draw="inverse_cdf")[1].item())
    assert in_batch == alone and len(set(alone)) > 5


def test_inverse_cdf_picks_the_only_id_and_rejects_bad_arguments():
    one_hot = torch.full((3, 513), -INF)
    one_hot[0, 0], one_hot[1, 256], one_hot[2, 512] = 0.0, 0.0, 0.0  # first id, a block's first id, the last id
    assert ops.choose_tokens(one_hot, True, draw="inverse_cdf")[:, 0].tolist() == [0, 256, 512]
    with pytest.raises(ValueError, match="draw must be"):
        ops.choose_tokens(one_hot, True, draw="gumbel")
    with pytest.raises(ValueError, match="draw must be"):
        ops.choose_tokens(one_hot, True, num_tokens=2, draw="inverse_cdf")
    with pytest.raises(ValueError, match="one entry per row"):
        ops.sample_inverse_cdf(torch.softmax(one_hot, -1), [None])


def test_inverse_cdf_at_the_ends_of_0_1_draws_a_positive_probability_id():
    """u = 0 and the largest float64 below 1: the drawn id is the first whose float64 cumulative probability exceeds
    u x total (a one-level search over the whole row, the definition), else (rounding: a float32 block sum above the
    block's float64 cumulative sum) the last positive id, so never a zero-probability id at either end of a row or a
    block."""
    probs = torch.zeros(3, 600)  # [3, V]: 3 blocks, zero-probability ids first and last
    probs[0, 5], probs[0, 300], probs[0, 301] = 0.25, 0.5, 0.25
    probs[1, 256:259] = 1 / 3
    probs[2, 256:512] = torch.rand(256, generator=torch.Generator().manual_seed(0))  # one block
    assert probs[2].sum() > probs[2].double().sum()  # its float32 block sum exceeds its float64 cumulative
    u = torch.tensor([0.0, math.nextafter(1.0, 0.0), math.nextafter(1.0, 0.0)], dtype=torch.float64)
    for ends in (u, u.flip(0)):
        ends = ends[:, None]  # [3, 1]
        cdf = probs.double().cumsum(dim=-1)  # [3, V]
        found = torch.searchsorted(cdf, ends * cdf[:, -1:], right=True)  # [3, 1]
        expected = torch.minimum(found, torch.searchsorted(cdf, cdf[:, -1:]))  # [3, 1]: capped at the last positive id
        drawn = ops.inverse_cdf_at(probs, ends)  # [3, 1]
        assert torch.equal(drawn, expected)
        assert bool((probs.gather(1, drawn) > 0).all())


def test_sampling_half_precision_scores_draws_from_their_float32_softmax():
    """HF samples from softmax of float32 scores (generate() casts the logits): bfloat16 scores draw, seed for seed,
    what torch.multinomial draws from the float32 softmax of the same values (and the inverse-CDF draw what it draws
    from those float32 scores)."""
    scores = (torch.randn(64, 300, generator=torch.Generator().manual_seed(9)) * 3).bfloat16()  # [64, V]
    expected = torch.multinomial(torch.softmax(scores.float(), dim=-1), 1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ops.choose_tokens(scores, True, torch.Generator().manual_seed(1)), expected)
    inverse = ops.choose_tokens(scores.float(), True, torch.Generator().manual_seed(1), draw="inverse_cdf")
    assert torch.equal(ops.choose_tokens(scores, True, torch.Generator().manual_seed(1), draw="inverse_cdf"), inverse)


# ---------------------------------------------------------------- logprobs


def test_logprob_helpers():
    logits = random_logits(61, 3, 12, num_inf=2)
    logprobs = ops.compute_logprobs(logits)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, dim=-1))
    chosen = torch.tensor([0, 5, 11])
    assert torch.equal(ops.gather_logprobs(logprobs, chosen), logprobs[torch.arange(3), chosen])
    values, ids = ops.top_logprobs(logprobs, 3)
    order = logprobs.argsort(dim=-1, descending=True)[:, :3]
    assert torch.equal(ids, order) and torch.equal(values, logprobs.gather(1, order))
    assert math.isclose(torch.exp(logprobs[0]).sum().item(), 1.0, rel_tol=1e-5)
    # rank: how many ids have a logprob >= the chosen one's, itself included (vLLM); id 0 of row 0 ties at -inf
    expected = [sum(int(v >= logprobs[r, c]) for v in logprobs[r]) for r, c in enumerate(chosen.tolist())]
    assert expected[0] == 12
    assert ops.logprob_ranks(logprobs, chosen).tolist() == expected
    assert ops.logprob_ranks(logprobs, logprobs.argmax(-1)).tolist() == [1, 1, 1]


def test_sampling_a_row_with_no_token_left_names_the_row():
    """Every token removed (or NaN scores): a ValueError naming the row, where torch.multinomial (and transformers)
    fail with "probability tensor contains either inf, nan or element < 0"; other rows, and greedy, are fine."""
    scores = torch.randn(3, 10)
    scores[1] = -float("inf")
    with pytest.raises(ValueError, match="no token left to sample in row 1"):
        ops.choose_tokens(scores, True, torch.Generator().manual_seed(0))
    scores[1, 4] = float("nan")
    with pytest.raises(ValueError, match="row 1"):
        ops.choose_tokens(scores, True, torch.Generator().manual_seed(0), num_tokens=2)
    scores[1] = 0.0
    assert ops.choose_tokens(scores, True, torch.Generator().manual_seed(0)).shape == (3, 1)
