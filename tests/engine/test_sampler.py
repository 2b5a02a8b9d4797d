"""Batched Sampler: per-row settings, per-row generators, the declared transform order."""

from __future__ import annotations

import math

import pytest
import torch

from kvgen.engine.sampler import Sampler, SamplingRow
from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.types import Logprob
from kvgen.sampling import ops

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3  # [B, V]


def _row(params: SamplingParams, seed: int | None = None, prompt=(1, 2, 3), output=(), eos=(0,)) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(prompt), list(output), gen, eos)


def test_greedy_rows_take_the_argmax_and_logprobs_are_of_raw_logits():
    logits = _logits(3)
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)
    out = Sampler()(logits, [_row(params, prompt=[5]), _row(SamplingParams(temperature=0.0)), _row(params)])
    penalized = ops.apply_repetition_penalty(logits, torch.tensor([[5], [-1], [1]]), torch.tensor([1.5, 1.0, 1.5]))
    assert out.token_ids == penalized.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    position = out.logprobs[0]
    chosen = out.token_ids[0]
    assert next(iter(position)) == chosen  # vLLM's order: the sampled id first
    rank = int((raw[0] >= raw[0, chosen]).sum())
    assert position[chosen] == Logprob(raw[0, chosen].item(), rank)
    top = raw[0].topk(2)
    assert {t: position[t] for t in top.indices.tolist()} == {
        t: Logprob(v, r) for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1)}
    assert len(position) == 2 + (chosen not in top.indices.tolist())


def test_logprobs_zero_still_give_the_sampled_id_with_its_rank():
    """vLLM returns the sampled token's logprob and rank whatever ``logprobs`` (0 included): the entry holds it."""
    logits = _logits(2, seed=5)
    biased = SamplingParams(temperature=0.0, logprobs=0, logit_bias={9: 50.0})  # drawn: 9, not the raw argmax
    out = Sampler()(logits, [_row(biased), _row(SamplingParams(temperature=0.0, logprobs=0))])
    raw = torch.log_softmax(logits, dim=-1)  # [2, V]: the logprobs are of the raw logits
    for row, chosen in enumerate(out.token_ids):
        rank = int((raw[row] >= raw[row, chosen]).sum())
        assert out.logprobs[row] == {chosen: Logprob(raw[row, chosen].item(), rank)}
    assert out.token_ids[0] == 9 and out.logprobs[0][9].rank > 1


def test_seeded_row_draws_the_same_token_alone_and_in_a_batch():
    logits = _logits(4, seed=1)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=7)
    alone = Sampler()(logits[2:3], [_row(params, seed=7)]).token_ids[0]
    mixed = [_row(SamplingParams(temperature=1.3), seed=123), _row(SamplingParams(temperature=0.0)),
             _row(params, seed=7), _row(SamplingParams(temperature=0.5, min_p=0.2), seed=5)]
    batched = Sampler()(logits, mixed).token_ids
    assert batched[2] == alone
    gen = torch.Generator().manual_seed(7)
    draws = {Sampler()(logits[2:3], [SamplingRow(params, [1], [], gen)]).token_ids[0] for _ in range(20)}
    assert len(draws) > 1  # the generator advances: the row really samples


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached_even_with_ignore_eos():
    """vLLM v1: ``MinTokensLogitsProcessor`` sets ``params.all_stop_token_ids`` to -inf, and
    ``update_from_generation_config`` puts EOS there whatever ``ignore_eos``: a row short of min_tokens never draws
    EOS, ignore_eos or not (ignore_eos only keeps a drawn EOS from stopping the request)."""
    logits = torch.zeros(4, V)
    logits[:, 0] = 10.0  # EOS (id 0) most likely
    logits[:, 7] = 9.0  # a stop token id
    logits[:, 3] = 8.0
    short = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    rows = [
        _row(short, output=[4]),  # 1 < 2: EOS and 7 suppressed -> 3
        _row(short, output=[4, 4]),  # reached: EOS allowed
        _row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), output=[]),  # EOS still suppressed
        _row(SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[0]), output=[], eos=()),
    ]
    assert Sampler()(logits, rows).token_ids == [3, 0, 7, 7]
    reached = _row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), output=[4, 4])
    assert Sampler()(logits[:1], [reached]).token_ids == [0]  # then EOS may be drawn (and does not stop)


def test_presence_and_frequency_penalties_count_only_output_tokens():
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 5] = 1.0, 0.9
    # presence/frequency look at generated tokens only (vLLM / OpenAI): a prompt token keeps its logit
    prompt_only = _row(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt=[4])
    assert Sampler()(logits, [prompt_only]).token_ids == [4]
    generated = _row(SamplingParams(temperature=0.0, frequency_penalty=0.1), output=[4, 4])
    assert Sampler()(logits, [generated]).token_ids == [5]


def test_top_k_one_samples_the_argmax():
    logits = _logits(2, seed=3)
    rows = [_row(SamplingParams(temperature=2.0, top_k=1), seed=s) for s in (0, 1)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_logit_bias_is_added_per_row_before_penalties_and_ignores_ids_past_the_vocabulary():
    logits = _logits(3, seed=2)
    biased = SamplingParams(temperature=0.0, logit_bias={11: 100.0, V + 5: 100.0})
    banned = SamplingParams(temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0})
    out = Sampler()(logits, [_row(biased), _row(banned), _row(SamplingParams(temperature=0.0))])
    assert out.token_ids[0] == 11
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1])  # the runner-up once the top is banned
    assert out.token_ids[2] == int(logits[2].argmax())  # a row without bias is untouched
    assert torch.equal(logits, _logits(3, seed=2))  # inputs are not edited


# vLLM v1 ``vllm/v1/sample/sampler.py``: ``Sampler.forward`` applies the allowed-token-ids mask, the bad words and
# the non-argmax-invariant logits processors (min_tokens, then logit_bias), then ``apply_all_penalties`` (repetition,
# frequency, presence), then ``Sampler.sample``: greedy argmax, temperature, the argmax-invariant
# min_p processor, then ``TopKTopPSampler`` (top_k, then top_p) and the draw.
VLLM_V1_ORDER = (
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "logit_bias",
    "repetition_penalty",
    "presence_frequency_penalty",
    "temperature",
    "min_p",
    "top_k",
    "top_p",
)


def test_engine_order_is_vllm_v1s():
    """The declared engine order is vLLM v1's, and greedy rows branch off right before temperature."""
    from kvgen.sampling.pipeline import ENGINE_FIRST_SAMPLING_STAGE, ENGINE_ORDER

    assert ENGINE_ORDER == VLLM_V1_ORDER
    assert ENGINE_FIRST_SAMPLING_STAGE == "temperature"


def test_sampler_equals_the_ops_composed_in_vllm_order():
    """Random logits, every stage enabled with per-row values: the Sampler's stages equal the ops applied by
    hand in vLLM v1's order, and its draws equal ``choose_tokens`` (inverse CDF) on that result with the same seeds."""
    from kvgen.engine.sampler import apply_stages

    logits = _logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.7, min_p=0.05, top_k=8, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.2, min_tokens=4, logit_bias={3: 2.0, 7: -1.0}, stop_token_ids=[9]),
        SamplingParams(temperature=1.3, min_p=0.0, top_k=0, top_p=0.6, repetition_penalty=0.8, logit_bias={1: 5.0}),
        SamplingParams(temperature=0.5, min_p=0.2, top_k=3, top_p=1.0, frequency_penalty=-0.4),
    ]
    outputs = [[4, 4, 8], [2], [6, 6, 6, 1]]
    rows = [_row(p, seed=10 + i, output=o) for i, (p, o) in enumerate(zip(params, outputs))]
    x = ops.apply_min_tokens(logits, torch.tensor([3, 1, 4]), torch.tensor([4, 0, 0]), [0, 9])
    bias = torch.zeros_like(x)
    bias[0, 3], bias[0, 7], bias[1, 1] = 2.0, -1.0, 5.0
    x = x + bias
    history = torch.tensor([[1, 2, 3, 4, 4, 8, -1], [1, 2, 3, 2, -1, -1, -1], [1, 2, 3, 6, 6, 6, 1]])
    x = ops.apply_repetition_penalty(x, history, torch.tensor([1.3, 0.8, 1.0], dtype=torch.float64))
    out_ids = torch.tensor([[4, 4, 8, -1], [2, -1, -1, -1], [6, 6, 6, 1]])
    f64 = torch.float64
    x = ops.apply_presence_frequency_penalty(x, out_ids, torch.tensor([0.5, 0.0, 0.0], dtype=f64),
                                             torch.tensor([0.2, 0.0, -0.4], dtype=f64))
    x = ops.apply_temperature(x, torch.tensor([0.7, 1.3, 0.5], dtype=f64))
    x = ops.apply_min_p(x, torch.tensor([0.05, 0.0, 0.2], dtype=f64))
    x = ops.apply_top_k(x, torch.tensor([8, 0, 3]))
    x = ops.apply_top_p(x, torch.tensor([0.9, 0.6, 1.0], dtype=f64))
    torch.testing.assert_close(apply_stages(logits, rows, VLLM_V1_ORDER), x, rtol=0, atol=0)
    assert bool(torch.isinf(x).any())  # the filters did remove tokens, so the order is exercised
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    expected = ops.choose_tokens(x, True, gens, draw="inverse_cdf").squeeze(1).tolist()
    assert Sampler()(logits, rows).token_ids == expected


def test_vllm_and_hf_filter_orders_keep_different_sets():
    """Why the engine and generate() keep their own orders: min-p before top-k (vLLM) and after top-p (HF)
    keep different tokens on the same logits, so one shared order would change one side's tokens."""
    logits = _logits(64, seed=3)
    vllm = ops.apply_top_p(ops.apply_top_k(ops.apply_min_p(logits, 0.3), 5), 0.5)
    hf = ops.apply_min_p(ops.apply_top_p(ops.apply_top_k(logits, 5), 0.5), 0.3)
    assert not torch.equal(torch.isinf(vllm), torch.isinf(hf))


def test_kernel_draw_gives_the_torch_samplers_tokens():
    """With the model's kernels the draw is one C++ op (and applies the temperature itself when no row filters):
    the same tokens as the torch ops, for temperature-only batches, filtered rows and greedy rows mixed in."""
    from kvgen.kernels import get_ops

    logits = torch.randn(6, 49_152, generator=torch.Generator().manual_seed(4)) * 3
    batches = [
        [SamplingParams(temperature=t, seed=s) for t, s in ((1.0, 1), (0.7, 2), (1.6, 3), (0.3, 4), (1.0, 5), (0.9, 6))],
        [SamplingParams(temperature=0.8, top_k=40, seed=1), SamplingParams(temperature=0.0),
         SamplingParams(temperature=1.1, min_p=0.02, seed=3), SamplingParams(temperature=0.6, top_p=0.9, seed=4),
         SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=5), SamplingParams(temperature=0.5, seed=6)],
    ]
    for params in batches:
        def rows(params=params):
            return [_row(p, seed=p.seed, output=[i, 7]) for i, p in enumerate(params)]
        torch_ids, kernel_ids = Sampler()(logits, rows()).token_ids, Sampler(get_ops())(logits, rows()).token_ids
        assert kernel_ids == torch_ids
    assert len(set(torch_ids)) > 3  # real draws, not one id
    # filter_draw leaves the flat row 3 (top_p's cut beyond 1,024 logits) to the torch stages: the same ids still
    peaked = logits.clone()
    peaked[[0, 2, 5], :20] += 12
    peaked[3] /= 4  # flat: at temperature 0.6, ~randn * 1.25
    temperature, min_p, top_k, top_p = ([p.temperature or 1.0 for p in params], [p.min_p for p in params],
                                        [p.top_k for p in params], [p.top_p for p in params])
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)
    left = get_ops().filter_draw(peaked, f64(temperature), f64(min_p), torch.tensor(top_k), f64(top_p), f64([0.5] * 6))
    if get_ops().backend == "avx2":
        assert int(left[3]) == -1 and bool((left[[0, 2]] >= 0).all())
    assert Sampler(get_ops())(peaked, rows()).token_ids == Sampler()(peaked, rows()).token_ids


def test_kernel_draw_applies_min_p_when_it_is_the_only_filter():
    """A batch whose sampled rows filter with min_p alone takes the kernels' filter_draw, not the temperature-only
    softmax_draw: the tokens are the torch stages' (min_p applied)."""
    from kvgen.kernels import get_ops

    logits = torch.randn(8, 2_000, generator=torch.Generator().manual_seed(8)) * 2  # [8, V]
    def rows():
        return [_row(SamplingParams(temperature=1.0, min_p=0.5, seed=s), seed=s) for s in range(8)]
    torch_ids = Sampler()(logits, rows()).token_ids
    kept = ops.apply_min_p(logits, 0.5)  # [8, V]
    assert all(torch.isfinite(kept[i, t]) for i, t in enumerate(torch_ids))
    assert Sampler(get_ops())(logits, rows()).token_ids == torch_ids


def test_allowed_token_ids_and_bad_words_stages():
    from kvgen.engine.sampler import apply_allowed_token_ids, apply_bad_words

    logits = _logits(3, seed=2)
    rows = [_row(SamplingParams(allowed_token_ids=[4, 9])), _row(SamplingParams()), _row(SamplingParams(allowed_token_ids=[1]))]
    out = apply_allowed_token_ids(logits, rows)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [4, 9] and torch.equal(out[0, [4, 9]], logits[0, [4, 9]])
    assert torch.equal(out[1], logits[1]) and torch.isfinite(out[2]).nonzero().flatten().tolist() == [1]
    words = [[5], [7, 8], [2, 3, 6]]  # vLLM v1: a word's last token is banned when its other tokens end the output
    params = SamplingParams(bad_words=["x"], bad_words_token_ids=words)
    cases = {(): [5], (7,): [5, 8], (1, 7): [5, 8], (2, 3): [5, 6], (3,): [5], (7, 1): [5], (2, 3, 7): [5, 8]}
    for output, banned in cases.items():
        got = apply_bad_words(logits[:1], [_row(params, output=output)])
        assert torch.isinf(got[0]).nonzero().flatten().tolist() == banned, output
    assert torch.equal(apply_bad_words(logits, [_row(SamplingParams())] * 3), logits)


def test_allowed_token_ids_and_bad_words_refuse_bad_values():
    for kwargs, message in [({"allowed_token_ids": []}, "must not be empty"), ({"allowed_token_ids": [-1]}, "allowed_token_ids must be"),
                            ({"bad_words": [""]}, "bad_words must be"), ({"bad_words": [3]}, "bad_words must be")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    assert SamplingParams(bad_words="no").bad_words == ["no"]


@pytest.mark.parametrize("use_kernels", [False, True])
def test_a_row_whose_masks_leave_no_token_gets_no_token_and_the_others_their_own(use_kernels):
    """allowed_token_ids [5] with 5 a stop id under min_tokens masks every logit: that row draws nothing (NO_TOKEN,
    no logprobs) instead of failing the whole batch, greedy or sampled, and the other rows get the tokens they get
    without it."""
    from kvgen.engine.types import NO_TOKEN
    from kvgen.kernels import get_ops

    sampler = Sampler(get_ops() if use_kernels else None)
    logits = _logits(4, seed=9)
    boxed_in = dict(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2, logprobs=1)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, seed=2, **boxed_in),
              SamplingParams(temperature=0.0, **boxed_in), SamplingParams(temperature=0.0, logprobs=1)]

    def rows(ps):
        return [_row(p, seed=p.seed) for p in ps]

    out = sampler(logits, rows(params))
    assert out.token_ids[1:3] == [NO_TOKEN, NO_TOKEN] and out.logprobs[1:3] == [None, None]
    alone = sampler(logits[[0, 3]], rows([params[0], params[3]]))
    assert [out.token_ids[0], out.token_ids[3]] == alone.token_ids and out.logprobs[3] == alone.logprobs[1]
    reached = sampler(logits[1:2], [_row(params[1], seed=2, output=[5, 5])])  # min_tokens reached: 5 is allowed
    assert reached.token_ids == [5]


def _vllm_top_p_kept(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM v1 ``apply_top_k_top_p_pytorch``'s top-p branch, with top_p held as its ``InputBatch`` holds it (a float32
    tensor, so ``1 - p`` is a float32 op): sorted ascending, cumulative probabilities <= 1 - p removed, the largest
    kept. logits: [B, V]. Returns [B, V] bool, True where kept."""
    p = torch.full((logits.shape[0],), top_p, dtype=torch.float32)  # [B]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [B, V]
    remove = logits_sort.softmax(dim=-1).cumsum(dim=-1) <= 1 - p.unsqueeze(dim=1)  # [B, V]
    remove[:, -1] = False
    return ~remove.scatter(1, logits_idx, remove)  # [B, V], vocabulary order


@pytest.mark.parametrize("use_kernels", [False, True])
def test_top_p_removes_what_vllms_float32_threshold_removes(use_kernels):
    """vLLM holds top_p in float32, so for top_p=0.9 its threshold 1 - p is 0.10000002 where float64's 1 - 0.9 rounds
    to 0.1000000015: a token whose cumulative probability lies between the two is removed, and every draw is the top
    token (the torch stages and the kernels' filter_draw alike)."""
    from kvgen.engine.sampler import apply_top_p
    from kvgen.kernels import get_ops

    threshold32 = float(1 - torch.tensor(0.9, dtype=torch.float32))  # vLLM's
    threshold64 = float(torch.tensor(1 - 0.9, dtype=torch.float32))  # HF's rounding of the Python float
    low = (threshold32 + threshold64) / 2
    logits = torch.full((1, V), -100.0)
    logits[0, 3], logits[0, 8] = math.log(low), math.log(1 - low)  # [1, V]
    kept = _vllm_top_p_kept(logits, 0.9)
    assert torch.nonzero(kept[0]).flatten().tolist() == [8]  # the low token sits between the thresholds
    params = SamplingParams(temperature=1.0, top_p=0.9)
    assert torch.equal(torch.isfinite(apply_top_p(logits, [_row(params)])), kept)
    sampler = Sampler(get_ops() if use_kernels else None)
    draws = [sampler(logits, [_row(SamplingParams(temperature=1.0, top_p=0.9, seed=s), seed=s)]).token_ids[0]
             for s in range(40)]
    assert draws == [8] * 40


def test_a_top_p_below_float32s_range_samples_the_top_token():
    """A top_p that float32 rounds to 0 (vLLM holds top_p in float32) keeps the top token, as vLLM's top-p does for
    a tiny p, with the torch stages and the kernels alike, instead of failing the step."""
    from kvgen.kernels import get_ops

    logits = _logits(2, seed=6)
    for kernels in (None, get_ops()):
        rows = [_row(SamplingParams(temperature=1.0, top_p=1e-50), seed=s) for s in (0, 1)]
        assert Sampler(kernels)(logits, rows).token_ids == logits.argmax(-1).tolist()
