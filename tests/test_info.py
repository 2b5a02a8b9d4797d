"""kvgen.info: the storage types of a Hugging Face directory come from the files the loader reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvgen.info import describe_model


def test_storage_types_ignore_safetensors_files_the_loader_does_not_read(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A corrupt optimizer.safetensors beside a valid model made ``kvgen info`` fail (SafetensorError) where
    ``generate`` worked; an int64 one would have been counted."""
    directory = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    want = describe_model(str(directory))["storage_types"]
    (directory / "optimizer.safetensors").write_bytes(b"abc")
    assert describe_model(str(directory))["storage_types"] == want == {"F32": sum(want.values())}
    (directory / "optimizer.safetensors").unlink()
    save_file({"step": torch.zeros(3, dtype=torch.int64)}, directory / "optimizer.safetensors")
    assert describe_model(str(directory))["storage_types"] == want
