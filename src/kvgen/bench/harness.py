"""What every ``kvgen bench`` shares: machine facts, timing, typed results -> JSON, the peers' subprocess protocol,
one text renderer. Torch-free at import: ``peers.py`` (run as a file by the llama.cpp peer) imports it."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import psutil

T = TypeVar("T")
Side = dict[str, Any]  # one system's JSON report: its figures, or {"skipped": why} / {"error": what}
OMIT_IF_NONE = {"omit_if_none": True}  # field metadata: left out of :func:`to_json` while None


def _proc_field(path: str, key: str) -> str | None:
    """The value of ``key`` in a ``/proc`` file of ``key: value`` lines, None where unreadable or absent."""
    try:
        return next(v.strip() for k, _, v in (line.partition(":") for line in Path(path).read_text().splitlines())
                    if k.strip() == key)
    except (OSError, StopIteration):
        return None


def environment_info() -> dict[str, Any]:
    """Versions and machine facts that a timing depends on (JSON-ready)."""
    import torch

    from kvgen.threads import available_cpus, physical_cores

    hf = importlib.metadata.version("transformers") if importlib.util.find_spec("transformers") else None
    return {"torch_version": torch.__version__, "transformers_version": hf, "python_version": platform.python_version(),
            "platform": platform.platform(), "machine": platform.machine(),
            "processor": _proc_field("/proc/cpuinfo", "model name") or platform.processor(),
            "cpu_count": os.cpu_count(), "physical_cores": physical_cores(), "available_cpus": available_cpus(),
            "torch_num_threads": torch.get_num_threads(), "torch_num_interop_threads": torch.get_num_interop_threads(),
            "load_average_1m": load_average()}


def load_average() -> float:
    """1-minute load average (runnable processes); above the core count, timings are contended."""
    return float(psutil.getloadavg()[0])


def rss_bytes() -> int:
    """Resident set size now, in bytes."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's own peak RSS in bytes (``VmHWM``; ``ru_maxrss`` would include a forking parent's)."""
    hwm = _proc_field("/proc/self/status", "VmHWM")  # "123456 kB"
    return int(hwm.split()[0]) * 1024 if hwm else rss_bytes()


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and the wall-clock seconds it took."""
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` (numpy's linear interpolation), None when empty."""
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def per_second(count: float, seconds: float | None) -> float | None:
    """``count / seconds`` (tokens/s), or None when ``seconds`` is missing or not positive."""
    return float(count) / seconds if seconds else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``, or None when either is missing or ``theirs`` is zero."""
    return None if ours is None or not theirs else ours / theirs


class Latencies(TypedDict):
    """TTFT (first token time - request start) and ITL (gaps between a request's tokens) percentiles, in seconds."""

    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None


def latencies(token_times: list[list[float]], starts: list[float]) -> Latencies:
    """The :class:`Latencies` of requests whose tokens came at ``token_times`` (seconds) after ``starts``."""
    ttft = [times[0] - start for times, start in zip(token_times, starts) if times]
    itl = [b - a for times in token_times for a, b in itertools.pairwise(times)]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "itl_p50_s": percentile(itl, 50),
            "itl_p99_s": percentile(itl, 99)}


class TokenTimer:
    """A ``generate`` streamer (``put``/``end``): ``times`` holds the ``perf_counter`` seconds of each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._has_prompt = False  # the first put is the prompt

    def put(self, value: Any) -> None:
        if self._has_prompt:
            self.times.append(time.perf_counter())
        self._has_prompt = True

    def end(self) -> None:
        pass

    def gaps(self) -> list[float]:
        """Seconds between consecutive new tokens (the first one comes from prefill)."""
        return [b - a for a, b in itertools.pairwise(self.times)]


class Progress:
    """Progress lines on stderr (stdout carries the JSON report)."""

    def __init__(self, enabled: bool = True, prefix: str = "[bench]") -> None:
        self.enabled, self.prefix, self._start = enabled, prefix, time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"{self.prefix} {time.perf_counter() - self._start:7.1f}s  {message}", file=sys.stderr, flush=True)


def start(config: Any, prefix: str = "[bench]") -> tuple[Progress, int, dict[str, Any]]:
    """A bench's opening: progress log, threads set from ``config.num_threads`` (their count), the environment."""
    from kvgen.threads import set_threads

    log, threads, env = Progress(config.progress, prefix), set_threads(config.num_threads), environment_info()
    if env["load_average_1m"] > 0.5:
        log(f"warning: 1-minute load average is {env['load_average_1m']:.2f}; timings will be contended")
    return log, threads, env


def optional() -> Any:
    """A dataclass field defaulting to None, left out of :func:`to_json` while None."""
    return dataclasses.field(default=None, metadata=OMIT_IF_NONE)


def to_json(obj: Any) -> Any:
    """Typed results -> JSON-ready values: dataclasses become dicts (in field order), recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)}
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    return [to_json(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


def run_side(name: str, argv: list[str], log: Callable[[str], None], request: Any = None, quiet: bool = False) -> Side:
    """``python *argv`` in a fresh process, ``request`` as JSON on stdin; its JSON report, or ``{"error": ...}``.
    Its progress goes to stderr (captured when ``quiet``)."""
    log(f"{name}: starting a fresh subprocess (its own peak RSS)")
    proc = subprocess.run([sys.executable, *argv], input=None if request is None else json.dumps(request),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE if quiet else None, text=True, check=False)
    if proc.returncode != 0:
        why = (proc.stderr or "")[-2000:] if quiet else "see stderr"
        return {"error": f"{name} subprocess exited with status {proc.returncode}: {why}"}
    try:
        return dict(json.loads(proc.stdout))
    except (TypeError, ValueError) as e:
        return {"error": f"{name} subprocess printed no JSON report ({e}): {proc.stdout[-500:]!r}"}


def peer_side(peer: str, task: str, enabled: bool, model: str, log: Progress, request: dict[str, Any]) -> Side:
    """``task`` of ``peer`` (``transformers`` or ``llama_cpp``) run by ``peers.py`` (see :func:`run_side`) on
    ``request`` plus ``model_path``, or ``{"skipped": why}``."""
    from kvgen.loader import resolve_model_path

    path = resolve_model_path(model)
    if not enabled:
        return {"skipped": f"include_{peer}=False"}
    if importlib.util.find_spec(peer) is None:
        return {"skipped": f"{peer} is not installed"}
    if peer == "llama_cpp" and path.is_dir():
        return {"skipped": "llama.cpp reads GGUF files; the model is a Hugging Face directory"}
    argv = [str(Path(__file__).with_name("peers.py")), peer, task]
    return run_side(f"{peer} {task}", argv, log, request | {"model_path": str(path)}, quiet=not log.enabled)


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of nested dicts (and of lists of dicts) keyed by their dotted paths."""
    if isinstance(obj, dict) or (isinstance(obj, list) and obj and isinstance(obj[0], dict)):
        return {p: v for k, x in (obj.items() if isinstance(obj, dict) else enumerate(obj))
                for p, v in _flat(x, f"{prefix}{k}.").items()}
    return {prefix[:-1]: obj}


def _text(path: str, value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "-", True: "yes", False: "no"}[value]
    if path.endswith("_bytes"):
        return f"{value / 2**20:.0f} MiB"
    return format(value, ".4g" if abs(value) < 1000 else ".0f") if isinstance(value, float) else str(value)


def render(result: dict[str, Any], sides: Sequence[str]) -> str:
    """A JSON report as text: a table with a column per side (dotted paths; rows: the numbers under them), then every
    other leaf (workload, env, ratios, texts, skips and errors) as ``path: value``. Floats to 4 digits, bytes in MiB."""
    flat, table = _flat(result), [["", *(s.rpartition(".")[2] for s in sides)]]
    rows = {p: p[len(side) + 1:] for side in sides for p, v in flat.items()
            if p.startswith(side + ".") and not isinstance(v, (str, list))}  # numbers: skips and errors are str
    for row in dict.fromkeys(rows.values()):
        table.append([row, *(_text(row, flat.get(f"{side}.{row}")) for side in sides)])
    widths = [max(map(len, column)) for column in zip(*table)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in table]
    return "\n".join([result.get("schema", "kvgen bench"), *lines,
                      *(f"{p}: {_text(p, v)}" for p, v in flat.items() if p not in rows and p != "schema")])
