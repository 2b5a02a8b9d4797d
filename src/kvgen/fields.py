"""Dataclass field helpers shared by every config: ``config_field`` (help text the CLI reuses),
``add_config_flags`` / ``config_from_args`` (CLI flags generated from a config dataclass) and
``check_int`` (the one "int >= N" check, with its one wording), ``as_bool`` (the one bool check) and
``check_minimums`` (``check_int`` on every field with a ``minimum`` in its metadata)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import field
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a bool: a bool or a numpy bool (``np.True_``, as transformers and vLLM take them); ``ValueError``
    naming ``name`` for anything else (a truthy ``"no"`` would flip the setting silently)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


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


def json_object(name: str, value: Any) -> dict[str, Any]:
    """``value`` as a dict: a mapping, or the JSON text of an object (what a CLI flag such as
    ``--speculative-config`` gives). Raises ``ValueError``: ``name must be JSON, got '{': ...`` or
    ``name must be a JSON object, got [3]``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be JSON, got {value!r}: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return dict(value)


def check_minimums(config: Any) -> None:
    """:func:`check_int` on each field of the dataclass ``config`` whose metadata has a ``minimum`` (None passes; a
    tuple is checked item by item). Raises its ``ValueError`` naming the field."""
    for f in dataclasses.fields(config):
        if "minimum" in f.metadata and (value := getattr(config, f.name)) is not None:
            for item in value if isinstance(value, (tuple, list)) else (value,):
                check_int(f.name, item, f.metadata["minimum"])


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An int flag value as vLLM's ``human_readable_int`` reads it: ``32768``, ``32k`` (32,000), ``25.6k`` (25,600),
    ``32K`` (32,768; binary suffixes take whole numbers only). Raises ``argparse.ArgumentTypeError``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (an int, or with a k/m/g/t or K/M/G/T "
                                             "suffix: 32k, 32K)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (decimals only with k/m/g/t, not {suffix})")
    return int(number) * _BINARY_SUFFIXES[suffix]


def add_config_flags(parser: argparse._ActionsContainer, config_cls: type) -> None:
    """A ``--field-name`` flag (or the metadata's ``flags``) per field of ``config_cls`` with help text and without
    ``cli=False``; a bool defaulting to True becomes ``--no-x`` (``include_x``: ``--no-x``; ``enable_x``:
    ``--enable-x/--no-enable-x``, as vLLM's), one defaulting to False a plain switch; an int field with
    ``human_readable`` in its metadata takes vLLM's ``32k`` / ``32K`` (:func:`human_readable_int`). The config's
    ``__post_init__`` validates the values (see :func:`config_from_args`)."""
    for f in dataclasses.fields(config_cls):
        if not f.metadata.get("cli", True) or "help" not in f.metadata:
            continue
        kind, kwargs = str(f.type), {"dest": f.name, "help": f.metadata["help"], "default": f.default}
        if kind == "bool" and f.default and f.name.startswith("enable_"):
            flags = f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == "bool" and f.default:
            flags = f.metadata.get("flags") or ("--no-" + f.name.removeprefix("include_").replace("_", "-"),)
            kwargs |= {"action": "store_false", "help": f"don't {f.metadata['help']}"}
        elif kind == "bool":
            flags = f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
            kwargs["action"] = "store_true"
        else:
            flags = f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
            kwargs["type"] = {"int": int, "float": float}.get(kind.split("[")[-1].split(",")[0].split("|")[0].strip("] "), str)
            kwargs |= {"nargs": "+"} if kind.startswith(("tuple", "list")) else {}
            kwargs |= {"type": human_readable_int} if f.metadata.get("human_readable") else {}
        parser.add_argument(*flags, **kwargs)


def config_from_args(config_cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``config_cls`` from the flags of :func:`add_config_flags` (fields without a flag keep their defaults).

    Raises the config's ``ValueError`` for a bad value, naming the flag where the message starts with a field that
    has one (``--threads must be an int >= 1, got 0``)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}  # type: ignore[arg-type]
    try:
        return config_cls(**{k: v for k, v in vars(args).items() if k in fields} | overrides)
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        if name not in fields or not fields[name].metadata.get("cli", True) or name in overrides:
            raise
        flag = fields[name].metadata.get("flags", ("--" + name.replace("_", "-"),))[0]
        raise ValueError(f"{flag} {rest}") from None
