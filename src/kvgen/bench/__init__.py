"""Benchmarks (``kvgen bench``), a thin client of kvgen's public API.

``harness``: timing, one percentile, one token timer, one subprocess protocol, typed
results -> JSON, flags from config dataclasses; ``workloads``: seeded prompts, request
mixes, perplexity text; ``peers``: transformers and llama-cpp-python in their own
processes; one module per bench (``decode``, ``strategies``, ``throughput``,
``perplexity``, ``serve``), each a ``*BenchConfig`` -> ``run_*_bench`` -> ``*Report``.
"""
