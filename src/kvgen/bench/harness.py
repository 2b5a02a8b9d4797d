"""Timing and reports shared by every ``kvgen bench``: environment facts, threads, one
percentile, one token timer, one subprocess protocol, typed results -> JSON, config flags.

Torch-free at import: the llama.cpp peer (``bench/peers.py`` run as a file) imports this
module, and its peak RSS must not include torch. Timings never go in tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Side = dict[str, Any]  # a system's JSON report: its figures, or {"skipped": why} / {"error": what}
PEERS_SCRIPT = Path(__file__).resolve().with_name("peers.py")


def available_cpus() -> int:
    """CPU cores this process may run on (affinity mask when the OS has one, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _cpuinfo() -> list[tuple[str, str]]:
    try:
        with open("/proc/cpuinfo") as f:
            return [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in f)]
    except OSError:
        return []


def physical_cores() -> int:
    """Distinct (package, core) ids of /proc/cpuinfo, at most the available CPUs (one thread per core)."""
    cores, package = set(), ""
    for key, value in _cpuinfo():
        if key == "physical id":
            package = value
        elif key == "core id":
            cores.add((package, value))
    return min(len(cores), available_cpus()) if cores else available_cpus()


def set_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads (default: :func:`physical_cores`); return the count. ``ValueError`` below 1."""
    import torch

    n = physical_cores() if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


def load_average() -> float | None:
    """1-minute load average (runnable processes); above the core count, timings are contended."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def environment_info() -> dict[str, Any]:
    """Versions and machine facts that a timing depends on (JSON-ready)."""
    import torch

    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:
        transformers_version = None
    model_name = next((v for k, v in _cpuinfo() if k == "model name"), platform.processor())
    return {
        "torch_version": torch.__version__, "transformers_version": transformers_version,
        "python_version": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
        "processor": model_name, "cpu_count": os.cpu_count(), "physical_cores": physical_cores(),
        "available_cpus": available_cpus(), "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(), "load_average_1m": load_average(),
    }


def peak_rss_bytes() -> int:
    """This process's own peak resident set size in bytes (``VmHWM``; ``ru_maxrss`` survives fork + exec)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    """Resident set size now, in bytes (Linux ``/proc/self/statm``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Call ``fn()``; return its result and the wall-clock seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation (numpy's default), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q / 100 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def per_second(count: float, seconds: float) -> float | None:
    """``count / seconds`` (tokens/s), or None when ``seconds`` is not positive."""
    return float(count) / seconds if seconds > 0 else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``, or None when either side is missing or ``theirs`` is zero."""
    return None if ours is None or theirs is None or theirs == 0 else ours / theirs


class TokenTimer:
    """A streamer (``put``/``end``: kvgen's, transformers' and our llama.cpp loop's protocol) timestamping tokens.

    ``generate`` puts the prompt first (ignored), then the new tokens of each step;
    ``times`` are those steps' ``time.perf_counter`` seconds, ``gaps()`` the seconds between them.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._has_prompt = False

    def put(self, value: Any) -> None:
        if self._has_prompt:
            self.times.append(time.perf_counter())
        self._has_prompt = True

    def end(self) -> None:
        pass

    def gaps(self) -> list[float]:
        """Seconds between consecutive new tokens (the first token comes from prefill and is excluded)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


class Progress:
    """Progress lines on stderr (never stdout, which carries the JSON report)."""

    def __init__(self, enabled: bool = True, prefix: str = "[bench]") -> None:
        self.enabled, self.prefix, self._start = enabled, prefix, time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"{self.prefix} {time.perf_counter() - self._start:7.1f}s  {message}", file=sys.stderr, flush=True)


def fmt(value: float | None, spec: str = ".1f") -> str:
    """``value`` formatted by ``spec``, or ``-`` when missing (report tables)."""
    return format(value, spec) if value is not None else "-"


OMIT_IF_NONE = {"omit_if_none": True}  # field metadata: left out of :func:`to_json` while None


def to_json(obj: Any) -> Any:
    """Typed results -> JSON-ready values: dataclasses become dicts (in field order), recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)}
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def run_side(name: str, argv: list[str], log: Callable[[str], None], request: Any = None, quiet: bool = False) -> Side:
    """The one subprocess protocol: ``python *argv`` with ``request`` as JSON on stdin, one JSON report on stdout.

    A fresh interpreter, so the side's peak RSS is its own; progress stays on stderr (captured when
    ``quiet``). A crash or a missing report becomes ``{"error": ...}``.
    """
    log(f"{name}: starting a fresh subprocess (its own peak RSS)")
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run([sys.executable, *argv], input=json.dumps(request) if request is not None else None, stdout=out,
                              stderr=subprocess.PIPE if quiet else None, text=True, check=False)
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-2000:] if quiet else "see stderr"
        return {"error": f"{name} subprocess exited with status {proc.returncode}: {tail}"}
    try:
        report: Side = json.loads(text)
        return report
    except json.JSONDecodeError as e:
        return {"error": f"{name} subprocess printed no JSON report ({e}): {text[-500:]!r}"}


def run_peer(peer: str, task: str, request: dict[str, Any], log: Callable[[str], None], quiet: bool = False) -> Side:
    """Run ``task`` of ``peer`` (``transformers`` or ``llama_cpp``) in ``bench/peers.py`` (see :func:`run_side`)."""
    return run_side(f"{peer} {task}", [str(PEERS_SCRIPT), peer, task], log, request, quiet)


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass ``config_cls`` with help text (``kvgen.fields.config_field``).

    ``--field-name`` unless the field's metadata names ``flags``; a bool defaulting to True
    (``include_transformers``) becomes ``--no-transformers``; ``cli=False`` fields get none.
    """
    for f in dataclasses.fields(config_cls):
        if f.name in skip or not f.metadata.get("cli", True) or "help" not in f.metadata:
            continue
        kind, default = str(f.type), f.default
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"], "default": default}
        if kind == "bool":
            flags = f.metadata.get("flags") or ("--no-" + f.name.removeprefix("include_").replace("_", "-"),)
            kwargs |= {"action": "store_false" if default else "store_true", "help": f"don't {f.metadata['help']}"}
        else:
            flags = f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
            base = kind.split("[")[-1].split(",")[0].split("|")[0].strip("] ")
            kwargs["type"] = {"int": int, "float": float}.get(base, str)
            if kind.startswith(("tuple", "list")):
                kwargs["nargs"] = "+"
        parser.add_argument(*flags, **kwargs)


def config_from_args(config_cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``config_cls`` built from the parsed flags of :func:`add_config_flags` (fields without a flag keep defaults)."""
    names = {f.name for f in dataclasses.fields(config_cls)}  # type: ignore[arg-type]
    return config_cls(**{k: v for k, v in vars(args).items() if k in names} | overrides)


@dataclasses.dataclass
class RunStats:
    """What one generation reports: token counts, and the engine's own model-time split if it has one."""

    num_prompt_tokens: int
    new_token_ids: list[int]
    model_prefill_s: float | None = None
    model_decode_s: float | None = None


# (prompt ids: [1, T] tensor for kvgen and transformers, list[int] for llama.cpp; max_new_tokens; streamer or None)
GenerateFn = Callable[[Any, int, "TokenTimer | None"], RunStats]


@dataclasses.dataclass
class GenerationTiming:
    """Batch-1 prefill and decode of one engine configuration (seconds, tokens/s); see ``time_generation``."""

    num_prompt_tokens: int
    num_requested_new_tokens: int
    num_new_tokens: int
    prefill_s: float
    prefill_tokens_per_s: float | None
    total_s: float
    decode_s: float
    decode_tokens_per_s: float | None
    num_decode_steps_timed: int
    decode_step_s_median: float | None
    decode_step_s_p90: float | None
    decode_tokens_per_s_at_median_step: float | None
    new_token_ids: list[int]
    model_prefill_s: float | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)  # the engine's own split: model forward + LM head only
    model_decode_s: float | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)
    model_decode_tokens_per_s: float | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)


def time_generation(generate_fn: GenerateFn, prompt_ids: Any, new_tokens: int, num_prefill_repeats: int = 3) -> GenerationTiming:
    """One untimed 2-token warm-up; prefill = median of 1-token runs; then one timed ``new_tokens`` run.

    ``decode_s = total_s - prefill_s``; ``decode_step_s_*``: gaps between streamed tokens.
    """
    generate_fn(prompt_ids, 2, None)  # warm-up: allocator, oneDNN primitives, first-call paths
    prefill_s = time_to_first_token(generate_fn, prompt_ids, num_prefill_repeats, warm_up=False)
    timer = TokenTimer()
    stats, total_s = timed(lambda: generate_fn(prompt_ids, new_tokens, timer))
    num_new, decode_s, steps = len(stats.new_token_ids), total_s - prefill_s, timer.gaps()  # steps: [num_new - 1]
    step_median = percentile(steps, 50)
    model_decode = stats.model_decode_s
    return GenerationTiming(
        stats.num_prompt_tokens, new_tokens, num_new, prefill_s, per_second(stats.num_prompt_tokens, prefill_s), total_s,
        decode_s, per_second(num_new - 1, decode_s), len(steps), step_median, percentile(steps, 90),
        per_second(1, step_median) if step_median else None, stats.new_token_ids, stats.model_prefill_s, model_decode,
        per_second(num_new - 1, model_decode) if model_decode is not None else None,
    )


def time_to_first_token(generate_fn: GenerateFn, prompt_ids: Any, num_repeats: int = 3, warm_up: bool = True) -> float:
    """Median seconds of ``num_repeats`` 1-token generations (prefill, LM head, first choice), after a warm-up."""
    if warm_up:
        generate_fn(prompt_ids, 1, None)
    seconds = [timed(lambda: generate_fn(prompt_ids, 1, None))[1] for _ in range(num_repeats)]
    return percentile(seconds, 50) or 0.0


def default_dtype() -> str:
    """The dtype name ``kvgen.load_model`` uses when none is given (benches time kvgen's default path)."""
    import inspect

    from kvgen.loader import load_model

    default = inspect.signature(load_model).parameters["dtype"].default
    return default if isinstance(default, str) else str(default).removeprefix("torch.")
