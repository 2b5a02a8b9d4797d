"""Bench helpers: the side-process protocol, thread and dtype defaults (no timings asserted)."""

from __future__ import annotations

import torch

from kvgen.bench.common import (
    available_cpus,
    peer_torch_dtype,
    physical_cores,
    run_side,
)
from kvgen.bench.decode import DecodeBenchConfig


def test_run_side_round_trips_a_request_and_reports_failures() -> None:
    echo = "import json, sys; print(json.dumps({'got': json.load(sys.stdin)}))"
    assert run_side("echo", ["-c", echo], lambda _: None, {"ids": [1, 2, 3]}) == {"got": {"ids": [1, 2, 3]}}
    crash = run_side("crash", ["-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], lambda _: None, quiet=True)
    assert "status 3" in crash["error"] and "boom" in crash["error"]
    silent = run_side("silent", ["-c", "print('not json')"], lambda _: None)
    assert "no JSON report" in silent["error"]


def test_thread_default_is_physical_cores_within_affinity() -> None:
    assert 1 <= physical_cores() <= available_cpus()


def test_transformers_runs_float32_where_kvgen_dtype_names_no_torch_dtype() -> None:
    assert peer_torch_dtype("auto") == torch.float32
    assert peer_torch_dtype("bfloat16") == torch.bfloat16


def test_bench_dtype_defaults_to_the_loaders_default() -> None:
    import inspect

    from kvgen.loader import load_model

    default = inspect.signature(load_model).parameters["dtype"].default
    config = DecodeBenchConfig(progress=False)
    assert config.dtype == (default if isinstance(default, str) else str(default).removeprefix("torch."))
    assert DecodeBenchConfig(dtype="bfloat16", progress=False).dtype == "bfloat16"
