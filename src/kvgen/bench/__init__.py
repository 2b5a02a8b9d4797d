"""Benchmarks (``kvgen bench``), a thin client of the public API: ``harness`` (timing, JSON, text), ``workloads``,
``peers`` (transformers, llama-cpp-python in subprocesses), one module per bench: config -> ``run_*_bench`` -> report."""
