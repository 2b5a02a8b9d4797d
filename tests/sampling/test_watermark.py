"""Green-list watermarking against transformers 4.55: the processor's scores and the detector's statistics are
transformers' for both seeding schemes, watermarked text is detected and plain text is not."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, random_ids, random_logits
from transformers.generation import WatermarkDetector as HFDetector
from transformers.generation import WatermarkingConfig as HFConfig
from transformers.generation import WatermarkLogitsProcessor as HFProcessor

from kvgen.sampling.watermark import (
    WatermarkDetector,
    WatermarkingConfig,
    WatermarkLogitsProcessor,
)

VOCAB = 97
CONFIGS = [
    {},
    {"greenlist_ratio": 0.5, "bias": 4.0, "hashing_key": 7, "context_width": 3},
    {"seeding_scheme": "selfhash"},
    {"seeding_scheme": "selfhash", "context_width": 2, "greenlist_ratio": 0.3},
]


@pytest.mark.parametrize("fields", CONFIGS, ids=["default", "lefthash-width-3", "selfhash", "selfhash-width-2"])
def test_processor_scores_equal_transformers(fields):
    ours = WatermarkLogitsProcessor(VOCAB, WatermarkingConfig(**fields))
    theirs = HFProcessor(VOCAB, "cpu", **fields)
    for seed in range(3):
        ids, scores = random_ids(seed, 4, 5 + seed, VOCAB), random_logits(seed, 4, VOCAB, scale=3.0)
        got = ours(ids, scores)
        assert_same(got, theirs(ids, scores))
        assert ((got - scores) != 0).any()  # some tokens were biased
    if fields.get("context_width", 1) > 1:  # too short to seed: left alone, as transformers
        short, scores = random_ids(0, 2, 1, VOCAB), random_logits(0, 2, VOCAB)
        assert_same(ours(short, scores), theirs(short, scores))
        assert_same(ours(short, scores), scores)


def test_vocab_size_defaults_to_the_scores_width():
    ids, scores = random_ids(1, 3, 6, VOCAB), random_logits(1, 3, VOCAB)
    assert_same(WatermarkLogitsProcessor(None, WatermarkingConfig())(ids, scores),
                WatermarkLogitsProcessor(VOCAB, WatermarkingConfig())(ids, scores))


@pytest.mark.parametrize("fields", CONFIGS[:3], ids=["default", "lefthash-width-3", "selfhash"])
def test_detector_statistics_equal_transformers_and_tell_watermarked_text(fields):
    config = SimpleConfig(vocab_size=VOCAB, bos_token_id=0)
    theirs = HFDetector(config, "cpu", HFConfig(**fields))
    ours = WatermarkDetector(VOCAB, fields, bos_token_id=0)
    plain = random_ids(3, 3, 40, VOCAB)
    marked = _watermarked(WatermarkLogitsProcessor(VOCAB, WatermarkingConfig(**{**fields, "bias": 8.0})))
    for ids in (plain, marked):
        got, want = ours(ids), theirs(ids, return_dict=True)
        assert got.num_tokens_scored == want.num_tokens_scored.tolist()
        assert got.num_green_tokens == want.num_green_tokens.tolist()
        torch.testing.assert_close(torch.tensor(got.z_score, dtype=torch.float64), torch.tensor(want.z_score))
        torch.testing.assert_close(torch.tensor(got.p_value, dtype=torch.float64), torch.tensor(want.p_value))
        assert got.prediction == want.prediction.tolist()
    assert ours(marked).prediction == [True, True] and not any(ours(plain).prediction)


def test_ignore_repeated_ngrams_counts_each_ngram_once():
    ids = torch.tensor([[5, 6, 5, 6, 5, 6, 5, 6, 9]])
    assert WatermarkDetector(VOCAB, {})(ids).num_tokens_scored == [8]
    assert WatermarkDetector(VOCAB, {}, ignore_repeated_ngrams=True)(ids).num_tokens_scored == [3]  # 56, 65, 69


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"greenlist_ratio": 1.0}, ValueError, "greenlist_ratio"),
    ({"seeding_scheme": "midhash"}, ValueError, "seeding_scheme"),
    ({"context_width": 0}, ValueError, "context_width"),
    ({"bias": float("inf")}, ValueError, "bias"),
    ({"gamma": 0.3}, ValueError, "unknown watermarking_config key"),
    ({"ngram_len": 0, "keys": [1, 2]}, ValueError, "ngram_len must be an int >= 1"),
    ({"ngram_len": 5, "keys": []}, ValueError, "keys must be a non-empty list"),
    ({"ngram_len": 5, "keys": [1], "sampling_table_size": 2**25}, ValueError, "sampling_table_size must be <= 2"),
    ({"ngram_len": 5, "keys": [1], "depth": 3}, ValueError, "unknown SynthID watermarking_config key"),
])
def test_bad_configs_are_refused(fields, error, message):
    with pytest.raises(error, match=message):
        WatermarkingConfig.of(fields)


def _watermarked(processor: WatermarkLogitsProcessor) -> torch.Tensor:
    """Two 40-token rows drawn greedily from flat random scores plus the watermark's bias."""
    ids = random_ids(9, 2, 3, VOCAB)
    for step in range(37):
        scores = processor(ids, random_logits(100 + step, 2, VOCAB))
        ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    return ids


class SimpleConfig:
    """The model config fields transformers' detector reads."""

    is_encoder_decoder = False

    def __init__(self, vocab_size: int, bos_token_id: int) -> None:
        self.vocab_size, self.bos_token_id = vocab_size, bos_token_id


# ---------------------------------------------------------------- SynthID


SYNTHID = {
    "5 keys, trigrams": {"ngram_len": 3, "keys": [654, 400, 836, 123, 340, 443, 597, 160]},
    "repeated contexts, skip first calls": {"ngram_len": 2, "keys": [7, -11], "context_history_size": 3,
                                            "skip_first_ngram_calls": True, "sampling_table_size": 1000},
    "debug mode": {"ngram_len": 4, "keys": [2**62, 5], "sampling_table_seed": 9, "debug_mode": True},
}


@pytest.mark.parametrize("name", list(SYNTHID))
def test_synthid_scores_equal_transformers_step_by_step(name):
    """Twelve steps of three rows over a 9-token vocabulary, the new tokens cycling 0, 1, 2 (so contexts repeat
    and the history check fires): the processor's log-probabilities equal transformers' bit for bit."""
    from transformers.generation import SynthIDTextWatermarkingConfig as HFSynthIDConfig

    from kvgen.sampling.synthid import SynthIDTextWatermarkLogitsProcessor

    fields = SYNTHID[name]
    theirs = HFSynthIDConfig(**fields).construct_processor(9, torch.device("cpu"))
    ours = SynthIDTextWatermarkLogitsProcessor(WatermarkingConfig.of(fields))
    ids = random_ids(3, 3, 4, 9)
    unchanged = 0
    for step in range(12):
        scores = random_logits(200 + step, 3, 9)
        want = theirs(ids, scores.clone())
        assert_same(ours(ids, scores.clone()), want)
        unchanged += int(torch.equal(want, scores))
        ids = torch.cat([ids, torch.full((3, 1), step % 3)], dim=1)
    assert unchanged < 12  # the watermark moves the scores
    if name.startswith("repeated"):  # the skipped first call, then contexts seen within 3 steps
        assert unchanged >= 2


def test_the_green_list_detector_refuses_synthid():
    with pytest.raises(ValueError, match="SynthID text needs a trained Bayesian detector"):
        WatermarkDetector(VOCAB, {"ngram_len": 3, "keys": [1]})
