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
    ({"ngram_len": 5, "keys": [1, 2]}, NotImplementedError, "SynthID"),
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
