"""kvgen.default_model: finding the default GGUF."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvgen import default_model
from kvgen.default_model import INSTALL_HINT, find_default_gguf
from kvgen.errors import ModelNotFoundError


def test_find_default_gguf_finds_the_file() -> None:
    try:
        gguf_path = find_default_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    assert gguf_path.is_file() and gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_find_default_gguf_missing_gives_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setattr(default_model.site, "getsitepackages", list)
    monkeypatch.setattr(default_model.site, "getusersitepackages", lambda: str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=INSTALL_HINT):
        find_default_gguf()
