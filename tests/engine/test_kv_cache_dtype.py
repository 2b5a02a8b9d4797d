"""``EngineArgs.kv_cache_dtype``: ``"int8"`` keeps the paged pool's rows as int8 values and a float32 scale each
(``kernels.reference.quantize_kv_rows``), about half the bytes of float16 rows, on a model that runs on the kernels;
anything else is refused with the field named."""

from __future__ import annotations

import pytest
import torch

import kvgen.kernels as K
from kvgen.engine import EngineArgs, LLMEngine, SamplingParams
from kvgen.kv_cache.paged import PagedAttentionMetadata, PagedKVCache, num_blocks_for_memory
from kvgen.loader import load_model

PROMPT = list(range(3, 63))  # 60 tokens: prefilled 16 a step, each chunk reading the earlier chunks' rows


@pytest.fixture(scope="module")
def kernel_model(tiny_model_dir):
    """The tiny random Llama with its matrices encoded as Q8_0 at load: it runs on the kernels."""
    return load_model(str(tiny_model_dir), quantization="q8_0")


def _prompt_logprobs(model, tok, **engine_args) -> tuple[torch.Tensor, LLMEngine]:
    """Each prompt token's logprob (the first has none) [59] float64 from an engine with ``engine_args``."""
    engine = LLMEngine(model, tok, EngineArgs(max_num_batched_tokens=16, block_size=16, **engine_args))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    engine.add_request("0", prompt_token_ids=PROMPT, sampling_params=params)
    outputs = [out for _ in range(20) if engine.has_unfinished_requests() for out in engine.step()]
    entries = outputs[-1].prompt_logprobs
    assert outputs[-1].finished and entries is not None and entries[0] is None
    return torch.tensor([e[t].logprob for t, e in zip(PROMPT[1:], entries[1:])], dtype=torch.float64), engine


def test_int8_rows_change_the_logprobs_by_little(kernel_model):
    model, tok = kernel_model
    fp16, _ = _prompt_logprobs(model, tok, num_blocks=8)
    int8, engine = _prompt_logprobs(model, tok, num_blocks=8, kv_cache_dtype="int8")
    assert engine.cache.key_cache[0].dtype == torch.int8 and len(engine.cache.key_scale) == model.config.num_hidden_layers
    assert engine.cache.key_scale[0].shape == engine.cache.key_cache[0].shape[:-1]  # a scale per row
    difference = float((int8 - fp16).abs().max())
    assert 0 < difference < 0.1  # nats (of ~6): int8 rows, close to the float16 ones (the tiny model's D is 16)


def test_int8_on_the_torch_twins_gives_the_kernels_logprobs(kernel_model, tiny_model_dir):
    """The same engine over the kernels' torch twins (``reference_ops``: the same int8 rows, float64 attention)."""
    model, tok = kernel_model
    int8, _ = _prompt_logprobs(model, tok, num_blocks=8, kv_cache_dtype="int8")
    twin, _ = load_model(str(tiny_model_dir), quantization="q8_0")
    twin.use_kernels(K.reference_ops())
    want, engine = _prompt_logprobs(twin, tok, num_blocks=8, kv_cache_dtype="int8")
    assert engine.cache.key_cache[0].dtype == torch.int8
    torch.testing.assert_close(int8, want, rtol=0, atol=2e-3)


def test_an_int8_pool_holds_more_blocks_in_the_same_memory(kernel_model):
    model, tok = kernel_model
    cfg, memory = model.config, 4 << 20
    fp16 = LLMEngine(model, tok, EngineArgs(kv_cache_memory=memory, block_size=16))
    int8 = LLMEngine(model, tok, EngineArgs(kv_cache_memory=memory, block_size=16, kv_cache_dtype="int8"))
    row = cfg.head_dim + 4  # int8 values and a float32 scale
    assert int8.cache.num_blocks == memory // (2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * row)
    assert int8.cache.num_blocks == num_blocks_for_memory(cfg, memory, 16, torch.int8)
    assert int8.cache.num_blocks / fp16.cache.num_blocks == pytest.approx(2 * cfg.head_dim / row, rel=0.01)
    assert int8.cache.nbytes() <= memory < int8.cache.nbytes() + int8.cache.nbytes() // int8.cache.num_blocks


def test_bad_kv_cache_dtypes_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs dtype 'auto'"):
        EngineArgs(kv_cache_dtype="int8", dtype="float32")
    model, tok = load_model(str(tiny_model_dir))  # float32 weights: the torch path, no kernels
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs a model on kvgen's kernels"):
        LLMEngine(model, tok, EngineArgs(kv_cache_dtype="int8"))
    pool = PagedKVCache(1, 2, 4, 1, 8, torch.int8)  # its torch path (attend) does not read int8 rows
    meta = PagedAttentionMetadata.build([1], [0], [[0]], 4)
    q, kv = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    with pytest.raises(ValueError, match="read by kvgen's kernels only"):
        pool.attend(0, q, kv, kv, meta)
