"""kvgen.engine.engine_args: ``EngineArgs`` validation (vLLM's argument names and values)."""

from __future__ import annotations

import pytest
import torch

from kvgen.engine.engine_args import EngineArgs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_takes_a_torch_dtype_as_vllm(dtype: torch.dtype) -> None:
    """vLLM's ``dtype`` is a name or a ``torch.dtype``; kvgen refused the latter ("got torch.float32")."""
    name = str(dtype).removeprefix("torch.")
    assert EngineArgs(dtype=dtype).dtype == EngineArgs(dtype=name).dtype == name


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": torch.int64}, r"dtype must be one of auto, .*got 'torch.int64'"),
    ({"dtype": ["float32"]}, r"dtype must be one of auto, .*got \['float32'\]"),
    ({"generation_config": 5}, r"generation_config must be 'auto', 'vllm' or a directory, got 5"),
    ({"generation_config": None}, r"generation_config must be 'auto', 'vllm' or a directory, got None"),
])
def test_a_dtype_or_generation_config_of_another_type_is_named(kwargs: dict, match: str) -> None:
    """A list dtype died with "unhashable type: 'list'", a generation_config that is no str with pathlib's TypeError."""
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)
