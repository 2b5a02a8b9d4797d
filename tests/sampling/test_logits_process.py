"""kvgen.sampling.logits_process against transformers' processors and its _get_logits_processor order."""

from types import SimpleNamespace

import pytest
import torch
import transformers.generation.logits_process as hf
from helpers import assert_same, make_tiny_model, random_ids, random_logits
from transformers import GenerationConfig

from kvgen.sampling import logits_process as lp

INF = float("inf")


# ------------------------------------------------------- class vs transformers

PROMPT = random_ids(11, 3, 6, 7)  # [3, 6]: the encoder_* processors' prompt

PAIRS = [
    (lambda: lp.TemperatureLogitsWarper(0.6), lambda: hf.TemperatureLogitsWarper(0.6)),
    (lambda: lp.TopKLogitsWarper(7, min_tokens_to_keep=2), lambda: hf.TopKLogitsWarper(7, min_tokens_to_keep=2)),
    (lambda: lp.TopPLogitsWarper(0.8), lambda: hf.TopPLogitsWarper(0.8)),
    (lambda: lp.MinPLogitsWarper(0.1, min_tokens_to_keep=3), lambda: hf.MinPLogitsWarper(0.1, min_tokens_to_keep=3)),
    (lambda: lp.TypicalLogitsWarper(0.7), lambda: hf.TypicalLogitsWarper(0.7)),
    (lambda: lp.EpsilonLogitsWarper(0.02), lambda: hf.EpsilonLogitsWarper(0.02)),
    (lambda: lp.EtaLogitsWarper(0.02), lambda: hf.EtaLogitsWarper(0.02)),
    (lambda: lp.RepetitionPenaltyLogitsProcessor(1.4), lambda: hf.RepetitionPenaltyLogitsProcessor(1.4)),
    (lambda: lp.NoRepeatNGramLogitsProcessor(2), lambda: hf.NoRepeatNGramLogitsProcessor(2)),
    (
        lambda: lp.MinNewTokensLengthLogitsProcessor(3, 5, [1, 4]),
        lambda: hf.MinNewTokensLengthLogitsProcessor(3, 5, [1, 4]),
    ),
    (
        lambda: lp.SequenceBiasLogitsProcessor([[[2], 1.5], [[3, 4], -3.0]]),
        lambda: hf.SequenceBiasLogitsProcessor([[[2], 1.5], [[3, 4], -3.0]]),
    ),
    (
        lambda: lp.NoBadWordsLogitsProcessor([[1], [4], [3, 5], [2, 2, 6]], eos_token_id=[4, 9]),
        lambda: hf.NoBadWordsLogitsProcessor([[1], [4], [3, 5], [2, 2, 6]], eos_token_id=[4, 9]),
    ),
    (lambda: lp.SuppressTokensLogitsProcessor([0, 7]), lambda: hf.SuppressTokensLogitsProcessor([0, 7])),
    (lambda: lp.MinLengthLogitsProcessor(7, [1, 4]), lambda: hf.MinLengthLogitsProcessor(7, [1, 4])),
    (lambda: lp.ForcedBOSTokenLogitsProcessor(3), lambda: hf.ForcedBOSTokenLogitsProcessor(3)),
    (lambda: lp.ForcedEOSTokenLogitsProcessor(6, [1, 4]), lambda: hf.ForcedEOSTokenLogitsProcessor(6, [1, 4])),
    (lambda: lp.InfNanRemoveLogitsProcessor(), lambda: hf.InfNanRemoveLogitsProcessor()),
    (lambda: lp.ExponentialDecayLengthPenalty((1, 1.7), [1, 4], 3),
     lambda: hf.ExponentialDecayLengthPenalty((1, 1.7), [1, 4], 3)),
    (lambda: lp.SuppressTokensAtBeginLogitsProcessor([0, 7], 5), lambda: hf.SuppressTokensAtBeginLogitsProcessor([0, 7], 5)),
    (lambda: lp.LogitNormalization(), lambda: hf.LogitNormalization()),
    # the prompt: 3 rows for the 6 score rows, as transformers' generate() gives it (unexpanded) with 2 beams
    (lambda: lp.EncoderRepetitionPenaltyLogitsProcessor(1.7, PROMPT), lambda: hf.EncoderRepetitionPenaltyLogitsProcessor(1.7, PROMPT)),
    (lambda: lp.EncoderRepetitionPenaltyLogitsProcessor(0.6, PROMPT), lambda: hf.EncoderRepetitionPenaltyLogitsProcessor(0.6, PROMPT)),
    (lambda: lp.EncoderNoRepeatNGramLogitsProcessor(2, PROMPT), lambda: hf.EncoderNoRepeatNGramLogitsProcessor(2, PROMPT)),
    (lambda: lp.EncoderNoRepeatNGramLogitsProcessor(1, PROMPT), lambda: hf.EncoderNoRepeatNGramLogitsProcessor(1, PROMPT)),
]


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=lambda f: type(f()).__name__)
@pytest.mark.parametrize("seed", range(5))
def test_processor_matches_transformers(ours, theirs, seed):
    logits = random_logits(seed, 6, 10, scale=1.0 + 3 * seed, num_inf=seed % 3)
    ids = random_ids(seed, 6, 4 + seed, 7)  # few ids: repeats and n-gram hits
    ids[0, -1] = 3  # completes [3, 5] / [3, 4]
    logits_before, ids_before = logits.clone(), ids.clone()
    actual = ours()(ids, logits)
    assert torch.equal(logits, logits_before) and torch.equal(ids, ids_before)  # pure
    assert_same(actual, theirs()(ids, logits.clone()))


def test_presence_frequency_counts_only_generated_tokens():
    prompt_length = 4
    ids = torch.tensor([[1, 1, 1, 2, 3, 3, 5], [4, 4, 4, 4, 4, 0, 0]])
    logits = random_logits(0, 2, 6)
    actual = lp.PresenceFrequencyPenaltyLogitsProcessor(0.5, 0.25, prompt_length)(ids, logits)
    for row in range(2):
        generated = ids[row, prompt_length:].tolist()
        for j in range(6):
            count = generated.count(j)
            expected = logits[row, j].item() - 0.25 * count - 0.5 * float(count > 0)
            assert actual[row, j].item() == pytest.approx(expected, abs=1e-6)


def test_logits_processor_list_applies_in_order():
    logits = random_logits(1, 3, 20)
    ids = random_ids(1, 3, 5, 20)
    temperature, top_k = lp.TemperatureLogitsWarper(0.5), lp.TopKLogitsWarper(3)
    chained = lp.LogitsProcessorList([temperature, top_k])(ids, logits)
    assert_same(chained, top_k(ids, temperature(ids, logits)))
    assert_same(lp.LogitsProcessorList()(ids, logits), logits)


# ------------------------------------------------------------------- order

PINNED_ORDER = (
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "EncoderNoRepeatNGramLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
    "PresenceFrequencyPenaltyLogitsProcessor",
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "WatermarkLogitsProcessor",
    "LogitNormalization",
)

EVERYTHING = {
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 12,
    "top_p": 0.9,
    "min_p": 0.05,
    "typical_p": 0.95,
    "epsilon_cutoff": 3e-4,
    "eta_cutoff": 1e-3,
    "repetition_penalty": 1.3,
    "encoder_repetition_penalty": 1.2,
    "no_repeat_ngram_size": 2,
    "encoder_no_repeat_ngram_size": 3,
    "min_new_tokens": 3,
    "min_length": 7,
    "eos_token_id": [2, 3],
    "pad_token_id": 0,
    "sequence_bias": [[[5], 1.0], [[6, 7], -2.0]],
    "bad_words_ids": [[8], [9, 10], [2]],
    "suppress_tokens": [11],
    "forced_bos_token_id": 4,
    "forced_eos_token_id": [3],
    "max_new_tokens": 4,
    "max_length": 9,  # transformers' generate() sets it: prompt (5) + max_new_tokens
    "remove_invalid_values": True,
    "exponential_decay_length_penalty": (2, 1.5),
    "begin_suppress_tokens": [12],
    "watermarking_config": {"bias": 1.5, "context_width": 2, "hashing_key": 11},
    "renormalize_logits": True,
}


def test_processor_order_is_pinned():
    assert tuple(cls.__name__ for cls in lp.PROCESSOR_ORDER) == PINNED_ORDER


def test_builder_returns_every_processor_in_declared_order():
    cfg = SimpleNamespace(**EVERYTHING, presence_penalty=0.5, frequency_penalty=0.1, guidance_scale=1.5)
    processors = lp.build_logits_processors(cfg, prompt_length=4, prompt_ids=random_ids(0, 2, 4, 9),
                                            unconditional_logits=lambda ids: torch.zeros(ids.shape[0], 32))
    assert tuple(type(p) for p in processors) == lp.PROCESSOR_ORDER
    cfg.guidance_scale = 1.0  # off
    without_prompt = lp.build_logits_processors(cfg, prompt_length=4)  # as transformers without input ids
    assert tuple(type(p) for p in without_prompt) == tuple(
        c for c in lp.PROCESSOR_ORDER if not c.__name__.startswith(("Encoder", "Unbatched")))


def hf_processors(config: GenerationConfig, prompt_ids: torch.Tensor) -> hf.LogitsProcessorList:
    """transformers' own list, from the model-free part of generate() on a tiny random Llama."""
    model = make_tiny_model("llama", vocab_size=32).ref
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    return model._get_logits_processor(config, input_ids_seq_length=prompt_ids.shape[1], encoder_input_ids=prompt_ids,
                                       device="cpu")


@pytest.mark.parametrize(
    "overrides",
    [{}, {"do_sample": False}, {"num_beams": 4}, {"num_beams": 3, "eos_token_id": None, "min_new_tokens": None, "min_length": 0,
                                                       "exponential_decay_length_penalty": None},  # HF fails on it without EOS
     {"num_beams": 3, "eos_token_id": [], "min_new_tokens": None, "min_length": 0,
      "exponential_decay_length_penalty": None}],  # [] keeps 1 token, None 2 (transformers' EOS tensor of 0 rows)
    ids=["sample", "greedy", "beam-sample", "beam-sample-no-eos", "beam-sample-empty-eos"],
)
def test_builder_matches_transformers_get_logits_processor(overrides):
    settings = {**EVERYTHING, **overrides}
    prompt_length = 5
    prompt = random_ids(5, 4, prompt_length, 12)  # 4 prompts for the 8 score rows
    theirs = hf_processors(GenerationConfig(**settings), prompt)
    ours = lp.build_logits_processors(GenerationConfig(**settings), prompt_length, prompt_ids=prompt)
    assert [type(p).__name__ for p in ours] == [type(p).__name__ for p in theirs]
    for seed in range(4):  # same composed result, so same order and same min_tokens_to_keep
        logits = random_logits(seed, 8, 32, scale=6.0, num_inf=2)
        ids = random_ids(seed, 8, prompt_length + seed, 12)
        ids[0, -1] = 6  # completes the biased [6, 7]
        ids[1, -1] = 9  # completes the bad [9, 10]
        assert_same(ours(ids, logits), theirs(ids, logits.clone()))


def test_beam_sampling_keeps_eos_count_plus_one_tokens():
    cfg = SimpleNamespace(do_sample=True, num_beams=4, top_k=1, top_p=0.01, eos_token_id=[2, 3])
    processors = lp.build_logits_processors(cfg, prompt_length=0)
    assert [p.min_tokens_to_keep for p in processors] == [3, 3]
    logits = random_logits(0, 2, 16, scale=50.0)
    assert (torch.isfinite(processors(torch.zeros(2, 0, dtype=torch.long), logits)).sum(-1) == 3).all()
    explicit = lp.build_logits_processors(cfg, prompt_length=0, min_tokens_to_keep=1)
    assert [p.min_tokens_to_keep for p in explicit] == [1, 1]


def test_builder_treats_missing_and_none_as_disabled():
    assert lp.build_logits_processors(SimpleNamespace(), prompt_length=3) == []
    nones = SimpleNamespace(**{k: None for k in EVERYTHING})
    assert lp.build_logits_processors(nones, prompt_length=3) == []
    no_sampling = SimpleNamespace(do_sample=False, temperature=0.0, top_p=7.0)  # warpers ignored, as in HF
    assert lp.build_logits_processors(no_sampling, prompt_length=3) == []
    no_eos = SimpleNamespace(min_new_tokens=5)  # HF skips min_new_tokens without an EOS id
    assert lp.build_logits_processors(no_eos, prompt_length=3) == []


def test_sequence_bias_accepts_dict_and_list():
    logits = random_logits(3, 2, 10)
    ids = torch.tensor([[1, 6], [6, 1]])
    as_dict = lp.SequenceBiasLogitsProcessor({(6, 7): 2.0, (3,): -1.0})(ids, logits)
    as_list = lp.SequenceBiasLogitsProcessor([[[6, 7], 2.0], [[3], -1.0]])(ids, logits)
    assert_same(as_dict, as_list)
    assert as_dict[0, 7] == logits[0, 7] + 2.0 and as_dict[1, 7] == logits[1, 7]  # row 0 ends with 6
    assert torch.equal(as_dict[:, 3], logits[:, 3] - 1.0)


# -------------------------------------------------------------- validation

Cfg = SimpleNamespace

INVALID = [
    (lambda: lp.TopPLogitsWarper(1.5), r"top_p must be in \(0, 1\], got 1\.5"),
    (lambda: lp.TopKLogitsWarper(-1), r"top_k must be an int in \[0, 2147483647\] .*got -1"),
    (lambda: lp.TemperatureLogitsWarper(0.0), r"temperature must be a finite number > 0 .*got 0\.0"),
    (lambda: lp.TemperatureLogitsWarper(-0.5), r"temperature must be a finite number > 0 .*got -0\.5"),
    (lambda: lp.RepetitionPenaltyLogitsProcessor(0.0), r"repetition_penalty must be in \[1e-06, 1000000\], got 0\.0"),
    (lambda: lp.RepetitionPenaltyLogitsProcessor(-1.2), r"repetition_penalty must be in \[1e-06, 1000000\], got -1\.2"),
    (lambda: lp.MinPLogitsWarper(1.01), r"min_p must be in \[0, 1\], got 1\.01"),
    (lambda: lp.TypicalLogitsWarper(0.0), r"typical_p must be in \(0, 1\], got 0\.0"),
    (lambda: lp.TypicalLogitsWarper(1.5), r"typical_p must be in \(0, 1\], got 1\.5"),
    (lambda: lp.EpsilonLogitsWarper(1.0), r"epsilon_cutoff must be in \[0, 1\), got 1\.0"),
    (lambda: lp.EtaLogitsWarper(-0.5), r"eta_cutoff must be in \[0, 1\), got -0\.5"),
    (lambda: lp.NoRepeatNGramLogitsProcessor(-1), r"no_repeat_ngram_size must be an int in \[0, 2147483647\] .*got -1"),
    (lambda: lp.TopKLogitsWarper(5, min_tokens_to_keep=0), r"min_tokens_to_keep must be an int in \[1, 2147483647\], got 0"),
    (
        lambda: lp.PresenceFrequencyPenaltyLogitsProcessor(0.0, 3.0, 0),
        r"frequency_penalty must be in \[-2, 2\], got 3\.0",
    ),
    (lambda: lp.NoBadWordsLogitsProcessor([]), r"bad_words_ids must be a non-empty list"),
    # nested or non-list entries (kvgen generate --bad-words-ids '[[[1], 2]]') raised TypeError: unhashable type
    (lambda: lp.NoBadWordsLogitsProcessor([[[1], 2]]), r"bad_words_ids entries must be non-empty sequences"),
    (lambda: lp.NoBadWordsLogitsProcessor([1]), r"bad_words_ids entries must be non-empty sequences"),
    (lambda: lp.NoBadWordsLogitsProcessor([{1: 2}]), r"bad_words_ids entries must be non-empty sequences"),
    (lambda: lp.SequenceBiasLogitsProcessor({(1, -2): 1.0}), r"sequence_bias keys must be non-empty sequences"),
    (lambda: lp.build_logits_processors(Cfg(do_sample=True, top_p=1.5), 0), r"top_p must be in \(0, 1\], got 1\.5"),
    (lambda: lp.build_logits_processors(Cfg(do_sample=True, temperature=0.0), 0), r"temperature must be a finite number > 0"),
    (lambda: lp.build_logits_processors(SimpleNamespace(repetition_penalty=0.0), 0), r"repetition_penalty must be in \[1e-06, 1000000\]"),
    (lambda: lp.build_logits_processors(SimpleNamespace(), -1), r"prompt_length must be an int >= 0, got -1"),
]


@pytest.mark.parametrize("build,message", INVALID)
def test_invalid_settings_raise_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("args,name", [((-1, 2, [0]), "prompt_length_to_skip"), ((1, -2, [0]), "min_new_tokens")])
def test_min_new_tokens_errors_name_the_parameter_as_transformers(args, name):
    # the messages said "num_generated" and "min_tokens", names the caller never wrote
    with pytest.raises(ValueError, match=name):
        hf.MinNewTokensLengthLogitsProcessor(*args)
    with pytest.raises(ValueError, match=rf"^{name} must be an int in \[0, 2147483647\], got -"):
        lp.MinNewTokensLengthLogitsProcessor(*args)


def test_forced_bos_and_begin_suppress_act_after_a_one_token_input():
    """transformers' rules: a forced BOS after a 1-token input, and begin_suppress_tokens one step later then."""
    cfg = GenerationConfig(forced_bos_token_id=5, begin_suppress_tokens=[6], max_new_tokens=3, max_length=4)
    ours, theirs = lp.build_logits_processors(cfg, prompt_length=1), hf_processors(cfg, random_ids(0, 2, 1, 12))
    for length in (1, 2, 3):
        ids, logits = random_ids(length, 2, length, 12), random_logits(length, 2, 12)
        assert_same(ours(ids, logits), theirs(ids, logits.clone()))
    forced = ours(random_ids(0, 2, 1, 12), random_logits(0, 2, 12))
    assert (forced.argmax(-1) == 5).all() and torch.isneginf(forced).sum() == 2 * 11
    assert torch.isneginf(ours(random_ids(1, 2, 2, 12), random_logits(1, 2, 12))[:, 6]).all()
