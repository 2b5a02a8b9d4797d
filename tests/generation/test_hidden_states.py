"""generate(output_hidden_states=True, output_attentions=True) against transformers 4.55 (eager attention).

Per forward, transformers returns every layer's input hidden states (the embeddings first) plus the output after
the final norm, and every layer's attention weights [B, H, T, S]. These tests compare the two on the tiny Llama and
GPT-2 over a left-padded batch, for every strategy that records (query positions of left padding excluded: there
each implementation computes its own unused values), and check the kernel path (quantized default model) against
the float32 path and against its own logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TinyModel, left_pad, make_tiny_model

from kvgen.generation import GenerateOutput, generate
from kvgen.generation.runner import make_cache

NEW_TOKENS = 4
PAD = 1
PROMPTS = [[5, 17, 42, 8, 61, 3, 29], [11, 70], [88, 4, 19, 33]]  # 7, 2 and 4 tokens
IDS, MASK = left_pad(PROMPTS, PAD)  # [3, 7]
NEGATIVE_IDS, NEGATIVE_MASK = left_pad([[9, 14, 2], [30], [21, 7]], PAD)

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "greedy, static cache": {"cache_implementation": "static"},
    "greedy, no cache": {"use_cache": False},
    "sampling, 2 per prompt": {"do_sample": True, "num_return_sequences": 2},
    "beam search": {"num_beams": 3},
    "beam sampling": {"num_beams": 3, "do_sample": True},
    "group beam search": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    "constrained beam search": {"num_beams": 3, "force_words_ids": [[7, 9]]},
    "dola": {"dola_layers": [0, 1]},
    "contrastive search": {"penalty_alpha": 0.6, "top_k": 4},
    "guidance, negative prompt": {"guidance_scale": 2.0, "negative_prompt_ids": NEGATIVE_IDS,
                                  "negative_prompt_attention_mask": NEGATIVE_MASK},
}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    model = make_tiny_model(request.param, std=0.5)
    model.ref.set_attn_implementation("eager")  # transformers' SDPA attention returns no weights
    return model


def _valid_queries(rows: int, step: int, num_queries: int) -> torch.Tensor:
    """[R, T_step] 1 where the step's query is a real token: the last ``num_queries`` columns of the prompt mask
    (each prompt's rows together) followed by one column per new token."""
    mask = torch.cat([MASK.repeat_interleave(rows // MASK.shape[0], 0), torch.ones(rows, step, dtype=torch.long)], 1)
    return mask[:, : IDS.shape[1] + step][:, -num_queries:]  # [R, T_step]


def _assert_recordings_match(ours: GenerateOutput, ref: Any, num_layers: int) -> None:
    assert ours.hidden_states is not None and ours.attentions is not None
    assert len(ours.hidden_states) == len(ref.hidden_states) == len(ours.attentions) == len(ref.attentions)
    for step, (got, want) in enumerate(zip(ours.hidden_states, ref.hidden_states, strict=True)):
        assert len(got) == len(want) == num_layers + 1
        for x, y in zip(got, want, strict=True):  # [R, T_step, C]
            assert x.shape == y.shape
            valid = _valid_queries(y.shape[0], step, y.shape[1]).bool()  # [R, T_step]
            torch.testing.assert_close(x[valid], y[valid], rtol=1e-4, atol=5e-4)
    for step, (got, want) in enumerate(zip(ours.attentions, ref.attentions, strict=True)):
        assert len(got) == len(want) == num_layers
        for x, y in zip(got, want, strict=True):  # [R, H, T_step, S]; transformers' static cache: longer S
            num_keys = x.shape[-1]
            assert x.shape[:-1] == y.shape[:-1] and num_keys == IDS.shape[1] + step
            valid = _valid_queries(y.shape[0], step, y.shape[2]).bool()  # [R, T_step]
            x, y = x.transpose(1, 2)[valid], y.transpose(1, 2)[valid]  # [Q, H, S] of the real queries
            assert not y[..., num_keys:].any()  # a static cache's slots past the sequence weigh nothing
            torch.testing.assert_close(x, y[..., :num_keys], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_hidden_states_and_attentions_match_transformers(tiny: TinyModel, name: str) -> None:
    kwargs = dict(SETTINGS[name])
    common = {"max_new_tokens": NEW_TOKENS, "pad_token_id": PAD, "output_hidden_states": True,
              "output_attentions": True}
    with torch.random.fork_rng(), torch.inference_mode():
        torch.manual_seed(3)
        ref = tiny.ref.generate(IDS, attention_mask=MASK, eos_token_id=None, return_dict_in_generate=True,
                                trust_remote_code=True, **common, **kwargs)
    ours = generate(tiny.ours, IDS, MASK, eos_token_id=[], seed=3, **common, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_recordings_match(ours, ref, tiny.ours.config.num_hidden_layers)
    assert ours.hidden_states is not None and ours.hidden_states[0][0].shape[1] == IDS.shape[1]  # the prefill


def test_nothing_is_recorded_unless_asked(tiny: TinyModel) -> None:
    out = generate(tiny.ours, IDS, MASK, max_new_tokens=2, output_scores=True)
    assert out.hidden_states is None and out.attentions is None
    only_attentions = generate(tiny.ours, IDS, MASK, max_new_tokens=2, output_attentions=True)
    assert only_attentions.hidden_states is None and only_attentions.attentions is not None


def test_a_cached_prefix_is_not_recorded_again(tiny: TinyModel) -> None:
    """With ``past_key_values`` holding 3 of 5 prompt tokens, the first forward records 2 positions whose values
    are those of the uncached run (their keys span all 5 slots)."""
    ids = torch.tensor([[5, 17, 42, 8, 61]])
    whole = generate(tiny.ours, ids, None, max_new_tokens=3, output_hidden_states=True, output_attentions=True)
    cache = make_cache(tiny.ours, "dynamic")
    generate(tiny.ours, ids[:, :4], None, max_new_tokens=1, past_key_values=cache)
    cache.crop(3)
    resumed = generate(tiny.ours, ids, None, max_new_tokens=3, past_key_values=cache, output_hidden_states=True,
                       output_attentions=True)
    assert resumed.sequences.tolist() == whole.sequences.tolist()
    assert whole.hidden_states is not None and resumed.hidden_states is not None
    assert whole.attentions is not None and resumed.attentions is not None
    for x, y in zip(resumed.hidden_states[0], whole.hidden_states[0], strict=True):
        assert x.shape[1] == 2
        torch.testing.assert_close(x, y[:, 3:], rtol=1e-4, atol=1e-4)
    for x, y in zip(resumed.attentions[0], whole.attentions[0], strict=True):
        assert x.shape[2:] == (2, 5)
        torch.testing.assert_close(x, y[:, :, 3:], rtol=1e-4, atol=1e-6)


def test_drafting_strategies_refuse_to_record(tiny: TinyModel) -> None:
    with pytest.raises(NotImplementedError, match=r"output_hidden_states / output_attentions are not implemented"):
        generate(tiny.ours, IDS[:1], None, max_new_tokens=2, output_hidden_states=True, prompt_lookup_num_tokens=2)
    with pytest.raises(NotImplementedError, match=r"not implemented for assisted decoding"):
        generate(tiny.ours, IDS[:1], None, max_new_tokens=2, output_attentions=True, assistant_model=tiny.ours)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_kernel_path_recordings_agree_with_the_float32_path(ours_default_auto, ours_default, cache: str) -> None:
    """The quantized model records what it computes: its final hidden states give its logits exactly, the
    attention rows sum to 1, and both are close to the float32 model's (activation quantization, float16 keys)."""
    (auto, tokenizer), (f32, _) = ours_default_auto, ours_default
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    kwargs = {"max_new_tokens": 4, "cache_implementation": cache, "output_hidden_states": True,
              "output_attentions": True}
    fast = generate(auto, ids, None, output_logits=True, **kwargs)
    exact = generate(f32, ids, None, **kwargs)
    assert fast.new_token_ids == exact.new_token_ids
    assert auto.one_op_decoder and all("forward_kernels" not in vars(layer) for layer in auto.model.layers)
    assert fast.hidden_states is not None and fast.attentions is not None and fast.logits is not None
    assert exact.hidden_states is not None and exact.attentions is not None
    for step, logits in enumerate(fast.logits):
        torch.testing.assert_close(auto.compute_logits(fast.hidden_states[step][-1][:, -1]), logits)
    for got, want in zip(fast.hidden_states, exact.hidden_states, strict=True):
        for x, y in zip(got, want, strict=True):
            assert x.shape == y.shape and float((x - y).abs().max() / y.abs().max()) < 0.05
    for got, want in zip(fast.attentions, exact.attentions, strict=True):
        for x, y in zip(got, want, strict=True):
            assert x.shape == y.shape and float((x - y).abs().max()) < 0.1
            torch.testing.assert_close(x.sum(-1), torch.ones(x.shape[:-1]))


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2", "qwen3", "mixtral"])
def test_other_architectures_record_what_transformers_returns(model_type: str) -> None:
    """Sliding-window layers (Gemma 3 and 2: a window of 6 slots, passed by the 7-token prompt), q/k norms, experts:
    the same hidden states and attention weights, every key slot included."""
    tiny = make_tiny_model(model_type, std=0.5)
    tiny.ref.set_attn_implementation("eager")
    ids = IDS[:1]  # [1, 7]: the unpadded prompt
    common = {"max_new_tokens": NEW_TOKENS, "pad_token_id": PAD, "output_hidden_states": True,
              "output_attentions": True}
    with torch.inference_mode():
        ref = tiny.ref.generate(ids, eos_token_id=None, return_dict_in_generate=True, **common)
    ours = generate(tiny.ours, ids, None, eos_token_id=[], **common)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert ours.hidden_states is not None and ours.attentions is not None
    assert len(ours.hidden_states) == len(ref.hidden_states) == NEW_TOKENS
    for got, want in zip(ours.hidden_states + ours.attentions, ref.hidden_states + ref.attentions, strict=True):
        assert len(got) == len(want)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=5e-4)
