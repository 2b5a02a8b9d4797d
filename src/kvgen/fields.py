"""``config_field``: a dataclass field carrying its help text (reused by the CLI)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def config_field(default: Any, help: str, **metadata: Any) -> Any:
    """A field with ``default`` (lists and dicts copied per instance) and ``metadata["help"]``."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})
