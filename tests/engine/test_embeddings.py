"""``LLM.embed`` (kvgen.engine.pooling) against transformers' last hidden state on the same weights.

transformers' base model (``model.model``: the decoder without its LM head) gives ``last_hidden_state`` [1, T, C]
after the final norm; an embedding is its last row, mean or first row, the first ``dimensions`` values, L2-normalized
(vLLM's pooler). The pooling comes from ``EngineArgs.pooling_type``, a GGUF file's ``{arch}.pooling_type`` (as
Qwen3-Embedding's GGUF files carry it) or a sentence-transformers ``1_Pooling/config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, PoolingType
from helpers import make_tiny_model, write_dense_gguf

from kvgen.engine.engine_args import EngineArgs
from kvgen.engine.llm import LLM
from kvgen.engine.pooling import PoolingParams, default_pooling_type
from kvgen.models import build_model
from kvgen.weights.gguf_loader import load_gguf

PROMPTS = [[5, 17, 42, 8, 61, 3, 29], [11, 70], [88]]


def _reference(ref, prompt: list[int], pooling: str, dimensions: int | None = None, normalize: bool = True
               ) -> torch.Tensor:
    """transformers' embedding of ``prompt``: the base model's last hidden state pooled, cut, normalized."""
    with torch.inference_mode():
        hidden = ref.base_model(torch.tensor([prompt])).last_hidden_state[0]  # [T, C]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling][:dimensions]
    return F.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_transformers_hidden_states(model_type: str, pooling: str) -> None:
    tiny = make_tiny_model(model_type, std=0.5)
    llm = LLM(tiny.ours, None, pooling_type=pooling)
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    assert [o.prompt_token_ids for o in outputs] == PROMPTS and all(o.finished for o in outputs)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (tiny.ours.config.hidden_size,)
        torch.testing.assert_close(got, _reference(tiny.ref, prompt, pooling), rtol=1e-5, atol=1e-5)
    cut = llm.embed(PROMPTS[0], PoolingParams(dimensions=8, normalize=False))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(cut), _reference(tiny.ref, PROMPTS[0], pooling, 8, normalize=False),
                               rtol=1e-5, atol=1e-5)
    per_prompt = llm.embed(PROMPTS[:2], [PoolingParams(dimensions=4), PoolingParams(normalize=False)], use_tqdm=False)
    torch.testing.assert_close(torch.tensor(per_prompt[0].outputs.embedding),
                               _reference(tiny.ref, PROMPTS[0], pooling, 4), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(per_prompt[1].outputs.embedding),
                               _reference(tiny.ref, PROMPTS[1], pooling, normalize=False), rtol=1e-5, atol=1e-5)


def test_embeddings_do_not_disturb_generation() -> None:
    """Embedding between the steps of running requests leaves their tokens as they are without it."""
    tiny = make_tiny_model("llama", std=0.5)
    from kvgen.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in LLM(tiny.ours, None).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    llm = LLM(tiny.ours, None)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", None, params, prompt_token_ids=prompt)
    tokens: dict[str, list[int]] = {}
    embeddings = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        embeddings.append(engine.embed("e", PROMPTS[0]).outputs.embedding)
    assert [tokens[f"g{i}"] for i in range(len(PROMPTS))] == alone
    assert all(e == embeddings[0] for e in embeddings)


def test_embedding_refusals() -> None:
    tiny = make_tiny_model("llama", max_position_embeddings=16)
    llm = LLM(tiny.ours, None)
    with pytest.raises(ValueError, match=r"dimensions must be <= the model's hidden size \(64\), got 65"):
        llm.embed([1, 2], PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="dimensions must be an int >= 1, got 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match=r"prompt of 17 tokens exceeds max_model_len \(16\)"):
        llm.embed(list(range(17)))
    with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, 97\), got 97"):
        llm.embed([1, 97])
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        llm.embed("hello")
    with pytest.raises(ValueError, match=r"pooling_params must be one PoolingParams or one per prompt \(2\), got 1"):
        llm.embed([[1, 2], [3]], [PoolingParams()])
    with pytest.raises(ValueError, match="pooling_type must be one of last, mean, cls, got 'max'"):
        LLM(tiny.ours, None, pooling_type="max")


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_truncate_prompt_tokens_embeds_the_last_k_tokens(pooling: str) -> None:
    """vLLM's ``PoolingParams.truncate_prompt_tokens``: k keeps the prompt's last k tokens, -1 its last
    ``max_model_len``, before the length check; 0 and k above ``max_model_len`` are refused."""
    tiny = make_tiny_model("llama", std=0.5, max_position_embeddings=16)
    llm = LLM(tiny.ours, None, pooling_type=pooling)
    out = llm.embed(PROMPTS[0], PoolingParams(truncate_prompt_tokens=3))[0]
    assert out.prompt_token_ids == PROMPTS[0][-3:]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), _reference(tiny.ref, PROMPTS[0][-3:], pooling),
                               rtol=1e-5, atol=1e-5)
    long = list(range(1, 21))  # 20 tokens, over max_model_len 16
    out = llm.embed(long, PoolingParams(truncate_prompt_tokens=-1))[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), _reference(tiny.ref, long[-16:], pooling),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be -1 or <= max_model_len \(16\), got 17"):
        llm.embed(long, PoolingParams(truncate_prompt_tokens=17))
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be -1 or an int in \[1, 2147483647\], got 0"):
        PoolingParams(truncate_prompt_tokens=0)


def test_the_model_names_its_pooling(tmp_path: Path) -> None:
    """A GGUF file's ``pooling_type`` key (llama.cpp's enum) and a sentence-transformers directory's pooling
    config set the default; EngineArgs.pooling_type wins over both."""
    tiny = make_tiny_model("llama")
    assert default_pooling_type(tiny.ours, tmp_path) == "last"  # neither: vLLM's default for a decoder
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert default_pooling_type(tiny.ours, tmp_path) == "mean"
    path = tmp_path / "emb.gguf"
    write_dense_gguf(path, tiny.ref, "llama", permute_qk=True, add_keys=lambda w: w.add_pooling_type(PoolingType.CLS))
    model = build_model(*load_gguf(path)[:2])
    assert LLM(model, None).llm_engine.pooling_type == "cls"
    assert LLM(model, None, pooling_type="mean").llm_engine.pooling_type == "mean"


def test_a_quantized_qwen3_embedding_file_matches_transformers(tmp_path: Path) -> None:
    """A Qwen3-Embedding-like GGUF (qwen3, ``pooling_type`` LAST, Q8_0 matrices) runs on the kernels: its embeddings
    point where transformers' float32 ones do (cosine > 0.99, nearest to their own prompt's)."""
    tiny = make_tiny_model("qwen3", std=0.5)
    path = tmp_path / "qwen3-embedding.gguf"
    def keys(w) -> None:  # the tiny Qwen3's head_dim is not hidden_size / heads
        w.add_key_length(tiny.ref.config.head_dim)
        w.add_value_length(tiny.ref.config.head_dim)
        w.add_pooling_type(PoolingType.LAST)

    write_dense_gguf(path, tiny.ref, "qwen3", GGMLQuantizationType.Q8_0, permute_qk=False, add_keys=keys)
    model = build_model(*load_gguf(path, dtype=None)[:2])  # the default path: Q8_0 blocks on the kernels
    llm = LLM(model, None)
    assert llm.llm_engine.pooling_type == "last" and model.kernels is not None
    wanted = torch.stack([_reference(tiny.ref, p, "last") for p in PROMPTS])  # [P, C]
    for i, out in enumerate(llm.embed([{"prompt_token_ids": p} for p in PROMPTS])):
        cosines = wanted @ torch.tensor(out.outputs.embedding)  # [P]
        assert float(cosines[i]) > 0.99 and int(cosines.argmax()) == i  # its own prompt's, not another's
        assert abs(float(torch.tensor(out.outputs.embedding).norm()) - 1) < 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_prompts_over_the_token_budget_run_in_chunks_with_the_same_result(pooling: str) -> None:
    """With ``max_num_batched_tokens=3`` a 7-token prompt runs as chunks of 3, 3 and 1 tokens over a KV cache of its
    own; the embedding is transformers' all the same."""
    tiny = make_tiny_model("llama", std=0.5)
    llm = LLM(tiny.ours, None, pooling_type=pooling, max_num_batched_tokens=3)
    job = llm.llm_engine.embedding_job("j", PROMPTS[0])
    assert [job.step() for _ in range(3)] == [False, False, True] and job.num_computed_tokens == 7
    torch.testing.assert_close(torch.tensor(job.output().outputs.embedding), _reference(tiny.ref, PROMPTS[0], pooling),
                               rtol=1e-5, atol=1e-5)
    cut = llm.embed(PROMPTS[0], PoolingParams(dimensions=8, normalize=False))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(cut), _reference(tiny.ref, PROMPTS[0], pooling, 8, normalize=False),
                               rtol=1e-5, atol=1e-5)


def test_generation_steps_run_between_the_chunks_of_a_long_embedding() -> None:
    """AsyncLLMEngine: while a 40-token prompt is embedded 4 tokens at a time, a running request keeps decoding."""
    import asyncio

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.llm_engine import LLMEngine
    from kvgen.engine.sampling_params import SamplingParams

    tiny = make_tiny_model("llama", std=0.5)
    engine = AsyncLLMEngine(LLMEngine(tiny.ours, None, EngineArgs(max_num_batched_tokens=4)), step_in_thread=False)

    async def run() -> tuple[int, list[float], list[float]]:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        stream = await engine.add_request("g", {"prompt_token_ids": PROMPTS[1]}, params)
        out = await engine.embed("e", list(range(3, 43)), None)
        num_outputs = stream._queue.qsize()  # decode steps that ran while the embedding was computed
        async for _ in stream:
            pass
        alone = await engine.embed("e2", list(range(3, 43)), None)
        await engine.shutdown()
        return num_outputs, out.outputs.embedding, alone.outputs.embedding

    num_outputs, during, alone = asyncio.run(run())
    assert num_outputs >= 5 and during == pytest.approx(alone, abs=1e-6)
