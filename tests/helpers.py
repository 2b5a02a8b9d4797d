"""Small helpers shared by tests (import as `from helpers import ...`)."""

from __future__ import annotations

import torch


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


def random_ids(seed: int, B: int, T: int, high: int) -> torch.Tensor:
    return torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


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
