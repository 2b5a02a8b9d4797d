"""The two declared processing orders, as data, over the same ops in ``kvgen.sampling.ops``.

``generate()`` follows Hugging Face, the engine follows vLLM, because each front
door must reproduce its reference token for token; the orders differ (HF: temperature
-> top-k -> top-p -> min-p; vLLM: temperature -> min-p -> top-k -> top-p; logit bias
and min_tokens before the penalties in vLLM, after them in HF), and a different
order changes the kept set (min-p before top-k keeps a different set than after it).
Tests pin both: ``tests/sampling/test_logits_process.py`` against transformers'
``_get_logits_processor``, ``tests/engine/test_sampler.py`` against vLLM v1's ``Sampler``.

Sources: transformers 4.55 ``GenerationMixin._get_logits_processor`` (processors in
order of the ``if`` chain; warpers only when ``do_sample``); vLLM v1
``vllm/v1/sample/sampler.py`` ``Sampler.forward`` / ``Sampler.sample`` (raw logprobs,
non-argmax-invariant processors min_tokens then logit_bias, penalties repetition ->
frequency -> presence, greedy argmax, temperature, min-p, top-k / top-p, draw).
"""

from __future__ import annotations

# generate(): HF's order. Presence/frequency penalties (not in HF) sit after HF's processors and
# before the warpers, where vLLM puts penalties relative to temperature.
GENERATE_ORDER: tuple[str, ...] = (
    "guidance",
    "sequence_bias",
    "encoder_repetition_penalty",
    "repetition_penalty",
    "no_repeat_ngram",
    "encoder_no_repeat_ngram",
    "bad_words",
    "min_length",
    "min_new_tokens",
    "forced_bos",
    "forced_eos",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "presence_frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "watermark",  # not a warper: after them (transformers #34630), sampling or not
    "renormalize_logits",  # not a warper: transformers appends it last, sampling or not
)
# Stages from this one on (but the last two) are HF "warpers": they run only when sampling.
GENERATE_FIRST_WARPER = "temperature"

# The engine: vLLM v1's order. Greedy rows take the argmax of the logits reached just
# before ENGINE_FIRST_SAMPLING_STAGE; the stages from it on run only for sampled rows.
ENGINE_ORDER: tuple[str, ...] = (
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
ENGINE_FIRST_SAMPLING_STAGE = "temperature"


def split_order(order: tuple[str, ...], first_sampling_stage: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(stages for every row, stages only for sampled rows) of a declared order."""
    cut = order.index(first_sampling_stage)
    return order[:cut], order[cut:]
