"""``load_model``: a GGUF file or a Hugging Face directory -> (model, tokenizer)."""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvgen.errors import ModelFormatError, ModelNotFoundError
from kvgen.generation.config import read_generation_defaults
from kvgen.heap import return_freed_memory
from kvgen.models import CausalLM, build_model
from kvgen.tokenizer import Tokenizer
from kvgen.weights.quantized import GGUFBlocks, parse_quantization

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto": quantized GGUF matrices stay in their blocks and run through kvgen's kernels;
# float weights load as float32. The default of load_model and the CLI.
AUTO = "auto"


def resolve_model_path(path_or_name: str | os.PathLike[str] = "default") -> Path:
    """The file or directory behind ``path_or_name``; ``"default"`` is SmolLM2-135M-Instruct's GGUF. A Hugging Face
    repo id (``org/name``) that is no local path is its snapshot in the local Hugging Face cache (``HF_HUB_CACHE``), as
    transformers and vLLM find it offline; nothing is downloaded.

    Raises ``ModelNotFoundError`` when nothing is there or the path is empty (``Path("")`` is the working directory,
    which transformers' ``from_pretrained("")`` refuses too), ``ModelFormatError`` for a path that is neither a
    regular file nor a directory (a FIFO, a socket, a device: opening one could block forever), a symlink loop or
    one the OS refuses to look up (a name too long), ``ValueError`` for anything but a str or path (None, a number).
    """
    if not isinstance(path_or_name, (str, os.PathLike)):  # Path(None) fails with pathlib's TypeError
        raise ValueError(f"path_or_name must be 'default', a .gguf file, a Hugging Face directory or cached repo id (a "
                         f"str or path), got {path_or_name!r}")
    if str(path_or_name) == "default":
        from kvgen.default_model import find_default_gguf

        return find_default_gguf()
    if not str(path_or_name):
        raise ModelNotFoundError("model path must not be empty, got '' (pass a .gguf file, a Hugging Face directory, a "
                                 "cached repo id or 'default')")
    path = Path(path_or_name).expanduser()
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            cached = cached_snapshot(str(path_or_name))
            if cached is not None:
                return cached
            raise ModelNotFoundError(f"model not found: {path} (pass a .gguf file, a Hugging Face directory, a repo id "
                                     f"in the local Hugging Face cache or 'default'; kvgen downloads nothing)") from None
        what = "is a symlink loop" if e.errno == errno.ELOOP else f"cannot be read: {e.strerror or e}"
        raise ModelFormatError(f"model path {path} {what}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ModelFormatError(f"model path {path} is neither a regular file nor a directory (a FIFO, socket or "
                               f"device)")
    return path


def cached_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot directory of ``repo_id`` (``org/name``, its ``main`` revision), or None
    when the name is no repo id or the cache lacks it. Source: ``huggingface_hub.snapshot_download(...,
    local_files_only=True)``, which transformers' ``from_pretrained`` uses offline."""
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id) or ".." in repo_id:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError  # both there since 0.23

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def check_load_options(dtype: str, quantization: str | None) -> None:
    """``ValueError`` for a ``dtype`` that :func:`load_model` does not take, an unknown ``quantization``, or a
    quantization without dtype auto (the kernels run it)."""
    if dtype != AUTO and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {AUTO}, {', '.join(DTYPES)}, got {dtype!r}")
    if parse_quantization(quantization) is not None and dtype != AUTO:
        raise ValueError(f"quantization={quantization!r} needs dtype 'auto' (the kernels), got {dtype!r}")


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.dtype`` from a dtype or its name, None for ``"auto"``/None; raises ``ValueError`` for others."""
    if dtype is None or dtype == AUTO:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(
    path_or_name: str | os.PathLike[str] = "default", dtype: torch.dtype | str | None = AUTO,
    quantization: str | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """Load a model and its tokenizer.

    ``path_or_name``: ``"default"``, a ``.gguf`` file, a Hugging Face repo id in the local cache
    (:func:`resolve_model_path`) or a Hugging Face checkpoint directory (``config.json`` + safetensors or
    ``pytorch_model.bin`` weights, and a tokenizer: see
    :meth:`Tokenizer.from_pretrained`, which also reads a BertTokenizer ``vocab.txt``). The format is sniffed
    from the path (directory, else the file's magic bytes). Returns the model in
    eval mode and a :class:`Tokenizer`. ``dtype="auto"`` (default) runs a quantized
    GGUF from its blocks through kvgen's kernels (float32 activations), F16 / BF16 GGUF files and
    float16 / bfloat16 Llama-family checkpoints from their 16-bit matrices, and other float
    checkpoints as float32; ``"float32"`` is the exact dequantized reference path.
    ``quantization`` (vLLM's argument; llama.cpp's ``llama-quantize`` types ``"q8_0"``, ``"q5_1"``, ``"q5_0"``,
    ``"q4_1"``, ``"q4_0"``; ``dtype="auto"`` only): float matrices are encoded in that type at load, with the
    ``gguf`` package's quantizers (llama.cpp's reference rounding), and run through the kernels: a float16
    checkpoint reads about half the bytes per token as ``q8_0``, a quarter as ``q4_0``. The token embedding and LM
    head take ``q8_0`` under the 4- and 5-bit types, as llama.cpp keeps its output matrix at a higher precision. A
    GGUF file's quantized matrices stay as stored.
    Raises ``ModelNotFoundError``, ``ModelFormatError``,
    ``UnsupportedArchitectureError``, ``UnsupportedQuantizationError`` or ``ValueError`` (a bad ``dtype`` or
    ``quantization``, or one the model cannot take: gpt-oss checkpoints, ``in_features`` not a multiple of 32).

    The load runs in a short-lived thread, whose OpenMP team ends with it: the caller's thread starts none until it
    runs the model, so a model run from another thread (``TextIteratorStreamer``'s pattern, a server's step thread)
    has the process's only team. With two teams' threads on 2 cores libgomp spins 100 rounds instead of 300,000
    before a waiting thread sleeps (its ``GOMP_SPINCOUNT`` rule), and a decode step's ~150 parallel regions each
    woke a sleeping worker: greedy decode from a second thread took 8.5-10.2 ms a token after a load in the
    caller's thread, 6.3-8.3 after a load in a thread that had ended. The thread is a daemon and the wait for it
    can be interrupted: Ctrl-C during a long load exits without waiting for the load to finish.
    """
    outcome: list[tuple[CausalLM, Tokenizer] | BaseException] = []

    def load() -> None:
        try:
            outcome.append(_load_model(path_or_name, dtype, quantization))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread, which raises it
            outcome.append(e)

    thread = threading.Thread(target=load, name="kvgen-load", daemon=True)
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _load_model(path_or_name: str | os.PathLike[str], dtype: torch.dtype | str | None, quantization: str | None
                ) -> tuple[CausalLM, Tokenizer]:
    qtype = parse_quantization(quantization)
    if qtype is not None and dtype not in (None, AUTO):
        raise ValueError(f"quantization={quantization!r} needs dtype 'auto' (the kernels), got {dtype!r}")
    dtype = parse_dtype(dtype)
    path = resolve_model_path(path_or_name)
    state_dict: Mapping[str, torch.Tensor | GGUFBlocks]
    generation_defaults: dict[str, Any] = {}  # a GGUF file carries no generation config
    if path.is_dir():
        from kvgen.weights.hf_loader import load_hf_directory

        config, state_dict = load_hf_directory(path, dtype=dtype, quantization=qtype)
        tokenizer = Tokenizer.from_pretrained(path)
        generation_defaults = read_generation_defaults(path / "generation_config.json")
    else:
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ModelFormatError(f"cannot read model file {path}: {e.strerror or e}") from None
        if magic != b"GGUF":
            raise ModelFormatError(
                f"{path} is neither a GGUF file nor a Hugging Face directory (first bytes {magic!r})"
            )
        from kvgen.weights.gguf_loader import load_gguf

        config, state_dict, meta = load_gguf(path, dtype=dtype, quantization=qtype)
        tokenizer = Tokenizer.from_gguf(meta)
    model = build_model(config, state_dict, dtype or torch.float32)
    model.generation_defaults = generation_defaults
    del state_dict
    return_freed_memory()
    return model, tokenizer
