"""``kvgen bench``, a thin client of the public API: ``harness`` (timing, JSON, text), ``workloads``, ``peers``
(transformers, llama-cpp-python in subprocesses), one module per bench: config -> ``run_*_bench`` -> report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgen.fields import check_minimums
from kvgen.fields import config_field as _f
from kvgen.loader import AUTO, check_load_options


@dataclass
class BenchConfig:
    """The fields every bench's config starts with (each bench adds its own; flags come from all of them).
    Raises ``ValueError`` naming an int field below its ``minimum``."""

    model: str = _f("default", "a .gguf file, a Hugging Face directory, a cached repo id or 'default' "
                    "(SmolLM2-135M-Instruct)",
                    flags=("--model", "-m"))  # -m, -t: llama-bench's, and every other kvgen subcommand's
    dtype: str = _f(AUTO, "kvgen's dtype, as load_model takes it")
    quantization: str | None = _f(None, "kvgen's quantization, as load_model takes it (q8_0, q5_1, q5_0, q4_1, q4_0)")
    num_threads: int | None = _f(None, "threads of every engine (default: $OMP_NUM_THREADS, else physical cores)",
                                 flags=("--threads", "--num-threads", "-t"), minimum=1)
    progress: bool = _f(True, "progress lines on stderr", cli=False)

    def __post_init__(self) -> None:
        check_minimums(self)
        check_load_options(self.dtype, self.quantization)


@dataclass
class BenchReport:
    """The fields every bench's report starts with: its ``schema`` name, machine facts (``env``: versions, cores,
    load average) and what was measured (``workload``); each bench adds its sides and ratios."""

    schema: str
    env: dict[str, Any]
    workload: dict[str, Any]
