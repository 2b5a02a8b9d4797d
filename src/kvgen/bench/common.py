"""Pieces every benchmark shares: environment facts, threads, seeded workloads,
wall-clock timing, memory figures and progress lines on stderr.

Timings never go in tests; these helpers only make them reproducible and
comparable (same machine, same run, same thread count, same prompt ids).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: the llama.cpp peer process
# (bench/llama_cpp_peer.py) imports this module, and its peak RSS must not include torch.

T = TypeVar("T")


def available_cpus() -> int:
    """CPU cores this process may run on (affinity mask when the OS has one, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def physical_cores() -> int:
    """Physical cores this process may use: distinct (package, core) ids of /proc/cpuinfo, at most
    the available CPUs (hyper-threads share one core's units, so one thread per core is the default)."""
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo") as f:
            package = ""
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    package = value.strip()
                elif key.strip() == "core id":
                    cores.add((package, value.strip()))
    except OSError:
        pass
    return min(len(cores), available_cpus()) if cores else available_cpus()


def set_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``num_threads`` (default: :func:`physical_cores`); return it.

    Raises ``ValueError`` for ``num_threads < 1``.
    """
    import torch

    n = physical_cores() if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


def environment_info() -> dict[str, Any]:
    """Versions and machine facts that a timing depends on (JSON-ready)."""
    import torch

    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:
        transformers_version = None
    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "physical_cores": physical_cores(),
        "available_cpus": available_cpus(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "load_average_1m": load_average(),
    }


def load_average() -> float | None:
    """1-minute system load average (runnable processes); above the core count, timings are contended."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def seeded_prompt_ids(num_tokens: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Prompt ids ``[1, num_tokens]`` int64, uniform over ``[0, vocab_size)`` from a ``torch.Generator(seed)``.

    Deterministic across processes and machines for the same torch version, so a
    subprocess (the transformers side) rebuilds the same prompt from the seed.
    Raises ``ValueError`` for ``num_tokens < 1`` or ``vocab_size < 1``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=gen, dtype=torch.long)  # [1, T]


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Call ``fn()``; return its result and the wall-clock seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


class TokenTimer:
    """A streamer (``put``/``end``, the protocol of kvgen and transformers ``generate``) that timestamps tokens.

    ``generate`` calls ``put`` once with the prompt, then once per step with the
    new tokens; the gaps between the token puts are per-step latencies (seconds),
    robust to a slow outlier step on a shared machine when summarised by the median.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_seconds(self) -> list[float]:
        """Seconds between consecutive new tokens (the first token comes from prefill and is excluded)."""
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, nearest rank) of ``values``, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def median(values: list[float]) -> float:
    """Median of a non-empty list (robust to one slow repeat on a busy machine)."""
    return float(statistics.median(values))


def peak_rss_bytes() -> int:
    """This process's own peak resident set size in bytes.

    ``VmHWM`` of /proc/self/status where it exists: ``ru_maxrss`` survives fork + exec on
    Linux, so a subprocess would report its parent's peak when that is higher. Falls back
    to ``ru_maxrss`` (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    """Resident set size of this process now, in bytes (Linux ``/proc/self/statm``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def per_second(count: float, seconds: float) -> float | None:
    """``count / seconds`` (tokens/s), or None when ``seconds`` is not positive."""
    return float(count) / seconds if seconds > 0 else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``, or None when either side is missing or ``theirs`` is zero."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


class Progress:
    """Progress lines on stderr (never stdout, which carries the JSON report)."""

    def __init__(self, enabled: bool = True, prefix: str = "[bench]") -> None:
        self.enabled = enabled
        self.prefix = prefix
        self._start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self._start
            print(f"{self.prefix} {elapsed:7.1f}s  {message}", file=sys.stderr, flush=True)


def default_dtype() -> str:
    """The dtype name ``kvgen.load_model`` uses when none is given (benches time kvgen's default path)."""
    import inspect

    from kvgen.loader import load_model

    default = inspect.signature(load_model).parameters["dtype"].default
    return default if isinstance(default, str) else str(default).removeprefix("torch.")


def peer_torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype transformers runs at for kvgen's ``dtype``: that dtype when it names one, else
    float32 (transformers dequantizes a GGUF to float32; kvgen's ``auto`` keeps it quantized)."""
    import torch

    from kvgen.loader import DTYPES

    return DTYPES.get(dtype, torch.float32)


@dataclass
class RunStats:
    """What one generation reports: token counts, and the engine's own model-time split if it has one."""

    num_prompt_tokens: int
    new_token_ids: list[int]
    model_prefill_s: float | None = None
    model_decode_s: float | None = None


# (prompt ids: [1, T] tensor for kvgen and transformers, list[int] for llama.cpp; max_new_tokens; streamer or None)
GenerateFn = Callable[[Any, int, "TokenTimer | None"], RunStats]


def time_generation(generate_fn: GenerateFn, prompt_ids: Any, new_tokens: int, num_prefill_repeats: int = 3) -> dict[str, Any]:
    """Warm up, then time prefill (median of 1-token runs) and a full ``new_tokens`` run (seconds, tokens/s)."""
    generate_fn(prompt_ids, 2, None)  # warm-up: allocator, oneDNN primitives, first-call paths
    prefill_s = median([timed(lambda: generate_fn(prompt_ids, 1, None))[1] for _ in range(num_prefill_repeats)])
    timer = TokenTimer()
    stats, total_s = timed(lambda: generate_fn(prompt_ids, new_tokens, timer))
    num_new = len(stats.new_token_ids)
    decode_s = total_s - prefill_s
    step_s = timer.step_seconds()  # [num_new - 1]
    step_median = percentile(step_s, 50)
    report: dict[str, Any] = {
        "num_prompt_tokens": stats.num_prompt_tokens,
        "num_requested_new_tokens": new_tokens,
        "num_new_tokens": num_new,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": per_second(stats.num_prompt_tokens, prefill_s),
        "total_s": total_s,
        "decode_s": decode_s,
        "decode_tokens_per_s": per_second(num_new - 1, decode_s),
        "num_decode_steps_timed": len(step_s),
        "decode_step_s_median": step_median,
        "decode_step_s_p90": percentile(step_s, 90),
        "decode_tokens_per_s_at_median_step": per_second(1, step_median) if step_median else None,
        "new_token_ids": stats.new_token_ids,
    }
    if stats.model_decode_s is not None:  # the engine's own split: model forward + LM head only
        report["model_prefill_s"] = stats.model_prefill_s
        report["model_decode_s"] = stats.model_decode_s
        report["model_decode_tokens_per_s"] = per_second(num_new - 1, stats.model_decode_s)
    return report


def time_to_first_token(generate_fn: GenerateFn, prompt_ids: Any, num_repeats: int = 3) -> float:
    """Seconds from the call to the first new token of a (short) prompt: one untimed warm-up, then
    the median of ``num_repeats`` 1-token generations (prefill, LM head, first choice)."""
    generate_fn(prompt_ids, 1, None)
    return median([timed(lambda: generate_fn(prompt_ids, 1, None))[1] for _ in range(num_repeats)])


def run_side(name: str, argv: list[str], log: Callable[[str], None], request: Any = None, quiet: bool = False) -> dict[str, Any]:
    """Run one side of a bench in a fresh interpreter so its peak RSS is its own.

    ``argv`` follows ``python``; ``request`` (JSON-ready) goes to its stdin; its stdout
    must be one JSON report; progress stays on stderr (captured when ``quiet``). A crash
    or a missing report becomes ``{"error": ...}``.
    """
    log(f"{name}: starting a fresh subprocess (its own peak RSS)")
    stdin = json.dumps(request) if request is not None else None
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run([sys.executable, *argv], input=stdin, stdout=out, stderr=subprocess.PIPE if quiet else None, text=True, check=False)
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-2000:] if quiet else "see stderr"
        return {"error": f"{name} subprocess exited with status {proc.returncode}: {tail}"}
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return {"error": f"{name} subprocess printed no JSON report ({e}): {text[-500:]!r}"}
