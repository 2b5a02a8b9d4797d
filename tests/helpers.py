"""Small helpers shared by tests (import as `from helpers import ...`).

The tiny-model builders live here so that module-level code and parametrizations can call
them; tests usually reach them through the ``tiny_model`` / ``tiny_model_dir`` fixtures of
``conftest.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvgen.config import ModelConfig

if TYPE_CHECKING:
    import transformers
    from tokenizers import Tokenizer as BackendTokenizer


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids [B, T] and attention_mask [B, T] for token lists."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


NEG_INF = float("-inf")


def random_logits(seed: int, B: int, V: int, scale: float = 1.0, num_inf: int = 0, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-3, 4, (B, V), generator=g).float()
    else:
        x = torch.randn(B, V, generator=g) * scale
    if num_inf:
        idx = torch.rand(B, V, generator=g).argsort(dim=1)[:, :num_inf]  # [B, num_inf]
        x = x.scatter(1, idx, NEG_INF)
    return x


def top_of(position: dict, k: int) -> dict[int, float]:
    """A vLLM-shaped logprobs dict's ``k`` best ids -> logprob, by rank (the chosen id only where it ranks in them)."""
    return {t: lp.logprob for t, lp in sorted(position.items(), key=lambda kv: kv[1].rank) if lp.rank <= k}


def random_ids(seed: int, B: int, T: int, high: int) -> torch.Tensor:
    return torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-equal values, the same -inf and NaN positions (NaN where the reference gives NaN, e.g. -inf + inf)."""
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def assert_batched_equals_alone(model, prompts: list[list[int]], pad_id: int, cfg, rows_per_prompt: int) -> None:
    """generate() on a left-padded batch gives each prompt the rows (tokens, finish reasons, scores) it gets alone."""
    from kvgen.generation import generate

    ids, mask = left_pad(prompts, pad_id)
    batched = generate(model, ids, mask, cfg)
    n = rows_per_prompt
    for i, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), None, cfg)
        assert batched.new_token_ids[n * i : n * i + n] == alone.new_token_ids
        assert batched.finish_reasons[n * i : n * i + n] == alone.finish_reasons
        torch.testing.assert_close(batched.sequences_scores[n * i : n * i + n], alone.sequences_scores)


def assert_padded_beams_match_transformers(ours_default, hf_model, hf_tokenizer, prompts: list[list[int]],
                                           max_new_tokens: int, **kwargs):
    """generate() and transformers' generate() on the left-padded ``prompts`` (a tokenizer given to both, for stop
    strings): the same sequences and sequence scores. Returns kvgen's ``GenerateOutput``."""
    from kvgen.generation import GenerationConfig, generate

    model, tok = ours_default
    ids, mask = left_pad(prompts, tok.pad_token_id)
    ours = generate(model, ids, mask, GenerationConfig(max_new_tokens=max_new_tokens, **kwargs), tokenizer=tok)
    with torch.inference_mode():
        ref = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_ids,
                                pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_scores=True,
                                tokenizer=hf_tokenizer, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores)
    return ours


# ---------------------------------------------------------------- running a model or an attention op


def model_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, T, V] float32 of kvgen's ``model`` on ids [B, T] int64, without a cache.

    mask [B, T] (1 real, 0 left padding): positions from it and ``AttentionMetadata(mask)``; None: positions
    0..T-1 and no attention metadata.
    """
    from kvgen.generation.runner import positions_from_mask
    from kvgen.models import AttentionMetadata

    with torch.inference_mode():
        if mask is None:
            return model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))
        return model.compute_logits(model(ids, positions_from_mask(mask), None, AttentionMetadata(mask)))


def hf_greedy(ref: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``max_new_tokens`` greedy tokens after ``prompt`` alone (no EOS stop, pad id 0)."""
    ids = torch.tensor([prompt])  # [1, T]
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # [1, T + max_new_tokens]
    return out[0, len(prompt):].tolist()


def engine_greedy(model, prompts: list[list[int]], max_tokens: int, **engine_args: Any) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens from the paged engine (``LLM``; 64 blocks of 4 tokens unless
    ``engine_args`` say otherwise), EOS ignored."""
    from kvgen.engine import LLM, SamplingParams

    llm = LLM(model, None, **{"num_blocks": 64, "block_size": 4, **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def twin_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``model_logits`` [B, T, V] float32 with the C++ ops of a model on the kernels swapped for their float32 torch
    twins (``reference_ops()``), which are swapped back afterwards."""
    from kvgen.kernels import reference_ops

    kernels = model.kernels
    model.use_kernels(reference_ops())
    try:
        return model_logits(model, ids, mask)
    finally:
        model.use_kernels(kernels)


def assert_one_op_decoder_is_layer_by_layer(model, ids: torch.Tensor, want: torch.Tensor | None = None) -> None:
    """A model on the kernels runs every layer in one op: ``decoder_layers`` once per forward with a static cache,
    giving the hidden states and cache contents of the layer-by-layer path bit for bit over a prefill of ids [1, T]
    and a decode step, and ``paged_decoder_layers`` in the paged engine, giving its greedy tokens; with ``want``
    [1, T, V] (the float32 path's logits) the logits stay near it."""
    import dataclasses

    from kvgen.generation.runner import make_cache

    kernels, calls = model.kernels, []

    def counted(name: str):
        def op(*args):
            calls.append(name)
            return getattr(kernels, name)(*args)
        return op

    runs, tokens = [], []
    try:
        model.use_kernels(dataclasses.replace(kernels, decoder_layers=counted("decoder_layers"),
                                              paged_decoder_layers=counted("paged_decoder_layers")))
        for one_op in (True, False):
            model.one_op_decoder, cache = one_op, make_cache(model, "static", 1, ids.shape[1] + 2)
            with torch.inference_mode():
                hidden = model(ids, torch.arange(ids.shape[1])[None], cache)
                step = model(ids[:, :1], torch.tensor([[ids.shape[1]]]), cache)
            runs.append((hidden, step, *cache.key_cache, *cache.value_cache))
            tokens.append(engine_greedy(model, [ids[0].tolist()], 4))
            assert calls.count("decoder_layers") == (2 if one_op else 0) and ("paged_decoder_layers" in calls) == one_op
            calls.clear()
    finally:
        model.one_op_decoder = True
        model.use_kernels(kernels)
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and tokens[0] == tokens[1]
    if want is not None:
        got = model.compute_logits(runs[0][0])
        torch.testing.assert_close(got, want, rtol=0, atol=0.05 * float(want.abs().max()))


def llama_cpp_permute(w: Any, n_head: int) -> Any:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF order -> GGUF order) of q or k rows, a numpy array
    [H * D, ...]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_DENSE_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                     "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                     "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GLOBAL_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}


def add_gguf_matrix(w: Any, name: str, x: Any, qtype: Any = None) -> None:
    """Add the float32 array ``x`` to the GGUFWriter ``w``: a 2-D one as ``qtype`` by the gguf package's quantizer,
    a vector (or any with ``qtype`` None / F32) as it is."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype not in (None, GGMLQuantizationType.F32) and x.ndim == 2:
        w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, x)


def finish_gguf(w: Any) -> None:
    """Write the GGUFWriter ``w``'s header, metadata and tensors to its file, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_dense_gguf(path: Path, ref: Any, arch: str, qtype: Any = None, *, permute_qk: bool,
                     add_keys: Any = None) -> None:
    """``ref`` (a dense transformers Llama-family model in float32) as llama.cpp's converter writes an ``arch`` file:
    the shape keys (:func:`gguf_writer_for`), ``rope.freq_base``, ``add_keys(writer)``, a token list t0 .., llama's
    tensor names, q/k rows permuted when ``permute_qk`` (its ``LlamaModel``), matrices as ``qtype`` (default F32;
    vectors F32), no ``output.weight`` when the embeddings are tied."""
    import numpy as np

    cfg = ref.config
    w = gguf_writer_for(path, arch, cfg)
    w.add_rope_freq_base(cfg.rope_theta)
    if add_keys is not None:
        add_keys(w)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for name, p in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = np.ascontiguousarray(p.detach().float().numpy())
        if name in _GLOBAL_GGUF_NAMES:
            gguf_name = _GLOBAL_GGUF_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_DENSE_GGUF_NAMES[module]}.{kind}"
        if permute_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = cfg.num_attention_heads if ".attn_q." in gguf_name else cfg.num_key_value_heads
            x = np.ascontiguousarray(llama_cpp_permute(x, heads))
        add_gguf_matrix(w, gguf_name, x, qtype)
    finish_gguf(w)


def gguf_writer_for(path: Path, arch: str, cfg: Any) -> Any:
    """A ``gguf.GGUFWriter`` for ``arch`` at ``path`` holding the shape keys every converted model has, from a
    transformers config: context length, embedding length, block count, feed-forward length, head counts and the RMS
    norm eps (the caller adds its architecture's own keys, the vocabulary and the tensors)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w


def assert_batch_matches_transformers(ours, ref: transformers.PreTrainedModel, prompts: list[list[int]],
                                      max_new_tokens: int, cache: str) -> None:
    """On ``prompts`` as one left-padded batch: our logits at the real positions equal transformers' (rtol = atol =
    1e-5), and ``generate`` with ``cache`` gives transformers' greedy sequences [B, T + max_new_tokens]."""
    from kvgen.generation import GenerationConfig, generate
    from kvgen.generation.runner import positions_from_mask

    ids, mask = left_pad(prompts, pad_id=0)
    with torch.inference_mode():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    real = mask.bool()
    torch.testing.assert_close(model_logits(ours, ids, mask)[real], expected[real], rtol=1e-5, atol=1e-5)
    got = generate(ours, ids, mask, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0,
                                                     cache_implementation=cache))
    assert got.sequences.tolist() == want.tolist()


def assert_greedy_on_every_cache(model, prompts: list[list[int]], expected: list[list[int]], max_new_tokens: int) -> None:
    """Each prompt alone gives its ``expected`` greedy tokens through generate() with the static and the dynamic
    cache, and the paged engine gives them all, with whole and with chunked prefill (7 tokens a step)."""
    from kvgen.generation import GenerationConfig, generate

    for cache in ("static", "dynamic"):
        for prompt, tokens in zip(prompts, expected):
            out = generate(model, torch.tensor([prompt]), None,
                           GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[], cache_implementation=cache))
            assert out.new_token_ids[0] == tokens, cache
    assert engine_greedy(model, prompts, max_new_tokens) == expected
    assert engine_greedy(model, prompts, max_new_tokens, max_num_batched_tokens=7) == expected


def attention_inputs(b: int, h: int, h_kv: int, t: int, s: int, d: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs of the attention ops: q [B, H, T, D] float32 (a transposed view, strided like the model's),
    k, v [B, Hkv, S, D] float16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2)  # [B, H, T, D]
    k = torch.randn(b, h_kv, s, d, generator=g).half()  # [B, Hkv, S, D]
    v = torch.randn(b, h_kv, s, d, generator=g).half()  # [B, Hkv, S, D]
    return q, k, v


class PagedInputs(NamedTuple):
    """Packed rows and a block pool for the paged attention ops: two sequences over 6 blocks of ``block_size`` = 4
    slots; sequence 0 holds 12 positions over blocks 3, 0, 5 (a 3-token chunk at 9-11), sequence 1 a decode at 6."""

    rows: torch.Tensor  # [N = 4, (H + 2 Hkv) D] float32: the chunk's 3 rows, then the decode's
    pools: list[torch.Tensor]  # K, V [6, Hkv, 4, D] float16
    slots: torch.Tensor  # [N] int64: where each row's K and V go
    tables: torch.Tensor  # [2, 3] int64 block tables
    qsl: torch.Tensor  # [3] int64 query_start_loc
    seq_lens: torch.Tensor  # [2] int64
    block_size: int


def paged_inputs(qkv: torch.Tensor, h_kv: int, d: int, g: torch.Generator) -> PagedInputs:
    """The first 4 rows of qkv [>= 4, (H + 2 Hkv) D] float32 as ``PagedInputs``, the pools drawn from ``g``."""
    bs = 4
    tables, seq_lens, qsl = torch.tensor([[3, 0, 5], [1, 2, 0]]), torch.tensor([12, 7]), torch.tensor([0, 3, 4])
    slots = torch.tensor([5 * bs + 1, 5 * bs + 2, 5 * bs + 3, 2 * bs + 2])  # [N]
    rows = qkv[:4].contiguous()  # [N, (H + 2 Hkv) D]
    pools = [torch.randn(6, h_kv, bs, d, generator=g).half() for _ in range(2)]  # K, V [6, Hkv, bs, D]
    return PagedInputs(rows, pools, slots, tables, qsl, seq_lens, bs)


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, past: int,
                      scale: float, window: int = 0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain attention in float64, the spec of the attention ops: scores * scale, then softcap * tanh(. / softcap)
    (softcap > 0; transformers' Gemma 2 ``eager_attention_forward``), the causal mask over slots (query i at slot
    past + i) with transformers' sliding window (window > 0: kv_idx > q_idx - window), the key mask, the softmax
    (with ``sinks`` [H]: over the scores and head h's sink logit, whose probability is dropped, as transformers'
    GptOss ``eager_attention_forward``).

    q [B, H, T, D]; k, v [B, Hkv, S, D]; key_mask [B, S] or None. Returns [B, T, H, D] float64.
    """
    h, t = q.shape[1], q.shape[2]
    s, group = k.shape[2], h // k.shape[1]
    q_slot, k_slot = past + torch.arange(t)[:, None], torch.arange(s)[None, :]  # [T, 1], [1, S]
    visible = (k_slot <= q_slot) & ((k_slot > q_slot - window) if window else True)  # [T, S]
    visible = visible[None] & (key_mask.bool()[:, None, :] if key_mask is not None else True)  # [B, T, S]
    scores = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale  # [B, H, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], float("-inf"))  # [B, H, T, S]
    if sinks is not None:
        sink = sinks.double().view(1, h, 1, 1).expand(scores.shape[0], h, t, 1)  # [B, H, T, 1]
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :s]  # [B, H, T, S]
    else:
        probs = scores.softmax(-1)  # [B, H, T, S]
    return (probs @ v.double().repeat_interleave(group, 1)).transpose(1, 2)  # [B, T, H, D]


# ---------------------------------------------------------------- tiny random models


class TinyModel(NamedTuple):
    """transformers' model (the reference, eval mode) and kvgen's model on the same float32 weights."""

    ref: transformers.PreTrainedModel
    ours: torch.nn.Module

    @property
    def config(self) -> ModelConfig:
        return self.ours.config


def _hf_config(model_type: str, tie: bool, kv_heads: int, bias: bool, vocab_size: int, max_position_embeddings: int,
               overrides: dict[str, Any]) -> transformers.PretrainedConfig:
    import transformers

    if model_type == "llama":
        return transformers.LlamaConfig(**{
            "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": kv_heads, "max_position_embeddings": max_position_embeddings,
            "tie_word_embeddings": tie, "attention_bias": bias, "mlp_bias": bias, **overrides})
    if model_type == "gpt2":
        if not bias or kv_heads != 4:
            raise ValueError(f"GPT-2 always has biases and one KV head per query head, got bias={bias}, kv_heads={kv_heads}")
        return transformers.GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=max_position_embeddings, tie_word_embeddings=tie, **overrides)
    if model_type == "qwen3":  # q_norm / k_norm, and a head_dim that is not hidden_size / heads
        return transformers.Qwen3Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=24, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie, **overrides)
    if model_type in ("qwen2", "mistral"):  # Llama-family: biases as their own configs define them
        cls = transformers.Qwen2Config if model_type == "qwen2" else transformers.MistralConfig
        return cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings,
                   tie_word_embeddings=tie, **overrides)
    if model_type == "smollm3":  # layer 1 without RoPE (NoPE); ids inside the tiny vocabulary
        return transformers.SmolLM3Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie,
            **({"no_rope_layers": [1, 0], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0} | overrides))
    if model_type == "gemma3_text":  # layers sliding, full, sliding (window 6); q/k norms; scale 24^-0.5 != 16^-0.5
        return transformers.Gemma3TextConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie, **({"num_hidden_layers": 3, "query_pre_attn_scalar": 24, "sliding_window": 6,
                                         "rope_theta": 1000.0,
                                         "rope_local_base_freq": 100.0, "bos_token_id": 1, "eos_token_id": 2,
                                         "pad_token_id": 0,
                                         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
                                        | overrides))
    if model_type == "gemma2":  # layers sliding, full, sliding (window 6); scale 24^-0.5; softcaps 5 / 10 that matter
        return transformers.Gemma2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie, attn_implementation="eager",  # its SDPA path drops the attention softcap
            **({"num_hidden_layers": 3, "query_pre_attn_scalar": 24, "sliding_window": 6, "rope_theta": 1000.0,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0, "bos_token_id": 1, "eos_token_id": 2,
                "pad_token_id": 0} | overrides))
    if model_type == "ernie4_5":  # Llama's layers, RoPE over interleaved pairs (q/k rows reordered by kvgen's loader)
        return transformers.Ernie4_5Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie, **({"use_bias": bias} | overrides))
    if model_type == "granite":  # Llama's layers with Granite's four multipliers, none of them 1
        return transformers.GraniteConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie,
            **({"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.125,
                "logits_scaling": 2.5} | overrides))
    if model_type == "phi3":  # stacked qkv_proj / gate_up_proj; ids inside the tiny vocabulary (Phi3Config's are 32000)
        ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
        return transformers.Phi3Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie, **(ids | overrides))
    # mixtures of experts: 3 layers of hidden 64, 8 experts of 32, top 2. Qwen3-MoE: layer 1 dense (mlp_only_layers),
    # q/k norms, head_dim 32 (not 64 / 4), renormalized top-k; Qwen2-MoE: a shared expert of 64, q/k/v biases, top-k as is;
    # Mixtral: every layer sparse, experts of intermediate_size, renormalized top-k
    moe = {"qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 32,
                                                       "norm_topk_prob": True, "mlp_only_layers": [1]}),
           "qwen2_moe": (transformers.Qwen2MoeConfig, {"num_experts": 8, "moe_intermediate_size": 32,
                                                       "shared_expert_intermediate_size": 64}),
           "mixtral": (transformers.MixtralConfig, {"num_local_experts": 8, "intermediate_size": 32})}
    if model_type in moe:
        cls, settings = moe[model_type]
        return cls(vocab_size=vocab_size, num_attention_heads=4, num_key_value_heads=kv_heads,
                   max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie,
                   **({"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128, "num_experts_per_tok": 2}
                      | settings | overrides))
    raise ValueError(f"model_type must be 'llama', 'gpt2', 'qwen2', 'qwen3', 'mistral', 'smollm3', 'phi3', 'granite', "
                     f"'ernie4_5', "
                     f"'gemma3_text', 'gemma2', 'qwen3_moe', 'qwen2_moe' or 'mixtral', got {model_type!r}")


_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def mixtral_to_qwen_names(name: str) -> str:
    """A transformers Mixtral parameter name in kvgen's layout (transformers' Qwen-MoE names), written out here
    independently of kvgen's name maps: ``block_sparse_moe.gate`` -> ``mlp.gate``,
    ``block_sparse_moe.experts.E.w1`` (w3, w2) -> ``mlp.experts.E.gate_proj`` (up_proj, down_proj)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, w, tail = name.rsplit(".", 2)
    return f"{head}.{_MIXTRAL_EXPERT.get(w, w)}.{tail}"


def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Every parameter drawn from one seeded generator: norm weights 1 + N(0, std²), the rest N(0, std²).

    No parameter keeps an init value (zero biases, unit norms), so swapping any two shows.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_weight = p.dim() == 1 and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if is_norm_weight else 0.0))


def hf_params_in_kvgen_layout(ref: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of a transformers model's parameters in kvgen's layout, mapped independently of kvgen's name maps.

    GPT-2's ``Conv1D`` weights ([in, out], found by type, not by name) are transposed to
    [out, in]; a tied ``lm_head.weight`` is absent (``named_parameters`` yields a shared tensor once).
    """
    from transformers.pytorch_utils import Conv1D

    conv1d = {name + ".weight" for name, m in ref.named_modules() if isinstance(m, Conv1D)}
    return {
        name: (p.detach().t() if name in conv1d else p.detach()).clone().contiguous()
        for name, p in ref.named_parameters()
    }


def interleaved_to_rotate_half(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [H * D, ...] of q or k whose RoPE pairs are (2j, 2j + 1) (ERNIE 4.5) reordered so the pairs are (j, j + D/2)
    (Llama's rotate-half): row 2j + s of a head goes to s * D/2 + j."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def make_tiny_model(
    model_type: str = "llama",
    *,
    tie: bool | None = None,
    kv_heads: int | None = None,
    bias: bool | None = None,
    vocab_size: int = 97,
    max_position_embeddings: int = 128,
    std: float = 0.1,
    seed: int = 0,
    **overrides: Any,
) -> TinyModel:
    """A fresh tiny (2 layers, hidden 64, 4 heads of 16; Gemma 3, Gemma 2: 3 layers) transformers model and kvgen's
    twin.

    Llama defaults: untied, 2 KV heads, no biases, intermediate 128. GPT-2: tied, biases.
    Weights come from ``torch.Generator().manual_seed(seed)`` (see ``_randomize``), so a
    call's result depends only on its arguments. ``overrides`` go to the transformers
    config (``rope_theta=500.0``, ``eos_token_id=0``, ``activation_function=...``).
    kvgen's config is ``ModelConfig.from_hf_dict`` of transformers' config; its model is
    ``build_model`` on a copy of the weights. Raises ``ValueError`` for an unknown
    ``model_type`` or a GPT-2 without biases / with grouped KV heads.
    """
    import transformers

    from kvgen.models import build_model

    is_gpt2 = model_type == "gpt2"
    tie = is_gpt2 if tie is None else tie
    kv_heads = (4 if is_gpt2 else 2) if kv_heads is None else kv_heads
    bias = is_gpt2 if bias is None else bias
    hf_config = _hf_config(model_type, tie, kv_heads, bias, vocab_size, max_position_embeddings, overrides)
    ref = transformers.AutoModelForCausalLM.from_config(hf_config)
    _randomize(ref, seed, std)
    ref.eval()
    params = hf_params_in_kvgen_layout(ref)
    if model_type == "mixtral":
        params = {mixtral_to_qwen_names(k): v for k, v in params.items()}
    if model_type in ("gemma3_text", "gemma2"):  # Gemma3RMSNorm / Gemma2RMSNorm multiply by 1 + w; kvgen's hold 1 + w
        params = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in params.items()}
    if model_type == "ernie4_5":  # q/k rows of interleaved pairs (2j, 2j + 1) -> kvgen's rotate-half (j, j + D/2)
        heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
        params = {k: interleaved_to_rotate_half(v, heads[k.split(".")[-2]]) if k.split(".")[-2] in heads else v
                  for k, v in params.items()}
    ours = build_model(ModelConfig.from_hf_dict(hf_config.to_dict()), params)
    return TinyModel(ref, ours)


# ---------------------------------------------------------------- a tiny HF directory

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# templates that loop over a message's content parts, as vision models' do (vLLM's "openai" content format)
SMOLVLM_TEMPLATE = (  # SmolVLM-Instruct's: no string case, a string content renders as nothing
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
PARTS_TEMPLATE = (  # Llama 3.2 Vision's and Pixtral's shape: the parts' texts back to back, through a sliced messages
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}[{{ message['role'] }}] "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{% for c in message.tool_calls or [] %}<call>{{ c.function.arguments | tojson }}</call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village, a story began.",
    "Name three colours: red, green and blue. Hello world! Tell me a story; still there?",
    "def add(a, b):\n    return a + b\n\nprint(add(10, 20))  # 30",
    "naïve café 中文 日本語 😀 3.14159, 1,000,000 and 2024-05-01. I'm sure they've seen it.",
]


def train_tiny_tokenizer(vocab_size: int = 384) -> BackendTokenizer:
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on a few lines; ids 0-2 are ``SPECIAL_TOKENS``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_TOKENIZER_TEXT * 4, trainer)
    return backend


def save_tiny_model_dir(path: Path, model_type: str = "llama", **model_kwargs: Any) -> Path:
    """Save a tiny Llama (or another ``model_type``: ``make_tiny_model`` + ``model_kwargs``) and the tiny tokenizer
    as an HF directory.

    BOS is ``<|im_start|>``, EOS ``<|im_end|>``, the chat template ChatML; the model's
    vocabulary is the tokenizer's. Returns ``path``.
    """
    backend = train_tiny_tokenizer()
    bos, eos = backend.token_to_id("<|im_start|>"), backend.token_to_id("<|im_end|>")
    model_kwargs = {"tie": True, "bos_token_id": bos, "eos_token_id": eos, **model_kwargs}
    ref, _ = make_tiny_model(model_type, vocab_size=backend.get_vocab_size(), **model_kwargs)
    ref.save_pretrained(path, safe_serialization=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
              "chat_template": CHATML_TEMPLATE, "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def tiny_gpt_oss(seed: int = 0, **overrides: Any):
    """transformers' GptOssForCausalLM in float32, eager attention: 4 layers alternating sliding (window 4) / full,
    hidden 64, 4 heads, 2 KV heads of 16, 4 experts of 32, top 2, YaRN (factor 8 over 32 positions, unrounded); every
    parameter random (biases N(0, 0.3²), expert matrices N(0, 0.5²), sinks N(0, 1), norms 1 + N(0, 0.3²)).
    ``overrides`` go to the ``GptOssConfig`` (``attention_bias=False``)."""
    from transformers import GptOssConfig
    from transformers import GptOssForCausalLM as Ref

    cfg = GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 32},
        attn_implementation="eager", **overrides)
    torch.manual_seed(seed)
    ref = Ref(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            norm = name.endswith("norm.weight")
            std = 1.0 if name.endswith("sinks") else 0.5 if "experts" in name else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if norm else 0.0))
    return ref
