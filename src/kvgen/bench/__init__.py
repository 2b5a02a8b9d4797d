"""Benchmarks: seeded workloads, wall-clock timing, JSON reports (``kvgen bench``).

Names are resolved on first use (PEP 562) so that ``python -m kvgen.bench.decode``
does not import its own module twice.
"""

from typing import Any

__all__ = ["DecodeBenchConfig", "format_decode_report", "measure_ours", "measure_transformers", "run_decode_bench"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvgen.bench import decode

        return getattr(decode, name)
    raise AttributeError(f"module 'kvgen.bench' has no attribute {name!r}")
