"""Loading a Hugging Face checkpoint directory (``config.json`` + safetensors or PyTorch weights).

Reads ``model.safetensors`` or, failing that, the shards listed in
``model.safetensors.index.json``, else (as transformers' ``from_pretrained`` falls back) ``pytorch_model.bin`` or
the shards of ``pytorch_model.bin.index.json``, unpickled weights-only (:mod:`kvgen.weights.torch_bin`: a file that
would run code is refused); maps names per architecture
(:mod:`kvgen.weights.name_maps`: GPT-2's ``Conv1D`` weights are transposed to
``[out, in]``), and checks keys and shapes strictly before reading any tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from safetensors import SafetensorError, safe_open

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, ModelNotFoundError
from kvgen.llama_config import INTERLEAVED_ROPE_MODEL_TYPES
from kvgen.tokenizer.hf_files import read_json
from kvgen.weights.gguf_loader import reverse_permute_qk
from kvgen.weights.gpt_oss import (
    check_mxfp4_pairs,
    expert_stack_shapes,
    is_expert_stack,
    split_expert_stacks,
)
from kvgen.weights.name_maps import (
    check_layer_count,
    check_state_dict,
    expected_param_shapes,
    hf_needs_transpose,
    hf_norm_offset,
    hf_to_kvgen_name,
    is_router_weight,
)
from kvgen.weights.quantized import GGUFBlocks, is_quantizable, quantize_matrix
from kvgen.weights.torch_bin import TorchCheckpoint

_16BIT = ("F16", "BF16")  # safetensors dtypes the 16-bit kernels run as stored
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors dtypes of weights (others are refused)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# (single file, index of shards) in the order transformers' from_pretrained looks for them
_WEIGHT_FILES = ((SINGLE_FILE, INDEX_FILE), ("pytorch_model.bin", "pytorch_model.bin.index.json"))


@dataclass(frozen=True)
class _Entry:
    """One checkpoint tensor we will load: where it is and what it becomes."""

    file: Path
    key: str  # name in the checkpoint
    name: str  # our name
    transpose: bool
    dtype: str  # safetensors dtype: "F32", "F16", "BF16", ...


def load_hf_directory(
    path: str | os.PathLike[str], dtype: torch.dtype | None = torch.float32,
    quantization: GGMLQuantizationType | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor | GGUFBlocks]]:
    """Config and state dict (our names, ``[out, in]`` matrices, ``dtype``) of an HF directory.

    ``dtype=None`` ("auto"): a Llama-family checkpoint whose matrices are all float16 or bfloat16 (with
    ``in_features`` a multiple of 32, and ``head_dim`` a multiple of 8 as the kernels' attention needs) keeps them as
    stored, as F16 / BF16 :class:`GGUFBlocks` for the 16-bit
    kernels (vLLM's "auto": the checkpoint's dtype); anything else loads as float32. Gemma 3's norm weights load
    as ``1 + w`` (:func:`~kvgen.weights.name_maps.hf_norm_offset`; exact in float32, rounded in a 16-bit ``dtype``).
    Mixture-of-experts routers (:func:`~kvgen.weights.name_maps.is_router_weight`) load as ``dtype`` (float32 for
    auto) whatever the rest; gpt-oss's expert stacks are split per expert (:mod:`kvgen.weights.gpt_oss`), its MXFP4
    stacks (``*_blocks`` / ``*_scales``) kept as MXFP4 blocks where the rest stays 16-bit, else dequantized.

    ``quantization`` (a type of :data:`~kvgen.weights.quantized.QUANTIZATIONS`, with ``dtype=None``): every matrix
    but the routers and GPT-2's position table is encoded in that type as it is read
    (:func:`~kvgen.weights.quantized.quantize_matrix`), for the kernels; Llama-family, Gemma 2, Gemma 3 and GPT-2
    checkpoints whose matrices have ``in_features`` a multiple of 32 (and, but for GPT-2, whose ``head_dim`` is a
    multiple of 8) only, else ``ValueError``.

    Keys ignored before the strict check: saved buffers (GPT-2 ``attn.bias`` /
    ``attn.masked_bias``, Llama ``rotary_emb.inv_freq``) and ``lm_head.weight``
    when ``tie_word_embeddings``. Raises ``ModelNotFoundError`` (no such
    directory), ``ModelFormatError`` (no or bad ``config.json``, no weights
    file, a corrupt file, a PyTorch checkpoint that would run code, missing/unexpected keys or wrong shapes: every
    one listed) and ``UnsupportedArchitectureError``.
    """
    root = Path(path)
    if not root.exists():
        raise ModelNotFoundError(f"model directory not found: {root}")
    if not root.is_dir():
        raise ModelFormatError(f"{root} is not a directory (expected an HF checkpoint directory with config.json)")
    cfg = _read_json(root / "config.json", "config.json")
    files = weight_files(root) if _has_weights(root) else None  # else config.json's errors come first
    opener = _Opener()
    if files is not None:
        layers = "n_layer" if cfg.get("model_type") == "gpt2" else "num_hidden_layers"
        check_layer_count(f"config.json {layers}", cfg.get(layers), _checkpoint_keys(files, opener), str(root))
    config = ModelConfig.from_hf_dict(cfg)
    entries, ignored = _plan(weight_files(root) if files is None else files, config, opener)
    check_mxfp4_pairs([e.name for e in entries])
    actual: dict[str, tuple[int, ...]] = {}
    for e, shape in entries.items():  # a gpt-oss expert stack: as the per-expert parameters it becomes
        actual |= expert_stack_shapes(e.name, shape) if is_expert_stack(e.name) else {e.name: shape}
    check_state_dict(expected_param_shapes(config), actual, str(root), ignored)
    matrices = {e: shape for e, shape in entries.items() if len(shape) >= 2 and not is_router_weight(e.name)
                and not e.name.endswith(("_bias", "_blocks", "_scales"))}
    if quantization is not None:
        _check_quantizable(config, matrices, dtype, quantization)
    keep_16bit = dtype is None and config.model_type in ("llama", "gemma3_text", "gemma2", "gpt_oss") and all(
        e.dtype in _16BIT and shape[1] % 32 == 0 for e, shape in matrices.items()) and config.head_dim % 8 == 0
    state = _read_tensors(list(entries), dtype or torch.float32, keep_16bit, _interleaved_qk_heads(config),
                          quantization, opener)
    if config.model_type == "gpt_oss":
        state = split_expert_stacks(state, dtype or torch.float32, keep_16bit, keep=keep_16bit)
    for name, tensor in state.items():
        offset = hf_norm_offset(name, config)  # Gemma 3's norms: 1 + w, added in float32 as transformers does
        if offset and isinstance(tensor, torch.Tensor):
            state[name] = (tensor.float() + offset).to(tensor.dtype)
    return config, state


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelFormatError(f"{path.parent} has no {what} (looked for {path})")
    return read_json(path)


def weight_files(root: Path) -> dict[Path, list[str] | None]:
    """Weights file -> the keys to read from it (None: all of them): ``model.safetensors``, else the shards of
    ``model.safetensors.index.json``, else ``pytorch_model.bin``, else the shards of its index (transformers'
    order). Raises ``ModelFormatError`` for a bad index or no weights."""
    for single, index in _WEIGHT_FILES:
        if (root / single).is_file():
            return {root / single: None}
        if (root / index).is_file():
            return _shards(root, index)
    raise ModelFormatError(f"{root} has no weights: expected {SINGLE_FILE}, {INDEX_FILE}, "
                           f"{' or '.join(_WEIGHT_FILES[1])}")


def _shards(root: Path, index: str) -> dict[Path, list[str] | None]:
    """Shard file -> its keys, from the index file ``index`` (``{"weight_map": {key: shard file}}``)."""
    weight_map = _read_json(root / index, index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFormatError(f"{root / index} has no 'weight_map'")
    files: dict[Path, list[str] | None] = {}
    for key, shard in weight_map.items():
        keys = files.setdefault(root / _shard_name(root / index, key, shard), [])
        assert keys is not None
        keys.append(key)
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise ModelFormatError(f"{root / index} lists shards that do not exist: {', '.join(absent)}")
    return files


def _index_name(shard: Path) -> str:
    """The name of the index file that lists ``shard``: PyTorch's for a ``.bin`` shard, else safetensors'."""
    return _WEIGHT_FILES[1][1] if shard.suffix == ".bin" else INDEX_FILE


def _has_weights(root: Path) -> bool:
    return any((root / name).is_file() for names in _WEIGHT_FILES for name in names)


def _shard_name(index: Path, key: str, shard: Any) -> str:
    """``shard``, the file that ``index`` names for tensor ``key``: ``ModelFormatError`` unless it is a path inside
    the index's directory (relative, without ``..``: a link inside the directory may lead elsewhere, as in the
    Hugging Face cache)."""
    if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
        raise ModelFormatError(f"{index}: weight_map[{key!r}] must name a file inside {index.parent}, "
                               f"got {shard!r}")
    return shard


def _checkpoint_keys(files: dict[Path, list[str] | None], opener: Callable[[Path], Any]) -> list[str]:
    """Every key of :func:`weight_files`' files (reads the headers of those that list none)."""
    keys: list[str] = []
    for file, listed in files.items():
        if listed is None:
            with opener(file) as f:
                listed = list(f.keys())
        keys += listed
    return keys


def _plan(files: dict[Path, list[str] | None], config: ModelConfig, opener: Callable[[Path], Any]
          ) -> tuple[dict[_Entry, tuple[int, ...]], list[str]]:
    """Every tensor to load with its final shape, and the checkpoint keys ignored. Reads headers only."""
    entries: dict[_Entry, tuple[int, ...]] = {}
    ignored: list[str] = []
    seen: dict[str, Path] = {}
    placed = {key: file for file, keys in files.items() for key in keys or ()}  # the index's shard of each key
    for file, keys in files.items():
        with opener(file) as f:
            available = set(f.keys())
            if keys is None:
                keys = sorted(available)
            absent = [k for k in keys if k not in available]
            if absent:
                raise ModelFormatError(f"{file} lacks tensors that {_index_name(file)} places there: {', '.join(absent)}")
            _check_not_elsewhere(file, available - set(keys), placed)
            for key in keys:
                name = hf_to_kvgen_name(key, config)
                if name is None:
                    ignored.append(key)
                    continue
                if name in seen:
                    raise ModelFormatError(f"{name} appears twice: in {seen[name]} and in {file} (as {key})")
                seen[name] = file
                transpose = hf_needs_transpose(name, config)
                tensor = f.get_slice(key)
                _check_dtype(file, key, name, tensor.get_dtype())
                shape = tuple(tensor.get_shape())
                entries[_Entry(file, key, name, transpose, tensor.get_dtype())] = shape[::-1] if transpose else shape
    return entries, ignored


def _check_not_elsewhere(file: Path, unlisted: set[str], placed: dict[str, Path]) -> None:
    """``ModelFormatError`` when shard ``file`` also holds a tensor (of its keys ``unlisted`` by the index) that the
    index places in another shard: two copies, of which transformers' ``from_pretrained`` (reading whole shards)
    takes the last shard's and the index names the other."""
    twice = [f"{k!r} (placed in {placed[k]})" for k in sorted(unlisted) if k in placed]
    if twice:
        raise ModelFormatError(f"{file} also holds tensors that {_index_name(file)} places in another shard: "
                               f"{', '.join(twice)}")


def _check_dtype(file: Path, key: str, name: str, dtype: str) -> None:
    """``ModelFormatError`` naming a tensor stored as anything but a float (integers, bools and complex numbers were
    cast to float without a word), except gpt-oss's MXFP4 ``*_blocks`` / ``*_scales``, which are uint8."""
    if dtype not in _FLOAT_DTYPES and not (dtype == "U8" and name.endswith(("_blocks", "_scales"))):
        raise ModelFormatError(f"{file}: tensor {key!r} is stored as {dtype}; kvgen loads weights stored as "
                               f"{', '.join(_FLOAT_DTYPES)} (and gpt-oss's MXFP4 blocks and scales as U8)")


class _Opener:
    """:func:`open_weights` for one load: a PyTorch checkpoint is unpickled once (a legacy, non-zip one is read whole
    each time) and kept until the load ends, where the header, plan and read passes each opened it; safetensors
    handles are cheap and opened per pass."""

    def __init__(self) -> None:
        self._checkpoints: dict[Path, TorchCheckpoint] = {}

    def __call__(self, file: Path) -> Any:
        if file.suffix != ".bin":
            return open_weights(file)
        if file not in self._checkpoints:
            self._checkpoints[file] = TorchCheckpoint(file)
        return self._checkpoints[file]


def open_weights(file: Path) -> Any:
    """A handle on a weights file (``keys()``, ``get_slice``, ``get_tensor``; a context manager): safetensors, or a
    PyTorch checkpoint (a ``.bin`` name) through :class:`~kvgen.weights.torch_bin.TorchCheckpoint`. Raises
    ``ModelFormatError`` naming a file that cannot be read."""
    if file.suffix == ".bin":
        return TorchCheckpoint(file)
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:  # a bad header or data / a missing file or a directory
        raise ModelFormatError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from None


def _interleaved_qk_heads(config: ModelConfig) -> dict[str, int]:
    """For a checkpoint whose q/k rows rotate interleaved pairs (``INTERLEAVED_ROPE_MODEL_TYPES``: ERNIE 4.5): the
    heads of each q_proj / k_proj weight and bias name suffix, to move its rows into rotate-half order (the order
    llama.cpp's converter permutes llama's rows out of, so :func:`reverse_permute_qk` undoes it); else empty."""
    if config.extra.get("hf_model_type") not in INTERLEAVED_ROPE_MODEL_TYPES:
        return {}
    return {f".self_attn.{p}.{kind}": heads for p, heads in (("q_proj", config.num_attention_heads),
                                                             ("k_proj", config.num_key_value_heads))
            for kind in ("weight", "bias")}


def _check_quantizable(config: ModelConfig, matrices: dict[_Entry, tuple[int, ...]], dtype: torch.dtype | None,
                       quantization: GGMLQuantizationType) -> None:
    """``ValueError`` unless ``quantization`` can encode every matrix of this checkpoint for the kernels."""
    name = quantization.name.lower()
    if dtype is not None:
        raise ValueError(f"quantization={name!r} needs dtype 'auto' (the kernels), got {dtype}")
    if config.model_type not in ("llama", "gemma3_text", "gemma2", "gpt2"):
        raise ValueError(f"quantization={name!r} is not supported for model_type {config.model_type!r} (Llama-family, "
                         "Gemma 2, Gemma 3 and GPT-2 checkpoints only)")
    odd = next((f"{e.key} {list(shape)}" for e, shape in matrices.items() if is_quantizable(e.name) and shape[-1] % 32),
               None)  # shapes as ours: [out, in]
    if odd is not None:
        raise ValueError(f"quantization={name!r} needs matrices whose in_features is a multiple of 32, got {odd}")
    if config.model_type != "gpt2" and config.head_dim % 8:  # the kernels' attention reads heads in 8-lane vectors
        raise ValueError(f"quantization={name!r} needs a head_dim that is a multiple of 8, got {config.head_dim}")


def _read_tensors(entries: list[_Entry], dtype: torch.dtype, keep_16bit: bool, qk_heads: dict[str, int],
                  quantization: GGMLQuantizationType | None, opener: Callable[[Path], Any]
                  ) -> dict[str, torch.Tensor | GGUFBlocks]:
    """Read one tensor at a time, transposed where needed and cast to ``dtype`` (contiguous); with ``keep_16bit``,
    2-D float16 / bfloat16 tensors become GGUFBlocks of their bytes instead, with ``quantization`` 2-D tensors are
    encoded in that type. A tensor whose name ends with a key of ``qk_heads`` has its rows put in rotate-half order
    first (:func:`_interleaved_qk_heads`). Routers stay dense ``dtype`` (float32 for auto)."""
    state: dict[str, torch.Tensor | GGUFBlocks] = {}
    by_file: dict[Path, list[_Entry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for file, group in by_file.items():
        with opener(file) as f:
            for e in group:
                try:
                    t = f.get_tensor(e.key)
                except SafetensorError as err:  # data out of bounds, unknown dtype
                    msg = f"{file}: cannot read tensor {e.key!r}: {type(err).__name__}: {err}"
                    raise ModelFormatError(msg) from None
                heads = next((h for suffix, h in qk_heads.items() if e.name.endswith(suffix)), None)
                if heads is not None:  # whole rows move: exact in any dtype
                    t = reverse_permute_qk(t, heads)
                if is_expert_stack(e.name):  # as stored: split_expert_stacks casts or keeps each expert's part
                    state[e.name] = t
                elif quantization is not None and t.dim() == 2 and is_quantizable(e.name):
                    state[e.name] = quantize_matrix(e.name, t.t() if e.transpose else t, quantization)
                elif keep_16bit and t.dim() == 2 and not is_router_weight(e.name):  # routers: dense float32
                    qtype = GGMLQuantizationType.F16 if t.dtype == torch.float16 else GGMLQuantizationType.BF16
                    state[e.name] = GGUFBlocks(qtype, [t.contiguous().view(torch.uint8)], (t.shape[0], t.shape[1]))
                elif e.transpose:  # Conv1D [in, out] -> [out, in], one copy
                    state[e.name] = torch.empty(t.shape[::-1], dtype=dtype).copy_(t.t())
                else:
                    state[e.name] = t.to(dtype).contiguous()
    return state
