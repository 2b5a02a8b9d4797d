"""Dataclass field helpers shared by every config: ``config_field`` (help text the CLI reuses)
and ``check_int`` (the one "int >= N" check, with its one wording)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def config_field(default: Any, help: str, **metadata: Any) -> Any:
    """A field with ``default`` (lists and dicts copied per instance) and ``metadata["help"]``."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """Refuse anything but an int (bools excluded) in ``[minimum, maximum]`` (no upper bound when None).

    Raises ``ValueError``: ``max_tokens must be an int >= 1, got 0`` or
    ``top_k must be an int in [0, 2147483647], got -1``.
    """
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and value >= minimum and (maximum is None or value <= maximum):
        return
    expected = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise ValueError(f"{name} must be an int {expected}, got {value!r}")
