"""PagedKVCache: packed steps over scattered blocks give the same logits as a DynamicCache per sequence."""

from __future__ import annotations

import pytest
import torch

from kvgen.generation.runner import make_cache
from kvgen.kv_cache import (
    PagedAttentionMetadata,
    PagedKVCache,
    num_blocks_for_memory,
)

BLOCK_SIZE = 4


def _dynamic_logits(model, tokens: list[int]) -> torch.Tensor:
    """Reference: every position's logits [T, V], prefill of the first half then one token at a time."""
    cache, half, out = make_cache(model, "dynamic", 1, len(tokens)), len(tokens) // 2, []
    with torch.inference_mode():
        for start, end in [(0, half)] + [(i, i + 1) for i in range(half, len(tokens))]:
            ids = torch.tensor([tokens[start:end]])
            pos = torch.arange(start, end)[None]
            out.append(model.compute_logits(model(ids, pos, cache, None))[0])
    return torch.cat(out)  # [T, V]


def _paged_logits(model, seqs: list[list[int]], chunk_plan: list[list[int]], num_blocks: int) -> list[torch.Tensor]:
    """Run ``chunk_plan`` (per step, tokens fed per sequence; 0 = idle) packed, decodes first.

    Block tables are scattered over the pool (reversed, interleaved ids). Returns [T_i, V] per sequence.
    """
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    free = list(range(num_blocks - 1, -1, -1))
    tables: list[list[int]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in chunk_plan:
        order = sorted((i for i, n in enumerate(step) if n), key=lambda i: step[i] != 1)
        for i in order:
            while len(tables[i]) * BLOCK_SIZE < done[i] + step[i]:
                tables[i].append(free.pop(len(free) // 2))
        meta = PagedAttentionMetadata.build([step[i] for i in order], [done[i] for i in order],
                                            [tables[i] for i in order], BLOCK_SIZE)
        ids = torch.tensor([[t for i in order for t in seqs[i][done[i]:done[i] + step[i]]]])  # [1, N]
        pos = torch.tensor([[p for i in order for p in range(done[i], done[i] + step[i])]])  # [1, N]
        with torch.inference_mode():
            step_logits = model.compute_logits(model(ids, pos, cache, meta))[0]  # [N, V]
        for j, i in enumerate(order):
            a, b = int(meta.query_start_loc[j]), int(meta.query_start_loc[j + 1])
            logits[i].append(step_logits[a:b])
            done[i] += step[i]
    return [torch.cat(rows) for rows in logits]


# three sequences: one prefilled whole, one in chunks (with cached context), one arriving late
SEQS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3]]
PLAN = [
    [4, 5, 0],
    [1, 4, 0],
    [1, 1, 2],
    [1, 1, 1],
    [1, 1, 0],
    [1, 0, 0],
]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_tiny_model_paged_steps_match_dynamic_cache(tiny_model, model_type):
    model = tiny_model(model_type).ours
    seqs = [s[: sum(p[i] for p in PLAN)] for i, s in enumerate(SEQS)]
    got = _paged_logits(model, seqs, PLAN, num_blocks=16)
    for seq, logits in zip(seqs, got):
        torch.testing.assert_close(logits, _dynamic_logits(model, seq), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_chunk_after_a_one_token_first_chunk_matches_dynamic_cache(tiny_model, model_type):
    """A prefill whose first chunk was one token (a step's token budget left only one: it ran as a decode) continues
    with a chunk at position 1: its queries see slot 0 and their own earlier slots, as one DynamicCache sequence."""
    model = tiny_model(model_type).ours
    seqs = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8]]
    plan = [[1, 2], [3, 1], [1, 3], [2, 0]]
    got = _paged_logits(model, seqs, plan, num_blocks=16)
    for seq, logits in zip(seqs, got):
        torch.testing.assert_close(logits, _dynamic_logits(model, seq), rtol=1e-5, atol=1e-5)


def test_default_model_paged_steps_match_dynamic_cache(ours_default):
    model, tok = ours_default
    texts = ["The capital of France is Paris, and", "def add(a, b):\n    return", "Hi"]
    seqs = [tok.encode(t) + [28, 29, 30] for t in texts]  # room for the decode steps after each prompt
    plan = [[len(seqs[0]) - 3, 3, 0], [1, len(seqs[1]) - 5, len(seqs[2]) - 3], [1, 1, 1], [1, 0, 0]]
    seqs = [s[: sum(p[i] for p in plan)] for i, s in enumerate(seqs)]
    got = _paged_logits(model, seqs, plan, num_blocks=32)
    for seq, logits in zip(seqs, got):
        torch.testing.assert_close(logits, _dynamic_logits(model, seq), rtol=1e-4, atol=1e-4)


def test_metadata_slots_follow_block_tables():
    meta = PagedAttentionMetadata.build([1, 3], [5, 0], [[7, 2], [4]], BLOCK_SIZE)
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18]
    assert meta.num_decodes == 1 and meta.seq_lens.tolist() == [6, 3]
    block_ids, mask = meta.decode_inputs
    assert block_ids.tolist() == [7, 2] and mask[0, 0, 0].tolist() == [True] * 6 + [False] * 2
    assert meta.query_start_loc.tolist() == [0, 1, 4]


def test_metadata_rejects_decode_after_prefill_and_short_tables():
    with pytest.raises(ValueError, match="one-token sequences must be packed before"):
        PagedAttentionMetadata.build([3, 1], [0, 4], [[1], [2, 3]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="block_table of sequence 0 covers 4 positions, needs 6"):
        PagedAttentionMetadata.build([2], [4], [[1]], BLOCK_SIZE)


def test_pool_sizing_from_memory(tiny_model):
    cfg = tiny_model("llama").config  # 2 layers, 2 KV heads of 16
    per_block = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert num_blocks_for_memory(cfg, 10 * per_block + 1, BLOCK_SIZE, torch.float32) == 10
    cache = PagedKVCache.from_config(cfg, BLOCK_SIZE, kv_cache_memory_bytes=10 * per_block)
    assert cache.num_blocks == 10 and cache.nbytes() == 10 * per_block
    assert tuple(cache.key_cache[0].shape) == (10, 2, BLOCK_SIZE, 16)  # [num_blocks, Hkv, block_size, D]
    with pytest.raises(ValueError, match=f"kv_cache_memory must hold at least one block of block_size={BLOCK_SIZE} "
                                         f"tokens .*lower block_size"):  # a huge block_size is named too
        num_blocks_for_memory(cfg, per_block - 1, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="exactly one of num_blocks and kv_cache_memory_bytes"):
        PagedKVCache.from_config(cfg, BLOCK_SIZE)


@pytest.mark.parametrize(("index", "name"), [(0, "num_layers"), (1, "num_blocks"), (2, "block_size"),
                                             (3, "num_kv_heads"), (4, "head_dim")])
@pytest.mark.parametrize("bad", [0, 4.5, "4"])
def test_a_size_that_is_no_positive_int_is_named(index: int, name: str, bad: object) -> None:
    """A float died in the allocation and a str comparing it with 1, neither naming the argument."""
    sizes: list = [2, 4, 4, 2, 16]
    sizes[index] = bad
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got {bad!r}"):
        PagedKVCache(*sizes)
