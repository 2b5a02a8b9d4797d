"""The seeded workloads of ``kvgen bench``: prompt ids, request mixes, fixed prompts, perplexity text.

Each comes from a ``torch.Generator(seed)`` (or fixed text), so a subprocess rebuilds the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PROMPTS = ("The capital of France is", "Once upon a time, in a small village,", "import numpy as np\n\ndef softmax(x):")
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")  # GNU GPL v3: ~35 kB of English (Debian's base-files)


def seeded_prompt_ids(num_tokens: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Prompt ids [1, num_tokens] int64, uniform over [0, vocab_size) from ``torch.Generator(seed)``; ``ValueError``
    below 1."""
    if num_tokens < 1 or vocab_size < 1:
        raise ValueError(f"num_tokens and vocab_size must be >= 1, got {num_tokens} and {vocab_size}")
    return torch.randint(0, vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(seed))  # [1, T]


@dataclass
class Workload:
    """A request mix: request i has ``prompt_token_ids[i]`` and generates ``output_lens[i]`` tokens."""

    prompt_token_ids: list[list[int]]
    output_lens: list[int]


def make_workload(num_prompts: int, vocab_size: int, seed: int = 0) -> Workload:
    """Prompt lengths uniform in [16, 512] tokens, output lengths in [16, 256], ids uniform over the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(16, 513, (num_prompts,), generator=gen).tolist()
    output_lens = torch.randint(16, 257, (num_prompts,), generator=gen).tolist()
    return Workload([torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in prompt_lens], output_lens)


def left_padded(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows as one left-padded batch: ids and attention mask, both [B, T] int64."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows])  # [B, T]
    return ids, torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # [B, T]


def read_text(file: str | None) -> tuple[Path, str]:
    """The perplexity text and its path: ``file``, or :data:`DEFAULT_TEXT`. ``ValueError`` when unreadable as UTF-8."""
    path = Path(file or DEFAULT_TEXT)
    try:
        return path, path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}{'' if file else ' (the default text; pass --file FILE)'}: {e}") from None
