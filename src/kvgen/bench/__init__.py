"""Benchmarks: seeded workloads, wall-clock timing, JSON reports (``kvgen bench``)."""

from kvgen.bench.decode import DecodeBenchConfig, format_decode_report, measure_ours, measure_transformers, run_decode_bench

__all__ = ["DecodeBenchConfig", "format_decode_report", "measure_ours", "measure_transformers", "run_decode_bench"]
