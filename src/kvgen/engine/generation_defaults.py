"""The model's recommended sampling defaults: its Hugging Face ``generation_config.json`` (vLLM's
``--generation-config auto``, the default) and ``--override-generation-config``.

Requests that leave a field unset get the default instead of vLLM's own; ``max_new_tokens`` becomes a
``max_tokens`` default and a cap on every request. A GGUF file has no generation config (the server then keeps
vLLM's defaults, as vLLM does for one).
Source: vLLM ``ModelConfig.get_diff_sampling_param`` (the keys read, values equal to transformers'
``GenerationConfig`` defaults dropped, ``max_new_tokens`` renamed) and ``OpenAIServing`` (the defaults used).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from kvgen.engine.sampling_params import SamplingParams
from kvgen.errors import ModelFormatError
from kvgen.fields import json_object
from kvgen.sampling.params import check_param
from kvgen.tokenizer.hf_files import read_json

GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a directory holding a generation_config.json
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
HF_DEFAULTS: dict[str, Any] = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}  # dropped


def parse_override(override: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """``--override-generation-config``: a JSON object (text or a mapping) of :data:`SAMPLING_KEYS` fields; a null
    removes the generation config's value (vLLM keeps the merged values that are not None). Raises ``ValueError``
    naming an unknown key, a non-object, or a value ``SamplingParams`` refuses."""
    if override is None:
        return {}
    values = json_object("override_generation_config", override)
    unknown = sorted(set(values) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config keys must be among {', '.join(SAMPLING_KEYS)}, got {unknown[0]!r}")
    try:
        as_sampling_params({k: v for k, v in values.items() if v is not None})  # the ranges SamplingParams accepts
    except ValueError as e:
        raise ValueError(f"override_generation_config must hold values SamplingParams accepts: {e}") from None
    return values


def read_generation_config(model_path: Path | None, generation_config: str = "auto",
                           overridden: Collection[str] = ()) -> dict[str, Any]:
    """The :data:`SAMPLING_KEYS` fields set in ``generation_config.json`` and different from transformers'
    defaults: from the model's directory (``"auto"``; none for a GGUF file or a model given as an object, None),
    none (``"vllm"``), or from the directory ``generation_config`` names. Raises ``ValueError`` for a missing
    directory, ``ModelFormatError`` (a ``ValueError``) naming the file for an unreadable file or a value
    ``SamplingParams`` refuses, unless an override replaces it (a key of ``overridden``: vLLM merges first)."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        if model_path is None or not model_path.is_dir():
            return {}
        directory = model_path
    else:
        directory = Path(generation_config).expanduser()
        if not directory.is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {generation_config!r}")
    file = directory / "generation_config.json"
    if not file.is_file():
        return {}
    config = read_json(file)  # ModelFormatError (a ValueError) when unreadable or not an object
    values = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None and config[k] != HF_DEFAULTS.get(k)}
    checked = {k: v for k, v in values.items() if k not in overridden}
    try:
        if "max_new_tokens" in checked:  # named as the file names it (SamplingParams' max_tokens)
            check_param("max_new_tokens", checked["max_new_tokens"])
        as_sampling_params(checked)
    except ValueError as e:
        raise ModelFormatError(f"{file}: {e}") from None
    return values


def default_sampling_params(model_path: Path | None, generation_config: str = "auto",
                            override: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
    """The defaults requests get, in ``SamplingParams`` names (``max_new_tokens`` as ``max_tokens``): the
    generation config's (see :func:`read_generation_config`), then ``override``'s over them, nulls left out (as
    vLLM's ``get_diff_sampling_param``). Raises ``ValueError`` naming a bad key, value, directory or file."""
    overrides = parse_override(override)
    merged = read_generation_config(model_path, generation_config, overrides.keys()) | overrides
    values = {k: v for k, v in merged.items() if v is not None}
    as_sampling_params(values)
    return {"max_tokens" if k == "max_new_tokens" else k: v for k, v in values.items()}


def as_sampling_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams`` with ``defaults`` (``max_new_tokens`` or ``max_tokens``) over vLLM's own: what a request
    or an ``LLM.generate`` call that sets nothing runs with. Raises ``ValueError`` naming a refused value."""
    return SamplingParams(**{"max_tokens" if k == "max_new_tokens" else k: v for k, v in defaults.items()})
