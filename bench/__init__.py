"""Benchmarks that write figures to ``bench/results/`` (not tests)."""
