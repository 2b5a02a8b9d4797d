"""Reading a PyTorch checkpoint (``pytorch_model.bin``, a zip of pickled tensors) through the handle interface the
HF loader uses for safetensors files (``keys()``, ``get_slice(key).get_dtype()`` / ``get_shape()``,
``get_tensor(key)``).

The file is unpickled as transformers 4.55 reads it (``load_state_dict``: ``torch.load(..., map_location="cpu",
weights_only=True)``, memory-mapped where the format allows): the weights-only unpickler builds tensors and plain
containers only, so a file that would run code is refused instead of executed.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from types import TracebackType

import torch

from kvgen.errors import ModelFormatError

# safetensors' dtype names for torch's dtypes (the loader checks and reports dtypes by these names)
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}


class _Slice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def get_dtype(self) -> str:
        return _DTYPE_NAMES.get(self._tensor.dtype, str(self._tensor.dtype).removeprefix("torch."))

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)


class TorchCheckpoint:
    """A ``pytorch_model.bin`` (or a shard of one) opened as a safetensors handle; a context manager.

    Raises ``ModelFormatError`` naming the file for one that is not a PyTorch checkpoint, is corrupt, needs code to
    unpickle (the weights-only unpickler refuses it) or holds anything but a flat dict of tensors.
    """

    def __init__(self, file: Path) -> None:
        self.file = file
        self._tensors = _load(file)

    def __enter__(self) -> TorchCheckpoint:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Nothing: the tensors go with the object (a load keeps it for its passes, :class:`hf_loader._Opener`)."""

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._tensors[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        """A copy in memory, as safetensors' ``get_tensor`` gives: not the file's mapping, nor a storage that
        another key of the file shares (tied weights are saved once)."""
        return self._tensors[key].clone()


def _load(file: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict, memory-mapped when it is torch's zip format (a legacy one is read whole)."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):  # the weights-only unpickler met something other than tensors
            raise ModelFormatError(f"{file} is not a weights-only PyTorch checkpoint (loading it could run code): "
                                   f"{_first_line(e)}") from None
        raise ModelFormatError(f"{file} is not a readable PyTorch checkpoint: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 -- a corrupt pickle fails in many ways (KeyError, AssertionError, ...)
        raise ModelFormatError(f"{file} is not a readable PyTorch checkpoint: {type(e).__name__}: "
                               f"{_first_line(e)}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ModelFormatError(f"{file} does not hold a state dict (names to tensors), got {type(state).__name__}")
    return state


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
