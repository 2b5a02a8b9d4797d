"""The default path: the default GGUF's Q4_1 / Q8_0 blocks run through kvgen's kernels.

References: the float32 path on the same (dequantized) weights for accuracy, and the same
model itself for the equivalences (batch, padding, cache kinds), which must hold exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import left_pad

from kvgen.engine import EngineArgs, LLMEngine, SamplingParams
from kvgen.generation import GenerationConfig, generate
from kvgen.generation.runner import make_cache, positions_from_mask
from kvgen.kernels import reference_ops
from kvgen.models import AttentionMetadata
from kvgen.models.quant_linear import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village, there lived"]


def _logits(model, ids, mask):
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions_from_mask(mask), None, AttentionMetadata(mask)))


def test_weights_stay_in_their_blocks(ours_default_auto, default_gguf_path):
    model, _ = ours_default_auto
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate_up, down per layer; the tied head
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert all(m.qweight.dtype == torch.uint8 for m in linears)
    nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert nbytes < 1.05 * default_gguf_path.stat().st_size  # nothing dequantized to float32


def test_logits_are_close_to_float32_on_the_same_weights(ours_default_auto, ours_default):
    (quant, tok), (dense, _) = ours_default_auto, ours_default
    ids, mask = left_pad([tok.encode(t) for t in TEXTS], pad_id=0)
    got, want = _logits(quant, ids, mask), _logits(dense, ids, mask)
    real = mask.bool()
    err = (got[real] - want[real]).abs().max() / want[real].abs().max()
    assert err < 0.06  # int8 activations per 32 values: a few % of the logit range
    top1 = (got[real].argmax(-1) == want[real].argmax(-1)).float().mean()
    assert top1 >= 0.9


def test_fast_kernels_and_torch_twins_agree(ours_default_auto):
    model, tok = ours_default_auto
    if model.kernels.backend != "avx2":
        pytest.skip("the C++ kernels are not in use")
    ids, mask = left_pad([tok.encode(t) for t in TEXTS], pad_id=0)
    fast = _logits(model, ids, mask)
    kernels = model.kernels
    try:
        model.use_kernels(reference_ops())
        slow = _logits(model, ids, mask)
    finally:
        model.use_kernels(kernels)
    real = mask.bool()
    torch.testing.assert_close(fast[real], slow[real], rtol=0, atol=0.05 * float(slow[real].abs().max()))


@pytest.mark.parametrize("cache", ["static", "dynamic", None])
def test_greedy_tokens_equal_alone_batched_and_across_cache_kinds(ours_default_auto, cache):
    model, tok = ours_default_auto
    prompts = [tok.encode(t) for t in TEXTS]
    static = GenerationConfig(max_new_tokens=16, cache_implementation="static")
    config = GenerationConfig(max_new_tokens=16, cache_implementation=cache or "static", use_cache=cache is not None)
    alone = [generate(model, torch.tensor([p]), None, static).new_token_ids[0] for p in prompts]
    ids, mask = left_pad(prompts, pad_id=0)
    assert generate(model, ids, mask, config).new_token_ids == alone


@pytest.mark.parametrize("twins", [False, True], ids=["kernels", "torch-twins"])
def test_one_op_decoder_equals_the_layer_by_layer_path(ours_default_auto, twins):
    """``decoder_layers`` (a static cache: every layer in one op) against each layer's own ops, on the C++ kernels
    and on their torch twins: the same hidden states and cache contents, bit for bit, over a padded prefill and
    two decode steps."""
    model, tok = ours_default_auto
    ids, mask = left_pad([tok.encode(t) for t in TEXTS], pad_id=0)
    kernels, calls = model.kernels, []
    base = reference_ops() if twins else kernels

    def counted(*args):
        calls.append(1)
        return base.decoder_layers(*args)

    runs = []
    try:
        model.use_kernels(dataclasses.replace(base, decoder_layers=counted))
        assert model._decoder_operands is not None  # SmolLM2 has no projection biases
        for one_op in (True, False):
            model.one_op_decoder = one_op
            calls.clear()
            cache, out, step_mask = make_cache(model, "static", ids.shape[0], ids.shape[1] + 4), [], mask
            with torch.inference_mode():
                out.append(model(ids, positions_from_mask(mask), cache, AttentionMetadata(mask)))
                for step in range(2):
                    step_mask = torch.cat([step_mask, torch.ones(ids.shape[0], 1, dtype=mask.dtype)], 1)
                    positions = positions_from_mask(step_mask)[:, -1:]
                    out.append(model(torch.full((ids.shape[0], 1), 42 + step), positions, cache, AttentionMetadata(step_mask)))
            runs.append((out, cache.key_cache + cache.value_cache))
            assert len(calls) == (3 if one_op else 0)  # one op per forward, or none
    finally:
        model.one_op_decoder = True
        model.use_kernels(kernels)
    (fused_out, fused_cache), (layer_out, layer_cache) = runs
    assert all(torch.equal(a, b) for a, b in zip(fused_out, layer_out))
    assert all(torch.equal(a, b) for a, b in zip(fused_cache, layer_cache))


def test_engine_steps_run_the_one_op_paged_decoder_with_the_same_tokens(ours_default_auto):
    """The engine's packed steps (chunked prefill next to decodes) through ``paged_decoder_layers``, one op per
    step, give the tokens of the layer-by-layer path."""
    model, tok = ours_default_auto
    kernels, calls = model.kernels, []

    def counted(*args):
        calls.append(1)
        return kernels.paged_decoder_layers(*args)

    def run() -> dict[str, list[int]]:
        engine = LLMEngine(model, tok, EngineArgs(model="default", max_num_batched_tokens=16, kv_cache_memory=32 << 20))
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, text in enumerate(TEXTS):
            engine.add_request(str(i), prompt=text, sampling_params=params)
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            outputs |= {out.request_id: out.outputs[0].token_ids for out in engine.step()}
        return outputs

    try:
        model.use_kernels(dataclasses.replace(kernels, paged_decoder_layers=counted))
        one_op = run()
        num_steps = len(calls)
        model.one_op_decoder = False
        assert run() == one_op and len(calls) == num_steps > 0
    finally:
        model.one_op_decoder = True
        model.use_kernels(kernels)
