"""The seeded workloads of ``kvgen bench``: prompt ids, request mixes, fixed prompts, perplexity text.

Every workload comes from a ``torch.Generator(seed)`` (or fixed text), so a subprocess
rebuilds exactly the same token ids from the seed for one torch version.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PROMPTS = (  # the strategies bench's batch
    "The capital of France is",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef softmax(x):",
)
# GNU GPL v3: ~35 kB of English prose that Debian's essential base-files package installs everywhere.
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def seeded_prompt_ids(num_tokens: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Prompt ids ``[1, num_tokens]`` int64, uniform over ``[0, vocab_size)`` from ``torch.Generator(seed)``.

    Raises ``ValueError`` for ``num_tokens < 1`` or ``vocab_size < 1``.
    """
    import torch

    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=gen, dtype=torch.long)  # [1, T]


@dataclass
class Workload:
    """A request mix: ``prompt_token_ids[i]`` and ``output_lens[i]`` (tokens) of request i."""

    prompt_token_ids: list[list[int]]
    output_lens: list[int]


def make_workload(num_prompts: int, vocab_size: int, seed: int = 0, prompt_range: tuple[int, int] = (16, 512),
                  output_range: tuple[int, int] = (16, 256)) -> Workload:
    """Prompt and output lengths uniform in the (inclusive) ranges, prompt ids uniform over the vocabulary.

    Raises ``ValueError`` for ``num_prompts < 1``.
    """
    import torch

    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (num_prompts,), generator=gen).tolist()
    output_lens = torch.randint(output_range[0], output_range[1] + 1, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    return Workload(prompts, output_lens)


def left_padded(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows as one left-padded batch: ids and attention mask, both [B, T] int64."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long)  # [B, T]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)  # [B, T]
    return ids, mask


def read_text(file: str | Path | None) -> tuple[Path, str]:
    """The perplexity text and its path: ``file``, or :data:`DEFAULT_TEXT`. ``ValueError`` when unreadable as UTF-8."""
    path = Path(file) if file is not None else DEFAULT_TEXT
    try:
        return path, path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        hint = "" if file is not None else " (the default text; pass --file FILE)"
        raise ValueError(f"cannot read {path}{hint}: {e}") from None
